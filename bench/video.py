"""Seconds per video-minute on the CPU: FFmpeg decoding (PyAV) apart from the model, at the
default settings.

A 60 s, 1280x720, 30 fps H.264 clip (a photo panned and zoomed, so the codec has real work),
written once under --cache-dir; the 2B-shaped random checkpoint of compare_hf; `mmcli caption`'s
defaults (fps 2 from the checkpoint, video.max_pixels over all frames), one caption of
--max-new-tokens tokens.

python bench/video.py [--smoke] [--seconds 60] [--max-new-tokens 64]"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import compare_hf


def make_clip(
    path: Path, seconds: float, width: int = 1280, height: int = 720, fps: int = 30
) -> Path:
    import av
    import numpy as np
    from PIL import Image

    if path.is_file():
        return path
    photo = (
        Image.open(compare_hf.ROOT / "samples" / "astronaut.jpg")
        .convert("RGB")
        .resize((width * 2, height * 2))
    )
    with av.open(str(path), "w") as container:
        stream = container.add_stream(
            "libx264", rate=fps, options={"preset": "veryfast", "crf": "23"}
        )
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for k in range(int(seconds * fps)):
            phase = k / (seconds * fps)
            x, y = int(phase * width), int((0.5 - abs(phase - 0.5)) * height)
            frame = np.asarray(photo.crop((x, y, x + width, y + height)))
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode(None))
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="the tiny checkpoint and a 4 s clip")
    parser.add_argument("--cache-dir", type=Path, default=compare_hf.ROOT / ".bench_cache")
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    args = parser.parse_args()
    seconds = 4.0 if args.smoke else args.seconds
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    ckpt, _, _ = compare_hf.make_inputs(
        args.cache_dir / ("smoke" if args.smoke else ""), args.smoke
    )
    clip = make_clip(args.cache_dir / f"clip_{seconds:g}s_720p.mp4", seconds)

    from mmcli.api.labeler import Labeler
    from mmcli.config import load_config
    from mmcli.inputs.video import decode_video

    cap = Labeler.from_pretrained(str(ckpt), config=load_config(None, {"device": "cpu"}))
    start = time.perf_counter()
    video = decode_video(clip, cap.requests.video_sampling)
    decode = time.perf_counter() - start
    spent = compare_hf.phase_timers(cap)
    start = time.perf_counter()
    result = cap.ask([], "Describe this video.", videos=[clip], max_new_tokens=args.max_new_tokens)
    total = time.perf_counter() - start
    assert result.ok, result.error
    info = result.images[0]
    minutes = video.duration / 60
    print(
        f"clip: {video.duration:.0f} s, {info['width']}x{info['height']} at "
        f"{video.source_fps:.0f} fps; {len(video.frames)} frames sampled ({video.frames_decoded} "
        f"decoded), {cap.precision.describe()}"
    )
    print(
        f"prompt: {result.num_input_tokens} tokens ({result.num_image_tokens} visual), "
        f"{len(result.token_ids)} generated"
    )
    model = total - decode  # ask decodes the file again; its own decoding is the measured `decode`
    print(
        f"FFmpeg decoding and sampling: {decode:.2f} s ({decode / minutes:.2f} s per video-minute)"
    )
    print(
        f"preprocessing and model: {model:.1f} s (vision {spent['vision']:.1f}, text prefill "
        f"{spent['prefill'] - spent['vision']:.1f}, decode {spent['decode']:.1f}) = "
        f"{model / minutes:.1f} s per video-minute"
    )
    print(f"in all: {total / minutes:.1f} s per video-minute")


if __name__ == "__main__":
    main()
