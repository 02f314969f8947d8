"""The caption job: scan, shard, resume filter, run (in this process or on Ray), write records.

The CLI parses options into a `CaptionJob` and calls `run_caption_job`; local and Ray runs share
the scan, the resume filter, the output and the labeling loop (labeling.py)."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

from mmcli.api.loader import Run, load_description, resolve_run
from mmcli.config import Config, check_sidecar
from mmcli.errors import ConfigError, MmcliError
from mmcli.inputs.sources import Source
from mmcli.jobs.distributed import RayOptions
from mmcli.jobs.labeling import Item, error_record, kind_of, label_records
from mmcli.jobs.records import JsonlOutput, append_record, sidecar_path, write_sidecar
from mmcli.jobs.resume import file_changed, label_settings, reviewed, task_resume_keys
from mmcli.jobs.scan import parse_shard, scan, shard_of
from mmcli.tasks import Task, resolve_tasks
from mmcli.weights.hub import read_ahead


@dataclass(frozen=True)
class Selection:
    """Which inputs a job labels: what the scan takes, and this machine's share of it."""

    recursive: bool = True
    include: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    shard: str | None = None  # INDEX/COUNT: a stable split over machines
    limit: int | None = None
    image_column: str | None = None  # Parquet inputs: the column of images (None: found)
    key_column: str | None = None  # Parquet inputs: the column of keys (None: `key`, or FILE/ROW)


@dataclass(frozen=True)
class Redo:
    """Which labels already recorded a job makes again."""

    overwrite: bool = False  # every one
    retry_errors: bool = False  # the failed ones
    check_changed: bool = True  # those whose input changed since its record
    reviewed: bool = False  # those a person edited or approved


@dataclass(kw_only=True)
class CaptionJob:
    paths: list[Path]
    config: Config
    output: str = "captions.jsonl"  # "-" for stdout
    select: Selection = field(default_factory=Selection)
    redo: Redo = field(default_factory=Redo)
    sidecar: str | None = None
    dry_run: bool = False
    quiet: bool = False
    logprobs: bool = False
    ray: RayOptions | None = None  # run on a Ray cluster
    # the settings as resolved once (api.loader.resolve_run); set at start
    run: Run | None = None
    # task name -> its resume keys (jobs.resume.task_resume_keys); set with the run
    resume_keys: dict[str, dict[str, str]] = field(default_factory=dict)
    # sampling given on the command line: wins over tasks' own
    sampling: dict = field(default_factory=dict)

    @cached_property
    def tasks(self) -> list[Task]:
        return resolve_tasks(self.config, given=self.sampling)

    def sidecar_ext(self, task: Task) -> str | None:
        """A task's own sidecar extension, or --sidecar for the first task."""
        return task.sidecar or (self.sidecar if task.name == self.config.task[0] else None)

    def settle(self, run: Run) -> None:
        """The run, and each task's resume keys: its label settings and the task's definition."""
        self.run, base = run, label_settings(run)
        self.resume_keys = {t.name: task_resume_keys(self.config, base, t) for t in self.tasks}

    def resume_key(self, task: str, path: Path) -> str:
        """The key a record of this task about this file is written under."""
        return self.resume_keys[task][kind_of(self.config, path)]


def sidecar_clashes(items: list[tuple[str, Path]], ext: str | None) -> dict[str, str]:
    """{key: earlier key} for every item whose sidecar path an earlier item (in key order)
    already takes."""
    if not ext:
        return {}
    not_files = [key for key, source in items if not isinstance(source, Path)]
    if not_files:
        raise ConfigError(
            f"{not_files[0]}: sidecars are written next to files, and this input is inside a shard "
            "or a Parquet file; label without --sidecar (mmcli export writes the labels out)"
        )
    owners: dict[Path, str] = {}
    clashes = {}
    for key, path in items:
        target = sidecar_path(path, ext)
        if target in owners:
            clashes[key] = owners[target]
        else:
            owners[target] = key
    return clashes


def select_items(job: CaptionJob) -> list[tuple[str, Source]]:
    """The scanned (key, source) items of this shard of the work."""
    items = scan(
        job.paths,
        job.config.scan.extensions + job.config.scan.video_extensions,
        recursive=job.select.recursive,
        include=job.select.include,
        exclude=job.select.exclude,
        columns=(job.select.image_column, job.select.key_column),
    )
    if job.select.shard:
        index, count = parse_shard(job.select.shard)
        items = [(k, p) for k, p in items if shard_of(k, count) == index]
    return items


def pending(items: list[tuple[str, Path]], out: JsonlOutput | None, job: CaptionJob) -> list[Item]:
    """(key, path, task names) for the tasks of each item the output does not hold as done under
    their settings (errors too, unless --retry-errors); with check_changed, also those whose
    image changed since its record."""
    names = [t.name for t in job.tasks]
    if out is None:
        return [(k, p, names) for k, p in items]
    wanted = {key: n for n in names for key in job.resume_keys[n].values()}
    recorded, by_person = {}, {}
    for r in out.records():
        recorded[(r.get("key"), wanted.get(r.get("settings")))] = r
        by_person[(r.get("key"), r.get("task"))] = reviewed(r)

    def todo(key: str, path: Path, name: str) -> bool:
        if by_person.get((key, name)):  # a person's label stays, unless asked to redo those
            return job.redo.reviewed
        if job.redo.overwrite:
            return True
        record = recorded.get((key, name))
        current = (job.resume_key(name, path), job.resume_keys[name]["legacy"])
        if record is None or record["settings"] not in current:
            return True
        if record.get("status") == "error":
            return job.redo.retry_errors
        return job.redo.check_changed and file_changed(path, record)

    left = [(k, p, [n for n in names if todo(k, p, n)]) for k, p in items]
    return [entry for entry in left if entry[2]]


