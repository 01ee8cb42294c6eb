"""The OpenAI-compatible HTTP app: /v1/completions, /v1/chat/completions (both with SSE streaming),
/v1/models, /health and /metrics (Prometheus).

Backpressure: past ``max_queue_len`` waiting requests, 503 with ``Retry-After``. A client that disconnects
aborts its request (its blocks are freed). Invalid bodies get 400 with an OpenAI-style error naming the field.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from ..engine import PagedEngine
from .engine_loop import EngineLoop, QueueFullError
from .protocol import ChatCompletionRequest, CompletionRequest, error_body

DEFAULT_MAX_TOKENS = 256
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class ServerMetrics:
    """Prometheus series of one server (own registry, so several apps can live in one process)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.blocks_used = Gauge("paged_hf_kv_cache_blocks_used", "KV blocks in use", registry=r)
        self.blocks_total = Gauge("paged_hf_kv_cache_blocks_total", "KV blocks in the pool", registry=r)
        self.prefix_hit_rate = Gauge("paged_hf_prefix_cache_hit_rate", "prefix-cache hits / queries (tokens)", registry=r)
        self.preemptions = Gauge("paged_hf_preemptions", "sequences preempted since start", registry=r)
        self.running = Gauge("paged_hf_requests_running", "sequences running", registry=r)
        self.waiting = Gauge("paged_hf_requests_waiting", "sequences waiting", registry=r)
        self.rejected = Counter("paged_hf_requests_rejected", "requests answered 503 (queue full)", registry=r)
        self.ttft = Histogram("paged_hf_time_to_first_token_seconds", "arrival to first token", registry=r,
                              buckets=_LATENCY_BUCKETS)
        self.itl = Histogram("paged_hf_inter_token_latency_seconds", "time between output updates", registry=r,
                             buckets=_LATENCY_BUCKETS)
        self._last: dict[str, float] = {}

    def observe(self, out, now: float) -> None:
        """Called by the engine loop with each ``RequestOutput``."""
        previous = self._last.get(out.request_id)
        if previous is None and out.metrics is not None and out.metrics.first_token_time is not None:
            self.ttft.observe(out.metrics.first_token_time - out.metrics.arrival_time)
        elif previous is not None:
            self.itl.observe(now - previous)
        if out.finished:
            self._last.pop(out.request_id, None)
        else:
            self._last[out.request_id] = now

    def render(self, stats) -> bytes:
        """The series, with the gauges set from ``stats`` (an ``EngineStats``)."""
        self.blocks_used.set(stats.kv_cache_used)
        self.blocks_total.set(stats.kv_cache_total)
        self.prefix_hit_rate.set(stats.prefix_cache_hit_rate)
        self.preemptions.set(stats.preemption_count)
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        return generate_latest(self.registry)


def _param_of(message: str) -> str | None:
    match = re.match(r"(\w+) must", message)
    return match.group(1) if match else None


def _bad_request(error: Exception) -> JSONResponse:
    return JSONResponse(error_body(str(error), _param_of(str(error))), status_code=400)


