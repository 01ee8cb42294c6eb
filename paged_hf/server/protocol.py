"""OpenAI API request bodies (pydantic) and their translation to ``SamplingParams``.

Every field of a body is honoured or refused, naming it: an unknown field gets OpenAI's "Unrecognized request
argument supplied" (400), and the OpenAI fields paged_hf does not implement (``tools``, ``functions``, a
``response_format`` other than text, ``suffix``, ``echo``, ``best_of`` other than ``n``) get a 400 saying so.
``null`` means the default, as in OpenAI's API. Values are range-checked by ``SamplingParams`` (``ParameterError``
naming the field) and by the engine's limits when the request is added.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from ..config import SamplingParams
from .errors import ApiError

MAX_COMPLETION_LOGPROBS = 5  # OpenAI's limit for /v1/completions "logprobs"
MAX_TOP_LOGPROBS = 20  # OpenAI's limit for /v1/chat/completions "top_logprobs"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool | None = False  # a last chunk, before [DONE], with empty choices and the request's usage


class _Sampling(_Strict):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None  # an end-user id for the caller's own records: nothing to do with generation
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk (``stream_options.include_usage``)."""
        return bool(self.stream_options is not None and self.stream_options.include_usage)

    def check_supported(self) -> None:
        """Refuses (400, naming the field) what paged_hf does not implement."""
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")

    def _requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The request's ``SamplingParams``; ``max_tokens`` is ``default_max_tokens`` when the body has none (the
        handler sets it per prompt: see ``max_tokens_given``)."""
        defaults = SamplingParams()
        given = {
            "n": self.n, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
        }
        values = {k: v for k, v in given.items() if v is not None}
        max_tokens = self._requested_max_tokens()
        return SamplingParams(
            **{**{k: getattr(defaults, k) for k in given}, **values},
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, logprobs=logprobs,
            logit_bias=_logit_bias(self.logit_bias),
        )

    @property
    def max_tokens_given(self) -> bool:
        return self._requested_max_tokens() is not None


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """JSON keys are strings: ``{"50256": -100}`` -> ``{50256: -100.0}``."""
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ApiError(400, f"logit_bias keys must be token ids (integers as strings), got {key!r:.50}",
                           "logit_bias") from None
    return out


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list:
        """The prompts as a list: strings or token-id lists."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if not self.prompt:
            raise ApiError(400, "prompt must not be empty", "prompt")
        if all(isinstance(t, int) for t in self.prompt):
            return [list(self.prompt)]
        return list(self.prompt)

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise ApiError(400, "echo is not supported", "echo")
        if self.suffix:
            raise ApiError(400, "suffix is not supported (no insertion / fill-in-the-middle)", "suffix")
        n = self.n if self.n is not None else 1
        if self.best_of is not None and self.best_of != n:
            raise ApiError(400, f"best_of must equal n (paged_hf returns every sample: it does not rank extra "
                                f"ones), got best_of={self.best_of}, n={n}", "best_of")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_COMPLETION_LOGPROBS:
            raise ApiError(400, f"logprobs must be in [0, {MAX_COMPLETION_LOGPROBS}], got {self.logprobs}",
                           "logprobs")


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart] | None = ""
    name: str | None = None

    def as_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name  # for chat templates that read it
        return message


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list | None = None
    tool_choice: str | dict | None = None
    functions: list | None = None
    function_call: str | dict | None = None
    response_format: dict | None = None

    def chat(self) -> list[dict]:
        return [m.as_dict() for m in self.messages]

    def _requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_top_logprobs(self) -> int | None:
        """The engine's ``logprobs`` for this request: None when not asked."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        for name in ("tools", "functions", "function_call"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported: paged_hf does not call tools", name)
        if self.tool_choice not in (None, "none"):
            raise ApiError(400, "tool_choice is not supported: paged_hf does not call tools", "tool_choice")
        if self.response_format is not None and self.response_format != {"type": "text"}:
            raise ApiError(400, f"response_format {self.response_format!r:.100} is not supported: only "
                                f"{{\"type\": \"text\"}} (no JSON mode or schema)", "response_format")
        if self.max_tokens is not None and self.max_completion_tokens is not None and \
                self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens differ: give one", "max_tokens")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            if not 0 <= self.top_logprobs <= MAX_TOP_LOGPROBS:
                raise ApiError(400, f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
                               "top_logprobs")
