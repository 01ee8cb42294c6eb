"""Reading a request body: a size limit, strict UTF-8, strict JSON, no lone surrogates, then the pydantic model.

Each failure is an ``ApiError``: 413 past ``max_request_bytes`` (from ``Content-Length`` before reading anything,
else as soon as the bytes read pass it), 400 for the rest, naming the field where there is one. JSON decoding and
validation run in a worker thread: a large body does not hold the event loop.
"""

from __future__ import annotations

import json
import logging

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect

from .errors import ApiError

DEFAULT_MAX_REQUEST_BYTES = 16 * 2**20

logger = logging.getLogger("paged_hf")
_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none"}


CLIENT_GONE = 499  # nginx's status for a client that closed the connection (nobody reads it)


class ClientGone(Exception):
    """The client disconnected before its body was read: there is nobody to answer."""


async def read_body(raw: Request, limit: int) -> bytes:
    declared = raw.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise _too_large(int(declared), limit)
    chunks, size = [], 0
    try:
        async for chunk in raw.stream():
            size += len(chunk)
            if size > limit:
                raise _too_large(size, limit, at_least=True)
            chunks.append(chunk)
    except ClientDisconnect:
        raise ClientGone() from None
    return b"".join(chunks)


def _too_large(size: int, limit: int, at_least: bool = False) -> ApiError:
    return ApiError(413, f"the request body is {'over ' if at_least else ''}{size} bytes; this server takes at most "
                         f"{limit} (--max-request-bytes)", code="request_too_large")


async def parse_body(body: bytes, model: type[BaseModel], allow_unknown_fields: bool = False) -> BaseModel:
    return await run_in_threadpool(_parse, body, model, allow_unknown_fields)


def _parse(body: bytes, model: type[BaseModel], allow_unknown_fields: bool = False) -> BaseModel:
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as error:
        raise ApiError(400, f"the request body is not valid UTF-8 (byte {error.start}: {error.reason})") from None
    try:
        data = json.loads(text, parse_constant=_no_constants)
        if not isinstance(data, dict):
            raise ApiError(400, f"the request body must be a JSON object, got a JSON {type(data).__name__}")
        _check_surrogates(data, "")
    except json.JSONDecodeError as error:
        raise ApiError(400, f"the request body is not valid JSON: {error.msg} (line {error.lineno}, column "
                            f"{error.colno})") from None
    except RecursionError:  # Python's parser (and the surrogate walk) recurse once per level
        raise ApiError(400, "the request body is nested too deeply (arrays or objects within each other)") from None
    while True:
        try:
            return model.model_validate(data)
        except ValidationError as error:
            unknown = [e["loc"] for e in error.errors() if e["type"] == "extra_forbidden"]
            if not allow_unknown_fields or not unknown:
                raise validation_error(error) from None
            try:
                for loc in unknown:
                    _drop(data, loc)
            except (KeyError, IndexError, TypeError):
                raise validation_error(error) from None


def _drop(data: dict, loc: tuple) -> None:
    """Removes the unknown field at ``loc`` (``--allow-unknown-fields``), with a warning naming it."""
    path = [p for p in loc if not _is_type_tag(p)]
    parent = data
    for part in path[:-1]:
        parent = parent[part]
    logger.warning("ignoring the unknown request field %s (--allow-unknown-fields)", ".".join(map(str, path)))
    del parent[path[-1]]


def _no_constants(name: str):
    raise json.JSONDecodeError(f"{name} is not valid JSON", name, 0)


def _check_surrogates(value, path: str) -> None:
    """Strings that cannot be UTF-8 (a lone surrogate, from a ``\\ud800`` escape) cannot reach a tokenizer."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as error:
            field = path or "body"
            raise ApiError(400, f"{field} holds a lone surrogate (\\u{ord(value[error.start]):04x} at character "
                                f"{error.start}): strings must be valid Unicode", path.split(".")[0] or None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_surrogates(key, path)
            _check_surrogates(item, f"{path}.{key}" if path else key)
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _check_surrogates(item, f"{path}.{index}")


def validation_error(error: ValidationError) -> ApiError:
    """A 400 naming the invalid field (``param`` is the top-level field; the message has the full path). Of a
    union's failed members, the deepest failure is the telling one (a content part's ``type``, not "not a string")."""
    errors = error.errors()
    first = max(errors, key=lambda e: sum(not _is_type_tag(p) for p in e["loc"]))
    parts = [str(p) for p in first["loc"] if not _is_type_tag(p)]
    field = ".".join(parts)
    if first["type"] == "extra_forbidden":
        return ApiError(400, f"Unrecognized request argument supplied: {field}", parts[0] if parts else None)
    if first["type"] == "missing":
        return ApiError(400, f"{field} is required", parts[0] if parts else None)
    return ApiError(400, f"{field}: {first['msg']}", parts[0] if parts else None)


def _is_type_tag(part) -> bool:
    """pydantic's loc names the member of a union it tried (``str``, ``list[int]``, ``ContentPart``): not a field."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or part[:1].isupper())