def check_job(job: CaptionJob) -> None:
    """What would fail later, refused before any work (exit 2): a bad --sidecar, two tasks writing
    one sidecar, a schema that cannot compile."""
    from mmcli.api.loader import check_schemas

    if job.sidecar is not None:
        check_sidecar(job.sidecar, "--sidecar")
    writers: dict[str, str] = {}
    for task in job.tasks:
        ext = job.sidecar_ext(task)
        if ext in writers:
            raise ConfigError(
                f"tasks {writers[ext]} and {task.name} both write the sidecar {ext}; give one its "
                "own tasks.NAME.sidecar"
            )
        if ext is not None:
            writers[ext] = task.name
    check_schemas(job.config, job.tasks)


def run_caption_job(job: CaptionJob, progress) -> int:
    """Run the job, reporting to `progress` (the command line's Progress); returns the exit code
    (0 done, 1 an item failed, 130 interrupted). Raises MmcliError for what stops it before or
    during the work."""
    check_job(job)
    with progress.status("finding the images and what is done"):
        # scanned once: the work, and the sidecar clashes among all images
        everything = select_items(job)
        job.settle(resolve_run(job.config))
        out = JsonlOutput(Path(job.output)).open() if job.output != "-" else None
    try:
        items = pending(everything, out, job)
        if out is not None and out.set_aside and not job.quiet:
            print(
                f"mmcli: {job.output}: a torn last line from an interrupted run was moved to "
                f"{out.set_aside}",
                file=sys.stderr,
            )
        limit = job.select.limit
        items = items[:limit] if limit is not None else items
        if job.dry_run or not items:
            if not job.quiet:
                print("".join(f"{key}\n" for key, *_ in items), end="")
                print(f"mmcli: {len(items)} images to caption", file=sys.stderr)
            return 0
        clashes = {
            t.name: sidecar_clashes(everything, job.sidecar_ext(t))
            for t in job.tasks
            if job.sidecar_ext(t)
        }
        if job.ray is None:  # work to do here: the checkpoint's pages read while torch loads
            read_ahead(job.config.model)
        return _run(job, items, out, clashes, progress)
    finally:
        if out is not None:
            out.close()


def _load(job: CaptionJob, progress):
    """The Labeler of a local run, its load shown with the kernels it chose."""
    from mmcli.api.labeler import Labeler

    with progress.loading(load_description(job.run)) as loaded:
        labeler = Labeler.from_run(job.run)
        loaded["kernels"] = labeler.kernels
    progress.note(labeler.compile_cache_report())
    if labeler.run is not job.run:  # the model was fetched just now: its files read once
        job.settle(labeler.run)
    return labeler


def _run(
    job: CaptionJob,
    items: list[Item],
    out: JsonlOutput | None,
    clashes: dict[str, dict[str, str]],
    progress,
) -> int:
    labeler = None
    progress.total = sum(len(names) for *_, names in items)
    if job.ray is None:
        labeler = _load(job, progress)
    else:
        progress.start()
    paths = {key: path for key, path, _ in items}
    tasks = {t.name: t for t in job.tasks}

    def write(record: dict) -> None:
        ext = job.sidecar_ext(tasks[record["task"]])
        if ext and record["status"] == "ok":
            record["sidecar"] = str(
                write_sidecar(paths[record["key"]], ext, record["text"]).absolute()
            )
        if out is not None:
            out.append(record)
        else:
            append_record(sys.stdout, record)
        progress.update(record)

    # SIGTERM ends the run like Ctrl-C: what finished is already on disk
    def on_term(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, on_term)
    try:
        items = _refuse_clashes(job, items, clashes, write)
        if job.ray is not None:
            from mmcli.jobs.distributed import caption_on_ray

            caption_on_ray(
                items, job.config, job.tasks, job.resume_keys, write, job.ray, job.logprobs
            )
        else:
            _label_here(labeler, job, items, write, progress)
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
        if labeler is not None:  # the int8 file written while it labeled: whole before the end
            labeler.prepared_weights_report()


def _refuse_clashes(
    job: CaptionJob,
    items: list[Item],
    clashes: dict[str, dict[str, str]],
    write: Callable[[dict], None],
) -> list[Item]:
    """An error record for each task whose sidecar another image already takes; the items without
    those tasks."""
    tasks = {t.name: t for t in job.tasks}
    left = []
    for key, path, names in items:
        for name in [n for n in names if key in clashes.get(n, {})]:
            target = sidecar_path(path, job.sidecar_ext(tasks[name]))
            error = ConfigError(
                f"{path}: its sidecar {target} is also the sidecar of {clashes[name][key]}; "
                "rename one of the two"
            )
            write(
                error_record(key, path, tasks[name], job.config, job.resume_key(name, path), error)
            )
        names = [n for n in names if key not in clashes.get(n, {})]
        if names:
            left.append((key, path, names))
    return left


def _label_here(
    labeler, job: CaptionJob, items: list[Item], write: Callable[[dict], None], progress
) -> None:
    tasks = {t.name: t for t in job.tasks}
    try:
        for record in label_records(labeler, items, tasks, job.resume_keys, job.logprobs):
            write(record)
    finally:
        progress.note(labeler.compile_use_report())
