"""Answers: a whole response (non-streaming) or server-sent events, for completions and chat.

Non-streaming requests run as ``FINAL_ONLY`` (one output per prompt, when it finishes); their handler also watches
the connection, and a client that leaves aborts every prompt of its request at once. Streams run as ``DELTA``: each
output carries only what is new. When one prompt of a request fails, the others are aborted: a non-streaming
request gets a 500, a stream gets an error event as its last event before ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request

from .engine_loop import EngineLoop
from .errors import internal_error
from .logprobs import ChoiceLogprobs


class ResponseBuilder:
    """The response shapes of one HTTP request (completion or chat), and each choice's logprobs state."""

    def __init__(self, model: str, chat: bool, n: int, decode, logprobs: int | None) -> None:
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.model, self.chat, self.n, self.decode, self.logprobs = model, chat, n, decode, logprobs
        self._choice_logprobs: dict[int, ChoiceLogprobs] = {}

    def _logprobs(self, index: int, completion, prompt_token_ids: list[int]):
        if self.logprobs is None or completion.logprobs is None:
            return None
        state = self._choice_logprobs.get(index)
        if state is None:
            state = self._choice_logprobs[index] = ChoiceLogprobs(self.decode, prompt_token_ids)
        if self.chat:
            return state.chat(completion.token_ids, completion.logprobs, self.logprobs)
        return state.completion(completion.token_ids, completion.logprobs)

    def response(self, finals) -> dict:
        """The whole response from each prompt's final output."""
        choices = []
        for p, out in enumerate(finals):
            for completion in out.outputs:
                index = p * self.n + completion.index
                choice = {"index": index, "logprobs": self._logprobs(index, completion, out.prompt_token_ids),
                          "finish_reason": completion.finish_reason}
                if self.chat:
                    choice["message"] = {"role": "assistant", "content": completion.text}
                else:
                    choice["text"] = completion.text
                choices.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": usage(finals)}

    def chunk(self, index: int, completion, first: bool, prompt_token_ids: list[int]) -> str:
        """One SSE event for the new part of a choice (``completion`` is a DELTA output of a prompt of
        ``prompt_token_ids``)."""
        text, reason = completion.text, completion.finish_reason
        logprobs = self._logprobs(index, completion, prompt_token_ids)
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return self.event({"choices": [choice]})

    def event(self, fields: dict) -> str:
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, **fields}
        return f"data: {json.dumps(body)}\n\n"


def usage(finals) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in finals)
    completion = sum(len(c.token_ids) for o in finals for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


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
                 include_usage: bool):
    """Server-sent events: a chunk per choice as it grows, then (``include_usage``) a chunk with empty ``choices``
    and the usage of the whole request, then ``[DONE]``. A failure ends the stream with an error event."""
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
    try:
        while finished < len(queues):
            p, item = await merged.get()
            error = failure(item)
            if error is not None:
                yield f"data: {json.dumps(error.body())}\n\n"
                break
            prompt_tokens[p] = len(item.prompt_token_ids)
            for completion in item.outputs:
                index = p * builder.n + completion.index
                if index in closed:
                    continue
                completion_tokens += len(completion.token_ids)
                first = index not in started
                if first or completion.text or completion.finish_reason or \
                        (builder.logprobs is not None and completion.token_ids):
                    yield builder.chunk(index, completion, first, item.prompt_token_ids)
                    started.add(index)
                if completion.finish_reason is not None:
                    closed.add(index)
            finished += item.finished
        else:
            if include_usage:
                prompt = sum(prompt_tokens)
                yield builder.event({"choices": [], "usage": {
                    "prompt_tokens": prompt, "completion_tokens": completion_tokens,
                    "total_tokens": prompt + completion_tokens}})
        yield "data: [DONE]\n\n"
    finally:  # normal end, a failure, or the client went away mid-stream: abort whatever still runs
        for task in pumps:
            task.cancel()
        for request_id in ids:
            loop.abort(request_id)
