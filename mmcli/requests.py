"""Files and questions into engine requests: images decoded and patchified once, one prompt per task.

An image's tasks become one group of requests: their prompts agree up to the first token that differs (the
chat template's opening, the image, the vision end), and the runner prefills that shared prefix once.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from .config import Config, SamplingParams
from .engine import Request
from .errors import ImageError, ItemError
from .images import ImageProcessorConfig
from .positions import rope_index
from .preprocess import decode_image, preprocess
from .prompt import PromptBuilder
from .tasks import Task, render_prompt


@dataclass
class PreparedImages:
    pixels: list
    grids: list[tuple[int, int, int]]
    infos: list[dict]  # width, height (as the user sees the image), note
    hashes: list[str]

    def token_counts(self, merge_size: int) -> list[int]:
        return [t * h * w // merge_size**2 for t, h, w in self.grids]


class RequestBuilder:
    def __init__(self, prompts: PromptBuilder, image_cfg: ImageProcessorConfig, config: Config, image_token_id: int,
                 stop_ids: frozenset[int], compiled: bool):
        self.prompts, self.image_cfg, self.config = prompts, image_cfg, config
        self.image_token_id, self.stop_ids, self.compiled = image_token_id, stop_ids, compiled

    def images(self, images: list) -> PreparedImages:
        """Decode and preprocess; raises ImageError naming the file for a bad image."""
        out = PreparedImages([], [], [], [])
        for image in images:
            if isinstance(image, Image.Image):
                rgb, note = image.convert("RGB"), None
            else:
                try:
                    decoded = decode_image(image, self.config.image.max_decode_pixels)
                except ImageError as e:
                    raise ImageError(f"{image}: {e}") from None
                rgb, note = decoded.image, decoded.note
            try:
                pv, grid = preprocess(rgb, self.image_cfg)
            except ImageError as e:
                raise ImageError(f"{image if not isinstance(image, Image.Image) else 'image'}: {e}") from None
            if pv.shape[0] > self.config.vision.block_size:  # only extreme aspect ratios under tiny budgets
                raise ImageError(f"{image}: {pv.shape[0]} patches do not fit vision.block_size "
                                 f"{self.config.vision.block_size}")
            out.pixels.append(pv)
            out.grids.append(grid)
            out.hashes.append(hashlib.blake2b(pv.numpy().tobytes(), digest_size=16).hexdigest())
            out.infos.append({"width": rgb.width, "height": rgb.height, "note": note})
        return out

    def build(self, key: str, prepared: PreparedImages, question: str, sampling: SamplingParams,
              **extra) -> Request:
        """One request for `question` about the prepared images; raises ItemError when the prompt cannot run."""
        counts = prepared.token_counts(self.image_cfg.merge_size)
        ids = self.prompts.encode(question, counts)
        max_len = self.config.engine.max_len
        if len(ids) >= max_len:
            raise ItemError(f"{key}: prompt of {len(ids)} tokens does not fit engine.max_len {max_len}")
        largest = max(self.config.compile.prefill_buckets)
        if self.compiled and len(ids) > largest:
            raise ItemError(f"{key}: prompt of {len(ids)} tokens is over the largest compile.prefill_buckets entry "
                            f"{largest}")
        rotary, delta = rope_index(ids, prepared.grids, self.image_token_id, self.image_cfg.merge_size)
        return Request(key, ids, rotary, delta, prepared.pixels, prepared.grids, sampling, self.stop_ids,
                       sum(counts), prepared.hashes, **extra)

    def for_tasks(self, key: str, path: str | Path, tasks: list[Task], grammars: dict) -> tuple[list[Request], list]:
        """One request per task about the image at `path`, grouped to share their prompt prefix."""
        prepared = self.images([path])
        requests = [self.build(key, prepared, render_prompt(task, path), task.sampling, task=task.name,
                               constraint=grammars[task.name].start() if task.name in grammars else None)
                    for task in tasks]
        if len(requests) > 1:
            first = requests[0].input_ids
            shared = min(_common_prefix(first, r.input_ids) for r in requests[1:])
            for req in requests:
                req.group, req.prefix_len = key, shared
        return requests, prepared.infos


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
