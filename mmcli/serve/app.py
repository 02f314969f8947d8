"""`mmcli serve`'s HTTP side: FastAPI routes in OpenAI's shapes over the engine service. Every
request passes the guard first (serve/guard.py: its id, Host, key, body size, the access log); a
chat request is then admitted (or refused with a 429 or 503) before any of its media is fetched,
prepared among a few at once within the media budget, and answered; every error, on every route,
in OpenAI's shape. Model work runs in the engine's thread and media decoding in worker threads:
the event loop never blocks on either."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from mmcli.inputs.prompt import TextStream
from mmcli.serve.admission import MediaBudget
from mmcli.serve.chat import Limits, build_job, choice_of, cut_at_stop, response_of, usage_of
from mmcli.serve.guard import Guard
from mmcli.serve.media import MediaPolicy
from mmcli.serve.metrics import Metrics
from mmcli.serve.protocol import APIError, ChatCompletionRequest
from mmcli.serve.service import EngineService

if TYPE_CHECKING:
    from mmcli.api.labeler import Labeler


@dataclass
class ServeSettings:
    served_model: str
    hosts: frozenset[str] | None  # the Host header values accepted (name:port); None: any
    api_key: str | None = None
    media: MediaPolicy = field(default_factory=MediaPolicy)
    limits: Limits = field(default_factory=Limits)


def create_app(
    labeler: Labeler, service: EngineService, settings: ServeSettings, log=None
) -> FastAPI:
    app = FastAPI(title="mmcli", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = service.metrics or Metrics()
    service.metrics = metrics
    metrics.queued.set_function(lambda: service.waiting)
    metrics.running.set_function(lambda: service.running)
    app.state.counter = 0
    app.add_middleware(Guard, settings=settings, metrics=metrics, log=log)
    _errors_in_openais_shape(app)
    preparing = Preparing(settings.limits, metrics)

    @app.get("/health")
    async def health():
        why = service.unavailable
        if why is not None:
            return JSONResponse({"status": "unavailable", "reason": why}, 503)
        return {"status": "ok", "waiting": service.waiting, "running": service.running}

    @app.get("/metrics")
    async def exposition():
        return Response(metrics.exposition(), media_type=metrics.content_type)

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
        if body.ignored:
            print(f"mmcli: ignored fields {', '.join(body.ignored)}", file=sys.stderr, flush=True)
        admission = service.admit()
        timeout = settings.limits.request_timeout
        watch = Watch(service, timeout, admission.arrived + timeout)
        app.state.counter += 1
        key = f"chatcmpl-{app.state.counter:08d}"
        try:
            job = await preparing.job(labeler, body, settings, key, watch)
            if await request.is_disconnected():  # nobody to answer: no sequence is started
                return Response(status_code=499)
            handles = service.submit(job.requests, asyncio.get_running_loop(), admission)
        finally:
            admission.release()
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            events = stream_events(labeler, service, job, handles, include_usage, watch)
            return StreamingResponse(events, media_type="text/event-stream")
        return await answer(labeler, service, job, handles, replace(watch, request=request))

    return app


def _errors_in_openais_shape(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, error: RequestValidationError):
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{where or 'body'}: {first.get('msg', 'invalid request body')}"
        return JSONResponse(APIError(400, message, where or None).body(), status_code=400)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException):  # an unknown route, a method
        message = f"{request.method} {request.url.path}: {error.detail}"
        return JSONResponse(APIError(error.status_code, message).body(), error.status_code)

    @app.exception_handler(Exception)
    async def failed(request: Request, error: Exception):
        print(f"mmcli: {request.url.path} failed: {error!r}", file=sys.stderr, flush=True)
        body = APIError(500, f"the server failed: {type(error).__name__}: {error}").body()
        return JSONResponse(body, status_code=500)


class Preparing:
    """At most --max-preparing requests fetch and decode their media at once, within the media
    budget; a request waits for its turn until its deadline (then a 503)."""

    def __init__(self, limits: Limits, metrics: Metrics):
        self.turns = asyncio.Semaphore(limits.max_preparing)
        self.budget, self.metrics = MediaBudget(limits.max_media_bytes), metrics

    async def job(self, labeler, body, settings: ServeSettings, key: str, watch: Watch):
        try:
            await asyncio.wait_for(self.turns.acquire(), max(watch.deadline - time.monotonic(), 0))
        except TimeoutError:
            raise APIError(
                503, "the server is busy preparing requests; retry later", headers=RETRY
            ) from None
        self.metrics.preparing.inc()
        try:
            job = await run_in_threadpool(
                build_job,
                labeler,
                body,
                settings.media,
                settings.limits,
                key,
                settings.served_model,
                self.budget,
                watch.deadline,
                True,  # a sampled request without a seed draws its own
            )
        finally:
            self.metrics.preparing.dec()
            self.turns.release()
        self.metrics.images.inc(job.images)
        self.metrics.video_frames.inc(job.video_frames)
        return job


RETRY = {"Retry-After": "1"}
CHECK_EVERY = 0.2  # seconds between looks at a request's deadline, client and engine


class ClientGone(Exception):
    """The client of a non-streamed answer disconnected."""


@dataclass
class Watch:
    """What ends a request early: its deadline, the engine unable to serve, its client gone
    (a non-streamed one's; a stream's is seen by Starlette's response)."""

    service: EngineService
    timeout: float
    deadline: float = 0.0
    request: Request | None = None
    checked: float = 0.0  # when it last looked

    def __post_init__(self):
        self.deadline = self.deadline or time.monotonic() + self.timeout

    async def check(self) -> None:
        now = time.monotonic()
        if now - self.checked < CHECK_EVERY:
            return
        self.checked = now
        if now > self.deadline:
            raise APIError(
                504, f"the request took over --request-timeout {self.timeout:g} s", code="timeout"
            )
        why = self.service.unavailable
        if why is not None and not self.service.closing.is_set():
            raise APIError(503, why, headers=RETRY)
        if self.request is not None and await self.request.is_disconnected():
            raise ClientGone


async def answer(labeler: Labeler, service, job, handles, watch: Watch):
    """The whole response once every choice has finished; a client gone (499, logged) or a
    deadline passed cancels its choices."""
    finished = []
    try:
        for handle in handles:
            async for _, done in choice_pieces(job, handle, service, watch):
                if done is not None:
                    finished.append(done)
    except ClientGone:
        return Response(status_code=499)
    finally:
        if len(finished) < len(handles):
            service.cancel(handles)
    return response_of(labeler, job, finished)


async def stream_events(labeler: Labeler, service, job, handles, include_usage: bool, watch: Watch):
    """Server-sent events: a role chunk, the text as it comes per choice (stop strings cut),
    each choice's finish, usage where asked, then [DONE]; a failure is an error event before
    [DONE]; a client gone cancels its choices."""
    finished = []
    try:
        for index, handle in enumerate(handles):
            start = {"index": index, "delta": {"role": "assistant", "content": ""}}
            yield _event(job, [{**start, "finish_reason": None}])
            async for piece, done in choice_pieces(job, handle, service, watch):
                if piece:
                    delta = {"index": index, "delta": {"content": piece}, "finish_reason": None}
                    yield _event(job, [delta])
                if done is not None:
                    finished.append(done)
                    yield _event(job, [_last_chunk(labeler, job, index, done)])
        if include_usage:
            yield _event(job, [], usage=usage_of(finished))
    except APIError as error:
        yield f"data: {json.dumps(error.body())}\n\n"
    finally:
        if len(finished) < len(handles):
            service.cancel(handles)
    yield "data: [DONE]\n\n"


def _last_chunk(labeler: Labeler, job, index: int, done) -> dict:
    final = choice_of(labeler, job, index, done)
    delta = {}
    if "reasoning_content" in final["message"]:
        delta["reasoning_content"] = final["message"]["reasoning_content"]
    last = {"index": index, "delta": delta, "finish_reason": final["finish_reason"]}
    if job.logprobs:
        last["logprobs"] = final["logprobs"]
    return last


async def choice_pieces(job, handle, service, watch: Watch):
    """(text piece, Finished or None) as one choice's tokens come. The text is the stream's
    whole characters so far, cut before the first stop string; there the sequence is cancelled
    and its Finished keeps the tokens up to the stop (what it made after is dropped, from the
    text, the usage and the logprobs); a tail that may begin a stop string waits."""
    stream, sent, kept, made = TextStream(job.prompts), "", None, 0
    while True:
        await watch.check()  # at most every CHECK_EVERY seconds
        try:
            kind, value = await asyncio.wait_for(handle.events.get(), timeout=CHECK_EVERY)
        except TimeoutError:
            continue
        if kind == "error":
            raise APIError(500, value)
        if kind == "done":
            if kept is None:
                stream.finish()
            else:
                value = _cut(value, kept)
            text, _ = cut_at_stop(stream.emitted, job.stops)
            yield text[len(sent) :], value
            return
        made += 1
        if kept is not None:
            continue
        stream.push(value)
        text, stopped = cut_at_stop(stream.emitted, job.stops)
        safe = text if stopped else _held_back(text, job.stops)
        if len(safe) > len(sent):
            yield safe[len(sent) :], None
            sent = safe
        if stopped:
            kept = made
            service.cancel([handle])


def _cut(done, tokens: int):
    """A finished sequence's first `tokens` tokens, ended by a stop string."""
    return replace(
        done,
        token_ids=done.token_ids[:tokens],
        logprobs=done.logprobs[:tokens],
        top_logprobs=done.top_logprobs[:tokens],
        finish_reason="stop",
    )


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
