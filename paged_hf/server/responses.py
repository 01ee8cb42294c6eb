"""Answers: a whole response (non-streaming) or server-sent events, for completions and chat.

Non-streaming requests run as ``FINAL_ONLY`` (one output per prompt, when it finishes); their handler also watches
the connection, and a client that leaves aborts every prompt of its request at once. Streams run as ``DELTA``: each
output carries only what is new. When one prompt of a request fails, the others are aborted: a non-streaming
request gets a 500, a stream gets an error event as its last event before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from dataclasses import dataclass, field

from fastapi import Request

from .engine_loop import EngineLoop
from .errors import internal_error
from .logprobs import ChoiceLogprobs, TokenBytes, vllm_prompt_logprobs
from .tools import ToolPlan, ToolStream


@dataclass
class Echo:
    """What a completions request asks about its prompts: ``echo`` them (``texts[p]``: the string given, or None
    to decode the ids), with their legacy logprobs (``logprobs`` is set); score them only (``max_tokens: 0``: the
    engine's one token is dropped); vLLM's ``prompt_logprobs`` (the choice's field of that name)."""

    echo: bool = False
    scores_only: bool = False
    texts: list[str | None] = field(default_factory=list)
    prompt_logprobs: int | None = None

    @property
    def needs_prompt(self) -> bool:
        return self.echo or self.prompt_logprobs is not None


class ResponseBuilder:
    """The response shapes of one HTTP request (completion or chat), and each choice's logprobs state."""

    def __init__(self, model: str, chat: bool, n: int, decode, logprobs: int | None, request_id: str | None = None,
                 token_bytes: TokenBytes | None = None, echo: Echo | None = None, tools: ToolPlan | None = None
                 ) -> None:
        prefix = "chatcmpl-" if chat else "cmpl-"
        self.id = prefix + (request_id if request_id is not None else uuid.uuid4().hex[:24])
        self.created = int(time.time())
        self.model, self.chat, self.n, self.decode, self.logprobs = model, chat, n, decode, logprobs
        self.token_bytes = token_bytes
        self.echo = echo or Echo()
        self.tools = tools  # a chat request's tool plan: its answers become tool calls
        self._tool_streams: dict[int, ToolStream] = {}
        self._choice_logprobs: dict[int, ChoiceLogprobs] = {}
        self._prompt_entries: dict[int, list] = {}  # prompt index -> its prompt logprobs received so far

    # ------------------------------------------------------------------------------------------ prompts
    def absorb(self, p: int, out) -> bool:
        """Takes the prompt logprobs an output of prompt ``p`` carries; True once its prompt is complete (what
        an echo, or vLLM's ``prompt_logprobs``, needs before its first chunk)."""
        if out.prompt_logprobs is None:
            return True
        entries = self._prompt_entries.setdefault(p, [])
        entries.extend(out.prompt_logprobs)
        return len(entries) >= len(out.prompt_token_ids)

    def _prompt_text(self, p: int, out) -> str:
        given = self.echo.texts[p] if p < len(self.echo.texts) else None
        return given if given is not None else self.decode(out.prompt_token_ids)

    def num_completion_tokens(self, completion) -> int:
        return 0 if self.echo.scores_only else len(completion.token_ids)

    # ------------------------------------------------------------------------------------------ choices
    def _logprobs(self, index: int, completion, prompt_token_ids):
        if self.logprobs is None or completion.logprobs is None:
            return None
        state = self._choice_logprobs.get(index)
        if state is None:
            state = self._choice_logprobs[index] = ChoiceLogprobs(self.decode, self.token_bytes, prompt_token_ids)
        if self.chat:
            return state.chat(completion.token_ids, completion.logprobs, self.logprobs)
        return state.completion(completion.token_ids, completion.logprobs)

    def _completion_choice(self, p: int, index: int, out, completion, first: bool) -> dict:
        """A completion choice's text and logprobs (the echoed prompt first, on its first chunk), and vLLM's
        ``prompt_logprobs`` there too when asked."""
        if self.echo.scores_only:
            completion = dataclasses.replace(completion, text="", token_ids=[],
                                             logprobs=None if completion.logprobs is None else [])
        choice = {"index": index, "text": completion.text, "logprobs": None}
        if first and self.echo.needs_prompt:
            entries = self._prompt_entries.get(p) or out.prompt_logprobs
            if self.echo.prompt_logprobs is not None:
                choice["prompt_logprobs"] = vllm_prompt_logprobs(out.prompt_token_ids, entries or [],
                                                                 self.echo.prompt_logprobs, self.decode)
            if self.echo.echo:
                choice["text"] = self._prompt_text(p, out) + completion.text
                if self.logprobs is not None:
                    state = self._choice_logprobs.setdefault(index, ChoiceLogprobs(self.decode))
                    prompt_part = state.completion(out.prompt_token_ids, entries or [None] * len(
                        out.prompt_token_ids), top=self.logprobs)
                    rest = self._logprobs(index, completion, ()) or {key: [] for key in prompt_part}
                    choice["logprobs"] = {key: prompt_part[key] + rest[key] for key in prompt_part}
                    return choice
        choice["logprobs"] = self._logprobs(index, completion, out.prompt_token_ids)
        return choice

    def response(self, finals) -> dict:
        """The whole response from each prompt's final output."""
        choices = []
        for p, out in enumerate(finals):
            for completion in out.outputs:
                index = p * self.n + completion.index
                reason = completion.finish_reason
                if self.chat:
                    message = {"role": "assistant", "content": completion.text}
                    if self.tools is not None:
                        content, calls, reason = self.tools.answer(completion.text, reason)
                        message = {"role": "assistant", "content": content, "tool_calls": calls}
                    choice = {"index": index, "message": message,
                              "logprobs": self._logprobs(index, completion, out.prompt_token_ids)}
                else:
                    choice = self._completion_choice(p, index, out, completion, first=True)
                choice["finish_reason"] = reason
                choice["stop_reason"] = completion.stop_reason
                choices.append(choice)
        body = {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": self.usage(finals)}
        if self.chat and self.echo.prompt_logprobs is not None:  # vLLM puts a chat's on the response
            body["prompt_logprobs"] = vllm_prompt_logprobs(finals[0].prompt_token_ids, finals[0].prompt_logprobs or [],
                                                           self.echo.prompt_logprobs, self.decode)
        return body

    def usage(self, finals) -> dict:
        prompt = sum(len(o.prompt_token_ids) for o in finals)
        completion = sum(self.num_completion_tokens(c) for o in finals for c in o.outputs)
        cached = sum(o.metrics.num_prefix_cached_tokens for o in finals if o.metrics is not None)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def chunk(self, p: int, index: int, out, completion, first: bool, usage: dict | None = None) -> str:
        """One SSE event for the new part of a choice (``completion`` is a DELTA output of ``out``); ``usage``:
        the request's so far (``continuous_usage_stats``)."""
        reason = completion.finish_reason
        if self.chat:
            delta = {"content": completion.text}
            if self.tools is not None:
                stream = self._tool_streams.setdefault(index, self.tools.stream())
                text, calls = stream.feed(completion.text, reason is not None)
                delta = {"content": text} if text or not calls else {}
                if calls:
                    delta["tool_calls"] = calls
                reason = stream.finish_reason(reason)
            choice = {"index": index, "delta": delta,
                      "logprobs": self._logprobs(index, completion, out.prompt_token_ids)}
        else:
            choice = self._completion_choice(p, index, out, completion, first)
        choice["finish_reason"] = reason
        if reason is not None:
            choice["stop_reason"] = completion.stop_reason
        fields = {"choices": [choice]}
        if usage is not None:
            fields["usage"] = usage
        return self.event(fields)

    def role_chunk(self, index: int, usage: dict | None = None) -> str:
        """A chat choice's first event, as vLLM and OpenAI send it: the role, with empty content."""
        choice = {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return self.event({"choices": [choice], **({"usage": usage} if usage is not None else {})})

    def event(self, fields: dict) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, **fields}
        return f"data: {json.dumps(body)}\n\n"


def failure(item):
    """The ApiError of a failed output (or of the engine loop's death), else None."""
    if isinstance(item, BaseException):
        return internal_error(str(item))
    if item.error:
        return internal_error(f"the request failed: {item.error}")
    return None


async def wait_for_disconnect(raw: Request) -> None:
    """Returns when the client closes the connection (its body was read already, so the next message is that)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(raw: Request, loop: EngineLoop, ids: list[str], queues: list[asyncio.Queue]):
    """Each prompt's final output, in order; None if the client left first (every prompt is aborted then).
    Raises the ``ApiError`` of the first prompt that fails, after aborting the others."""
    gets = [asyncio.ensure_future(q.get()) for q in queues]
    gone = asyncio.ensure_future(wait_for_disconnect(raw))
    finals = [None] * len(queues)
    waiting = {*gets, gone}
    try:
        while any(final is None for final in finals):
            done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
            if gone in done:
                return None
            for task in done:
                item = task.result()
                error = failure(item)
                if error is not None:
                    raise error
                finals[gets.index(task)] = item
        return finals
    finally:
        gone.cancel()
        for task in gets:
            task.cancel()
        if any(final is None for final in finals):  # the client left, or a prompt failed: stop the others
            for request_id in ids:
                loop.abort(request_id)


async def events(loop: EngineLoop, ids: list[str], queues: list[asyncio.Queue], builder: ResponseBuilder,
                 include_usage: bool, continuous_usage: bool = False):
    """Server-sent events: a chunk per choice as it grows (each with the request's usage so far when
    ``continuous_usage``), then (``include_usage``) a chunk with empty ``choices`` and the usage of the whole
    request, then ``[DONE]``. A failure ends the stream with an error event. A choice whose prompt is echoed, or
    whose prompt logprobs were asked, starts once its prompt's logprobs are all in."""
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(p: int, outputs: asyncio.Queue) -> None:
        while True:
            item = await outputs.get()
            merged.put_nowait((p, item))
            if isinstance(item, BaseException) or item.finished:
                return

    pumps = [asyncio.ensure_future(pump(p, q)) for p, q in enumerate(queues)]
    started: set[int] = set()
    closed: set[int] = set()
    prompt_tokens = [0] * len(queues)
    completion_tokens = 0
    finished = 0

    def so_far() -> dict:
        prompt = sum(prompt_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion_tokens,
                "total_tokens": prompt + completion_tokens}

    try:
        while finished < len(queues):
            p, item = await merged.get()
            error = failure(item)
            if error is not None:
                yield f"data: {json.dumps(error.body())}\n\n"
                break
            prompt_tokens[p] = len(item.prompt_token_ids)
            finished += item.finished
            if not builder.absorb(p, item) and not item.finished:
                continue
            for completion in item.outputs:
                index = p * builder.n + completion.index
                if index in closed:
                    continue
                first = index not in started
                if first and builder.chat:
                    yield builder.role_chunk(index, so_far() if continuous_usage else None)
                completion_tokens += builder.num_completion_tokens(completion)
                usage = so_far() if continuous_usage else None
                if first and not builder.chat or completion.text or completion.finish_reason or \
                        (builder.logprobs is not None and completion.token_ids and not builder.echo.scores_only):
                    yield builder.chunk(p, index, item, completion, first, usage)
                started.add(index)
                if completion.finish_reason is not None:
                    closed.add(index)
        else:
            if include_usage:
                yield builder.event({"choices": [], "usage": so_far()})
        yield "data: [DONE]\n\n"
    finally:  # normal end, a failure, or the client went away mid-stream: abort whatever still runs
        for task in pumps:
            task.cancel()
        for request_id in ids:
            loop.abort(request_id)
