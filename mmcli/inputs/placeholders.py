"""A task's prompt filled for one input: {filename}, {stem}, {folder} and {sidecar}."""

from __future__ import annotations

import re
from pathlib import Path

from mmcli.config import PLACEHOLDER
from mmcli.errors import ItemError
from mmcli.inputs.sources import Source, describe, names, sidecar_bytes
from mmcli.tasks import Task


def render_prompt(task: Task, source: Source | str | None) -> str:
    """The task's prompt with this input's placeholders filled; `{{filename}}` is the literal text
    `{filename}`, every other character is sent as written. Raises ItemError naming the sidecar
    when {sidecar} cannot be read."""
    if "{" not in task.prompt:
        return task.prompt
    source = Path(source) if isinstance(source, str) else source

    def fill(match: re.Match) -> str:
        if match.group(1):
            return "{" + match.group(1) + "}"
        return _placeholder(match.group(2), source, task.sidecar or ".txt")

    return PLACEHOLDER.sub(fill, task.prompt)


def _placeholder(name: str, source: Source | None, sidecar_ext: str) -> str:
    if source is None:
        return ""
    if name != "sidecar":
        return names(source)[name]
    if not isinstance(source, Path):  # a shard sample's .txt member
        data = sidecar_bytes(source, sidecar_ext)
        return _utf8(data, describe(source) + " (its .txt member)") if data is not None else ""
    return _sidecar_text(source.with_suffix(sidecar_ext))


def _utf8(data: bytes, where: str) -> str:
    try:
        return data.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise ItemError(f"{where}: the sidecar is not UTF-8 text") from None


def _sidecar_text(sidecar: Path) -> str:
    """The text of an existing sidecar (none yet: empty)."""
    if not sidecar.exists():
        return ""
    try:
        return _utf8(sidecar.read_bytes(), str(sidecar))
    except OSError as e:
        raise ItemError(f"{sidecar}: cannot read the sidecar ({e.strerror or e})") from None
