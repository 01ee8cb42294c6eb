"""The structured-output fields of a request body, read into one ``StructuredOutputsParams``.

OpenAI's ``response_format`` (``{"type": "json_object"}``, ``{"type": "json_schema", "json_schema": {"name": ...,
"schema": {...}}}``; ``{"type": "text"}`` constrains nothing; vLLM's ``{"type": "structural_tag", "format": {...}}``
and its older ``{"type": "structural_tag", "structures": [...], "triggers": [...]}``), vLLM's ``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar`` extras and its ``structured_outputs`` object. A request gives at most one; a
malformed one is a 400 naming its field, and so is a spec the backend cannot compile (``check_compiles``, run in a
worker thread: the engine thread never parses a schema a handler has not parsed first).
"""

from __future__ import annotations

from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool

from ..config import ParameterError
from ..structured import GrammarError, StructuredOutputsParams
from ..structured.params import KINDS
from .errors import ApiError

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
BACKENDS = ("auto", "xgrammar")
RESPONSE_FORMATS = ("text", "json_object", "json_schema", "structural_tag")
REFUSED = {"guided_whitespace_pattern": "the xgrammar backend has no whitespace pattern (structured_outputs' "
                                        "disable_any_whitespace turns free whitespace off)",
           "structural_tag": 'a structural tag is given as response_format {"type": "structural_tag", ...} or as '
                             'structured_outputs.structural_tag'}


@dataclass(frozen=True)
class StructuredField:
    """The spec a body asks for; ``field``: the top-level request field it came from; ``label``: where exactly."""

    spec: StructuredOutputsParams
    field: str
    label: str


def structured_field(body) -> StructuredField | None:
    """The body's structured-output spec (None when it asks for none); ``ApiError`` 400 naming the field."""
    for name, why in REFUSED.items():
        if getattr(body, name) is not None:
            raise ApiError(400, f"{name} is not supported: {why}", name)
    if body.guided_decoding_backend is not None and body.guided_decoding_backend not in BACKENDS:
        raise ApiError(400, f"guided_decoding_backend must be one of {list(BACKENDS)}, got "
                            f"{body.guided_decoding_backend!r:.50}", "guided_decoding_backend")
    found = []
    if body.response_format is not None:
        found += _response_format(body.response_format)
    for name, kind in GUIDED.items():
        value = getattr(body, name)
        if value is not None:
            found.append(_spec(name, name, kind, {kind: value}))
    if body.structured_outputs is not None:
        found.append(_structured_outputs(body.structured_outputs))
    if len(found) > 1:
        raise ApiError(400, f"give one structured output constraint, got {[f.label for f in found]}", found[1].field)
    return found[0] if found else None


async def check_compiles(grammars, structured: StructuredField) -> None:
    """Parses (and starts compiling) the spec in a worker thread; a 400 naming the field if the backend refuses it."""
    try:
        await run_in_threadpool(grammars.submit, structured.spec)
    except GrammarError as error:
        raise ApiError(400, f"{structured.label}: cannot be compiled (xgrammar): {error.backend_message}",
                       structured.field) from None
    except ImportError as error:
        raise ApiError(400, f"{structured.field} is not available on this server: {error}", structured.field) \
            from None


def _response_format(value: dict) -> list[StructuredField]:
    kind = value.get("type")
    if kind not in RESPONSE_FORMATS:
        raise ApiError(400, f"response_format.type must be one of {list(RESPONSE_FORMATS)}, got {kind!r:.50}",
                       "response_format")
    if kind == "text":
        return []
    if kind == "json_object":
        return [_spec("response_format", "response_format", "json_object", {"json_object": True})]
    if kind == "structural_tag":  # the whole object is the tag: xgrammar reads {"type": "structural_tag", ...}
        return [_spec("response_format", "response_format", "structural_tag", {"structural_tag": value})]
    schema = value.get("json_schema")
    if not isinstance(schema, dict) or not isinstance(schema.get("schema"), dict):
        raise ApiError(400, "response_format.json_schema.schema is required: a JSON schema (an object), as in "
                            "{\"type\": \"json_schema\", \"json_schema\": {\"name\": ..., \"schema\": {...}}}",
                       "response_format")
    return [_spec("response_format", "response_format.json_schema.schema", "json", {"json": schema["schema"]})]


def _structured_outputs(value) -> StructuredField:
    if not isinstance(value, dict):
        raise ApiError(400, f"structured_outputs must be an object, got {value!r:.100}", "structured_outputs")
    given = [kind for kind in KINDS if value.get(kind) not in (None, False)]
    label = f"structured_outputs.{given[0]}" if len(given) == 1 else "structured_outputs"
    return _spec("structured_outputs", label, None, value)


def _spec(field: str, label: str, kind: str | None, options: dict) -> StructuredField:
    try:
        spec = StructuredOutputsParams(**options)
    except TypeError as error:  # an unknown key of structured_outputs
        raise ApiError(400, f"{field}: {error}", field) from None
    except ParameterError as error:
        message = str(error).replace(f"structured_outputs.{kind}", label, 1) if kind else str(error)
        raise ApiError(400, message, field) from None
    return StructuredField(spec, field, label)
