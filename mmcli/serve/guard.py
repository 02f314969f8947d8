"""The server's outermost layer, pure ASGI: it passes every message through, a client's disconnect
included (Starlette's BaseHTTPMiddleware hides it from the route). Per request: its id (the
client's `x-request-id` where it is a sane one, else a new one; echoed in the response), the Host
and key checks, the body read whole and cut at its limit as it arrives, the requests counter by
route and status, and one access log line."""

from __future__ import annotations

import hmac
import re
import sys
import time
import uuid

from starlette.responses import JSONResponse

from mmcli.serve.protocol import APIError

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
OPEN_PATHS = ("/health", "/metrics")  # any Host and no key: load balancers' probes, scrapers
ROUTES = ("/health", "/metrics", "/v1/models", "/v1/chat/completions")


class Guard:
    def __init__(self, app, settings, metrics, log=None):
        self.app, self.settings, self.metrics = app, settings, metrics
        self.log = log or (lambda line: print(line, file=sys.stderr, flush=True))

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        given = headers.get(b"x-request-id", b"").decode("latin-1")
        request_id = given if REQUEST_ID.fullmatch(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        started, status = time.perf_counter(), 0

        async def tagged(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                echoed = (b"x-request-id", request_id.encode())
                message = {**message, "headers": [*message.get("headers", []), echoed]}
            await send(message)

        try:
            refusal = check_request(scope["path"], headers, self.settings)
            body = None if refusal else await read_body(receive, self.settings.limits)
            if isinstance(body, APIError):
                refusal = body
            if refusal is not None:
                response = JSONResponse(refusal.body(), refusal.status, refusal.headers)
                return await response(scope, receive, tagged)
            if body is None:  # the client left before its body came
                return
            await self.app(scope, _replay(body, receive), tagged)
        finally:
            route = scope["path"] if scope["path"] in ROUTES else "other"
            self.metrics.requests.labels(route, str(status or 499)).inc()
            client = (scope.get("client") or ("-",))[0]
            self.log(
                f'mmcli: {client} "{scope["method"]} {scope["path"]}" {status or 499} '
                f"{time.perf_counter() - started:.3f}s id={request_id}"
            )


def check_request(path: str, headers: dict, settings) -> APIError | None:
    """Host, key and declared size, before the body is read (None: go on)."""
    if path in OPEN_PATHS:
        return None
    host = headers.get(b"host", b"").decode("latin-1")
    if settings.hosts is not None and host not in settings.hosts:
        return APIError(400, f"Host {host!r} is not this server's address (--allowed-host NAME)")
    if settings.api_key is not None and path.startswith("/v1/"):
        given = headers.get(b"authorization", b"")
        expected = f"Bearer {settings.api_key}".encode()
        if not hmac.compare_digest(given, expected):
            return APIError(
                401, "a valid API key is needed (Authorization: Bearer KEY)", code="invalid_api_key"
            )
    length = headers.get(b"content-length")
    limit = settings.limits.max_body_bytes
    if length is not None and (not length.isdigit() or int(length) > limit):
        return _too_big(limit)
    return None


async def read_body(receive, limits) -> bytes | APIError | None:
    """The body, whole: a 413 as soon as it passes the limit, declared or not (chunked); None
    when the client left first."""
    chunks, size, more = [], 0, True
    while more:
        message = await receive()
        if message["type"] != "http.request":
            return None
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        more = message.get("more_body", False)
        if size > limits.max_body_bytes:
            return _too_big(limits.max_body_bytes)
    return b"".join(chunks)


def _too_big(limit: int) -> APIError:
    return APIError(413, f"the body is over --max-body-mb ({limit >> 20} MB)")


def _replay(body: bytes, receive):
    """The body as one message, then the client's own messages (a disconnect among them)."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed():
        return pending.pop() if pending else await receive()

    return replayed
