"""The ASGI guard around every request: hosts, origins, content types, body bounds, metrics, access log.

It runs before routing, so nothing it refuses reaches a handler (or the JSON parser): a Host that
is not this server's (DNS rebinding) is 421, a foreign Origin on a state-changing request in
no-key mode 403, a JSON route's body sent as anything but ``application/json`` 415 (a browser
sends ``text/plain`` cross-origin without asking first), a body over its route's limit 413 and a
JSON body nested deeper than ``max_json_depth`` 400 (``json.loads`` recurses: 50,000 levels was a
500 RecursionError). Then it counts the request under its route template (never the raw path:
random 404 paths once grew /metrics without bound) and writes one access-log line.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, MutableMapping
from itertools import accumulate
from typing import Any
from urllib.parse import urlsplit

from fastapi.responses import JSONResponse

from ragkv.server.state import ServerState

__all__ = ["Guard", "json_depth", "route_label"]

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Any]]
Send = Callable[[Any], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

access_log = logging.getLogger("ragkv.server.access")

LOOPBACK = ("127.0.0.1", "localhost", "::1")
BODY_TIMEOUT_S = 60.0  # seconds a JSON or upload body may take to arrive once its headers did
_STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})
_JSON_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/documents")
_DEPTH = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_STRINGS = re.compile(rb'"(?:[^"\\]|\\.)*"')


def json_depth(body: bytes) -> int:
    """How deeply ``body``'s arrays and objects nest (brackets inside strings do not count).

    Linear and iteration-free in Python (regex, translate, accumulate), so a body can be checked
    before ``json.loads`` recurses into it.

    >>> json_depth(b'{"a": [1, {"b": "[[[["}]}')
    3
    >>> json_depth(b'"plain"')
    0
    """
    brackets = _STRINGS.sub(b"", body).translate(None, _NOT_BRACKETS).translate(_DEPTH)
    steps = (1 if b == 1 else -1 for b in brackets)
    return max(accumulate(steps, initial=0))


def route_label(scope: Scope) -> str:
    """The metrics/log label of a routed request: its route template, or one of a few fixed names."""
    route = scope.get("route")
    if route is not None and isinstance(getattr(route, "path", None), str):
        return str(route.path)
    return "/static" if str(scope.get("path", "")).startswith("/static/") else "unmatched"


def _host_name(value: str) -> str:
    """``Host`` header -> host name, lowercased, without port (``[::1]:8000`` -> ``::1``)."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:].split("]", 1)[0]
    return value.rsplit(":", 1)[0] if value.count(":") == 1 else value


