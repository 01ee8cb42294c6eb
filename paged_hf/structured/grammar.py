"""From a ``StructuredOutputsParams`` to an xgrammar ``Grammar`` (parsed, not yet compiled for a vocabulary).

Parsing is cheap (a JSON schema or regex converted to the backend's grammar form) and finds the specs the backend
cannot serve: each raises ``GrammarError`` (a ``ParameterError``) with the backend's own message. xgrammar is
imported here, on first use, with an install hint when it is absent.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from ..config import ParameterError
from .params import StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

_LOCATION = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[15:10:54] /project/cpp/x.cc:94: " prefix
JSON_OBJECT_SCHEMA = '{"type": "object"}'
WHAT = {"json": "the JSON schema", "regex": "the regex", "choice": "the choices", "grammar": "the grammar",
        "json_object": "the JSON object schema", "structural_tag": "the structural tag"}


class GrammarError(ParameterError):
    """The backend refused a spec. ``kind``: which field; ``backend_message``: xgrammar's words."""

    def __init__(self, kind: str, backend_message: str) -> None:
        super().__init__("structured_outputs", f"structured_outputs.{kind}: {WHAT[kind]} cannot be compiled "
                                               f"(xgrammar): {backend_message}")
        self.kind, self.backend_message = kind, backend_message


def xgrammar_module():
    """The ``xgrammar`` module; ImportError with the install command when it is absent."""
    try:
        import xgrammar  # noqa: PLC0415 - an optional dependency, imported when structured outputs are used
    except ImportError as error:
        raise ImportError("structured outputs need xgrammar: pip install 'paged_hf[structured]' (or xgrammar)") \
            from error
    return xgrammar


def backend_message(error: BaseException) -> str:
    """xgrammar's message without its time stamp and source location."""
    return _LOCATION.sub("", str(error).strip())


def build_grammar(spec: StructuredOutputsParams) -> "xgrammar.Grammar":
    """The parsed grammar of ``spec``; ``GrammarError`` when the backend cannot read it."""
    xgr = xgrammar_module()
    kind = spec.kind
    try:
        if kind == "json":
            return xgr.Grammar.from_json_schema(json.dumps(spec.json), any_whitespace=not spec.disable_any_whitespace)
        if kind == "json_object":  # an object, as OpenAI promises and vLLM compiles it (never an array)
            return xgr.Grammar.from_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=not spec.disable_any_whitespace)
        if kind == "regex":
            return xgr.Grammar.from_regex(spec.regex)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(spec.choice))
        if kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(json.dumps(structural_tag(spec.structural_tag)))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as error:  # xgrammar's parse errors are RuntimeErrors
        raise GrammarError(kind, backend_message(error)) from None


def structural_tag(tag: dict) -> dict:
    """``tag`` in xgrammar's current form: vLLM's older ``{"structures": [{"begin", "schema", "end"}], "triggers":
    [...]}`` (any text; after a trigger, one of the structures, whose content follows its schema; then any text
    again) becomes the ``triggered_tags`` format that means the same; the current form is returned as it is."""
    if "structures" not in tag:
        return tag
    structures, triggers = tag.get("structures"), tag.get("triggers")
    if not isinstance(structures, list) or not all(isinstance(item, dict) for item in structures) or \
            not isinstance(triggers, list):
        raise ValueError('a structural tag with "structures" needs a list of {"begin", "schema", "end"} objects and '
                         'a list of "triggers"')
    tags = [{"type": "tag", "begin": item.get("begin"), "end": item.get("end"),
             "content": {"type": "json_schema", "json_schema": item.get("schema", True)}} for item in structures]
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}


def as_format(spec: StructuredOutputsParams) -> dict:
    """``spec`` as one element of a structural tag (xgrammar's format JSON), to be combined with others (a tool-call
    tag or this answer: ``{"type": "or", ...}``). ``ParameterError`` for ``disable_any_whitespace``, which a
    structural tag's JSON schema element cannot express."""
    if spec.disable_any_whitespace:
        raise ParameterError("structured_outputs", "structured_outputs.disable_any_whitespace cannot be combined with "
                                                   "tool calls held to their schemas (strict tools)")
    kind = spec.kind
    if kind in ("json", "json_object"):
        return {"type": "json_schema", "json_schema": spec.json if kind == "json" else json.loads(JSON_OBJECT_SCHEMA)}
    if kind == "regex":
        return {"type": "regex", "pattern": spec.regex}
    if kind == "choice":
        return {"type": "or", "elements": [{"type": "const_string", "value": choice} for choice in spec.choice]}
    if kind == "grammar":
        return {"type": "grammar", "grammar": spec.grammar}
    return structural_tag(spec.structural_tag).get("format")


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """``root ::= "a" | "b"``: each choice as an EBNF string literal (JSON's escapes, which xgrammar reads)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
