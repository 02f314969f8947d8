"""Videos in, without torch: frames sampled as Qwen3-VL's video processor samples them, decoded
with PyAV (FFmpeg).

Sampling (the reference's `sample_frames`): n = int(total_frames / source_fps * fps), clamped to
[min_frames, max_frames] and to the frame count, or exactly `num_frames`; indices
round(linspace(0, total - 1, n)). Each index is a time (index / average fps); the decoder seeks
to the keyframe before it when it is far ahead and decodes forward to the first frame shown at
that time, so a long file is not decoded whole. A frame's time is its own presentation time: for
a constant-rate file exactly index / fps, as the reference computes it; a variable-rate file is
sampled by time the same way (documented fallback, noted in the record). A stream that ends
before its header says (a truncated file) is an error, not a label of the part that decoded.
Sizing (the reference's video smart_resize): one (height, width) for every frame, the pixel
budget counted over all frames of the video. The prompt stamps each pair of frames (one temporal
patch) with the mean of their times."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np
from PIL import Image

from mmcli.errors import ImageError
from mmcli.inputs.sources import Source, open_hashed, open_source, read_source
from mmcli.models.config import QWEN_MERGE_SIZE, QWEN_PATCH_SIZE, QWEN_TEMPORAL_PATCH_SIZE

# seconds: a target further ahead than this is reached by seeking, nearer ones by decoding on
SEEK_AHEAD = 2.0


@dataclass(frozen=True)
class VideoSampling:
    """How frames are chosen and sized: the checkpoint's video_preprocessor_config.json under the
    settings."""

    fps: float | None = 2.0
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    min_pixels: int = 4096  # over all frames of one video
    max_pixels: int = 25_165_824
    max_decode_pixels: int = 67_108_864  # a frame larger than this is refused before decoding
    # each frame also held to an image's budget (a frame pair fits a block)
    max_frame_pixels: int | None = None
    factor: int = QWEN_PATCH_SIZE * QWEN_MERGE_SIZE
    temporal_patch_size: int = QWEN_TEMPORAL_PATCH_SIZE

    @classmethod
    def from_checkpoint(
        cls, path: Path | None, settings, max_frame_pixels: int | None = None
    ) -> VideoSampling:
        """`settings` is the `video` config section; its set values win over the checkpoint's,
        and max_pixels caps the checkpoint's budget (as image.max_pixels does)."""
        file = path / "video_preprocessor_config.json" if path is not None else None
        raw = json.loads(file.read_text()) if file is not None and file.is_file() else {}
        size = raw.get("size") or {}
        base = cls(
            fps=raw.get("fps", cls.fps),
            num_frames=raw.get("num_frames"),
            min_frames=raw.get("min_frames", cls.min_frames),
            max_frames=raw.get("max_frames", cls.max_frames),
            min_pixels=size.get("shortest_edge", cls.min_pixels),
            max_pixels=size.get("longest_edge", cls.max_pixels),
            factor=raw.get("patch_size", QWEN_PATCH_SIZE) * raw.get("merge_size", QWEN_MERGE_SIZE),
            temporal_patch_size=raw.get("temporal_patch_size", QWEN_TEMPORAL_PATCH_SIZE),
        )
        # the settings' choice wins, either way
        given = settings.num_frames is not None or settings.fps is not None
        num_frames = settings.num_frames if given else base.num_frames
        fps = None if num_frames is not None else (settings.fps or base.fps or 2.0)
        return cls(
            fps=fps,
            num_frames=num_frames,
            min_frames=settings.min_frames or base.min_frames,
            max_frames=settings.max_frames or base.max_frames,
            min_pixels=settings.min_pixels or base.min_pixels,
            max_pixels=min(base.max_pixels, settings.max_pixels),
            max_decode_pixels=settings.max_decode_pixels,
            max_frame_pixels=max_frame_pixels,
            factor=base.factor,
            temporal_patch_size=base.temporal_patch_size,
        )


