"""Compiled grammars, cached by their spec and compiled off the caller's thread.

``GrammarCompilerCache.submit(spec)`` parses the spec on the caller's thread (cheap; a spec the backend refuses raises
``GrammarError`` there, before anything is queued) and hands the compilation for the model's vocabulary to a small
thread pool: it returns a ``Future`` of the ``CompiledGrammar``. Equal specs share one future, done or not; a failed
compilation is forgotten so that the next request tries again. The backend's tokenizer tables are built on first use
(about 0.1 s for a 49k vocabulary), so an engine that never constrains an output never imports xgrammar.
Thread-safe: the server submits from its handlers' threads while the engine thread reads the futures.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor

from .grammar import GrammarError, backend_message, build_grammar, xgrammar_module
from .params import StructuredOutputsParams

logger = logging.getLogger("paged_hf")

MAX_CACHED_GRAMMARS = 256  # compiled grammars kept (least recently used dropped first)
COMPILE_THREADS = 2  # grammars compiled at once


class GrammarCompilerCache:
    """Compiles specs for one tokenizer and a logits width of ``vocab_size`` columns; ``stop_token_ids``: the tokens
    that end an output (the model's EOS): the grammar allows them only where it can end."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: Iterable[int] = (),
                 max_entries: int = MAX_CACHED_GRAMMARS) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.max_entries = max_entries
        self._futures: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()
        self._compiler = None
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, spec: StructuredOutputsParams) -> Future:
        """The future compiled grammar of ``spec`` (cached); ``GrammarError`` now if the backend cannot parse it."""
        key = spec.key
        with self._lock:
            future = self._futures.get(key)
            if future is not None:
                self._futures.move_to_end(key)
                return future
        grammar = build_grammar(spec)  # outside the lock: the caller's thread parses
        with self._lock:
            future = self._futures.get(key)
            if future is not None:
                return future
            future = self._executor().submit(self._compile, grammar, spec.kind)
            self._futures[key] = future
            self._evict()
        # outside the lock: a compilation that already failed runs the callback here, and it takes the lock
        future.add_done_callback(lambda done, key=key: self._forget_failure(key, done))
        return future

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of ``spec``, waiting for it (``generate``'s logits processor)."""
        return self.submit(spec).result()

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            xgr = xgrammar_module()
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS, cache_enabled=False)
            self._pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="paged-hf-grammar")
        return self._pool

    def _compile(self, grammar, kind: str):
        started = time.perf_counter()
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except (RuntimeError, ValueError) as error:
            raise GrammarError(kind, backend_message(error)) from None
        logger.debug("compiled a %s grammar in %.1f ms", kind, (time.perf_counter() - started) * 1e3)
        return compiled

    def _forget_failure(self, key: tuple, future: Future) -> None:
        if future.exception() is not None:
            with self._lock:
                if self._futures.get(key) is future:
                    del self._futures[key]

    def _evict(self) -> None:
        """Drops the least recently used finished compilations past ``max_entries`` (the lock is held)."""
        excess = len(self._futures) - self.max_entries
        for key in [k for k, f in self._futures.items() if f.done()][:max(0, excess)]:
            del self._futures[key]


def logits_width(model) -> int:
    """Columns of the model's logits (its output layer; the config's ``vocab_size`` without one)."""
    head = model.get_output_embeddings()
    width = getattr(head, "out_features", None)
    return width if width else model.config.get_text_config(decoder=True).vocab_size
