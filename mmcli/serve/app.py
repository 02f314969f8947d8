"""`mmcli serve`'s HTTP side: FastAPI routes in OpenAI's shapes over the engine service. Every
request is checked before any work: its Host (DNS rebinding), its key, its size, its body against
the declared models; errors answer in OpenAI's shape. Model work runs in the engine's thread and
the media decoding in a worker thread: the event loop never blocks on either."""

from __future__ import annotations

import asyncio
import hmac
import json
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool

from mmcli.inputs.prompt import TextStream
from mmcli.serve.chat import Limits, build_job, choice_of, cut_at_stop, response_of, usage_of
from mmcli.serve.media import MediaPolicy
from mmcli.serve.protocol import APIError, ChatCompletionRequest
from mmcli.serve.service import EngineService


@dataclass
class ServeSettings:
    served_model: str
    hosts: frozenset[str]  # the Host header values accepted (name:port)
    api_key: str | None = None
    media: MediaPolicy = field(default_factory=MediaPolicy)
    limits: Limits = field(default_factory=Limits)


def create_app(labeler, service: EngineService, settings: ServeSettings) -> FastAPI:
    app = FastAPI(title="mmcli", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.counter = 0
    app.add_middleware(BodyLimit, limit=settings.limits.max_body_bytes)

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where or 'body'}: {first.get('msg', 'invalid request body')}"
        return JSONResponse(APIError(400, message, where or None).body(), status_code=400)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        try:
            check_request(request, settings)
        except APIError as error:
            return JSONResponse(error.body(), status_code=error.status)
        return await call_next(request)

    @app.get("/health")
    async def health():
        return {"status": "ok", "waiting": service.waiting}

    @app.get("/v1/models")
    async def models():
        entry = {"id": settings.served_model, "object": "model", "owned_by": "mmcli", "created": 0}
        return {"object": "list", "data": [entry]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request):
        if body.model != settings.served_model:
            raise APIError(
                404,
                f"model {body.model!r} is not served here (this server serves "
                f"{settings.served_model!r})",
                "model",
                "model_not_found",
            )
        app.state.counter += 1
        key = f"chatcmpl-{app.state.counter:08d}"
        job = await run_in_threadpool(
            build_job, labeler, body, settings.media, settings.limits, key, settings.served_model
        )
        handles = service.submit(job.requests, asyncio.get_running_loop())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = stream_events(labeler, service, job, handles, include_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        return await answer(labeler, service, job, handles, request)

    return app


class BodyLimit:
    """The body read whole before the route, and cut at the limit as it arrives whether or not
    it declared its length (chunked): a 413 in OpenAI's shape, the route never called."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            more = message.get("more_body", False)
            if size > self.limit:
                error = APIError(413, f"the body is over --max-body-mb ({self.limit >> 20} MB)")
                return await JSONResponse(error.body(), status_code=413)(scope, receive, send)
        body = b"".join(chunks)

        async def replay():
            nonlocal body
            if body is None:
                return await receive()
            message, body = {"type": "http.request", "body": body, "more_body": False}, None
            return message

        await self.app(scope, replay, send)


def check_request(request: Request, settings: ServeSettings) -> None:
    """Host, key and size, before the body is read."""
    host = request.headers.get("host", "")
    if host not in settings.hosts:
        raise APIError(400, f"Host {host!r} is not this server's address (--allowed-host NAME)")
    if settings.api_key is not None and request.url.path.startswith("/v1/"):
        given = request.headers.get("authorization", "")
        expected = f"Bearer {settings.api_key}"
        if not hmac.compare_digest(given.encode(), expected.encode()):
            raise APIError(
                401, "a valid API key is needed (Authorization: Bearer KEY)", code="invalid_api_key"
            )
    length = request.headers.get("content-length")
    if length is not None and (
        not length.isdigit() or int(length) > settings.limits.max_body_bytes
    ):
        raise APIError(
            413, f"the body is over --max-body-mb ({settings.limits.max_body_bytes >> 20} MB)"
        )


async def answer(labeler, service, job, handles, request: Request) -> dict:
    """The whole response once every choice has finished; a client gone cancels its choices."""
    finished = []
    try:
        for handle in handles:
            while True:
                try:
                    kind, value = await asyncio.wait_for(handle.events.get(), timeout=0.5)
                except TimeoutError:
                    if await request.is_disconnected():
                        raise asyncio.CancelledError from None
                    continue
                if kind == "error":
                    raise APIError(500, value)
                if kind == "done":
                    finished.append(value)
                    break
    finally:
        if len(finished) < len(handles):
            service.cancel(handles)
    return response_of(labeler, job, finished)


async def stream_events(labeler, service, job, handles, include_usage: bool):
    """Server-sent events: a role chunk, the text as it comes per choice (stop strings cut),
    each choice's finish, usage where asked, then [DONE]; a client gone cancels its choices."""
    finished = []
    try:
        for index, handle in enumerate(handles):
            yield _event(
                job,
                [
                    {
                        "index": index,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                    }
                ],
            )
            async for piece, done in choice_pieces(labeler, job, handle, service):
                if piece:
                    yield _event(
                        job, [{"index": index, "delta": {"content": piece}, "finish_reason": None}]
                    )
                if done is not None:
                    finished.append(done)
                    final = choice_of(labeler, job, index, done)
                    delta = {}
                    if "reasoning_content" in final["message"]:
                        delta["reasoning_content"] = final["message"]["reasoning_content"]
                    last = {"index": index, "delta": delta, "finish_reason": final["finish_reason"]}
                    if job.logprobs:
                        last["logprobs"] = final["logprobs"]
                    yield _event(job, [last])
        if include_usage:
            yield _event(job, [], usage=usage_of(finished))
        yield "data: [DONE]\n\n"
    finally:
        if len(finished) < len(handles):
            service.cancel(handles)


async def choice_pieces(labeler, job, handle, service):
    """(text piece, Finished or None) as one choice's tokens come. The text is the stream's
    whole characters so far, cut before the first stop string (then the sequence is cancelled
    and what it still made is dropped); a tail that may begin a stop string waits."""
    stream, sent, stopped = TextStream(job.prompts), "", False
    while True:
        kind, value = await handle.events.get()
        if kind == "error":
            raise APIError(500, value)
        if kind == "done":
            if not stopped:
                stream.finish()
            text, _ = cut_at_stop(stream.emitted, job.stops)
            yield text[len(sent) :], value
            return
        if stopped:
            continue
        stream.push(value)
        text, stopped = cut_at_stop(stream.emitted, job.stops)
        safe = text if stopped else _held_back(text, job.stops)
        if len(safe) > len(sent):
            yield safe[len(sent) :], None
            sent = safe
        if stopped:
            service.cancel([handle])


def _held_back(text: str, stops: list[str]) -> str:
    """The text without a tail that could be the start of a stop string."""
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                return text[:-n]
    return text


def _event(job, choices: list, usage: dict | None = None) -> str:
    chunk = {
        "id": job.id,
        "object": "chat.completion.chunk",
        "created": job.created,
        "model": job.model,
        "choices": choices,
    }
    if usage is not None:
        chunk["usage"] = usage
    return f"data: {json.dumps(chunk)}\n\n"