class Guard:
    """The outermost middleware of ``ragkv serve`` (see the module docstring)."""

    def __init__(self, app: ASGIApp, state: ServerState) -> None:
        self.app, self.state = app, state
        s = state.settings
        wildcard = s.host in ("0.0.0.0", "::", "")
        self.hosts = None if "*" in s.allowed_hosts else {*LOOPBACK, *(() if wildcard else (s.host,)), *s.allowed_hosts}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        info = scope.setdefault("state", {})  # handlers note the tenant and cached tokens here
        status = {"code": 500}

        async def recorded_send(message: Any) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            refusal = await self._check(scope, receive)
            if isinstance(refusal, JSONResponse):
                await refusal(scope, receive, recorded_send)
            else:
                await self.app(scope, refusal, recorded_send)
        finally:
            label = route_label(scope)
            self.state.metrics.count_request(label, status["code"])
            self._log(scope, label, status["code"], (time.perf_counter() - t0) * 1000, info)

    async def _check(self, scope: Scope, receive: Receive) -> JSONResponse | Receive:
        """A refusal, or the ``receive`` to run the app with (the body read already, when checked)."""
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers") or []}
        s, method, path = self.state.settings, scope["method"], scope["path"]
        if self.hosts is not None and _host_name(headers.get("host", "")) not in self.hosts:
            return _refuse(421, "this server does not answer to that Host name; start it with --allowed-host NAME")
        origin = headers.get("origin")
        if method in _STATE_CHANGING and origin and not s.api_keys and not self._same_origin(origin, headers):
            return _refuse(403, f"cross-origin {method} from {origin} refused: this server has no API keys")
        if method not in _STATE_CHANGING or not path.startswith(_JSON_ROUTES):
            return receive
        auth = headers.get("authorization", "")
        if s.api_keys and not _known_key(auth, s.api_keys):
            # no body is read (up to 8 MiB, held in memory) for a client without a key; the words are the app's
            what = "no API key given" if not auth else "unknown API key"
            fix = "send 'Authorization: Bearer KEY' with a key from the server's --api-keys file"
            return _refuse(401, f"{what}: {fix}", "authentication_error")
        ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
        uploads = path.startswith("/v1/documents")
        if uploads and ctype == "multipart/form-data":
            if int(headers.get("content-length", "0") or 0) > s.max_body_bytes:
                return _too_large(s.max_body_bytes)
            return _bounded(receive, s.max_body_bytes)
        if method == "DELETE" and not headers.get("content-length", "0").strip("0"):
            return receive
        if ctype != "application/json":
            return _refuse(415, f"send the body as Content-Type: application/json (got {ctype or 'none'})")
        limit = s.max_body_bytes if uploads else s.max_json_bytes
        if int(headers.get("content-length", "0") or 0) > limit:
            return _too_large(limit)
        try:  # a client dribbling its body holds a connection and its bytes: not for long
            body = await asyncio.wait_for(_read(receive, limit), BODY_TIMEOUT_S)
        except TimeoutError:
            return _refuse(408, f"the request body did not arrive within {BODY_TIMEOUT_S:.0f} s; send it at once")
        if body is None:
            return _too_large(limit)
        depth = await asyncio.to_thread(json_depth, body) if len(body) > 65536 else json_depth(body)
        if depth > s.max_json_depth:
            return _refuse(400, f"JSON nested {depth} levels deep; this server takes at most {s.max_json_depth}")
        return _replay(body, receive)

    def _same_origin(self, origin: str, headers: dict[str, str]) -> bool:
        """An Origin naming this server itself (the web page at /) is not foreign."""
        parts = urlsplit(origin)
        return parts.netloc.lower() == headers.get("host", "").lower() and (
            self.hosts is None or _host_name(parts.netloc) in self.hosts
        )

    def _log(self, scope: Scope, label: str, status: int, ms: float, info: dict[str, Any]) -> None:
        if not self.state.settings.access_log or not access_log.isEnabledFor(logging.INFO):
            return
        fields = {
            "method": scope["method"],
            "route": label,
            "status": status,
            "duration_ms": round(ms, 1),
            "tenant": info.get("tenant"),
            "cached_tokens": info.get("cached_tokens"),
        }
        if self.state.settings.log_json:
            access_log.info(json.dumps(fields))
        else:
            access_log.info(" ".join(f"{k}={'-' if v is None else v}" for k, v in fields.items()))


def _refuse(status: int, message: str, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": None, "code": None}},
                        status_code=status)  # fmt: skip


def _known_key(auth: str, keys: dict[str, str]) -> bool:
    scheme, _, key = auth.partition(" ")
    return scheme.lower() == "bearer" and key.strip() in keys


def _too_large(limit: int) -> JSONResponse:
    return _refuse(413, f"request body over this route's limit of {limit} bytes; send less")


async def _read(receive: Receive, limit: int) -> bytes | None:
    """The whole body, or None once it passes ``limit`` bytes (reading stops there)."""
    parts: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(parts)  # the client left; the handler sees an empty body
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        parts.append(chunk)
        if not message.get("more_body", False):
            return b"".join(parts)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the already-read body once, then waits for the disconnect."""
    sent = False

    async def replayed() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()  # after the body: the client's disconnect, when it leaves

    return replayed


def _bounded(receive: Receive, limit: int) -> Receive:
    """For multipart uploads: the body streamed through, with a 413 error raised past ``limit`` bytes."""
    seen = 0

    async def counted() -> Any:
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        if seen > limit:
            from ragkv.server.state import ApiError

            raise ApiError(413, f"request body over this route's limit of {limit} bytes; send less")
        return message

    return counted
