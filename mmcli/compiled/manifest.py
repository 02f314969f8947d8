"""The compile cache's manifest: cache_dir/manifest.json, one entry per compiled bucket with the
key it was compiled under, its compile time and its artifacts; rewritten atomically, concurrent
writers take turns."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

from mmcli.errors import ConfigError


def open_cache_dir(path: str | Path) -> Path:
    """cache_dir, created readable by the user alone (compiled code is loaded from it and run)."""
    cache = Path(path).expanduser()
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    if cache.stat().st_uid != os.getuid():
        raise ConfigError(
            f"config compile.cache_dir {cache}: owned by another user; compiled code is not "
            "loaded from it"
        )
    return cache


class Manifest:
    """cache_dir/manifest.json: {entry id: {key, seconds, artifacts, created_at}}, rewritten
    atomically under a lock."""

    def __init__(self, cache_dir: Path):
        self.dir = cache_dir
        self.path = cache_dir / "manifest.json"

    def entries(self) -> dict[str, dict]:
        try:
            return json.loads(self.path.read_text()).get("entries", {})
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, AttributeError):
            return {}  # unreadable: everything is rebuilt, nothing loaded blindly

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        with open(self.dir / "manifest.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # concurrent `mmcli compile` runs take turns
            yield

    def put(self, entry_id: str, entry: dict) -> None:
        entries = self.entries()
        entries[entry_id] = entry
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"schema": 1, "entries": entries}, indent=1, sort_keys=True))
        os.replace(tmp, self.path)

    def artifacts_present(self, entry: dict) -> bool:
        return bool(entry.get("artifacts")) and all(
            (self.dir / a).exists() for a in entry["artifacts"]
        )

    def remove_artifacts(self, entry: dict, keep: set[str]) -> None:
        for rel in entry.get("artifacts", []):
            path = self.dir / rel
            if rel not in keep:
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)


def stale_fields(old: dict, new: dict) -> list[str]:
    return sorted(k for k in new if old.get(k) != new[k])
