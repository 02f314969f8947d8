"""Labeling from WebDataset shards against labeling the same images from a folder: the engine's
input wait (the share of the run it had nothing to compute), side by side; and the peak memory of
a run over a small shard and over one a hundred times larger (other samples' members as filler),
which must not grow with the shard.

python bench/shards.py [--images 48] [--filler-mb 300] [--smoke]
"""

from __future__ import annotations

import argparse
import io
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def jpegs(n: int) -> list[bytes]:
    from PIL import Image

    samples = sorted((ROOT / "samples").glob("*.jpg"))
    out = []
    for i in range(n):
        image = Image.open(samples[i % len(samples)]).convert("RGB").resize((320 + 8 * i, 240))
        buffer = io.BytesIO()
        image.save(buffer, "JPEG", quality=90)
        out.append(buffer.getvalue())
    return out


def write_shard(path: Path, images: list[bytes], filler_mb: int = 0) -> None:
    """Samples with a jpg each; `filler_mb` more of samples holding only a 1 MB .bin member."""
    with tarfile.open(path, "w") as tar:
        members = [(f"{k:09d}.jpg", data) for k, data in enumerate(images)]
        members += [(f"filler{k:06d}.bin", bytes(1 << 20)) for k in range(filler_mb)]
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def input_wait(checkpoint: Path, source: Path, tokens: int) -> tuple[float, float]:
    """(seconds, share of the run the engine waited for inputs) labeling every item of `source`."""
    from mmcli.api.labeler import Labeler
    from mmcli.config import load_config
    from mmcli.jobs.scan import scan

    cfg = load_config(
        None, {"dtype": "float32", "device": "cpu", "generation": {"max_new_tokens": tokens}}
    )
    labeler = Labeler.from_pretrained(str(checkpoint), config=cfg)
    items = scan([source], cfg.scan.extensions)
    started = time.perf_counter()
    for _ in labeler.label(items):
        pass
    seconds = time.perf_counter() - started
    return seconds, labeler.engine.input_wait / seconds


def peak_rss(checkpoint: Path, shard: Path, out: Path, limit: int) -> float:
    """Peak resident memory (GiB) of `mmcli caption SHARD --limit N`, measured by a fresh parent
    process (its children's maximum is that one run's)."""
    cmd = [
        sys.executable,
        "-m",
        "mmcli",
        "caption",
        str(shard),
        "-o",
        str(out),
        "--model",
        str(checkpoint),
        "-q",
        "--limit",
        str(limit),
        "--max-new-tokens",
        "4",
    ]
    probe = (
        "import resource, subprocess, sys; subprocess.run(sys.argv[1:], check=True); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, *cmd], check=True, timeout=900, capture_output=True, text=True
    )
    return int(done.stdout.split()[-1]) * 1024 / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=48)
    parser.add_argument("--filler-mb", type=int, default=300)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    if args.smoke:
        args.images, args.filler_mb, args.tokens = 6, 8, 4
    from mmcli.testing import make_tiny_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkpoint = make_tiny_checkpoint(tmp / "ckpt")
        images = jpegs(args.images)
        folder = tmp / "folder"
        folder.mkdir()
        for k, data in enumerate(images):
            (folder / f"{k:09d}.jpg").write_bytes(data)
        write_shard(tmp / "small.tar", images)
        write_shard(tmp / "large.tar", images, args.filler_mb)
        rows = [
            (name, *input_wait(checkpoint, source, args.tokens))
            for name, source in (("folder", folder), ("shard", tmp / "small.tar"))
        ]
        small = peak_rss(checkpoint, tmp / "small.tar", tmp / "a.jsonl", args.images)
        large = peak_rss(checkpoint, tmp / "large.tar", tmp / "b.jsonl", args.images)
        sizes = [(tmp / n).stat().st_size / 2**20 for n in ("small.tar", "large.tar")]
    print(f"{args.images} JPEG images, tiny checkpoint, {args.tokens} tokens each, one process")
    for name, seconds, share in rows:
        print(f"from a {name}: {seconds:.1f} s, engine input wait {100 * share:.1f}% of the run")
    print(
        f"peak RSS, a {sizes[0]:.0f} MB shard: {small:.2f} GiB; a {sizes[1]:.0f} MB shard: "
        f"{large:.2f} GiB; ratio {large / small:.2f}"
    )


if __name__ == "__main__":
    main()
