"""Folders, files, WebDataset shards and Parquet files -> sorted (key, source) items: extensions,
include/exclude globs, hidden files, symlink loops, shards of the work."""

from __future__ import annotations

import fnmatch
import hashlib
import os
from pathlib import Path

from mmcli.config import ScanConfig
from mmcli.errors import ConfigError
from mmcli.inputs.datasets import dataset_items, expand, is_dataset_file, is_pattern
from mmcli.inputs.sources import Source

IMAGE_EXTENSIONS = ScanConfig().extensions


def _wanted(key: str, extensions: tuple[str, ...], include: list[str], exclude: list[str]) -> bool:
    if extensions and not key.lower().endswith(extensions):
        return False
    if include and not any(fnmatch.fnmatch(key, g) for g in include):
        return False
    return not any(fnmatch.fnmatch(key, g) for g in exclude)


def scan(
    roots: list[Path],
    extensions: tuple[str, ...] = IMAGE_EXTENSIONS,
    recursive: bool = True,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    columns: tuple[str | None, str | None] = (None, None),
) -> list[tuple[str, Source]]:
    """Image files under `roots`, keyed by their path relative to their root (a file given
    directly is keyed by its name); with several roots, each folder's keys start with the
    folder's name (`a/img.jpg`, `b/img.jpg`), and two roots that would give one key are refused,
    naming both. Hidden files and folders are skipped; a folder reached twice through symlinks is
    walked once. Tar shards and Parquet files (or folders of Parquet files; globs and brace ranges
    of either) give one item per sample or row, keyed `SHARD/SAMPLEKEY` or `FILE/KEY`;
    `columns` names the Parquet image and key columns (None: found)."""
    include, exclude = include or [], exclude or []
    extensions = tuple(e.lower() for e in extensions)
    items: dict[str, Source] = {}

    def add(key: str, path: Source) -> None:
        if key in items and items[key] != path:
            raise ConfigError(
                f"{items[key]} and {path} both give the key {key!r}; caption them in separate "
                "runs (or give their folders other names)"
            )
        items[key] = path

    for root in _expanded(roots):
        prefix = f"{root.resolve().name}/" if len(roots) > 1 else ""
        datasets = _dataset_files(root)
        if datasets:
            for key, source in (i for f in datasets for i in dataset_items(f, extensions, columns)):
                if _wanted(key, (), include, exclude):
                    add(key, source)
            continue
        if root.is_file() or (root.is_symlink() and not root.exists()):
            if _wanted(root.name, extensions, include, exclude):
                add(root.name, root)
            continue
        if not root.is_dir():
            raise ConfigError(f"{root}: no such file or folder")
        seen: set[str] = set()
        for folder, dirs, files in os.walk(root, followlinks=True):
            real = os.path.realpath(folder)
            if real in seen:  # a symlink loop or a second link to the same folder
                dirs[:] = []
                continue
            seen.add(real)
            dirs[:] = sorted(d for d in dirs if not d.startswith(".")) if recursive else []
            for name in files:
                if name.startswith("."):
                    continue
                path = Path(folder) / name
                key = prefix + path.relative_to(root).as_posix()
                if _wanted(key, extensions, include, exclude):
                    add(key, path)
    return sorted(items.items())


def _expanded(roots: list[Path]) -> list[Path]:
    """Globs and brace ranges replaced by the files they match."""
    return [p for root in roots for p in (expand(str(root)) if is_pattern(str(root)) else [root])]


def _dataset_files(root: Path) -> list[Path]:
    """A shard or Parquet file, or a folder holding only Parquet files: the files to list."""
    if root.is_file():
        return [root] if is_dataset_file(root) else []
    if not root.is_dir():
        return []
    files = sorted(p for p in root.iterdir() if p.is_file() and not p.name.startswith("."))
    parquet = [p for p in files if p.suffix.lower() == ".parquet"]
    return parquet if parquet and len(parquet) == len(files) else []


def shard_of(key: str, num_shards: int) -> int:
    """Stable shard of a key (same on every machine and Python run)."""
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") % num_shards


def parse_shard(text: str) -> tuple[int, int]:
    try:
        index, count = (int(x) for x in text.split("/"))
    except ValueError:
        raise ConfigError(f"--shard {text!r}: expected I/N, e.g. 0/4") from None
    if not 0 <= index < count:
        raise ConfigError(f"--shard {text!r}: I must be in 0..N-1")
    return index, count
