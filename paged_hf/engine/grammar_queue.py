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


def give_matchers(request: Request, eos_token_ids: set[int]) -> None:
    """Each sample of a request with a compiled grammar follows it on its own matcher. The request's
    ``stop_token_ids`` join the end tokens (``eos_token_ids``) as the grammar's stop tokens: they may end the output
    only where the grammar can end (vLLM's rule), never in the middle of a value."""
    if request.compiled_grammar is not None:
        stops = request.params.stop_token_ids
        stop_tokens = sorted(set(eos_token_ids) | set(stops)) if stops else None
        for seq in request.sequences:
            seq.grammar = SequenceGrammar(request.compiled_grammar.result(), stop_tokens)
