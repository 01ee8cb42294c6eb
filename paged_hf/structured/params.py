"""``StructuredOutputsParams``: what a request's output must match (vLLM's name and fields).

Exactly one of ``json`` (a JSON schema), ``regex``, ``choice``, ``grammar`` (EBNF, as xgrammar reads it),
``json_object`` or ``structural_tag`` (xgrammar's, as vLLM takes it) is set; every value is checked here, and a bad one raises ``ParameterError`` naming the field. A
schema or regex that is well formed but that the backend cannot compile is refused when the request is added
(``grammar.build_grammar``). This module imports no backend: ``SamplingParams`` checks it without xgrammar.
"""

from __future__ import annotations

import json as _json
from dataclasses import dataclass

from ..config import ParameterError

KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _fail(name: str, message: str) -> ParameterError:
    return ParameterError("structured_outputs", f"structured_outputs.{name} {message}")


@dataclass(frozen=True)
class StructuredOutputsParams:
    """The constraint of one request's output.

    Attributes:
        json: a JSON schema, as a dict or its JSON text; the output is a JSON value that validates against it.
        regex: the output matches this regular expression (whole).
        choice: the output is one of these strings, exactly.
        grammar: an EBNF grammar (xgrammar's dialect, GBNF-like; the rule ``root`` is the output).
        json_object: True: the output is a JSON object, any keys and values (OpenAI's ``{"type": "json_object"}``).
        structural_tag: an xgrammar structural tag, as a dict or its JSON text: ``{"type": "structural_tag", "format":
            {...}}`` (free text and constrained parts, e.g. tool calls held to their schemas once a trigger such as
            ``<tool_call>`` is written), or vLLM's older ``{"structures": [{"begin", "schema", "end"}], "triggers":
            [...]}``.
        disable_any_whitespace: with ``json`` or ``json_object``: no free whitespace between JSON tokens (vLLM's
            name); by default any amount is allowed, as vLLM's xgrammar backend does.
    """

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: dict | str | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ParameterError("structured_outputs", f"structured_outputs needs exactly one of {list(KINDS)}, got "
                                                       f"{given or 'none'}")
        if self.json is not None:
            object.__setattr__(self, "json", _schema(self.json))
        if self.structural_tag is not None:
            object.__setattr__(self, "structural_tag", _json_object("structural_tag", self.structural_tag,
                                                                    "a structural tag"))
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _fail(name, f"must be a non-empty string, got {value!r:.100}")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or \
                    not all(isinstance(c, str) for c in self.choice):
                raise _fail("choice", f"must be a non-empty list of strings, got {self.choice!r:.100}")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object is not None and not isinstance(self.json_object, bool):
            raise _fail("json_object", f"must be a bool, got {self.json_object!r}")
        if not isinstance(self.disable_any_whitespace, bool):
            raise _fail("disable_any_whitespace", f"must be a bool, got {self.disable_any_whitespace!r}")
        if self.disable_any_whitespace and self.json is None and not self.json_object:
            raise _fail("disable_any_whitespace", f"applies to json and json_object only, not to {given[0]}")

    @property
    def kind(self) -> str:
        """The one constraint set: ``"json"``, ``"regex"``, ``"choice"``, ``"grammar"``, ``"json_object"`` or
        ``"structural_tag"``."""
        return next(name for name in KINDS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple:
        """What identifies the compiled grammar (the cache key): equal specs share one compilation. A schema's key
        ignores the order of its keywords but keeps its properties' order, which the grammar writes them in
        (``{a, b}`` and ``{b, a}`` differ); a structural tag's keeps its text's order."""
        key = self.__dict__.get("_key")
        if key is None:
            value = getattr(self, self.kind)
            text = _json.dumps(_canonical(value)) if self.kind == "json" else \
                _json.dumps(value) if self.kind == "structural_tag" else value
            key = (self.kind, text, self.disable_any_whitespace)
            object.__setattr__(self, "_key", key)
        return key


def _canonical(value, ordered: bool = False):
    """``value`` with every object's keys sorted, but a ``properties`` object's (``ordered``): their order is the
    output's."""
    if isinstance(value, dict):
        items = value.items() if ordered else sorted(value.items())
        return {key: _canonical(item, key == "properties" and not ordered) for key, item in items}  # dumped in order
    if isinstance(value, list):
        return [_canonical(item) for item in value]
    return value


def _schema(schema) -> dict:
    """A JSON schema as a dict (its JSON text is parsed here: invalid JSON is a ``ParameterError``)."""
    return _json_object("json", schema, "a JSON schema")


def _json_object(name: str, value, what: str) -> dict:
    """``value`` (a dict, or its JSON text, parsed here) as a dict; ``ParameterError`` naming ``name`` otherwise."""
    if isinstance(value, str):
        try:
            value = _json.loads(value)
        except _json.JSONDecodeError as error:
            raise _fail(name, f"is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise _fail(name, f"must be {what} (a JSON object), got {value!r:.100}")
    return value
