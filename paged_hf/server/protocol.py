"""OpenAI API request bodies (pydantic) and their translation to ``SamplingParams``.

Every field of OpenAI's Chat Completions and Completions references is here, and vLLM's extensions that clients
written for vLLM send. Each is honoured, accepted as changing nothing here (``NO_EFFECT``: logged at debug), or
refused with a 400 naming it (``functions``, ``audio``, ``prediction``, ``web_search_options``, ``suffix``,
``best_of`` other than ``n``, ``use_beam_search: true``); structured outputs (``response_format``, vLLM's
``guided_*`` and ``structured_outputs``) are read by ``structured.py``. ``null`` means the default for every field,
as in OpenAI's API. An unknown field gets OpenAI's
"Unrecognized request argument supplied" (400), unless the server runs with ``--allow-unknown-fields``. Values
are range-checked by ``SamplingParams`` (``ParameterError`` naming the field) and by the engine's limits when the
request is added.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from ..config import SamplingParams
from .errors import ApiError
from .structured import StructuredField, structured_field
from .tools import ToolPlan

logger = logging.getLogger("paged_hf")

# Fields that change nothing here: the caller's records (store, metadata, user, safety_identifier), routing and
# caching hints of OpenAI's own service (service_tier, prompt_cache_key, prompt_cache_retention), and stream
# obfuscation (no padding field is ever added here).
NO_EFFECT = ("store", "metadata", "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_retention",
             "user")


class StrictBody(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(StrictBody):
    include_usage: bool | None = False  # a last chunk, before [DONE], with empty choices and the request's usage
    continuous_usage_stats: bool | None = False  # vLLM's: the usage so far in every chunk too
    include_obfuscation: bool | None = None  # OpenAI's padding against side channels: none is added here


class _Sampling(StrictBody):
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
    response_format: dict | None = None  # OpenAI's on chat, vLLM's on completions (structured.py)
    # OpenAI's fields that change nothing here (NO_EFFECT)
    user: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    # vLLM's extensions
    top_k: int | None = None  # 0 or -1: off
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    min_tokens: int | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: int | None = None  # keep the prompt's last k tokens; -1: no truncation
    prompt_logprobs: int | None = None
    priority: int | None = None  # under --scheduling-policy priority: lower runs first
    request_id: str | None = None  # the response's id is "cmpl-<request_id>" / "chatcmpl-<request_id>"
    enable_prefix_caching: bool | None = None  # false: this request reuses no cached prefix
    cache_salt: str | None = None  # requests share cached prefixes only with the same salt
    add_special_tokens: bool | None = None
    use_beam_search: bool | None = None
    length_penalty: float | None = None  # beam search only: 1.0 (its default) alone is accepted
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    structured_outputs: Any = None
    structural_tag: Any = None

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk (``stream_options.include_usage``)."""
        return bool(self.stream_options is not None and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Whether every streamed chunk carries the usage so far (``stream_options.continuous_usage_stats``)."""
        return bool(self.stream_options is not None and self.stream_options.continuous_usage_stats)

    def check_supported(self) -> None:
        """Refuses (400, naming the field) what paged_hf does not implement; logs the fields that change nothing."""
        given = [name for name in NO_EFFECT if getattr(self, name, None) is not None]
        if given:
            logger.debug("accepted, changing nothing here: %s", ", ".join(given))
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream: true", "stream_options")
        self.structured()
        if self.use_beam_search:
            raise ApiError(400, "use_beam_search is not supported: the engine samples (greedy at temperature 0); "
                                "beam search runs through transformers' generate(num_beams=...)", "use_beam_search")
        if self.length_penalty is not None and self.length_penalty != 1.0:
            raise ApiError(400, f"length_penalty applies to beam search, which is not supported; got "
                                f"{self.length_penalty}", "length_penalty")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens != -1 and \
                self.truncate_prompt_tokens < 1:
            raise ApiError(400, f"truncate_prompt_tokens must be -1 (no truncation) or an int >= 1, got "
                                f"{self.truncate_prompt_tokens}", "truncate_prompt_tokens")

    def _requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def structured(self) -> StructuredField | None:
        """The structured output this body asks for (``response_format``, ``guided_*``, ``structured_outputs``)."""
        return structured_field(self)

    def sampling_params(self, defaults: SamplingParams, default_max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """The request's ``SamplingParams``, ``defaults``' values for the fields it leaves out (the model's
        generation_config); ``max_tokens`` is ``default_max_tokens`` when the body has none (the handler sets it per
        prompt: see ``max_tokens_given``)."""
        given = {
            "n": self.n, "temperature": self.temperature, "top_p": self.top_p,
            "top_k": -1 if self.top_k == 0 else self.top_k,
            "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens,
            "skip_special_tokens": self.skip_special_tokens,
            "spaces_between_special_tokens": self.spaces_between_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
        }
        values = {k: v for k, v in given.items() if v is not None}
        max_tokens = self._requested_max_tokens()
        return SamplingParams(
            **{**{k: getattr(defaults, k) for k in given}, **values},
            max_tokens=max_tokens if max_tokens is not None else default_max_tokens,
            seed=self.seed, stop=self.stop, stop_token_ids=self.stop_token_ids, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, logit_bias=_logit_bias(self.logit_bias),
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            structured_outputs=structured.spec if (structured := self.structured()) is not None else None,
        )

    @property
    def max_tokens_given(self) -> bool:
        return self._requested_max_tokens() is not None

    def submit_options(self) -> dict:
        """The engine's per-request options (``PagedEngine.add_request`` keywords) this body sets."""
        return {"priority": self.priority or 0, "cache_salt": self.cache_salt,
                "enable_prefix_caching": self.enable_prefix_caching is not False}


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

    @property
    def scores_only(self) -> bool:
        """``max_tokens: 0`` with ``echo``: the prompt and its logprobs, nothing generated."""
        return self.max_tokens == 0 and bool(self.echo)

    def _requested_max_tokens(self) -> int | None:
        return 1 if self.scores_only else self.max_tokens  # the engine's one token is dropped from the answer

    @property
    def engine_prompt_logprobs(self) -> int | None:
        """The engine's ``prompt_logprobs``: what ``echo`` with ``logprobs`` and vLLM's ``prompt_logprobs`` need."""
        wanted = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(wanted) if wanted else None

    def check_supported(self) -> None:
        super().check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens must be an int >= 1, got 0 (0 is allowed only with echo: true, to score "
                                "the prompt)", "max_tokens")
        if self.suffix:
            raise ApiError(400, "suffix is not supported (no insertion / fill-in-the-middle)", "suffix")
        n = self.n if self.n is not None else 1
        if self.best_of is not None and self.best_of != n:
            raise ApiError(400, f"best_of must equal n (paged_hf returns every sample: it does not rank extra "
                                f"ones), got best_of={self.best_of}, n={n}", "best_of")
        if self.logprobs is not None and self.logprobs < 0:  # the most: the engine's max_logprobs (--max-logprobs)
            raise ApiError(400, f"logprobs must be an int >= 0, got {self.logprobs}", "logprobs")


class ImageUrl(StrictBody):
    url: str
    detail: Literal["auto", "low", "high"] | None = None  # "low": scaled to fit 512 pixels a side (multimodal_prompts)


class ContentPart(StrictBody):
    """A text part (``text``) or an image part (``image_url``: a data: URL, or what the server's media flags
    allow)."""

    type: Literal["text", "image_url"]
    text: str | None = None
    image_url: ImageUrl | None = None

    def check_supported(self, where: str) -> None:
        if (self.type == "text") != (self.text is not None) or (self.type == "image_url") != \
                (self.image_url is not None):
            raise ApiError(400, f"{where}: a {self.type!r} content part takes the field {self.type!r} alone",
                           "messages")


class FunctionCall(StrictBody):
    name: str
    arguments: str | dict = "{}"  # OpenAI sends a JSON string; the chat template gets it parsed (as vLLM's)


class ToolCall(StrictBody):
    """A call an earlier assistant turn made (``messages[i].tool_calls``)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall
    index: int | None = None  # clients that rebuild a turn from its stream may keep the delta's index


class ChatMessage(StrictBody):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = ""
    name: str | None = None
    refusal: str | None = None  # an assistant turn that refused: its text when it has no content
    tool_calls: list[ToolCall] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    function_call: dict | None = None  # OpenAI's deprecated forms: refused
    audio: dict | None = None

    def check_supported(self, index: int) -> None:
        for name in ("function_call", "audio"):
            if getattr(self, name):
                raise ApiError(400, f"messages.{index}.{name} is not supported: paged_hf has no "
                                    f"{'audio' if name == 'audio' else 'function_call (use tool_calls)'}", "messages")
        if self.tool_calls and self.role != "assistant":
            raise ApiError(400, f"messages.{index}.tool_calls: only an assistant message makes tool calls",
                           "messages")
        for number, part in enumerate(self.content if isinstance(self.content, list) else []):
            part.check_supported(f"messages.{index}.content.{number}")

    @property
    def num_images(self) -> int:
        return sum(part.type == "image_url" for part in self.content) if isinstance(self.content, list) else 0

    def as_dict(self, index: int = 0) -> dict:
        content = self.content
        if isinstance(content, list) and self.num_images:  # the parts, for the image prompt (server/media.py)
            content = [part.model_dump(exclude_none=True) for part in content]
        elif isinstance(content, list):
            content = "\n".join(part.text for part in content)  # as vLLM joins text parts
        if not content and self.refusal:
            content = self.refusal
        message = {"role": self.role, "content": content or ""}  # "developer": see PromptTokenizer._template
        if self.name is not None:
            message["name"] = self.name  # for chat templates that read it
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            message["tool_calls"] = [_template_call(call, f"messages.{index}.tool_calls.{number}")
                                     for number, call in enumerate(self.tool_calls)]
        return message


def _template_call(call: ToolCall, where: str) -> dict:
    """A call as chat templates read it: its arguments a dict (transformers' convention, and vLLM's)."""
    arguments = call.function.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError as error:
            raise ApiError(400, f"{where}.function.arguments is not JSON: {error}", "messages") from None
    out = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
    return out if call.id is None else {"id": call.id, **out}


class FunctionDefinition(StrictBody):
    name: str = Field(pattern=r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's: letters, digits, _ - (and .), at most 64
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments (none: no arguments)
    strict: bool | None = None  # calls are held to the schema (forced calls always are; under "auto" where strict)


class Tool(StrictBody):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(StrictBody):
    name: str


class NamedToolChoice(StrictBody):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # false: at most one call
    functions: list | None = None
    function_call: str | dict | None = None
    modalities: list[str] | None = None
    audio: dict | None = None
    prediction: dict | None = None
    web_search_options: dict | None = None
    reasoning_effort: str | None = None  # handed to the chat template (gpt-oss's reads it); others ignore it
    verbosity: str | None = None
    # vLLM's
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool | None = None

    def chat(self) -> list[dict]:
        return [m.as_dict(index) for index, m in enumerate(self.messages)]

    @property
    def num_images(self) -> int:
        return sum(m.num_images for m in self.messages)

    def template_kwargs(self) -> dict:
        """Extra variables for the chat template: ``chat_template_kwargs``, ``tools`` and ``reasoning_effort`` when
        given."""
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        if self.tools:
            kwargs.setdefault("tools", [tool.model_dump(exclude_none=True) for tool in self.tools])
        return kwargs

    def tool_plan(self, parser: str | None) -> ToolPlan | None:
        """What ``tools`` / ``tool_choice`` ask (None without tools); ``parser``: the server's tool-call parser
        (None when auto tool choice is off)."""
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        tools = [tool.model_dump(exclude_none=True) for tool in self.tools or ()]
        plan = ToolPlan.of(tools, choice, self.parallel_tool_calls, parser)
        structured = self.structured() if plan is not None and plan.mode in ("named", "required") else None
        if structured is not None:
            raise ApiError(400, f"tool_choice {plan.mode!r} holds the answer to the tools' schemas: it cannot be "
                                f"combined with {structured.field}", "tool_choice")
        return plan

    def _requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_top_logprobs(self) -> int | None:
        """The engine's ``logprobs`` for this request: None when not asked."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def check_supported(self) -> None:
        super().check_supported()
        for index, message in enumerate(self.messages):
            message.check_supported(index)
        for name in ("functions", "function_call"):
            if getattr(self, name):
                raise ApiError(400, f"{name} is not supported: it is OpenAI's deprecated form of tools and "
                                    f"tool_choice, which work here", name)
        for name, what in (("audio", "audio output"), ("prediction", "predicted outputs"),
                           ("web_search_options", "web search")):
            if getattr(self, name) is not None:
                raise ApiError(400, f"{name} is not supported: paged_hf has no {what}", name)
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            raise ApiError(400, f"modalities {self.modalities!r:.100} is not supported: only [\"text\"]", "modalities")
        if self.verbosity not in (None, "medium"):
            raise ApiError(400, f"verbosity {self.verbosity!r:.30} is not supported: the model's answer length is "
                                f"its own (only \"medium\", the default, is accepted)", "verbosity")
        if self.max_tokens is not None and self.max_completion_tokens is not None and \
                self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens differ: give one", "max_tokens")
        if self.top_logprobs is not None:
            if not self.logprobs:
                raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
            if self.top_logprobs < 0:  # the most: the engine's max_logprobs (--max-logprobs; 20 by default)
                raise ApiError(400, f"top_logprobs must be an int >= 0, got {self.top_logprobs}", "top_logprobs")

