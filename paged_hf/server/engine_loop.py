"""Runs a ``PagedEngine`` in one background thread; HTTP handlers talk to it through commands.

The engine is not thread-safe: only the loop thread calls it. Handlers submit a request (a future answers
with its id, or the ``ValueError`` that rejected it) and read its outputs from an ``asyncio.Queue`` the loop
fills with ``call_soon_threadsafe``. A full waiting queue rejects new requests (``QueueFullError``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time

from ..config import SamplingParams
from ..engine import PagedEngine


class QueueFullError(RuntimeError):
    """More requests wait than ``max_queue_len``: the client should retry later (HTTP 503)."""


class EngineLoop:
    def __init__(self, engine: PagedEngine, max_queue_len: int = 256, on_output=None) -> None:
        self.engine = engine
        self.max_queue_len = max_queue_len
        self.on_output = on_output  # called in the loop thread with each RequestOutput (metrics)
        self.stats = engine.get_stats()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._pending = 0  # submissions not yet added to the engine
        self._added = 0  # requests added to the engine since ``stats`` was last refreshed (they wait)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="paged-hf-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    # --------------------------------------------------------------------- called by handlers
    async def submit(self, prompt, params: SamplingParams) -> tuple[str, asyncio.Queue]:
        """Queues a request; returns its id and the queue its ``RequestOutput``s arrive on."""
        with self._lock:
            if self._pending + self._added + self.stats.num_waiting >= self.max_queue_len:
                raise QueueFullError(f"{self.max_queue_len} requests are already waiting")
            self._pending += 1
        outputs: asyncio.Queue = asyncio.Queue()
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("add", (prompt, params, asyncio.get_running_loop(), outputs, future)))
        self._wake.set()
        return await asyncio.wrap_future(future), outputs

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))
        self._wake.set()

    # ----------------------------------------------------------------------------- the thread
    def _apply(self, command: str, payload) -> None:
        if command == "abort":
            self.engine.abort(payload)
            self._streams.pop(payload, None)
            return
        prompt, params, loop, outputs, future = payload
        try:
            request_id = self.engine.add_request(prompt, params)
        except Exception as error:  # noqa: BLE001 - handed to the handler, which answers 400
            future.set_exception(error)
        else:
            self._streams[request_id] = (loop, outputs)
            future.set_result(request_id)
        finally:
            with self._lock:
                self._pending -= 1
                self._added += future.exception() is None

    def _refresh_stats(self) -> None:
        stats = self.engine.get_stats()
        with self._lock:
            self.stats, self._added = stats, 0

    def _run(self) -> None:
        while not self._stop.is_set():
            while True:
                try:
                    self._apply(*self._commands.get_nowait())
                except queue.Empty:
                    break
            if not self.engine.has_unfinished_requests():
                self._refresh_stats()
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            for out in self.engine.step():
                if self.on_output is not None:
                    self.on_output(out, time.monotonic())
                target = self._streams.get(out.request_id)
                if target is not None:
                    loop, outputs = target
                    loop.call_soon_threadsafe(outputs.put_nowait, out)
                    if out.finished:
                        self._streams.pop(out.request_id, None)
            self._refresh_stats()
