"""API keys (``paged-hf serve --api-key``, or ``VLLM_API_KEY`` as vLLM reads it): every request but the operational
probes must carry ``Authorization: Bearer <one of the keys>``, else 401 in OpenAI's error shape.

An ASGI middleware, so streamed responses and every route (present and future) pass through it; preflight
``OPTIONS`` requests pass, as browsers send them without credentials. Keys are compared as SHA-256 digests with
``hmac.compare_digest`` over all of them, so the time taken says nothing about which key or how much of it matched.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/load", "/metrics"})  # probes that carry no data
ENV_VAR = "VLLM_API_KEY"


def api_keys(given: list[str] | None) -> list[str]:
    """The keys to require: those given (``--api-key``), else ``$VLLM_API_KEY``'s, else none (an open server).
    ValueError for an empty key, which any client could send."""
    keys = list(given) if given else ([os.environ[ENV_VAR]] if os.environ.get(ENV_VAR) is not None else [])
    if any(not key.strip() for key in keys):
        raise ValueError(f"--api-key / {ENV_VAR} must not be empty")
    return keys


class ApiKeyMiddleware:
    """Refuses requests without a valid bearer key with 401 (``code: "invalid_api_key"``)."""

    def __init__(self, app, keys: list[str]) -> None:
        self.app = app
        self.digests = [hashlib.sha256(key.encode()).digest() for key in keys]

    def _authorized(self, scope) -> bool:
        header = dict(scope.get("headers") or ()).get(b"authorization", b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer":
            return False
        digest = hashlib.sha256(token.strip().encode("latin-1")).digest()
        matched = False
        for known in self.digests:  # no early exit: every key is compared
            matched |= hmac.compare_digest(digest, known)
        return matched

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or \
                scope["path"].removeprefix(scope.get("root_path", "")) in OPEN_PATHS or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        body = json.dumps({"error": {"message": "Incorrect or missing API key: send 'Authorization: Bearer <key>'",
                                     "type": "invalid_request_error", "param": None,
                                     "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
