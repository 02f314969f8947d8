"""What the page shows of an input: a thumbnail of an image (its EXIF orientation applied), or
the sampled frames of a video; made on demand and kept in a small in-memory cache."""

from __future__ import annotations

import io
import threading
from collections import OrderedDict

from PIL import Image

from mmcli.errors import ImageError
from mmcli.inputs.images import decode_image
from mmcli.inputs.sources import Source, describe
from mmcli.inputs.video import frames_at_times

SIZES = (256, 1024)  # grid thumbnails and the detail view


class Thumbnails:
    def __init__(self, max_decode_pixels: int, capacity: int = 512):
        self.max_decode_pixels, self.capacity = max_decode_pixels, capacity
        self.cache: OrderedDict[tuple, bytes] = OrderedDict()
        self.lock = threading.Lock()

    def image(self, path: Source, size: int) -> bytes:
        """A JPEG of the image as shown, its longer side at most `size`."""
        return self._cached(
            (describe(path), size), lambda: decode_image(path, self.max_decode_pixels).image, size
        )

    def frame(self, path: Source, time: float, size: int) -> bytes:
        """A JPEG of the video frame shown at `time` seconds."""

        def decode() -> Image.Image:
            frames = frames_at_times(path, [time])
            if not frames:
                raise ImageError(f"no frame at {time:.2f} s")
            return frames[0]

        return self._cached((describe(path), size, round(time, 3)), decode, size)

    def _cached(self, key: tuple, decode, size: int) -> bytes:
        with self.lock:
            if key in self.cache:
                self.cache.move_to_end(key)
                return self.cache[key]
        image = decode().convert("RGB")
        image.thumbnail((size, size))
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=85)
        data = buffer.getvalue()
        with self.lock:
            self.cache[key] = data
            while len(self.cache) > self.capacity:
                self.cache.popitem(last=False)
        return data
