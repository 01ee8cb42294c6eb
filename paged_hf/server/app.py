"""The OpenAI-compatible HTTP app: /v1/completions, /v1/chat/completions (both with SSE streaming),
/v1/models and /v1/models/{id}, vLLM's /tokenize, /detokenize and /tokenizer_info, /health and /metrics
(Prometheus).

A request goes: body read under ``max_request_bytes`` (413) and parsed (400: JSON, UTF-8, surrogates, unknown or
unsupported fields) -> model name checked (404) -> ``SamplingParams`` (400 naming the field) -> prompts tokenized in
a worker thread -> submitted to the engine loop, all prompts or none (400 for what the engine refuses, 503 with
``Retry-After`` while the waiting queue is full) -> a response or a stream. A client that disconnects aborts every
prompt of its request, streaming or not. Errors: see ``errors.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool

from .. import __version__
from ..config import SamplingParams
from ..engine import PagedEngine, RequestOutputKind
from ..engine.detokenizer import Decoder
from ..engine.validation import bad_words_token_ids
from ..media import MediaPolicy
from .body import CLIENT_GONE, DEFAULT_MAX_REQUEST_BYTES, ClientGone, parse_body, read_body
from .auth import ApiKeyMiddleware
from .engine_loop import EngineDeadError, EngineLoop, QueueFullError
from .errors import ApiError, bad_request, install_handlers, internal_error
from .logprobs import TokenBytes
from .media import ImagePrompts
from .metrics import ServerMetrics
from .prompts import PromptTokenizer
from .protocol import ChatCompletionRequest, CompletionRequest
from .responses import Echo, ResponseBuilder, collect, events
from .structured import StructuredField, check_compiles
from .tools import TOOL_CALL_PARSERS, ToolPlan, tool_constraint
from .tokenizer_api import add_tokenizer_routes

# When a request gives no max_tokens (vLLM's and OpenAI's defaults): a completion gets 16 tokens, a chat completion
# the room its prompt leaves; a completion's 16 are capped by that room too.
DEFAULT_COMPLETION_TOKENS = 16
logger = logging.getLogger("paged_hf")


def build_app(engine: PagedEngine, model_name: str | list[str], max_queue_len: int = 256,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, allow_unknown_fields: bool = False,
              processor=None, media: MediaPolicy | None = None, api_keys: list[str] | None = None,
              sampling_defaults: dict | None = None, tool_call_parser: str | None = None) -> FastAPI:
    """The app; its engine loop starts and stops with the app's lifespan. ``model_name``: the name clients send, or
    several (``/v1/models`` lists them; a response carries the one its request named, else the first).
    ``allow_unknown_fields``: a request
    field this server does not know is ignored with a warning instead of a 400 (vLLM's behaviour). ``processor``:
    the model's, for chat image parts; ``media``: which image URLs they may name (default: data: URLs only).
    ``api_keys``: the bearer keys every request but the probes must carry (``auth``; none: an open server).
    ``sampling_defaults``: ``{SamplingParams field: value}`` for fields a request leaves out (the model's
    generation_config, ``sampling_defaults.generation_defaults``); its ``max_tokens`` caps the default length.
    ``tool_call_parser``: the format whose tool calls ``tool_choice: "auto"`` reads from the model's text (one of
    ``tools.TOOL_CALL_PARSERS``; None: auto tool choice is off, as vLLM without ``--enable-auto-tool-choice``)."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {list(TOOL_CALL_PARSERS)}, got {tool_call_parser!r}")
    if engine.tokenizer is None:
        raise ValueError("the server needs an engine with a tokenizer: PagedEngine(model, tokenizer)")
    names = [model_name] if isinstance(model_name, str) else list(model_name)
    if not names or not all(isinstance(n, str) and n for n in names):
        raise ValueError(f"model_name must be a non-empty name or list of names, got {model_name!r}")
    model_name = names[0]
    metrics = ServerMetrics(model_name)
    loop = EngineLoop(engine, max_queue_len, on_output=metrics.observe, on_abort=metrics.aborted)
    tokenize = PromptTokenizer(engine.tokenizer, engine.max_model_len)
    decode = Decoder(engine.tokenizer)
    token_bytes = TokenBytes(engine.tokenizer)
    limit = engine.config.limit_mm_per_prompt
    image_prompts = ImagePrompts(tokenize, processor, media or MediaPolicy(), limit and limit.get("image"))

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        loop.start()
        logger.info("serving %s: max_queue_len %d, max_request_bytes %d", model_name, max_queue_len,
                    max_request_bytes)
        try:
            yield
        finally:
            loop.stop()

    app = FastAPI(title="paged_hf", version=__version__, lifespan=lifespan)
    app.state.engine_loop = loop
    install_handlers(app)
    if api_keys:
        app.add_middleware(ApiKeyMiddleware, keys=list(api_keys))
    defaults = dataclasses.replace(SamplingParams(), **{k: v for k, v in (sampling_defaults or {}).items()
                                                        if k != "max_tokens"})
    length_cap = (sampling_defaults or {}).get("max_tokens")

    @app.exception_handler(ClientGone)
    async def client_gone(_raw: Request, _error: ClientGone):  # the client left while its body was read
        return Response(status_code=CLIENT_GONE)

    model_cards = {name: {"id": name, "object": "model", "created": 0, "owned_by": "paged_hf",
                          "max_model_len": engine.max_model_len} for name in names}

    @app.get("/health")
    async def health():
        if not loop.alive:
            why = f"{type(loop.error).__name__}: {loop.error}" if loop.error is not None else "it is stopped"
            return ApiError(503, f"the engine loop is not running ({why})", code="engine_dead").response()
        return {"status": "ok"}

    @app.get("/ping")
    @app.post("/ping")
    async def ping():  # the liveness probe of SageMaker-style hosts, as vLLM answers it
        return await health()

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/load")
    async def load():  # vLLM's: requests in the server (running and queued)
        stats = loop.stats
        return {"server_load": stats.num_running + stats.num_waiting}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(loop.stats), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": list(model_cards.values())}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id not in model_cards:
            raise ApiError(404, f"The model `{model_id}` does not exist.", "model", "model_not_found")
        return model_cards[model_id]

    async def parse(raw: Request, model):
        body = await parse_body(await read_body(raw, max_request_bytes), model, allow_unknown_fields)
        if getattr(body, "model", None) is not None and body.model not in model_cards:
            raise ApiError(404, f"The model `{body.model}` does not exist.", "model", "model_not_found")
        body.check_supported()
        return body

    @app.post("/v1/completions")
    async def completions(raw: Request):
        body = await parse(raw, CompletionRequest)
        params = sampling_params(body, defaults, body.logprobs, {}, body.engine_prompt_logprobs)
        prompts = await tokenize.completions(body.prompts(), body.add_special_tokens is not False,
                                             _truncation(body))
        echo = Echo(echo=bool(body.echo), scores_only=body.scores_only,
                    texts=[p.get("prompt") if isinstance(p, dict) else None for p in prompts],
                    prompt_logprobs=body.prompt_logprobs)
        return await run(raw, body, prompts, params, chat=False, logprobs=body.logprobs, rename={}, echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request):
        body = await parse(raw, ChatCompletionRequest)
        if body.stream and body.prompt_logprobs is not None:
            raise ApiError(400, "prompt_logprobs is not available with stream: true on chat completions (use "
                                "/v1/completions, which streams them)", "prompt_logprobs")
        max_tokens = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        rename = {"prompt": "messages", "logprobs": "top_logprobs", "max_tokens": max_tokens}
        params = sampling_params(body, defaults, body.num_top_logprobs, rename, body.prompt_logprobs, chat=True)
        tools = body.tool_plan(tool_call_parser)
        structured = body.structured()
        constraint = tool_constraint(tools, structured)
        if constraint is not None:
            structured = constraint
            params = dataclasses.replace(params, structured_outputs=constraint.spec)
        if tools is not None and tools.keeps_special_tokens:
            params = dataclasses.replace(params, skip_special_tokens=False)
        options = body.submit_options()
        if body.num_images:
            prompt, options["images"] = await image_prompts.chat(
                body.chat(), body.num_images, body.template_kwargs(), body.add_generation_prompt is not False,
                bool(body.add_special_tokens), _truncation(body))
        else:
            prompt = await tokenize.chat(body.chat(), body.template_kwargs(), body.add_generation_prompt is not False,
                                         bool(body.add_special_tokens), _truncation(body))
        return await run(raw, body, [prompt], params, chat=True, logprobs=body.num_top_logprobs, rename=rename,
                         echo=Echo(prompt_logprobs=body.prompt_logprobs), options=options, structured=structured,
                         tools=tools)

    add_tokenizer_routes(app, engine, tokenize, parse, image_prompts)

    async def run(raw: Request, body, prompts: list, params: SamplingParams, chat: bool, logprobs, rename, echo,
                  options: dict | None = None, structured: StructuredField | None = None,
                  tools: ToolPlan | None = None):
        structured = structured if structured is not None else body.structured()
        if structured is not None:
            await check_compiles(engine.grammars, structured)
            rename = {**rename, "structured_outputs": structured.field}
        if params.bad_words:  # tokenized here, in a worker thread: a client's long words never stall the engine's
            params = dataclasses.replace(params, _bad_words_token_ids=(params.bad_words, await run_in_threadpool(
                bad_words_token_ids, params.bad_words, engine.tokenizer)))
        per_prompt = [params if body.max_tokens_given else
                      default_max_tokens(params, p, engine.max_sequence_len, chat, length_cap) for p in prompts]
        try:  # what the engine would refuse whatever its state, refused here: a 400 even while the queue is full
            await run_in_threadpool(lambda: [engine.check_request(p, q) for p, q in zip(prompts, per_prompt)])
        except ValueError as error:
            raise bad_request(error, rename) from None
        kind = RequestOutputKind.DELTA if body.stream else RequestOutputKind.FINAL_ONLY
        try:
            submitted = await loop.submit(prompts, per_prompt, kind, options or body.submit_options())
        except QueueFullError as error:
            metrics.rejected.inc()
            raise ApiError(503, str(error), code="overloaded", headers={"Retry-After": "1"}) from None
        except EngineDeadError as error:
            raise internal_error(str(error)) from None
        except ValueError as error:
            raise bad_request(error, rename) from None
        ids = [request_id for request_id, _ in submitted]
        queues = [outputs for _, outputs in submitted]
        builder = ResponseBuilder(getattr(body, "model", None) or model_name, chat, params.n, decode, logprobs,
                                  body.request_id, token_bytes, echo, tools)
        if body.stream:
            return StreamingResponse(events(loop, ids, queues, builder, body.include_usage, body.continuous_usage),
                                     media_type="text/event-stream")
        finals = await collect(raw, loop, ids, queues)
        if finals is None:
            return Response(status_code=CLIENT_GONE)
        return JSONResponse(await run_in_threadpool(builder.response, finals))

    return app


