"""What a request may hold while it is prepared: the server admits a request (or answers 429)
before any of its media is fetched, lets a few be prepared at once, and has each medium reserve
the memory it will take, from its size on disk or its header, before it is read or decoded. The
bytes of every request being prepared stay under one budget (`--max-media-mb`)."""

from __future__ import annotations

import io
import threading
import time

from PIL import Image

from mmcli.serve.protocol import APIError

# A decoded image as Pillow holds it: 4 bytes a pixel (RGB included), the frame, its EXIF
# rotation and its RGB conversion alive at once at the worst.
DECODE_BYTES_PER_PIXEL = 12


class MediaBudget:
    """Bytes the requests being prepared may hold at once; a reservation waits for room until
    its request's deadline. Thread-safe: media are fetched and decoded in worker threads."""

    def __init__(self, limit: int):
        self.limit, self.held, self.peak = limit, 0, 0
        self.room = threading.Condition()

    def reserve(self, size: int, deadline: float, what: str) -> None:
        if size > self.limit:
            raise APIError(
                400,
                f"{what}: needs {size >> 20} MB to decode, over --max-media-mb {self.limit >> 20}",
                "messages",
            )
        with self.room:
            while self.held + size > self.limit:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise APIError(
                        503,
                        "the server is busy preparing other requests' media; retry later",
                        headers={"Retry-After": "1"},
                    )
                self.room.wait(left)
            self.held += size
            self.peak = max(self.peak, self.held)

    def release(self, size: int) -> None:
        with self.room:
            self.held -= size
            self.room.notify_all()

    def hold(self, deadline: float) -> Hold:
        return Hold(self, deadline)


class Hold:
    """One request's reservations, released together when its preparation ends."""

    def __init__(self, budget: MediaBudget, deadline: float):
        self.budget, self.deadline, self.size = budget, deadline, 0

    def reserve(self, size: int, what: str) -> None:
        self.budget.reserve(size, self.deadline, what)
        self.size += size

    def shrink(self, reserved: int, used: int) -> None:
        """Give back what a reservation made ahead (a web medium's limit) did not need."""
        if used < reserved:
            self.budget.release(reserved - used)
            self.size -= reserved - used

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc) -> None:
        self.budget.release(self.size)
        self.size = 0


def image_pixels(data: bytes) -> int:
    """The pixels an image's header declares (0 when it is no image Pillow knows: its decode
    then fails with the reason)."""
    try:
        with Image.open(io.BytesIO(data)) as im:
            return im.width * im.height
    except Exception:  # noqa: BLE001 - any unreadable header is the decoder's to name
        return 0
