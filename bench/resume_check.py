"""Cost of resume's changed-image check (`--check-changed`, the default) on a tree of small
files.

Writes N small files and an output holding one `ok` record per file (as a finished run leaves
it), then times the resume filter with the check and without it (`--no-check-changed`), and with
every file touched (new mtimes, so each one is confirmed by its sha256).

python bench/resume_check.py [--files 10000]"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from mmcli.config import Config
from mmcli.inputs.sources import file_facts
from mmcli.jobs.caption import CaptionJob, pending
from mmcli.jobs.records import JsonlOutput


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=10_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "images"
        root.mkdir()
        items = []
        for i in range(args.files):
            path = root / f"{i:06d}.jpg"
            path.write_bytes(os.urandom(2048))
            items.append((path.name, path))
        out = JsonlOutput(Path(tmp) / "out.jsonl").open()
        for key, path in items:
            out.append({"key": key, "status": "ok", "settings": "s", **file_facts(path)})
        times = {}
        for name, check in (
            ("no check (--no-check-changed)", False),
            ("check, nothing changed", True),
        ):
            job = CaptionJob(
                paths=[root], config=Config(), check_changed=check, resume_keys={"caption": "s"}
            )
            started = time.perf_counter()
            left = pending(items, out, job)
            times[name] = time.perf_counter() - started
            assert not left
        for _, path in items:
            os.utime(path)
        job = CaptionJob(paths=[root], config=Config(), resume_keys={"caption": "s"})
        started = time.perf_counter()
        assert not pending(items, out, job)
        times["check, every mtime changed (sha256 each)"] = time.perf_counter() - started
        out.close()
    for name, seconds in times.items():
        print(f"{args.files} files of 2 KiB, {name}: {seconds:.3f} s")
    base = times["no check (--no-check-changed)"]
    print(
        f"the check costs {times['check, nothing changed'] - base:.3f} s over the filter alone "
        f"({1e6 * (times['check, nothing changed'] - base) / args.files:.1f} us a file)"
    )


if __name__ == "__main__":
    main()