def _truncation(body) -> int | None:
    return None if body.truncate_prompt_tokens in (None, -1) else body.truncate_prompt_tokens


def sampling_params(body, defaults: SamplingParams, logprobs: int | None, rename: dict[str, str],
                    prompt_logprobs: int | None = None, chat: bool = False) -> SamplingParams:
    """``body``'s ``SamplingParams``, ``defaults`` for the fields it leaves out; a bad value is a 400 naming it.
    Without a ``max_tokens`` in the body, a completion's is ``DEFAULT_COMPLETION_TOKENS`` and a chat completion's
    None until ``default_max_tokens`` gives it its prompt's room (so ``min_tokens`` is checked against that room)."""
    try:
        return body.sampling_params(defaults, None if chat else DEFAULT_COMPLETION_TOKENS, logprobs, prompt_logprobs)
    except ValueError as error:
        raise bad_request(error, rename) from None


def default_max_tokens(params: SamplingParams, prompt, max_len: int, chat: bool,
                       length_cap: int | None = None) -> SamplingParams:
    """The ``max_tokens`` of a request that gives none: the room its prompt leaves for a chat completion,
    ``DEFAULT_COMPLETION_TOKENS`` or that room if less for a completion, and at most ``length_cap`` (the
    generation_config's ``max_new_tokens``) when given; a request that gives ``max_tokens`` keeps it (the engine
    stops every request at the context length, as vLLM does). ``max_len``: the longest sequence the engine holds
    (``PagedEngine.max_sequence_len``: the context, or less where the KV pool is smaller)."""
    ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt
    room = max(1, max_len - len(ids))
    room = room if chat else min(DEFAULT_COMPLETION_TOKENS, room)
    room = room if length_cap is None else max(1, min(room, length_cap))
    if room == params.max_tokens:
        return params
    try:
        return dataclasses.replace(params, max_tokens=room)
    except ValueError as error:
        raise bad_request(error) from None
