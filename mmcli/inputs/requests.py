"""Files and questions into engine requests: images and videos decoded and patchified once, one
prompt per task.

An image's tasks become one group of requests: their prompts agree up to the first token that
differs (the chat template's opening, the image, the vision end), and the runner prefills that
shared prefix once."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from mmcli.config import Config, SamplingParams
from mmcli.engine.sequence import Request
from mmcli.errors import ImageError, ItemError
from mmcli.inputs.images import ImageProcessorConfig
from mmcli.inputs.placeholders import render_prompt
from mmcli.inputs.preprocess import decode_image, preprocess, preprocess_video
from mmcli.inputs.prompt import PromptBuilder
from mmcli.inputs.sources import describe, suffix
from mmcli.inputs.video import VideoSampling, decode_video
from mmcli.tasks import Task


@dataclass
class PreparedInputs:
    """Decoded and patchified inputs: vision segments (an image, or one temporal patch of a
    video) in prompt order, and per input its record facts and its prompt layout."""

    pixels: list
    grids: list[tuple[int, int, int]]
    infos: list[dict]  # width, height (as the user sees it), note; a video's facts under "video"
    hashes: list[str]
    # per input: an image's token count, or a video's [(seconds, tokens)]
    layout: list = field(default_factory=list)

    def extend(self, other: PreparedInputs) -> None:
        """`other`'s inputs after these (a conversation's media prepared one at a time)."""
        for name in ("pixels", "grids", "infos", "hashes", "layout"):
            getattr(self, name).extend(getattr(other, name))

    def add(self, pixels, grid: tuple[int, int, int]) -> None:
        self.pixels.append(pixels)
        self.grids.append(grid)
        self.hashes.append(hashlib.blake2b(pixels.numpy().tobytes(), digest_size=16).hexdigest())


class RequestBuilder:
    def __init__(
        self,
        prompts: PromptBuilder,
        image_cfg: ImageProcessorConfig,
        config: Config,
        visual_token_ids: tuple[int, int],
        stop_ids: frozenset[int],
        compiled: bool,
        rope_index: Callable,
        video_sampling: VideoSampling | None = None,
    ):
        """`rope_index`: the family's rotary index of a prompt (Family.rope_index)."""
        self.prompts, self.image_cfg, self.config = prompts, image_cfg, config
        self.rope_index = rope_index
        self.visual_token_ids, self.stop_ids, self.compiled = visual_token_ids, stop_ids, compiled
        self.video_sampling = video_sampling or VideoSampling()

    def is_video(self, source) -> bool:
        return not isinstance(source, Image.Image) and self.config.scan.is_video(suffix(source))

    def prepare(self, images: list, videos: list = ()) -> PreparedInputs:
        """Decode and preprocess (files with a video extension as videos, after the images);
        raises ImageError naming the file for a bad input."""
        videos = [i for i in images if self.is_video(i)] + list(videos)
        images = [i for i in images if not self.is_video(i)]
        return self.prepare_in_order(
            [("image", i) for i in images] + [("video", v) for v in videos]
        )

    def prepare_in_order(self, inputs: list[tuple[str, object]]) -> PreparedInputs:
        """Decode and preprocess ("image" or "video", source) inputs in the order given (a
        conversation's parts); raises ImageError naming the input for a bad one."""
        out = PreparedInputs([], [], [], [])
        for kind, source in inputs:
            if kind == "video":
                self._add_video(out, source)
            else:
                self._add_image(out, source)
        return out

    def _add_image(self, out: PreparedInputs, image) -> None:
        rgb, note, file = self._decode_image(image)
        try:
            pv, grid = preprocess(rgb, self.image_cfg)
        except ImageError as e:
            raise ImageError(f"{_named(image)}: {e}") from None
        self._check_block(image, pv.shape[0])
        out.add(pv, grid)
        out.infos.append({"width": rgb.width, "height": rgb.height, "note": note, **file})
        out.layout.append(grid[0] * grid[1] * grid[2] // self.image_cfg.merge_size**2)

    def _decode_image(self, image):
        """(RGB, note, {"file": the facts of the bytes decoded} or {} for a PIL image)."""
        if isinstance(image, Image.Image):
            return image.convert("RGB"), None, {}
        try:
            decoded = decode_image(image, self.config.image.max_decode_pixels)
        except ImageError as e:
            raise ImageError(f"{_named(image)}: {e}") from None
        return decoded.image, decoded.note, {"file": decoded.file}

    def _check_block(self, source, patches: int) -> None:
        if patches > self.config.vision.block_size:  # only extreme aspect ratios under tiny budgets
            raise ImageError(
                f"{source}: {patches} patches do not fit vision.block_size "
                f"{self.config.vision.block_size}"
            )

    def _add_video(self, out: PreparedInputs, path) -> None:
        try:
            # frames resized as decoded
            video = decode_video(path, self.video_sampling, self.image_cfg.resample)
            first = video.frames[0]
            patches = preprocess_video(video.frames, (first.height, first.width), self.image_cfg)
        except ImageError as e:
            raise ImageError(f"{_named(path)}: {e}") from None
        groups = []
        for (pv, grid), seconds in zip(
            patches, video.group_times(self.image_cfg.temporal_patch_size)
        ):
            self._check_block(path, pv.shape[0])
            out.add(pv, grid)
            groups.append((seconds, grid[1] * grid[2] // self.image_cfg.merge_size**2))
        out.layout.append(groups)
        out.infos.append(
            {
                "width": video.size[0],
                "height": video.size[1],
                "note": "; ".join(video.notes) or None,
                "file": video.file,
                "video": {
                    "duration": round(video.duration, 3),
                    "source_fps": round(video.source_fps, 3),
                    "frame_times": [round(t, 3) for t in video.times],
                    "num_frames": len(video.frames),
                },
            }
        )

    def build(
        self, key: str, prepared: PreparedInputs, question: str, sampling: SamplingParams, **extra
    ) -> Request:
        """One request for `question` about the prepared images; raises ItemError when the prompt
        cannot run."""
        ids = self.prompts.encode(question, prepared.layout)
        return self.request(key, ids, prepared, sampling, **extra)

    def build_messages(
        self,
        key: str,
        prepared: PreparedInputs,
        messages: list[dict],
        sampling,
        prompts: PromptBuilder | None = None,
        **extra,
    ) -> Request:
        """One request for a conversation whose image and video parts are the prepared inputs,
        in order (chat_template's content parts), rendered by `prompts` (default: the run's);
        raises ItemError when the prompt cannot run."""
        ids = (prompts or self.prompts).encode_messages(messages, prepared.layout)
        return self.request(key, ids, prepared, sampling, **extra)

    def request(
        self, key: str, ids: list[int], prepared: PreparedInputs, sampling, **extra
    ) -> Request:
        """The engine's request for prompt `ids` about the prepared inputs, checked against the
        engine's and the compiled buckets' limits."""
        max_len = self.config.engine.max_len
        if len(ids) >= max_len:
            raise ItemError(
                f"{key}: prompt of {len(ids)} tokens does not fit engine.max_len {max_len}"
            )
        largest = max(self.config.compile.prefill_buckets)
        if self.compiled and len(ids) > largest:
            raise ItemError(
                f"{key}: prompt of {len(ids)} tokens is over the largest compile.prefill_buckets "
                f"entry {largest}"
            )
        rotary, delta = self.rope_index(
            ids, prepared.grids, self.visual_token_ids, self.image_cfg.merge_size
        )
        visual_tokens = sum(t * h * w for t, h, w in prepared.grids) // self.image_cfg.merge_size**2
        return Request(
            key=key,
            input_ids=ids,
            rotary_position_ids=rotary,
            rope_delta=delta,
            pixel_values=prepared.pixels,
            vision_grids=prepared.grids,
            sampling=sampling,
            stop_ids=self.stop_ids,
            num_image_tokens=visual_tokens,
            vision_hashes=prepared.hashes,
            **extra,
        )

    def for_tasks(
        self, key: str, path: str | Path, tasks: list[Task], grammars: dict
    ) -> tuple[list[Request], list[dict], dict[str, ItemError]]:
        """One request per task about the input at `path`, grouped to share their prompt prefix;
        each prompt rendered once (the request keeps it for the record). A task whose prompt
        cannot run is that task's failure alone: (requests, input facts, {task: its error})."""
        prepared = self.prepare([path])
        requests, failures = [], {}
        for task in tasks:
            try:
                prompt = render_prompt(task, path)
                grammar = grammars.get(task.name)
                constraint = grammar.start() if grammar is not None else None
                request = self.build(
                    key,
                    prepared,
                    prompt,
                    task.sampling,
                    task=task.name,
                    prompt=prompt,
                    constraint=constraint,
                )
            except ItemError as e:
                failures[task.name] = ItemError(f"task {task.name}: {e}")
                continue
            requests.append(request)
        if len(requests) > 1:
            first = requests[0].input_ids
            shared = min(_common_prefix(first, r.input_ids) for r in requests[1:])
            for req in requests:
                req.group, req.prefix_len = key, shared
        return requests, prepared.infos, failures


def _named(source) -> str:
    return "image" if isinstance(source, Image.Image) else describe(source)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
