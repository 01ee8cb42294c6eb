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
        "json_object": "the JSON object schema"}


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
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError, TypeError) as error:  # xgrammar's parse errors are RuntimeErrors
        raise GrammarError(kind, backend_message(error)) from None


def choice_ebnf(choices: tuple[str, ...]) -> str:
    """``root ::= "a" | "b"``: each choice as an EBNF string literal (JSON's escapes, which xgrammar reads)."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)
