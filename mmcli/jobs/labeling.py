"""The labeling loop shared by local and Ray runs: items through a Labeler, out as records."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from mmcli.api.result import Result
from mmcli.config import Config
from mmcli.errors import MmcliError
from mmcli.jobs.records import labeled_record, make_record
from mmcli.tasks import Task

Item = tuple[str, Path, list[str]]  # key, input file, the names of the tasks still to run


def kind_of(config: Config, path: str | Path) -> str:
    """ "video" or "image": which resume key a record of this file takes."""
    return "video" if config.scan.is_video(path) else "image"


def label_records(
    labeler,
    items: list[Item],
    tasks: dict[str, Task],
    keys: dict[str, dict[str, str]],
    logprobs: bool,
) -> Iterator[dict]:
    """One record per item and task, as each finishes (errors included), each under its task's
    resume key for its kind of file (`keys`: jobs.resume.resume_keys per task)."""
    paths = {key: path for key, path, _ in items}
    for result in labeler.label(items, tasks=list(tasks.values())):
        task = tasks[result.task]
        path = paths[result.key]
        yield labeled_record(
            labeler,
            result,
            key=result.key,
            task=task.name,
            prompt=result.prompt,
            sampling=task.sampling.as_dict(),
            path=path,
            logprobs=logprobs,
            extra={"settings": keys[task.name][kind_of(labeler.config, path)]},
        )


def error_record(
    key: str, path: Path, task: Task, config: Config, settings: str, error: MmcliError
) -> dict:
    """The record of an item's task refused before it ran."""
    result = Result.failed(key, error)
    return make_record(
        key=key,
        task=task.name,
        prompt=task.prompt,
        result=result,
        model=config.model,
        model_revision=None,
        sampling=task.sampling.as_dict(),
        path=path,
        extra={"settings": settings},
    )
