"""Tool calls in chat completions, as OpenAI's API and vLLM's server give them.

A request's ``tools`` go to the chat template (its ``tools`` variable); what the model answers depends on
``tool_choice``:

- ``"none"``: plain content (the template still sees the tools, as vLLM's default);
- ``{"type": "function", "function": {"name": N}}``: the output is held to N's ``parameters`` schema (structured
  outputs) and returned as one call of N; ``finish_reason`` stays the engine's (``"stop"``);
- ``"required"``: the output is held to a JSON array of ``{"name", "parameters"}`` objects, one per call, over the
  tools given (at most one with ``parallel_tool_calls: false``); ``finish_reason`` ``"tool_calls"``;
- ``"auto"`` (the default when tools are given): the model decides; needs the server's ``--enable-auto-tool-choice``
  and a ``--tool-call-parser`` that knows the model's format. ``hermes`` (Hermes, Qwen 2.5 / 3, SmolLM3 and other
  templates that write ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``) is the one built here; the
  text before the first call is the content, and ``finish_reason`` is ``"tool_calls"`` when a call was made. Where a
  tool is ``strict``, the answer is held to vLLM's structural tag: free text, and once ``<tool_call>`` is written, a
  call of one of the tools whose arguments follow its schema if it is strict (any JSON if not); with a
  ``response_format`` too, the answer is either calls or that format.

Streams carry the same: a named call's arguments as they grow; a ``"required"`` answer's calls when it ends; an
``"auto"`` answer's content as it grows (held back while it may be the start of ``<tool_call>``), each call whole
once its closing tag arrives. ``parallel_tool_calls: false`` keeps the first call alone.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from ..config import ParameterError
from ..structured import StructuredOutputsParams
from ..structured.grammar import as_format
from .errors import ApiError
from .structured import StructuredField

TOOL_CALL_PARSERS = ("hermes",)


def call_id() -> str:
    return "chatcmpl-tool-" + uuid.uuid4().hex[:24]


def tool_call(name: str, arguments: str, index: int | None = None) -> dict:
    """One call in OpenAI's shape (``index`` for a stream's delta)."""
    call = {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}
    return call if index is None else {"index": index, **call}


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request asks of tools. ``mode``: "none", "auto", "required" or "named" (then ``name``);
    ``parameters``: each tool's schema by name; ``strict``: the names of the tools marked ``strict: true``. (The tools
    reach the chat template from the request itself.)"""

    mode: str
    parameters: dict[str, dict] = field(default_factory=dict)
    name: str | None = None
    parallel: bool = True
    strict: frozenset[str] = frozenset()

    @classmethod
    def of(cls, tools: list[dict] | None, tool_choice, parallel_tool_calls: bool | None,
           parser: str | None) -> ToolPlan | None:
        """The plan of a request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` (None without tools);
        ``parser``: the server's ``--tool-call-parser`` when ``--enable-auto-tool-choice`` is on, else None.
        ``ApiError`` 400 naming the field for what cannot be done."""
        if not tools:
            if tool_choice not in (None, "none"):
                raise ApiError(400, "tool_choice needs tools: give the functions the model may call in tools",
                               "tool_choice")
            return None
        parameters, strict = {}, set()
        for index, tool in enumerate(tools):
            function = tool["function"]
            if function["name"] in parameters:
                raise ApiError(400, f"tools.{index}.function.name {function['name']!r:.64} is given twice", "tools")
            schema = function.get("parameters")
            parameters[function["name"]] = schema if schema else {"type": "object", "properties": {}}
            if function.get("strict"):
                strict.add(function["name"])
        name = None
        if isinstance(tool_choice, dict):
            mode, name = "named", tool_choice["function"]["name"]
            if name not in parameters:
                raise ApiError(400, f"tool_choice names the function {name!r:.64}, which is not in tools "
                                    f"(tools has {sorted(parameters)!r:.200})", "tool_choice")
        else:
            mode = "auto" if tool_choice is None else tool_choice
        if mode == "auto" and parser is None:
            raise ApiError(400, 'tool_choice "auto" (the default when tools are given) needs a server started with '
                                '--enable-auto-tool-choice and --tool-call-parser; "none", "required" or a named '
                                'function work on any server', "tool_choice")
        return cls(mode, parameters, name, parallel_tool_calls is not False, frozenset(strict))

    # ---------------------------------------------------------------------------------------------- requests
    def constraint(self, answer: StructuredOutputsParams | None = None) -> StructuredOutputsParams | None:
        """The structured output that holds the answer: a call (named), calls ("required"), or under "auto" with
        strict tools vLLM's structural tag (text, then after ``<tool_call>`` calls held to the tools), or with
        ``answer`` (the request's own structured output) either calls or ``answer``. None for "none" and for "auto"
        without strict tools: ``answer`` then applies alone. ``ParameterError`` for an ``answer`` a tag cannot hold."""
        if self.mode == "auto":
            if not self.strict:
                return None
            if answer is None:
                tag = {"type": "triggered_tags", "triggers": [_OPEN], "tags": self._hermes_tags(),
                       "stop_after_first": not self.parallel}
            else:
                calls = {"type": "tags_with_separator", "tags": self._hermes_tags(), "separator": "",
                         "at_least_one": True, "stop_after_first": not self.parallel}
                tag = {"type": "or", "elements": [calls, as_format(answer)]}
            return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": tag})
        if self.mode == "named":
            return StructuredOutputsParams(json=self.parameters[self.name])
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                  "required": ["name", "parameters"]} for name, schema in self.parameters.items()]
        array = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        return StructuredOutputsParams(json=array)

    def _hermes_tags(self) -> list[dict]:
        """One structural-tag element per tool and per hermes layout (a call on lines of its own, or inline): the
        envelope up to ``"arguments": `` is fixed, then the arguments (the tool's schema if it is strict, any JSON
        if not), then the close."""
        return [{"type": "tag", "begin": f'{begin}{{"name": "{name}", "arguments": ',
                 "content": {"type": "json_schema", "json_schema": schema if name in self.strict else True},
                 "end": f"}}{end}"}
                for name, schema in self.parameters.items() for begin, end in _HERMES_LAYOUTS]

    @property
    def keeps_special_tokens(self) -> bool:
        """The parser reads tags that many tokenizers make special tokens (``<tool_call>``): keep them in the text."""
        return self.mode == "auto"

    # ---------------------------------------------------------------------------------------------- answers
    def answer(self, text: str, finish_reason: str | None) -> tuple[str | None, list[dict], str | None]:
        """(content, calls, finish_reason) of a whole answer."""
        if self.mode == "named":
            return "", [tool_call(self.name, text)], finish_reason
        if self.mode == "required":
            calls = _required_calls(text)
            if calls is None:  # cut by max_tokens: no complete array to call with
                return text, [], finish_reason
            return "", calls, self.finish_reason(len(calls), finish_reason)
        if self.mode == "auto":
            content, calls = parse_hermes(text)
            calls = calls if self.parallel else calls[:1]
            return content, calls, self.finish_reason(len(calls), finish_reason)
        return text, [], finish_reason

    def finish_reason(self, num_calls: int, reason: str | None) -> str | None:
        """OpenAI's: "tool_calls" where an answer that chose to call ("auto", "required") ended with calls; a named
        call keeps the engine's reason."""
        return "tool_calls" if reason == "stop" and num_calls and self.mode in ("auto", "required") else reason

    def stream(self) -> ToolStream:
        return ToolStream(self)


