"""Several tasks in one pass against one task, on the 2B-shaped random checkpoint (compare_hf's),
one process.

Three text tasks (caption, tags, detailed) on the same 8 images, 48 tokens each (eos set aside,
so every answer has that length, as compare_hf does), against the caption task alone: the image
is decoded and encoded once, the shared prompt prefix prefilled once, and the three answers
decode side by side. Prints the time ratio (three separate runs would be about 3x). Then a JSON
task under a schema (enum, integer range, strings, an array) on the same images: every answer
checked against the schema, and the grammar's masks as a share of decode time.

python bench/tasks.py [--images 8] [--dtype auto] [--quantize int8] [--smoke]"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_hf import ROOT, make_inputs  # noqa: E402

from mmcli.engine.grammar import SequenceConstraint  # noqa: E402
from mmcli.testing import EXAMPLE_SCHEMA as SCHEMA  # noqa: E402

TASKS = {
    "caption": {"max_new_tokens": 48},
    "tags": {"max_new_tokens": 48},
    "detailed": {"max_new_tokens": 48},
    "fields": {
        "prompt": "Describe this image as JSON.",
        "output": "json",
        "schema": SCHEMA,
        "max_new_tokens": 96,
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantize", default="none", choices=["none", "int8"])
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    from mmcli.api.labeler import Labeler
    from mmcli.config import load_config

    cache = Path("/tmp/mmcli-bench") if args.smoke else ROOT / ".bench_cache"
    cache.mkdir(parents=True, exist_ok=True)
    ckpt, images, _ = make_inputs(cache, args.smoke, args.images)
    cfg = load_config(
        None,
        {
            "dtype": args.dtype,
            "device": "cpu",
            "tasks": TASKS,
            "quantize": args.quantize,
            "engine": {"max_seqs": 3 * args.images, "max_len": 1024},
        },
    )
    cap = Labeler.from_pretrained(str(ckpt), config=cfg)
    decode = {"seconds": 0.0}
    runner_decode = cap.runner.decode

    def timed_decode(items):
        started = time.perf_counter()
        try:
            return runner_decode(items)
        finally:
            decode["seconds"] += time.perf_counter() - started

    cap.runner.decode = timed_decode
    masks = {"seconds": 0.0}  # logits masked to the grammars, in the sampler
    constraint_mask = SequenceConstraint.mask

    def timed_mask(self, row):
        started = time.perf_counter()
        try:
            return constraint_mask(self, row)
        finally:
            masks["seconds"] += time.perf_counter() - started

    SequenceConstraint.mask = timed_mask
    items = [(f"img{n}", path) for n, path in enumerate(images)]
    times = {}
    stop_ids = cap.requests.stop_ids
    runs = (
        ("one task (caption)", ["caption"]),
        ("three tasks (caption, tags, detailed)", ["caption", "tags", "detailed"]),
        ("json task (fields)", ["fields"]),
    )
    for name, tasks in runs:
        cap.runner.encoder.cache.clear()  # each run encodes its images itself
        decode["seconds"], masks["seconds"] = 0.0, 0.0
        # text answers: all 48 tokens
        cap.requests.stop_ids = stop_ids if tasks == ["fields"] else frozenset()
        started = time.perf_counter()
        results = list(cap.label(items, tasks=tasks))
        times[name] = time.perf_counter() - started
        print(
            f"{name}: {times[name]:.1f} s for {len(images)} images, {len(results)} labels, decode "
            f"{decode['seconds']:.1f} s, grammar masks {masks['seconds']:.2f} s "
            f"({100 * masks['seconds'] / max(decode['seconds'], 1e-9):.1f}% of decode)",
            flush=True,
        )
    fields = [r for r in results if r.task == "fields"]
    import jsonschema

    for r in fields:
        if r.ok:
            jsonschema.validate(json.loads(r.text), SCHEMA)
    print(
        f"JSON answers: {sum(r.ok for r in fields)} of {len(fields)} ok, every ok one valid under "
        "the schema"
    )
    ratio = times["three tasks (caption, tags, detailed)"] / times["one task (caption)"]
    print(f"time ratio (three tasks in one pass / one task): {ratio:.2f}")


if __name__ == "__main__":
    main()
