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
from .errors import ConfigError, MmcliError
from .output import JsonlOutput, Result, append_record, make_record, sidecar_path, write_sidecar
from .resume import file_changed, load_description, settings_hash
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
    check_changed: bool = True  # redo an item whose image changed since its record
    settings: str = ""  # the label settings' hash; set when the job starts


def caption_record(result, captioner, config: Config, settings: str, path: str | Path, logprobs: bool) -> dict:
    """The record of one captioned item (local and Ray runs alike)."""
    return make_record(key=result.key, task="caption", prompt=config.prompt, result=result,
                       model=captioner.model_name, model_revision=captioner.revision,
                       sampling=config.generation.as_dict(), path=path, logprobs=logprobs,
                       extra={"precision": captioner.precision, "settings": settings})


def error_record(key: str, path: Path, config: Config, settings: str, error: MmcliError) -> dict:
    """The record of an item refused before it ran."""
    result = Result(key, error={"type": type(error).__name__, "message": str(error)})
    return make_record(key=key, task="caption", prompt=config.prompt, result=result, model=config.model,
                       model_revision=None, sampling=config.generation.as_dict(), path=path,
                       extra={"settings": settings})


def sidecar_clashes(items: list[tuple[str, Path]], ext: str | None) -> dict[str, str]:
    """{key: earlier key} for every item whose sidecar path an earlier item (in key order) already takes."""
    if not ext:
        return {}
    owners: dict[Path, str] = {}
    clashes = {}
    for key, path in items:
        target = sidecar_path(path, ext)
        if target in owners:
            clashes[key] = owners[target]
        else:
            owners[target] = key
    return clashes


def select_items(job: CaptionJob) -> list[tuple[str, Path]]:
    """The scanned (key, path) items of this shard."""
    items = scan(job.paths, job.config.scan.extensions, recursive=job.recursive, include=job.include,
                 exclude=job.exclude)
    if job.shard:
        index, count = parse_shard(job.shard)
        items = [(k, p) for k, p in items if shard_of(k, count) == index]
    return items


def pending(items: list[tuple[str, Path]], out: JsonlOutput, job: CaptionJob) -> list[tuple[str, Path]]:
    """Items the output does not hold as done under the same settings (errors too, unless --retry-errors); with
    check_changed, also those whose image changed since its record."""
    if job.overwrite:
        return items
    recorded = {r.get("key"): r for r in out.records() if r.get("settings") == job.settings}

    def todo(key: str, path: Path) -> bool:
        record = recorded.get(key)
        if record is None:
            return True
        if record.get("status") == "error":
            return job.retry_errors
        return job.check_changed and file_changed(path, record)

    return [(k, p) for k, p in items if todo(k, p)]


def run_caption_job(job: CaptionJob) -> int:
    """Run the job; returns the exit code (0 done, 1 an item failed, 130 interrupted). Raises MmcliError for
    what stops it before or during the work."""
    from rich.console import Console

    from .progress import status_line
    from .resume import planned_settings

    with status_line(Console(stderr=True, quiet=job.quiet), "finding the images and what is done"):
        items = select_items(job)
        job.settings = settings_hash(planned_settings(job.config))
        out = JsonlOutput(Path(job.output)).open() if job.output != "-" else None
    try:
        items = pending(items, out, job) if out is not None else items
        if out is not None and out.set_aside and not job.quiet:
            print(f"mmcli: {job.output}: a torn last line from an interrupted run was moved to {out.set_aside}",
                  file=sys.stderr)
        items = items[:job.limit] if job.limit is not None else items
        if job.dry_run or not items:
            if not job.quiet:
                print("\n".join(key for key, _ in items) + ("\n" if items else ""), end="")
                print(f"mmcli: {len(items)} images to caption", file=sys.stderr)
            return 0
        return _run(job, items, out, sidecar_clashes(select_items(job), job.sidecar) if job.sidecar else {})
    finally:
        if out is not None:
            out.close()


def _run(job: CaptionJob, items: list[tuple[str, Path]], out: JsonlOutput | None, clashes: dict[str, str]) -> int:
    from .captioner import Captioner
    from .progress import Progress

    captioner = None
    progress = Progress(len(items), quiet=job.quiet)
    if job.ray is None:
        with progress.loading(load_description(job.config)):
            captioner = Captioner.from_pretrained(config=job.config)
        captioner.report_compile_cache()
        job.settings = settings_hash(captioner.label_settings)  # the same, unless the model was fetched just now
    else:
        progress.start()
    paths = dict(items)

    def write(record: dict) -> None:
        if job.sidecar and record["status"] == "ok":
            write_sidecar(paths[record["key"]], job.sidecar, record["text"])
        out.append(record) if out is not None else append_record(sys.stdout, record)
        progress.update(record)

    def on_term(signum, frame):  # SIGTERM ends the run like Ctrl-C: what finished is already on disk
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        for key, first in clashes.items():
            if key in paths:
                error = ConfigError(f"{paths[key]}: its sidecar {sidecar_path(paths[key], job.sidecar)} is also the "
                                    f"sidecar of {first}; rename one of the two")
                write(error_record(key, paths[key], job.config, job.settings, error))
        items = [(k, p) for k, p in items if k not in clashes]
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
