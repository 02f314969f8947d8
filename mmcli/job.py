"""The caption job: scan, shard, resume filter, run (in this process or on Ray), write records.

The CLI parses options into a `CaptionJob` and calls `run_caption_job`; local and Ray runs share the scan, the
resume filter, the output and `caption_record`.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .config import Config
from .errors import MmcliError
from .output import JsonlOutput, append_record, file_sha256, make_record, settings_hash, write_sidecar
from .scan import parse_shard, scan, shard_of


@dataclass
class RayOptions:
    address: str | None = None
    replicas: int = 1
    resources: dict = field(default_factory=lambda: {"num_cpus": 1})


@dataclass
class CaptionJob:
    paths: list[Path]
    config: Config
    output: str = "captions.jsonl"  # "-" for stdout
    recursive: bool = True
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    shard: str | None = None
    limit: int | None = None
    overwrite: bool = False
    retry_errors: bool = False
    sidecar: str | None = None
    dry_run: bool = False
    quiet: bool = False
    logprobs: bool = False
    ray: RayOptions | None = None

    @property
    def settings(self) -> str:
        return settings_hash(self.config.prompt, self.config.model, self.config.generation.as_dict())


def caption_record(result, captioner, config: Config, settings: str, path: str | Path, logprobs: bool) -> dict:
    """The record of one captioned item (local and Ray runs alike)."""
    return make_record(key=result.key, task="caption", prompt=config.prompt, result=result,
                       model=captioner.model_name, model_revision=captioner.revision,
                       sampling=config.generation.as_dict(), sha256=file_sha256(path), logprobs=logprobs,
                       extra={"settings": settings})


def select_items(job: CaptionJob) -> list[tuple[str, Path]]:
    """The scanned (key, path) items of this shard."""
    items = scan(job.paths, job.config.scan.extensions, recursive=job.recursive, include=job.include,
                 exclude=job.exclude)
    if job.shard:
        index, count = parse_shard(job.shard)
        items = [(k, p) for k, p in items if shard_of(k, count) == index]
    return items


def pending(items: list[tuple[str, Path]], out: JsonlOutput, job: CaptionJob) -> list[tuple[str, Path]]:
    """Items the output does not hold as done under the same settings (errors too, unless --retry-errors)."""
    if job.overwrite:
        return items
    recorded = {r.get("key"): r.get("status") for r in out.records() if r.get("settings") == job.settings}
    return [(k, p) for k, p in items if recorded.get(k) is None or (recorded[k] == "error" and job.retry_errors)]


def run_caption_job(job: CaptionJob) -> int:
    """Run the job; returns the exit code (0 done, 1 an item failed, 130 interrupted). Raises MmcliError for
    what stops it before or during the work."""
    items = select_items(job)
    out = JsonlOutput(Path(job.output)).open() if job.output != "-" else None
    try:
        if out is not None:
            if out.set_aside and not job.quiet:
                print(f"mmcli: {job.output}: a torn last line from an interrupted run was moved to {out.set_aside}",
                      file=sys.stderr)
            items = pending(items, out, job)
        items = items[:job.limit] if job.limit is not None else items
        if job.dry_run or not items:
            if not job.quiet:
                print("\n".join(key for key, _ in items) + ("\n" if items else ""), end="")
                print(f"mmcli: {len(items)} images to caption", file=sys.stderr)
            return 0
        return _run(job, items, out)
    finally:
        if out is not None:
            out.close()


def _run(job: CaptionJob, items: list[tuple[str, Path]], out: JsonlOutput | None) -> int:
    from .captioner import Captioner
    from .progress import Progress

    captioner = None
    if job.ray is None:
        captioner = Captioner.from_pretrained(config=job.config)
        captioner.report_compile_cache()
    paths = dict(items)
    progress = Progress(len(items), quiet=job.quiet)

    def write(record: dict) -> None:
        if job.sidecar and record["status"] == "ok":
            write_sidecar(paths[record["key"]], job.sidecar, record["text"])
        out.append(record) if out is not None else append_record(sys.stdout, record)
        progress.update(record)

    def on_term(signum, frame):  # SIGTERM ends the run like Ctrl-C: what finished is already on disk
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        if job.ray is not None:
            from .distributed import caption_on_ray

            caption_on_ray(items, job.config, job.settings, write, job.ray, job.logprobs)
        else:
            _caption_here(captioner, job, items, write)
        progress.finish()
        return 1 if progress.failed else 0
    except KeyboardInterrupt:
        progress.finish(interrupted=True)
        return 130
    except MmcliError:
        progress.stop()
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)


def _caption_here(captioner, job: CaptionJob, items: list[tuple[str, Path]], write: Callable[[dict], None]) -> None:
    paths = dict(items)
    try:
        for result in captioner.caption(items, prompt=job.config.prompt):
            write(caption_record(result, captioner, job.config, job.settings, paths[result.key], job.logprobs))
    finally:
        captioner.report_compile_use()
