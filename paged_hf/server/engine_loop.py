"""Runs a ``PagedEngine`` in one background thread; HTTP handlers talk to it through commands.

The engine is not thread-safe: only the loop thread calls it. Handlers submit the prompts of one HTTP request
together (a future answers with their ids, or the error that rejected them: then none of them is queued) and read
each one's outputs from an ``asyncio.Queue`` the loop fills with ``call_soon_threadsafe``. A full waiting queue
rejects new requests (``QueueFullError``: 503); more prompts than the queue can ever hold is a bad request.

The loop is guarded: if it dies (a bug in the engine, say), the error is logged, every request still waiting for
outputs receives an ``EngineDeadError`` at once, new submissions raise it, and ``error`` is set (``/health``
answers 503). A tensor-parallel engine whose group broke (a rank died) kills the loop the same way; when the loop
ends, the engine's follower ranks are shut down.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time

from ..config import ParameterError, SamplingParams
from ..engine import PagedEngine, RequestOutputKind
from ..engine.threads import release_openmp_team

logger = logging.getLogger("paged_hf")


class QueueFullError(RuntimeError):
    """More requests wait than ``max_queue_len``: the client should retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop died; nothing more will run (HTTP 500)."""


class EngineLoop:
    def __init__(self, engine: PagedEngine, max_queue_len: int = 256, on_output=None, on_abort=None) -> None:
        self.engine = engine
        self.max_queue_len = max_queue_len
        self.on_output = on_output  # called in the loop thread with each RequestOutput (metrics)
        self.on_abort = on_abort  # called in the loop thread with the id of each request aborted before it finished
        self.stats = engine.get_stats()
        self.error: BaseException | None = None  # set when the loop died
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._pending = 0  # submitted prompts not yet added to the engine
        self._added = 0  # requests added to the engine since ``stats`` was last refreshed (they wait)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._guarded_run, name="paged-hf-engine", daemon=True)

    def start(self) -> None:
        """Starts the loop thread. The calling thread (which built the engine) gives up its OpenMP team first: the
        loop thread, which runs every step from now on, then keeps the process's only one, and its idle workers spin
        before they sleep (``engine/threads.py``)."""
        if not release_openmp_team():
            logger.debug("EngineLoop: no OpenMP runtime with omp_pause_resource_all: the starting thread keeps "
                         "its OpenMP team")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self.error is None and self._thread.is_alive()

    # --------------------------------------------------------------------- called by handlers
    async def submit(self, prompts: list, params: list[SamplingParams], output_kind: RequestOutputKind,
                     options: dict | None = None) -> list[tuple[str, asyncio.Queue]]:
        """Queues the prompts of one HTTP request, all or none; returns each one's id and output queue.
        ``options``: ``PagedEngine.add_request`` keywords for each of them (``priority``, ``cache_salt``, ...).

        Raises ``ParameterError`` for more prompts than the queue can ever hold, ``QueueFullError`` when the queue
        is full now, ``EngineDeadError`` when the loop died, and the engine's ``ValueError`` for a prompt it refuses.
        """
        if len(prompts) > self.max_queue_len:
            raise ParameterError("prompt", f"the request has {len(prompts)} prompts; this server queues at most "
                                           f"{self.max_queue_len} requests (--max-queue-len)")
        loop = asyncio.get_running_loop()
        outputs = [asyncio.Queue() for _ in prompts]
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.error is not None:
                raise EngineDeadError(f"the engine loop died: {type(self.error).__name__}: {self.error}")
            if self._pending + self._added + self.stats.num_waiting + len(prompts) > self.max_queue_len:
                raise QueueFullError(f"{self.max_queue_len} requests are already waiting")
            self._pending += len(prompts)
            self._commands.put(("add", (prompts, params, output_kind, options or {}, loop, outputs, future)))
        self._wake.set()
        ids = await asyncio.wrap_future(future)
        return list(zip(ids, outputs))

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    # ----------------------------------------------------------------------------- the thread
    def _add(self, payload) -> None:
        prompts, params, output_kind, options, loop, outputs, future = payload
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.engine.add_request(prompt, p, output_kind=output_kind, **options))
        except Exception as error:  # noqa: BLE001 - handed to the handler (400 for a ValueError, else 500)
            for request_id in ids:
                self.engine.abort(request_id)
            future.set_exception(error)
        else:
            for request_id, queue_ in zip(ids, outputs):
                self._streams[request_id] = (loop, queue_)
            future.set_result(ids)
        finally:
            with self._lock:
                self._pending -= len(prompts)
                self._added += len(ids) if future.exception() is None else 0

    def _apply(self, command: str, payload) -> None:
        if command == "abort":
            live = payload in self.engine.requests
            self.engine.abort(payload)
            self._streams.pop(payload, None)
            if live and self.on_abort is not None:  # no output follows an abort: the callback's last word on it
                self.on_abort(payload)
        else:
            self._add(payload)

    def _refresh_stats(self) -> None:
        stats = self.engine.get_stats()
        with self._lock:
            self.stats, self._added = stats, 0

    def _guarded_run(self) -> None:
        try:
            self._run()
        except BaseException as error:  # noqa: BLE001 - logged, and every waiting request is told
            self._die(error)
        finally:
            try:
                self.engine.shutdown()  # tensor parallelism: the follower ranks leave (else a no-op)
            except Exception:  # noqa: BLE001 - nothing more can be done for them; say so
                logger.exception("stopping the tensor-parallel ranks failed")

    def _die(self, error: BaseException) -> None:
        logger.critical("the engine loop died; every request fails from now on", exc_info=error)
        dead = EngineDeadError(f"the engine loop died: {type(error).__name__}: {error}")
        with self._lock:
            self.error = error
            while True:  # submissions that will never be applied
                try:
                    command, payload = self._commands.get_nowait()
                except queue.Empty:
                    break
                if command == "add":
                    payload[-1].set_exception(dead)
        for request_id in list(self._streams):
            self._send(request_id, dead, abort_if_gone=False)
        self._streams.clear()

    def _send(self, request_id: str, item, abort_if_gone: bool = True) -> None:
        """Puts ``item`` on the request's output queue, in its handler's event loop."""
        loop, outputs = self._streams[request_id]
        try:
            loop.call_soon_threadsafe(outputs.put_nowait, item)
        except RuntimeError:  # that event loop is closed: nobody reads this request any more
            self._streams.pop(request_id, None)
            if abort_if_gone:
                self.engine.abort(request_id)

    def _run(self) -> None:
        while not self._stop.is_set():
            while True:
                try:
                    self._apply(*self._commands.get_nowait())
                except queue.Empty:
                    break
            if not self.engine.has_unfinished_requests():
                self._refresh_stats()
                self.engine.keep_alive()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            for out in self.engine.step():
                if self.on_output is not None:
                    self.on_output(out, time.monotonic())
                if out.request_id in self._streams:
                    self._send(out.request_id, out)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
            self._refresh_stats()
            if self.engine.broken is not None:  # a tensor-parallel rank died: its requests failed; nothing can run
                raise self.engine.broken
