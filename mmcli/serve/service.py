"""The engine behind the server: one thread runs the Labeler's engine loop over every connection's
requests, so requests of different clients share decode steps and vision waves (continuous
batching across clients). A request is admitted first (counted in the queue while its media are
prepared, or refused with a 429), then its engine requests arrive through a queue; each one's
tokens and its end go back to the event loop of the connection waiting for it. A cancelled
request (its client gone, its stop string reached, its deadline passed) is dropped by the
scheduler at the next step. An engine failure fails the sequences that were in the engine and the
loop starts again; failing `max_failures` times in a minute, it gives up (the server exits)."""

from __future__ import annotations

import asyncio
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from mmcli.serve.protocol import APIError

if TYPE_CHECKING:
    from mmcli.api.labeler import Labeler


class Handle:
    """One engine request's events, for the event loop waiting on them: ("token", id),
    ("done", Finished) or ("error", message)."""

    def __init__(self, request, loop: asyncio.AbstractEventLoop, arrived: float):
        self.request, self.loop, self.arrived = request, loop, arrived
        self.events: asyncio.Queue = asyncio.Queue()
        self.started = False  # a first token came: no longer waiting

    def send(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class Admission:
    """A request admitted before any work: it holds a place in the queue until its sequences
    are submitted or it fails."""

    def __init__(self, service: EngineService):
        self.service, self.arrived, self.held = service, time.monotonic(), True

    def release(self) -> None:
        if self.held:
            self.held = False
            with self.service.lock:
                self.service.admitted -= 1


class EngineService:
    def __init__(self, labeler: Labeler, max_queue: int = 64, metrics=None, max_failures: int = 3):
        self.labeler, self.max_queue, self.metrics = labeler, max_queue, metrics
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.handles: dict[str, Handle] = {}
        self.admitted = 0  # admitted, their sequences not yet submitted (media being prepared)
        self.taken: set[str] = set()  # keys the current engine loop took from the inbox
        self.lock = threading.Lock()
        self.closing = threading.Event()
        self.max_failures, self.failures = max_failures, []
        self.failure: str | None = None  # why the engine gave up
        self.on_fatal: Callable[[str], None] | None = None  # the server's exit, once given up
        self.thread = threading.Thread(target=self._serve, name="mmcli-engine", daemon=True)

    def start(self) -> EngineService:
        self.thread.start()
        return self

    def close(self) -> None:
        """Admit nothing more, finish what is in flight, stop the loop."""
        self.closing.set()
        self.thread.join()

    @property
    def unavailable(self) -> str | None:
        """Why no request can be served now (None: it can)."""
        if self.closing.is_set():
            return "the server is shutting down"
        if self.failure is not None:
            return self.failure
        if not self.thread.is_alive():
            return "the engine thread is not running"
        return None

    @property
    def waiting(self) -> int:
        """Requests admitted whose sequences have not started."""
        with self.lock:
            return self.admitted + sum(not h.started for h in self.handles.values())

    @property
    def running(self) -> int:
        with self.lock:
            return sum(h.started for h in self.handles.values())

    def admit(self) -> Admission:
        """A place in the queue before any work; APIError(503) when nothing can be served,
        APIError(429) when --max-queue requests already wait (both with Retry-After)."""
        why = self.unavailable
        if why is not None:
            raise APIError(503, why, headers={"Retry-After": "5"})
        with self.lock:
            queued = self.admitted + sum(not h.started for h in self.handles.values())
            if queued >= self.max_queue:
                raise APIError(
                    429,
                    f"{queued} requests already wait (--max-queue {self.max_queue}); retry later",
                    headers={"Retry-After": "1"},
                )
            self.admitted += 1
        return Admission(self)

    def submit(self, requests: list, loop, admission: Admission | None = None) -> list[Handle]:
        """The requests queued for the engine, in the place `admission` holds (without one,
        checked against --max-queue now)."""
        if admission is None:
            admission = self.admit()
        handles = [Handle(request, loop, admission.arrived) for request in requests]
        with self.lock:
            self.handles.update({h.request.key: h for h in handles})
        admission.release()
        for handle in handles:
            self.inbox.put(handle.request)
        return handles

    def cancel(self, handles: list[Handle]) -> None:
        for handle in handles:
            handle.request.cancelled = True

    def _incoming(self):
        """The engine's requests as they arrive; None while none is ready and some are in flight
        (the engine goes on with them); with none in flight, it waits for the next one rather
        than polling. Ends on close."""
        while True:
            idle = not self.handles  # a request's handle is there from submit to its end
            try:
                request = self.inbox.get(timeout=0.05) if idle else self.inbox.get_nowait()
                self.taken.add(request.key)
                yield request
            except queue.Empty:
                if self.closing.is_set():
                    return
                if not idle:
                    yield None

    def _serve(self) -> None:
        while not self.closing.is_set() or not self.inbox.empty():
            self.taken = set()
            try:
                for done in self.labeler.generate(self._incoming(), self._token):
                    self.taken.discard(done.key)
                    with self.lock:
                        handle = self.handles.pop(done.key, None)
                    if handle is not None:
                        self._count(handle, done)
                        handle.send("done", done)
            except Exception as e:  # the engine's own failure: its sequences fail, it goes on
                self._failed(e)
                if self.failure is not None:
                    return

    def _failed(self, error: Exception) -> None:
        """The sequences in the engine answered 500; the loop starts again, unless it failed
        max_failures times in a minute: then every request fails and the server is told."""
        now = time.monotonic()
        self.failures = [t for t in self.failures if now - t < 60] + [now]
        with self.lock:
            concerned = [self.handles.pop(k) for k in self.taken if k in self.handles]
        print(
            f"mmcli: the engine failed: {error!r}; its {len(concerned)} sequences answered 500",
            file=sys.stderr,
            flush=True,
        )
        for handle in concerned:
            handle.send("error", f"the engine failed: {error}")
        if len(self.failures) < self.max_failures:
            return
        self.failure = f"the engine failed {len(self.failures)} times in a minute ({error})"
        with self.lock:
            rest, self.handles = list(self.handles.values()), {}
        for handle in rest:
            handle.send("error", self.failure)
        if self.on_fatal is not None:
            self.on_fatal(self.failure)

    def _token(self, key: str, token_id: int) -> None:
        handle = self.handles.get(key)
        if handle is not None:
            if not handle.started and self.metrics is not None:
                self.metrics.time_to_first_token.observe(time.monotonic() - handle.arrived)
            handle.started = True
            handle.send("token", token_id)

    def _count(self, handle: Handle, done) -> None:
        if self.metrics is None:
            return
        self.metrics.latency.observe(time.monotonic() - handle.arrived)
        self.metrics.prompt_tokens.inc(done.num_input_tokens)
        self.metrics.generation_tokens.inc(len(done.token_ids))