@dataclass
class DecodedVideo:
    frames: list[Image.Image]  # RGB, upright (the stream's display rotation applied)
    times: list[float]  # each sampled frame's presentation time, seconds from the stream's start
    indices: list[int]  # the sampled frame indices
    duration: float
    source_fps: float  # average frame rate
    total_frames: int
    size: tuple[int, int]  # (width, height) of a frame as shown (upright), before any resize
    notes: list[str] = field(default_factory=list)
    # frames the decoder produced to reach the sampled ones (seeking keeps this low)
    frames_decoded: int = 0
    file: dict | None = None  # the facts of the bytes decoded (sources.open_hashed)

    def group_times(self, temporal_patch_size: int = QWEN_TEMPORAL_PATCH_SIZE) -> list[float]:
        return group_timestamps(self.times, temporal_patch_size)


def sample_indices(total_frames: int, source_fps: float, sampling: VideoSampling) -> list[int]:
    """Frame indices to decode, as the reference's sample_frames picks them."""
    if sampling.num_frames is not None:
        count = sampling.num_frames
    else:
        count = int(total_frames / source_fps * sampling.fps)
        count = min(max(count, sampling.min_frames), sampling.max_frames, total_frames)
    return [int(i) for i in np.linspace(0, total_frames - 1, count).round().astype(int)]


def group_timestamps(
    times: list[float], temporal_patch_size: int = QWEN_TEMPORAL_PATCH_SIZE
) -> list[float]:
    """One time per temporal patch: the list padded with its last time to a multiple of the
    patch, then the mean of each patch's first and last frame (the reference's
    _calculate_timestamps)."""
    times = list(times) + [times[-1]] * (-len(times) % temporal_patch_size)
    return [
        (times[i] + times[i + temporal_patch_size - 1]) / 2
        for i in range(0, len(times), temporal_patch_size)
    ]


