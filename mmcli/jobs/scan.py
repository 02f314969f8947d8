"""Folders -> sorted (key, path) items: extensions, include/exclude globs, hidden files, symlink
loops, shards."""

from __future__ import annotations

import fnmatch
import hashlib
import os
from pathlib import Path

from mmcli.config import ScanConfig
from mmcli.errors import ConfigError

IMAGE_EXTENSIONS = ScanConfig().extensions


def _wanted(key: str, extensions: tuple[str, ...], include: list[str], exclude: list[str]) -> bool:
    if not key.lower().endswith(extensions):
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
) -> list[tuple[str, Path]]:
    """Image files under `roots`, keyed by their path relative to their root (a file given
    directly is keyed by its name); with several roots, each folder's keys start with the
    folder's name (`a/img.jpg`, `b/img.jpg`), and two roots that would give one key are refused,
    naming both. Hidden files and folders are skipped; a folder reached twice through symlinks is
    walked once."""
    include, exclude = include or [], exclude or []
    extensions = tuple(e.lower() for e in extensions)
    items: dict[str, Path] = {}

    def add(key: str, path: Path) -> None:
        if key in items and items[key] != path:
            raise ConfigError(
                f"{items[key]} and {path} both give the key {key!r}; caption them in separate "
                "runs (or give their folders other names)"
            )
        items[key] = path

    for root in roots:
        prefix = f"{root.resolve().name}/" if len(roots) > 1 else ""
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