def build_app(engine: PagedEngine, model_name: str, max_queue_len: int = 256) -> FastAPI:
    """The app; its engine loop starts and stops with the app's lifespan."""
    metrics = ServerMetrics()
    loop = EngineLoop(engine, max_queue_len, on_output=metrics.observe)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        loop.start()
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="paged_hf", version="0.1.0", lifespan=lifespan)
    app.state.engine_loop = loop

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_, exc: RequestValidationError):
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"] if p != "body")
        return JSONResponse(error_body(f"{field}: {first['msg']}", field or None), status_code=400)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(loop.stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "paged_hf"}]}

    async def run(raw: Request, body, prompts: list, params, chat: bool):
        ids, queues = [], []
        try:
            for prompt in prompts:
                request_id, outputs = await loop.submit(prompt, params)
                ids.append(request_id)
                queues.append(outputs)
        except QueueFullError as error:
            metrics.rejected.inc()
            for request_id in ids:
                loop.abort(request_id)
            return JSONResponse(error_body(str(error), None, "server_busy", 503), status_code=503,
                                headers={"Retry-After": "1"})
        except ValueError as error:
            for request_id in ids:
                loop.abort(request_id)
            return _bad_request(error)
        response_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        if body.stream:
            return StreamingResponse(
                _sse(loop, ids, queues, response_id, created, model_name, params.n, chat, body.include_usage),
                media_type="text/event-stream",
            )
        finals = await _collect(raw, loop, ids, queues)
        if finals is None:
            return Response(status_code=499)
        return _response(finals, response_id, created, model_name, chat)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        if body.echo:
            return JSONResponse(error_body("echo is not supported", "echo"), status_code=400)
        try:
            params = body.sampling_params(DEFAULT_MAX_TOKENS, body.logprobs)
        except ValueError as error:
            return _bad_request(error)
        return await run(raw, body, body.prompts(), params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        try:
            params = body.sampling_params(DEFAULT_MAX_TOKENS)
        except ValueError as error:
            return _bad_request(error)
        return await run(raw, body, [body.chat()], params, chat=True)

    return app


async def _collect(raw: Request, loop: EngineLoop, ids: list[str], queues: list[asyncio.Queue]):
    """Waits for every request to finish; aborts them all if the client goes away."""
    finals = []
    try:
        for outputs in queues:
            while True:
                try:
                    out = await asyncio.wait_for(outputs.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await raw.is_disconnected():
                        raise ConnectionError("client disconnected") from None
                    continue
                if out.finished:
                    finals.append(out)
                    break
    except (ConnectionError, asyncio.CancelledError):
        for request_id in ids:
            loop.abort(request_id)
        return None
    return finals


def _usage(finals) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish_reason(completion) -> str | None:
    return {"abort": "stop", "error": "stop"}.get(completion.finish_reason, completion.finish_reason)


def _response(finals, response_id: str, created: int, model: str, chat: bool):
    for out in finals:
        if out.error:
            return JSONResponse(error_body(out.error, None, "server_error"), status_code=500)
    choices = []
    for p, out in enumerate(finals):
        for completion in out.outputs:
            index = p * len(out.outputs) + completion.index
            reason = _finish_reason(completion)
            if chat:
                choices.append({"index": index, "message": {"role": "assistant", "content": completion.text},
                                "logprobs": None, "finish_reason": reason})
            else:
                choices.append({"index": index, "text": completion.text, "logprobs": None, "finish_reason": reason})
    return {"id": response_id, "object": "chat.completion" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "usage": _usage(finals)}


async def _sse(loop, ids, queues, response_id, created, model, n, chat, include_usage=False):
    """Server-sent events: one chunk per text delta of each choice, then (``include_usage``) a chunk with empty
    ``choices`` and the usage of the whole request, then ``[DONE]``."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(p, outputs):
        while True:
            out = await outputs.get()
            await merged.put((p, out))
            if out.finished:
                return

    pumps = [asyncio.create_task(pump(p, q)) for p, q in enumerate(queues)]
    sent: dict[int, int] = {}
    closed: set[int] = set()
    finals = []

    def chunk(index, text, reason, first=False):
        if chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text, "logprobs": None, "finish_reason": reason}
        body = {"id": response_id, "object": obj, "created": created, "model": model, "choices": [choice]}
        return f"data: {json.dumps(body)}\n\n"

    try:
        while len(finals) < len(queues):
            p, out = await merged.get()
            if out.error:
                yield f"data: {json.dumps(error_body(out.error, None, 'server_error'))}\n\n"
            for completion in out.outputs:
                index = p * n + completion.index
                if index in closed:
                    continue
                start = sent.get(index)
                text = completion.text[start or 0 :]
                reason = _finish_reason(completion)
                if text or reason or start is None:
                    yield chunk(index, text, reason, first=start is None)
                    sent[index] = len(completion.text)
                if reason is not None:
                    closed.add(index)
            if out.finished:
                finals.append(out)
        if include_usage:
            body = {"id": response_id, "object": obj, "created": created, "model": model, "choices": [],
                    "usage": _usage(finals)}
            yield f"data: {json.dumps(body)}\n\n"
        yield "data: [DONE]\n\n"
    finally:  # normal end, or the client went away mid-stream: abort whatever still runs
        for task in pumps:
            task.cancel()
        for request_id in ids:
            loop.abort(request_id)
