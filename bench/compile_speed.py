"""Eager vs inductor on the CPU with the real Qwen3-VL-2B shapes, in one run: images/s and
compile times.

The checkpoint and images are compare_hf.py's (random 2B-shaped weights, written once to
--cache-dir); the first --images of its 16 images with their output lengths. Every step runs in a
process of its own: compile all buckets ahead (a fresh compile cache), compile again (every
bucket cached), caption with inductor (loading only), caption with eager. The last line names the
faster backend, which is what compile.backend auto picks on the CPU.

python bench/compile_speed.py [--images 8] [--cache-dir DIR]"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_hf import PROMPT, ROOT, make_inputs  # noqa: E402

from mmcli.engine.warmup import run_bucket  # noqa: E402

# Buckets sized for this job: prompts of 60-320 tokens, outputs up to 96, images up to 1200 patches.
SETTINGS = {
    "device": "cpu",
    "dtype": "float32",
    "engine": {"max_seqs": 8, "max_len": 512},
    "vision": {"block_size": 1280, "num_blocks_buckets": [1, 2, 4, 8]},
    "image": {"max_pixels": 1280 * 256},
    "compile": {
        "prefill_buckets": [128, 256, 384],
        "decode_batch_buckets": [1, 2, 4, 8],
        "decode_context_buckets": [512],
    },
}


def labeler(ckpt: Path, backend: str, compile_dir: Path):
    from mmcli.api.labeler import Labeler
    from mmcli.config import load_config

    cfg = load_config(
        None,
        {
            **SETTINGS,
            "compile": {**SETTINGS["compile"], "backend": backend, "cache_dir": str(compile_dir)},
        },
    )
    return Labeler.from_pretrained(str(ckpt), config=cfg)


def worker_compile(ckpt: Path, compile_dir: Path) -> dict:
    started = time.perf_counter()
    cap = labeler(ckpt, "inductor", compile_dir)
    graphs = cap.graphs
    warm = partial(run_bucket, cap.runner)
    rows = [(b.label, *graphs.compile_bucket(b, warm)) for b in graphs.buckets]
    return {"seconds": time.perf_counter() - started, "buckets": rows}


def worker_run(
    ckpt: Path, images: list[Path], lengths: list[int], backend: str, compile_dir: Path
) -> dict:
    cap = labeler(ckpt, backend, compile_dir)
    if cap.graphs is not None:
        missing = cap.graphs.missing
        assert not missing, f"not compiled ahead: {[b.label for b in missing]}"
    start = time.perf_counter()

    def requests():
        for n, (path, length) in enumerate(zip(images, lengths)):
            req, _ = cap.request(f"img{n}", [path], PROMPT, cap.sampling(max_new_tokens=length))
            yield replace(req, stop_ids=frozenset())  # the length schedule stands in for eos

    tokens = {r.key: r.token_ids for r in cap.engine.generate(requests())}
    elapsed = time.perf_counter() - start
    graphs = cap.graphs
    return {
        "images_per_s": len(images) / elapsed,
        "seconds": elapsed,
        "tokens": tokens,
        "loaded": len(graphs.loaded) if graphs else 0,
        "compiled_at_run_time": len(graphs.compiled_at_run_time) if graphs else 0,
        "ran_eagerly": [b.label for b in graphs.missing_used] if graphs else [],
    }


def run_worker(args, kind: str, backend: str = "inductor") -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        kind,
        "--backend",
        backend,
        "--cache-dir",
        str(args.cache_dir),
        "--compile-dir",
        str(args.compile_dir),
        "--images",
        str(args.images),
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=os.environ)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--cache-dir", type=Path, default=ROOT / ".bench_cache")
    parser.add_argument("--compile-dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker", choices=["compile", "run"], help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="inductor", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    ckpt, images, lengths = make_inputs(args.cache_dir, smoke=False)
    images, lengths = images[: args.images], lengths[: args.images]
    if args.worker == "compile":
        print(json.dumps(worker_compile(ckpt, args.compile_dir)))
        return
    if args.worker == "run":
        print(json.dumps(worker_run(ckpt, images, lengths, args.backend, args.compile_dir)))
        return

    with tempfile.TemporaryDirectory(prefix="mmcli-compile-") as tmp:
        args.compile_dir = Path(tmp) / "cache"
        print(
            f"{len(images)} images, output lengths {min(lengths)}-{max(lengths)} tokens, float32, "
            f"CPU; settings {json.dumps(SETTINGS)}",
            flush=True,
        )
        first = run_worker(args, "compile")
        print(
            f"inductor compile, fresh cache: {first['seconds']:.1f} s for {len(first['buckets'])} "
            "buckets",
            flush=True,
        )
        for label, status, seconds in first["buckets"]:
            print(f"  {label}: {seconds:.1f} s ({status})", flush=True)
        second = run_worker(args, "compile")
        cached = sum(status == "cached" for _, status, _ in second["buckets"])
        print(
            f"inductor compile, new process: {second['seconds']:.1f} s, {cached} of "
            f"{len(second['buckets'])} cached ({100 * second['seconds'] / first['seconds']:.1f}% "
            "of the first)",
            flush=True,
        )
        compiled = run_worker(args, "run", "inductor")
        print(
            f"inductor: {compiled['images_per_s']:.4f} images/s ({compiled['seconds']:.1f} s; "
            f"{compiled['loaded']} buckets loaded, {compiled['compiled_at_run_time']} compiled at "
            "run time)",
            flush=True,
        )
    eager = run_worker(args, "run", "eager")
    print(f"eager: {eager['images_per_s']:.4f} images/s ({eager['seconds']:.1f} s)", flush=True)
    same = sum(compiled["tokens"][k] == eager["tokens"][k] for k in eager["tokens"])
    print(f"greedy tokens identical for {same} of {len(eager['tokens'])} images")
    winner = "inductor" if compiled["images_per_s"] > eager["images_per_s"] else "eager"
    print(
        "images/s ratio (inductor / eager): "
        f"{compiled['images_per_s'] / eager['images_per_s']:.2f}; faster on this CPU: {winner}"
    )


if __name__ == "__main__":
    main()
