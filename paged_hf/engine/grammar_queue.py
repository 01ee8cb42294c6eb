"""Requests whose grammar (structured outputs) is still compiling: they wait here, off the scheduler's queue, so a
slow schema holds up no other request, and join the queue at the first step after their grammar is ready."""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, wait

from ..structured.matcher import SequenceGrammar
from .request import Request

# With nothing else to run, the engine waits this long (seconds) for a grammar being compiled before it steps again.
GRAMMAR_WAIT_S = 0.01


class GrammarQueue:
    def __init__(self) -> None:
        self.requests: list[Request] = []

    def __len__(self) -> int:
        return len(self.requests)

    def hold(self, request: Request) -> bool:
        """Whether ``request`` must wait for its grammar (it is kept here); False: it may be queued now."""
        grammar = request.compiled_grammar
        if grammar is None or (grammar.done() and grammar.exception() is None):
            return False
        self.requests.append(request)
        return True

    def settle(self, idle: bool) -> tuple[list[Request], list[tuple[Request, BaseException]]]:
        """The requests whose grammar is ready (to queue) and those whose compilation raised (to fail), both
        removed; aborted ones are dropped. ``idle``: nothing else runs, so first wait up to ``GRAMMAR_WAIT_S``."""
        if not self.requests:
            return [], []
        if idle:
            wait([r.compiled_grammar for r in self.requests], timeout=GRAMMAR_WAIT_S, return_when=FIRST_COMPLETED)
        ready, failed, pending = [], [], []
        for request in self.requests:
            if request.finished:  # aborted while its grammar compiled
                continue
            grammar = request.compiled_grammar
            if not grammar.done():
                pending.append(request)
            elif grammar.exception() is not None:
                failed.append((request, grammar.exception()))
            else:
                ready.append(request)
        self.requests = pending
        return ready, failed


def give_matchers(request: Request) -> None:
    """Each sample of a request with a compiled grammar follows it on its own matcher."""
    if request.compiled_grammar is not None:
        for seq in request.sequences:
            seq.grammar = SequenceGrammar(request.compiled_grammar.result())
