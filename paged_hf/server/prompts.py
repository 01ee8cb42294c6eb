"""Prompts to token ids, in the request handlers' worker threads (never on the engine thread, which only queues ids).

A huge text is refused before it is tokenized: no token of the vocabulary covers more than ``longest_token_chars``
characters (its longest piece, or added token), so a text longer than ``max_model_len`` times that (times
``LENGTH_SLACK`` for normalizers that compose characters) is certainly longer than ``max_model_len`` tokens.
The tokenizer's Rust core releases the GIL: tokenizing in a worker thread lets the engine keep stepping.
"""

from __future__ import annotations

from starlette.concurrency import run_in_threadpool

from .errors import ApiError, internal_error

LENGTH_SLACK = 4


class PromptTokenizer:
    def __init__(self, tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.max_chars = max_model_len * longest_token_chars(tokenizer) * LENGTH_SLACK

    async def completions(self, prompts: list, add_special_tokens: bool = True, truncate: int | None = None) -> list:
        """Each string prompt as ``{"prompt": text, "prompt_token_ids": ids}``; token-id prompts as they are.
        ``truncate``: keep each prompt's last ``truncate`` tokens (vLLM's ``truncate_prompt_tokens``)."""
        for prompt in prompts:
            if isinstance(prompt, str) and truncate is None:
                self._check_length(len(prompt), "prompt")
        if not any(isinstance(p, str) for p in prompts) and truncate is None:
            return prompts
        return await run_in_threadpool(self._completions, prompts, add_special_tokens, truncate)

    def _completions(self, prompts: list, add_special_tokens: bool, truncate: int | None) -> list:
        texts = [p for p in prompts if isinstance(p, str)]
        encoded = iter(self.tokenizer(texts, add_special_tokens=add_special_tokens)["input_ids"] if texts else [])
        out = []
        for p in prompts:
            if isinstance(p, str):
                ids = _last(next(encoded), truncate)
                out.append({"prompt": p if truncate is None else None, "prompt_token_ids": ids})
            else:
                out.append(_last(p, truncate))
        for prompt in out:
            if isinstance(prompt, dict):
                self._check_tokens(prompt["prompt_token_ids"], "prompt")
        return out

    async def chat(self, messages: list[dict], template_kwargs: dict | None = None, add_generation_prompt: bool = True,
                   add_special_tokens: bool = False, truncate: int | None = None) -> dict:
        self._check_length(sum(len(m["content"]) for m in messages), "messages")
        text = await run_in_threadpool(self._template, messages, template_kwargs or {}, add_generation_prompt)
        if truncate is None:
            self._check_length(len(text), "messages")
        ids = await run_in_threadpool(lambda: self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])
        ids = _last(ids, truncate)
        self._check_tokens(ids, "messages")
        return {"prompt": text if truncate is None else None, "prompt_token_ids": ids}

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        self._check_length(len(text), "prompt")
        return await run_in_threadpool(lambda: self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"])

    def _template(self, messages: list[dict], template_kwargs: dict, add_generation_prompt: bool = True) -> str:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise ApiError(400, "this model's tokenizer has no chat template: use /v1/completions", "messages")
        reserved = {"messages", "add_generation_prompt", "tokenize", "conversation"} & set(template_kwargs)
        if reserved:
            raise ApiError(400, f"chat_template_kwargs may not set {sorted(reserved)}", "chat_template_kwargs")
        if "developer" not in str(self.tokenizer.chat_template):  # OpenAI's newer name for the system role
            messages = [{**m, "role": "system"} if m.get("role") == "developer" else m for m in messages]
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt,
                                                      tokenize=False, **template_kwargs)
        except Exception as error:  # noqa: BLE001 - a template refuses messages by raising (jinja2 raise_exception)
            if type(error).__module__.startswith("jinja2"):
                raise ApiError(400, f"the chat template refused these messages: {error}", "messages") from None
            raise internal_error(f"the chat template failed: {type(error).__name__}: {error}") from error

    def _check_tokens(self, ids: list[int], field: str) -> None:
        """Refuses a prompt with no room to generate here, in the worker thread (the engine would refuse it too,
        after copying and checking every id on its own thread)."""
        if len(ids) >= self.max_model_len:
            raise ApiError(400, f"This model's maximum context length is {self.max_model_len} tokens, but the "
                                f"{field} has {len(ids)} tokens: max_model_len={self.max_model_len} leaves no room to "
                                f"generate", field)

    def _check_length(self, num_chars: int, field: str) -> None:
        if num_chars > self.max_chars:
            raise ApiError(400, f"{field} is {num_chars} characters long: that is more than this model's maximum "
                                f"context length of {self.max_model_len} tokens (max_model_len)", field)


def _last(ids: list[int], truncate: int | None) -> list[int]:
    """The last ``truncate`` of ``ids`` (all of them for None or -1)."""
    return list(ids) if truncate is None or truncate == -1 else list(ids)[-truncate:]


def longest_token_chars(tokenizer) -> int:
    """The most characters one token of ``tokenizer`` stands for (its longest vocabulary piece or added token)."""
    vocab = tokenizer.get_vocab()
    return max(max(len(piece) for piece in vocab), 1)