def video_smart_resize(
    num_frames: int, height: int, width: int, sampling: VideoSampling
) -> tuple[int, int]:
    """(height, width) for every frame: multiples of the factor, the budget counted over all
    frames."""
    factor, tf = sampling.factor, sampling.temporal_patch_size
    max_pixels = min(
        sampling.max_pixels, (sampling.max_frame_pixels or sampling.max_pixels) * num_frames
    )
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise ImageError(
            f"aspect ratio {max(height, width) / min(height, width):.0f}:1 is over 200:1"
        )
    h_bar, w_bar = round(height / factor) * factor, round(width / factor) * factor
    t_bar = round(num_frames / tf) * tf
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt(num_frames * height * width / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < sampling.min_pixels:
        beta = math.sqrt(sampling.min_pixels / (num_frames * height * width))
        h_bar, w_bar = (
            math.ceil(height * beta / factor) * factor,
            math.ceil(width * beta / factor) * factor,
        )
    return h_bar, w_bar


# The display matrix's 2x2 part as signs (a, b, c, d): a stored pixel (x, y) is shown at
# (a x + c y, b x + d y). The eight rotations and mirrors, as FFmpeg's autorotate applies them.
_TRANSPOSES = {
    (1, 0, 0, 1): None,
    (-1, 0, 0, 1): Image.Transpose.FLIP_LEFT_RIGHT,
    (1, 0, 0, -1): Image.Transpose.FLIP_TOP_BOTTOM,
    (-1, 0, 0, -1): Image.Transpose.ROTATE_180,
    (0, -1, 1, 0): Image.Transpose.ROTATE_90,
    (0, 1, -1, 0): Image.Transpose.ROTATE_270,
    (0, 1, 1, 0): Image.Transpose.TRANSPOSE,
    (0, -1, -1, 0): Image.Transpose.TRANSVERSE,
}


def _upright(frame) -> Image.Image:
    """The frame as shown: its display matrix applied (rotation and mirroring)."""
    image = frame.to_image()
    matrix = _display_matrix(frame)
    if matrix is None:
        return image
    signs = tuple(int(np.sign(matrix[i])) for i in (0, 1, 3, 4))
    if signs in _TRANSPOSES:
        op = _TRANSPOSES[signs]
        return image if op is None else image.transpose(op)
    # another angle: turned as the matrix says (counterclockwise degrees)
    return image.rotate(frame.rotation or 0, expand=True)


def _display_matrix(frame) -> np.ndarray | None:
    for side in frame.side_data:
        if str(side.type).endswith("DISPLAYMATRIX"):
            return np.frombuffer(bytes(side), dtype=np.int32)
    return None


def decode_video(
    path: Source | str, sampling: VideoSampling, resample: int | None = None
) -> DecodedVideo:
    """Sample and decode one video file, or raise ImageError naming what is wrong with it. With
    `resample` (a Pillow filter) each frame is resized to the run's size as it is decoded, so a
    long high-resolution video never holds its full-size frames."""
    import av  # PyAV: imported here so that `plan` and image-only runs never load FFmpeg

    source = Path(path) if isinstance(path, str) else path
    if isinstance(source, Path):
        opened, facts = open_hashed(source)
    else:  # a shard member or a Parquet cell: its bytes, read once
        read = read_source(source)
        opened, facts = read.data, read.facts
    try:
        with opened, av.open(opened) as container:
            if not container.streams.video:
                kinds = sorted({s.type for s in container.streams})
                raise ImageError(
                    f"no video stream ({', '.join(kinds)} streams only)"
                    if kinds
                    else "no video stream: the file holds no streams (zero frames)"
                )
            video = _decode(container, container.streams.video[0], sampling, resample)
            video.file = facts
            return video
    except ImageError:
        raise
    except av.error.InvalidDataError as e:
        # an MP4/MOV whose index (the moov box, written last) is missing
        if _looks_like_mp4(source):
            raise ImageError(
                "truncated or corrupt MP4/MOV: FFmpeg finds no readable index (moov box) in it"
            ) from None
        raise ImageError(f"not a video FFmpeg can read (corrupt or unknown format): {e}") from None
    except (av.error.FFmpegError, OSError, ValueError) as e:
        raise ImageError(f"cannot decode video (corrupt or truncated): {e}") from None


def frames_at_times(path: str | Path, times: list[float]) -> list[Image.Image]:
    """The frames shown at these times (seconds from the stream's start), upright, as a record's
    `video.frame_times` names them; raises ImageError for a file that cannot be read."""
    import av

    opened = open_source(Path(path) if isinstance(path, str) else path)
    try:
        with av.open(str(opened) if isinstance(opened, Path) else opened) as container:
            stream = _video_stream(container)
            _, fps, _ = _stream_facts(container, stream)
            tolerance = 0.5 / fps if fps > 0 else 0.05
            start = stream.start_time or 0
            frames, *_ = _frames_at(
                container, stream, times, start, stream.time_base, tolerance, None
            )
    except av.error.FFmpegError as e:
        raise ImageError(f"cannot decode video: {e}") from None
    return frames


def _video_stream(container):
    if not container.streams.video:
        raise ImageError("no video stream")
    return container.streams.video[0]


def _looks_like_mp4(source: Source) -> bool:
    try:
        if isinstance(source, Path):
            with open(source, "rb") as f:
                return f.read(12)[4:8] == b"ftyp"
        return source.read()[4:8] == b"ftyp"
    except (OSError, ImageError):
        return False


def probe_video(path: str | Path, sampling: VideoSampling) -> tuple[int, int, int]:
    """(frames sampled, height, width as stored) from the headers alone, for `plan`; raises
    ImageError."""
    import av

    opened = open_source(Path(path) if isinstance(path, str) else path)
    try:
        with av.open(str(opened) if isinstance(opened, Path) else opened) as container:
            stream = _video_stream(container)
            _, fps, total = _stream_facts(container, stream)
            if total <= 0 or fps <= 0:
                raise ImageError("no frames (the video stream is empty or its length is unknown)")
            return (
                len(sample_indices(total, fps, sampling)),
                stream.codec_context.height,
                stream.codec_context.width,
            )
    except av.error.FFmpegError as e:
        raise ImageError(f"not a video FFmpeg can read: {e}") from None


def _stream_facts(container, stream) -> tuple[float, float, int]:
    """(duration in seconds, average fps, frame count) from the headers, or from the last packet's
    end where the stream has no length of its own (Matroska and WebM store an end time, which is
    not the length when the timestamps start after 0)."""
    base = stream.time_base or Fraction(1, 1_000_000)
    if stream.duration:
        duration = float(stream.duration * base)
    else:
        duration = _length_without_header(container, stream, base)
    rate = stream.average_rate or stream.guessed_rate or stream.base_rate
    fps = float(rate) if rate else 0.0
    total = stream.frames or (round(duration * fps) if fps else 0)
    if fps <= 0 and total and duration > 0:
        fps = total / duration
    return duration, fps, total


def _length_without_header(container, stream, base) -> float:
    """Seconds from the first packet to the end of the last. The container's duration is an end
    time in some muxers (FFmpeg's Matroska) and a length in others: where it promises more than the
    packets hold, the file was cut short, and that duration is kept so that decoding reports it."""
    claimed = (container.duration or 0) / 1_000_000
    end = _stream_end(container, stream)
    if end is None:
        return claimed
    start = float((stream.start_time or 0) * base)
    if claimed - float(end * base) > 0.5:
        return claimed
    return float(end * base) - start


def _stream_end(container, stream) -> int | None:
    """The end (pts + duration) of the stream's last packet, in its time base: read from its last
    keyframe on, packets only (nothing is decoded)."""
    import av

    end = None
    try:
        container.seek(2**62, stream=stream, backward=True, any_frame=False)
        for packet in container.demux(stream):
            if packet.pts is not None:
                end = max(end or packet.pts, packet.pts + (packet.duration or 0))
    except av.error.FFmpegError:
        return None
    return end


def _decode(container, stream, sampling: VideoSampling, resample: int | None) -> DecodedVideo:
    codec = stream.codec_context
    if codec is None or not codec.name:
        raise ImageError("video stream with an unknown codec (FFmpeg has no decoder for it)")
    width, height = codec.width, codec.height
    if width * height > sampling.max_decode_pixels:
        raise ImageError(
            f"{width}x{height} pixels a frame is over the decode limit of "
            f"{sampling.max_decode_pixels} (video.max_decode_pixels)"
        )
    duration, fps, total = _stream_facts(container, stream)
    if total <= 0 or fps <= 0:
        raise ImageError("no frames (the video stream is empty or its length is unknown)")
    indices = sample_indices(total, fps, sampling)
    start = stream.start_time or 0
    base = stream.time_base
    sized = (
        None
        if resample is None
        else (lambda h, w: video_smart_resize(len(indices), h, w, sampling), resample)
    )
    frames, times, decoded, shown = _frames_at(
        container, stream, [i / fps for i in indices], start, base, 0.5 / fps, sized
    )
    if not frames:
        raise ImageError("no frames could be decoded (truncated or corrupt stream)")
    if len(frames) < len(indices):
        raise ImageError(
            f"truncated: the stream ends at {times[-1]:.1f} s of the {duration:.1f} s its header "
            f"gives ({len(frames)} of {len(indices)} sampled frames decoded)"
        )
    notes = []
    if _variable_rate(stream, times, indices, fps):
        notes.append("variable frame rate: frames sampled by time, stamped with their own times")
    return DecodedVideo(frames, times, indices, duration, fps, total, shown, notes, decoded)


def _variable_rate(stream, times: list[float], indices: list[int], fps: float) -> bool:
    """Header rates that disagree, or sampled frames off the constant-rate grid (their own times
    more than a quarter frame from index / fps)."""
    rates = stream.average_rate, stream.guessed_rate
    if all(rates) and rates[0] != rates[1]:
        return True
    return any(abs(t - i / fps) > 0.25 / fps for t, i in zip(times, indices))


def _frames_at(container, stream, targets: list[float], start: int, base, tolerance: float, sized):
    """The first frame shown at or after each target time (seconds from `start`), seeking only
    when far ahead; with `sized` = (size of (height, width), Pillow filter), resized as decoded."""
    frames: list[Image.Image] = []
    shown, target_size = (0, 0), None
    times: list[float] = []
    decoder, last_time, decoded = None, -math.inf, 0
    pending = None  # a decoded frame not yet used (it lies beyond the previous target)
    for target in targets:
        if decoder is None or target - last_time > SEEK_AHEAD:
            container.seek(
                start + int(target / base), stream=stream, backward=True, any_frame=False
            )
            decoder, pending = container.decode(stream), None
        found = None
        while found is None:
            frame = pending if pending is not None else next(decoder, None)
            decoded += pending is None
            pending = None
            if frame is None:
                return frames, times, decoded, shown
            if frame.pts is None:
                continue
            last_time = float((frame.pts - start) * base)
            if last_time >= target - tolerance:
                found = frame
        image = _upright(found)
        shown = image.size
        if sized is not None:
            target_size = target_size or sized[0](image.height, image.width)[::-1]
            if image.size != target_size:
                image = image.resize(target_size, resample=sized[1])
        frames.append(image)
        times.append(last_time)
        pending = found  # the next target may fall on this same frame
    return frames, times, decoded, shown
