"""The engine behind the server: one thread runs the Labeler's engine loop over every connection's
requests, so requests of different clients share decode steps and vision waves (continuous
batching across clients). Requests arrive through a queue; each one's tokens and its end go back
to the event loop of the connection waiting for it. A cancelled request (its client gone) is
dropped by the scheduler at the next step."""

from __future__ import annotations

import asyncio
import queue
import sys
import threading

from mmcli.serve.protocol import APIError


class Handle:
    """One engine request's events, for the event loop waiting on them: ("token", id),
    ("done", Finished) or ("error", message)."""

    def __init__(self, request, loop: asyncio.AbstractEventLoop):
        self.request, self.loop = request, loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.started = False  # a first token came: no longer waiting

    def send(self, kind: str, value) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


class EngineService:
    def __init__(self, labeler, max_queue: int = 64):
        self.labeler, self.max_queue = labeler, max_queue
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.handles: dict[str, Handle] = {}
        self.lock = threading.Lock()
        self.closing = threading.Event()
        self.thread = threading.Thread(target=self._serve, name="mmcli-engine", daemon=True)

    def start(self) -> EngineService:
        self.thread.start()
        return self

    def close(self) -> None:
        """Admit nothing more, finish what is in flight, stop the loop."""
        self.closing.set()
        self.thread.join()

    @property
    def waiting(self) -> int:
        with self.lock:
            return sum(not h.started for h in self.handles.values())

    def submit(self, requests: list, loop: asyncio.AbstractEventLoop) -> list[Handle]:
        """The requests queued for the engine; APIError(429) when --max-queue already wait."""
        if self.closing.is_set():
            raise APIError(503, "the server is shutting down")
        if self.waiting + len(requests) > self.max_queue:
            raise APIError(
                429,
                f"{self.waiting} requests already wait (--max-queue {self.max_queue}); retry later",
            )
        handles = [Handle(request, loop) for request in requests]
        with self.lock:
            self.handles.update({h.request.key: h for h in handles})
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
                yield self.inbox.get(timeout=0.05) if idle else self.inbox.get_nowait()
            except queue.Empty:
                if self.closing.is_set():
                    return
                if not idle:
                    yield None

    def _serve(self) -> None:
        while not self.closing.is_set() or not self.inbox.empty():
            try:
                for done in self.labeler.engine.generate(self._incoming(), self._token):
                    with self.lock:
                        handle = self.handles.pop(done.key, None)
                    if handle is not None:
                        handle.send("done", done)
            except Exception as e:  # the engine's own failure: every request in flight fails
                print(
                    f"mmcli: the engine failed: {e!r}; its requests answered 500", file=sys.stderr
                )
                self._fail_all(f"the engine failed: {e}")

    def _token(self, key: str, token_id: int) -> None:
        handle = self.handles.get(key)
        if handle is not None:
            handle.started = True
            handle.send("token", token_id)

    def _fail_all(self, message: str) -> None:
        with self.lock:
            handles, self.handles = list(self.handles.values()), {}
        for handle in handles:
            handle.send("error", message)
