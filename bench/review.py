"""`mmcli review` on a large label file: 100,000 synthetic records (two tasks over 50,000 inputs),
the time to open them, to serve the first page, and to filter and sort, through the server's own
HTTP API.

python bench/review.py [--items 50000]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from mmcli.review.server import ReviewServer
from mmcli.review.store import ReviewStore

WORDS = "a cat dog red blue car tree sky person cup table on with under near small large".split()


def write_records(path: Path, items: int) -> None:
    rng = random.Random(0)
    with open(path, "w") as f:
        for n in range(items):
            for task in ("caption", "tags"):
                failed = rng.random() < 0.02
                text = " ".join(rng.choice(WORDS) for _ in range(12))
                record = {
                    "schema": 2,
                    "key": f"shard{n // 1000:03d}/{n:07d}.jpg",
                    "task": task,
                    "path": f"/data/shard{n // 1000:03d}/{n:07d}.jpg",
                    "width": 640,
                    "height": 480,
                    "status": "error" if failed else "ok",
                    "text": None if failed else text,
                    "error": {"type": "ImageError", "message": "truncated"} if failed else None,
                    "latency_ms": rng.randint(200, 4000),
                    "logprobs": [round(-rng.random(), 4) for _ in range(12)],
                }
                f.write(json.dumps(record) + "\n")


def timed(fn):
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def get(server: ReviewServer, query: str) -> dict:
    with urllib.request.urlopen(f"{server.url}api/items?{query}") as response:
        return json.loads(response.read())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=50_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        labels = Path(tmp) / "labels.jsonl"
        write_records(labels, args.items)
        size = labels.stat().st_size / 1e6
        store, load_s = timed(lambda: ReviewStore([labels]))
        server = ReviewServer(store, "127.0.0.1", 0, 1 << 27)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        first, first_s = timed(lambda: get(server, "offset=0"))
        rows = [
            ("first page", first, first_s),
            (
                "filter: task tags, status error",
                *timed(lambda: get(server, "task=tags&status=error")),
            ),
            ("filter: text contains 'red car'", *timed(lambda: get(server, "q=red%20car"))),
            ("filter: regex ^cat.*tree$", *timed(lambda: get(server, "q=%5Ecat.*tree%24&regex=1"))),
            ("sort: least confident first", *timed(lambda: get(server, "sort=confidence"))),
        ]
        server.shutdown()
    print(
        f"{2 * args.items} records of {args.items} inputs ({size:.0f} MB): opened in {load_s:.2f} s"
    )
    for name, page, seconds in rows:
        shown = len(page["items"])
        print(f"{name}: {1000 * seconds:.0f} ms, {page['matches']} matches, {shown} shown")
    print(f"time to first page (open + first page): {load_s + first_s:.2f} s")


if __name__ == "__main__":
    main()