def tool_constraint(plan: ToolPlan | None, answer: StructuredField | None) -> StructuredField | None:
    """The structured output a chat request runs with when its tools decide it (``ToolPlan.constraint``), named
    after the field that caused it; None where ``answer`` (the request's own, or none) applies as it is."""
    if plan is None:
        return None
    try:
        spec = plan.constraint(answer.spec if answer is not None else None)
    except ParameterError as error:
        raise ApiError(400, str(error), answer.field) from None
    if spec is None:
        return None
    if answer is None:
        return StructuredField(spec, "tool_choice", f"tool_choice {plan.mode!r}")
    return StructuredField(spec, answer.field, f"{answer.label} or calls of the strict tools")


def _required_calls(text: str) -> list[dict] | None:
    """The calls of a "required" answer (a JSON array of {"name", "parameters"}); None if it is not complete."""
    try:
        return [tool_call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in json.loads(text)]
    except (ValueError, TypeError, KeyError):
        return None


# ------------------------------------------------------------------------------------------------------ hermes
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_HERMES_LAYOUTS = ((_OPEN + "\n", "\n" + _CLOSE), (_OPEN, _CLOSE))  # Qwen's templates write the first


def _hermes_call(body: str) -> dict | None:
    """The call a ``<tool_call>`` body holds: ``{"name": ..., "arguments": {...}}``; None if it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    return tool_call(value["name"], json.dumps(arguments, ensure_ascii=False))


def parse_hermes(text: str) -> tuple[str | None, list[dict]]:
    """(content, calls) of a whole hermes-format answer, exactly as a stream of it gives them (``ToolStream``): the
    content is the text before the first ``<tool_call>`` (None when empty and calls were made) and the text of any
    call that does not parse (one cut by ``max_tokens`` too); the text between and after calls is not content."""
    content, deltas = ToolStream(ToolPlan("auto")).feed(text, finished=True)
    calls = [{key: value for key, value in delta.items() if key != "index"} for delta in deltas]
    return (content or None) if calls else content, calls


class ToolStream:
    """One choice's stream under a plan: ``feed`` each new text, then once more with ``finished``; each returns
    (content delta, [call deltas])."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""  # required: everything; auto: what is held back (a possible tag start, or an open call)
        self.calls = 0
        self.inside = False  # auto: inside <tool_call>...</tool_call>
        self.opened = False  # auto: a call has begun (text between and after calls is not content, as unstreamed)

    def feed(self, new: str, finished: bool) -> tuple[str, list[dict]]:
        mode = self.plan.mode
        if mode == "none":
            return new, []
        if mode == "named":
            if not new and self.calls:
                return "", []
            first = self.calls == 0
            self.calls = 1
            if first:
                return "", [tool_call(self.plan.name, new, index=0)]
            return "", [{"index": 0, "function": {"arguments": new}}]
        self.text += new
        if mode == "required":
            if not finished:
                return "", []
            calls = _required_calls(self.text)
            if calls is None:
                return self.text, []
            self.calls = len(calls)
            return "", [{"index": i, **call} for i, call in enumerate(calls)]
        return self._auto(finished)

    def _auto(self, finished: bool) -> tuple[str, list[dict]]:
        content, calls = "", []
        while self.text:
            if not self.inside:
                start = self.text.find(_OPEN)
                if start < 0:
                    keep = 0 if finished else _partial_tag(self.text)
                    if not self.opened:
                        content += self.text[:len(self.text) - keep]
                    self.text = self.text[len(self.text) - keep:]
                    break
                if not self.opened:
                    content += self.text[:start]
                self.text, self.inside, self.opened = self.text[start + len(_OPEN):], True, True
            end = self.text.find(_CLOSE)
            if end < 0 and not finished:
                break
            body = self.text if end < 0 else self.text[:end]
            call = _hermes_call(body.strip())
            if call is None:  # not a call after all: its text is content
                content += _OPEN + (self.text if end < 0 else self.text[:end + len(_CLOSE)])
            elif self.plan.parallel or not self.calls:  # parallel_tool_calls false: the first call alone
                calls.append({"index": self.calls, **call})
                self.calls += 1
            self.text = "" if end < 0 else self.text[end + len(_CLOSE):]
            self.inside = False
        return content, calls

    def finish_reason(self, reason: str | None) -> str | None:
        return self.plan.finish_reason(self.calls, reason)


def _partial_tag(text: str) -> int:
    """How many of ``text``'s last characters could begin ``<tool_call>``."""
    for keep in range(min(len(_OPEN) - 1, len(text)), 0, -1):
        if _OPEN.startswith(text[-keep:]):
            return keep
    return 0
