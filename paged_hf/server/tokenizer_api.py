"""vLLM's tokenizer endpoints: ``POST /tokenize`` (a prompt, or chat messages through the chat template),
``POST /detokenize`` (token ids to text) and ``GET /tokenizer_info``, with vLLM's request and response shapes.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from starlette.concurrency import run_in_threadpool

from ..engine.detokenizer import Decoder
from .errors import ApiError
from .protocol import ChatCompletionRequest, ChatMessage, StrictBody, Tool


class TokenizeRequest(StrictBody):
    """vLLM's ``/tokenize``: a ``prompt``, or chat ``messages`` through the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (the template has them)
    add_generation_prompt: bool | None = None
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None  # for the chat template, as a chat request's

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise ApiError(400, "give either prompt or messages", "prompt")


class DetokenizeRequest(StrictBody):
    """vLLM's ``/detokenize``: token ids to text."""

    model: str | None = None
    tokens: list[int]

    def check_supported(self) -> None:
        pass


def add_tokenizer_routes(app: FastAPI, engine, tokenize, parse, image_prompts) -> None:
    """The three routes over ``engine``'s tokenizer; ``parse(raw, model)`` reads and checks a body as the app does.
    Messages with images are read and processed as a chat request's (``image_prompts``): the count includes each
    image's tokens, and an image that cannot be read is a 400. ``/detokenize`` keeps special tokens
    (``tokenizer.decode``'s default, as vLLM's), so a tokenized chat prompt comes back with its template's markers."""
    keep_special = Decoder(engine.tokenizer, skip_special_tokens=False)

    @app.post("/tokenize")
    async def tokenize_route(raw: Request):
        body = await parse(raw, TokenizeRequest)
        if body.messages is not None:
            chat = ChatCompletionRequest(messages=body.messages, chat_template_kwargs=body.chat_template_kwargs,
                                         tools=body.tools)
            generation_prompt = body.add_generation_prompt is not False
            if chat.num_images:
                prompt, _ = await image_prompts.chat(chat.chat(), chat.num_images, chat.template_kwargs(),
                                                     generation_prompt, bool(body.add_special_tokens), None)
            else:
                prompt = await tokenize.chat(chat.chat(), chat.template_kwargs(), generation_prompt,
                                             bool(body.add_special_tokens))
            ids = prompt["prompt_token_ids"]
        else:
            ids = await tokenize.encode(body.prompt, body.add_special_tokens is not False)
        strs = engine.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids, "token_strs": strs}

    @app.post("/detokenize")
    async def detokenize_route(raw: Request):
        body = await parse(raw, DetokenizeRequest)
        vocab = engine.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"tokens holds {bad}, not a token id of this model (0 .. {vocab - 1})", "tokens")
        return {"prompt": await run_in_threadpool(keep_special, body.tokens)}

    @app.get("/tokenizer_info")
    async def tokenizer_info():
        return tokenizer_summary(engine.tokenizer, engine.max_model_len)


def tokenizer_summary(tokenizer, max_model_len: int) -> dict:
    """``/tokenizer_info``: the tokenizer's class, special tokens, chat template and lengths."""
    special = {name: getattr(tokenizer, name, None) for name in ("bos_token", "eos_token", "unk_token", "pad_token")}
    return {"tokenizer_class": type(tokenizer).__name__, **{k: v for k, v in special.items() if v is not None},
            "model_max_length": max_model_len, "vocab_size": len(tokenizer),
            "chat_template": getattr(tokenizer, "chat_template", None)}
