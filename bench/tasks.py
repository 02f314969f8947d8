"""Several tasks in one pass against one task, on the 2B-shaped random checkpoint (compare_hf's), one process.

Three tasks (a caption, tags, typed JSON fields under a schema) on the same 8 images take the time of one task
plus what only they need: the image is decoded and encoded once, the shared prompt prefix prefilled once, and the
three answers decode side by side. Prints the ratio (three tasks / one task; three separate runs would be about
3x), the time the grammar's masks took as a share of decode time, and checks every JSON answer against the schema.

    python bench/tasks.py [--images 8] [--dtype float32] [--smoke]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_hf import ROOT, make_inputs  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["kind", "count", "title", "tags"],
          "properties": {"kind": {"enum": ["photo", "drawing", "screenshot"]},
                         "count": {"type": "integer", "minimum": 0, "maximum": 20},
                         "title": {"type": "string", "maxLength": 12},
                         "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2}}}
TASKS = {"caption": {"max_new_tokens": 48}, "tags": {"max_new_tokens": 48},
         "fields": {"prompt": "Describe this image as JSON.", "output": "json", "schema": SCHEMA,
                    "max_new_tokens": 96}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args()
    from mmcli.captioner import Captioner
    from mmcli.config import load_config

    cache = Path("/tmp/mmcli-bench") if args.smoke else ROOT / ".bench_cache"
    cache.mkdir(parents=True, exist_ok=True)
    ckpt, images, _ = make_inputs(cache, args.smoke, args.images)
    cfg = load_config(None, {"dtype": args.dtype, "device": "cpu", "tasks": TASKS,
                             "engine": {"max_seqs": 3 * args.images, "max_len": 1024}})
    cap = Captioner.from_pretrained(str(ckpt), config=cfg)
    decode = {"seconds": 0.0}
    runner_decode = cap.runner.decode

    def timed_decode(items):
        started = time.perf_counter()
        try:
            return runner_decode(items)
        finally:
            decode["seconds"] += time.perf_counter() - started

    cap.runner.decode = timed_decode
    items = [(f"img{n}", path) for n, path in enumerate(images)]
    times = {}
    for name, tasks in (("one task (caption)", ["caption"]), ("three tasks (caption, tags, fields)",
                                                               ["caption", "tags", "fields"])):
        cap.runner.encoder.cache.clear()  # each run encodes its images itself
        decode["seconds"], cap.runner.mask_seconds = 0.0, 0.0
        started = time.perf_counter()
        results = list(cap.caption(items, tasks=tasks))
        times[name] = time.perf_counter() - started
        print(f"{name}: {times[name]:.1f} s for {len(images)} images, {len(results)} labels, decode "
              f"{decode['seconds']:.1f} s, grammar masks {cap.runner.mask_seconds:.2f} s "
              f"({100 * cap.runner.mask_seconds / max(decode['seconds'], 1e-9):.1f}% of decode)", flush=True)
    fields = [r for r in results if r.task == "fields"]
    import jsonschema

    for r in fields:
        if r.ok:
            jsonschema.validate(json.loads(r.text), SCHEMA)
    print(f"JSON answers: {sum(r.ok for r in fields)} of {len(fields)} ok, every ok one valid under the schema")
    ratio = times["three tasks (caption, tags, fields)"] / times["one task (caption)"]
    print(f"time ratio (three tasks in one pass / one task): {ratio:.2f}")


if __name__ == "__main__":
    main()
