"""Where an input's bytes are: a file, a member of a WebDataset tar shard, or a cell of a Parquet
file. Shards and Parquet files are listed once (headers and key columns only) and each input is
read when its turn comes, so no shard is ever held whole in memory or unpacked on disk."""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import threading
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import BinaryIO

from mmcli.errors import ImageError


@dataclass(frozen=True)
class TarMember:
    """A sample's media member in a tar shard, and its `.txt` member (what {sidecar} reads)."""

    shard: Path
    name: str
    offset: int  # of the member's data in the shard
    size: int
    text: tuple[int, int] | None = None  # (offset, size) of the sample's .txt member

    def read(self, span: tuple[int, int] | None = None) -> bytes:
        offset, size = span or (self.offset, self.size)
        try:
            with open(self.shard, "rb") as f:
                f.seek(offset)
                data = f.read(size)
        except OSError as e:
            raise ImageError(f"cannot read the shard ({e.strerror or e})") from None
        if len(data) != size:
            raise ImageError(f"the shard ends inside this member (byte {offset + len(data)})")
        return data


@dataclass(frozen=True)
class ParquetCell:
    """An image held in one row of a Parquet file (bytes, or Hugging Face's {bytes, path})."""

    file: Path
    row_group: int
    row: int
    column: str
    name: str = ""  # the image's own file name, when the struct records one

    def read(self) -> bytes:
        value = _row_group(self.file, self.row_group, self.column)[self.row]
        if isinstance(value, dict):
            value = value.get("bytes")
        if not value:
            raise ImageError(f"row {self.row} of row group {self.row_group} holds no image bytes")
        return value


@dataclass(frozen=True)
class Broken:
    """An input that cannot be read (a damaged shard, a sample without media, a Parquet file
    that does not open): preparing it raises, so its error record says why and the run goes on."""

    where: Path
    message: str
    name: str = ""

    def read(self) -> bytes:
        raise ImageError(self.message)


@dataclass(frozen=True)
class Received:
    """An input whose bytes came with a request (a server's data URL or fetched URL), and the
    name errors give it."""

    name: str
    data: bytes = field(repr=False)

    def read(self) -> bytes:
        return self.data


Source = Path | TarMember | ParquetCell | Broken | Received


def describe(source: Source) -> str:
    """How errors name an input: its file, `SHARD:MEMBER` or `FILE:ROW`."""
    if isinstance(source, TarMember):
        return f"{source.shard}:{source.name}"
    if isinstance(source, ParquetCell):
        return f"{source.file}:row group {source.row_group} row {source.row}"
    if isinstance(source, Broken):
        return str(source.where)
    if isinstance(source, Received):
        return source.name
    return str(source)


def suffix(source: Source) -> str:
    held = (TarMember, ParquetCell, Broken, Received)
    name = source.name if isinstance(source, held) else str(source)
    return Path(name).suffix.lower()


def container_file(source: Source) -> Path:
    """The file on disk an input's changes are checked on (its shard or Parquet file)."""
    if isinstance(source, TarMember):
        return source.shard
    if isinstance(source, ParquetCell):
        return source.file
    if isinstance(source, Broken):
        return source.where
    return Path(source)


def file_sha256(path: str | Path) -> str | None:
    h = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    except OSError:
        return None
    return h.hexdigest()


@functools.lru_cache(maxsize=64)
def _sha256_of(path: str, size: int, mtime_ns: int) -> str | None:
    return file_sha256(path)


def checked_sha256(path: str | Path) -> str | None:
    """The file's sha256, hashed once while its size and mtime stay (a shard's thousands of
    records share one hash)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _sha256_of(os.path.abspath(path), st.st_size, st.st_mtime_ns)


def file_facts(path: str | Path | None) -> dict:
    """sha256, size and mtime of the input's file (a shard or Parquet file for their samples):
    what resume checks to see whether an input changed."""
    try:
        st = os.stat(path) if path is not None else None
    except OSError:
        st = None
    return {
        "sha256": checked_sha256(path) if st else None,
        "file_size": st.st_size if st else None,
        "file_mtime_ns": st.st_mtime_ns if st else None,
    }


@dataclass
class Opened:
    """An input read once, on the worker that decodes it: what its decoder reads, and the facts
    of the file a record names (sha256, size, mtime), taken from that same read."""

    data: Path | BinaryIO
    facts: dict


def read_source(source: Source) -> Opened:
    """The input's bytes, read once, and their facts (a shard member's or a Parquet cell's are
    its file's, hashed once a file); raises ImageError naming what cannot be read."""
    if isinstance(source, Received):
        data = source.read()
        return Opened(io.BytesIO(data), {"sha256": hashlib.sha256(data).hexdigest()})
    if isinstance(source, (TarMember, ParquetCell, Broken)):
        return Opened(io.BytesIO(source.read()), file_facts(container_file(source)))
    path = Path(source)
    check_readable(path)
    try:
        with open(path, "rb") as f:
            stat = os.fstat(f.fileno())
            data = f.read()
    except OSError as e:
        raise ImageError(f"unreadable file ({e.strerror or e})") from None
    return Opened(io.BytesIO(data), _facts(hashlib.sha256(data).hexdigest(), stat))


def open_hashed(path: Path) -> tuple[BinaryIO, dict]:
    """A file opened once for a decoder that seeks (a video: too large to hold), and its facts,
    hashed through that open file before the decoder reads it from the start."""
    check_readable(path)
    f = open(path, "rb")  # noqa: SIM115 - the caller's decoder closes it
    digest = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        digest.update(chunk)
    f.seek(0)
    return f, _facts(digest.hexdigest(), os.fstat(f.fileno()))


def _facts(sha256: str, stat: os.stat_result) -> dict:
    return {"sha256": sha256, "file_size": stat.st_size, "file_mtime_ns": stat.st_mtime_ns}


def open_source(source: Source) -> Path | BinaryIO:
    """A readable file's path, or the input's bytes (read now, from its shard or Parquet file);
    raises ImageError naming what cannot be read."""
    if isinstance(source, (TarMember, ParquetCell, Broken, Received)):
        return io.BytesIO(source.read())
    check_readable(Path(source))
    return Path(source)


def check_readable(path: Path) -> None:
    """Raise ImageError when the file cannot be read or is empty (before any decoder sees it)."""
    if not os.access(path, os.R_OK):
        why = "permission denied" if path.exists() else "no such file or broken link"
        raise ImageError(f"unreadable file ({why})")
    if path.is_file() and path.stat().st_size == 0:
        raise ImageError("empty file (0 bytes)")


def names(source: Source) -> dict[str, str]:
    """The values of {filename}, {stem} and {folder}: a member's own name, and its shard."""
    if isinstance(source, TarMember):
        return {
            "filename": Path(source.name).name,
            "stem": Path(source.name).name.split(".")[0],
            "folder": source.shard.stem,
        }
    if isinstance(source, ParquetCell):
        name = Path(source.name or f"row{source.row}")
        return {"filename": name.name, "stem": name.stem, "folder": source.file.stem}
    if isinstance(source, Broken):
        return {"filename": "", "stem": "", "folder": source.where.stem}
    path = Path(source)
    return {"filename": path.name, "stem": path.stem, "folder": path.parent.name}


def sidecar_bytes(source: Source, ext: str) -> bytes | None:
    """The existing sidecar's bytes (a shard sample's `.txt` member), or None where there is none;
    a file's sidecar is read by the caller."""
    if isinstance(source, TarMember) and source.text is not None and ext == ".txt":
        return source.read(source.text)
    return None


def to_json(source: Source) -> str:
    """A source as text, to ship to a Ray replica (never the bytes)."""
    if isinstance(source, TarMember):
        return json.dumps({"tar": {**asdict(source), "shard": str(source.shard)}})
    if isinstance(source, ParquetCell):
        return json.dumps({"parquet": {**asdict(source), "file": str(source.file)}})
    if isinstance(source, Broken):
        return json.dumps({"broken": {**asdict(source), "where": str(source.where)}})
    return json.dumps({"file": str(source)})


def from_json(text: str) -> Source:
    data = json.loads(text)
    if "tar" in data:
        member = data["tar"]
        text_span = tuple(member.pop("text")) if member.get("text") else None
        return TarMember(**{**member, "shard": Path(member["shard"]), "text": text_span})
    if "parquet" in data:
        return ParquetCell(**{**data["parquet"], "file": Path(data["parquet"]["file"])})
    if "broken" in data:
        return Broken(**{**data["broken"], "where": Path(data["broken"]["where"])})
    return Path(data["file"])


_GROUPS: OrderedDict[tuple, list] = OrderedDict()
_GROUPS_LOCK = threading.Lock()


def _row_group(file: Path, index: int, column: str) -> list:
    """One column of one row group, kept while its rows are being read (two at most: memory
    stays bounded by a row group, whatever the file's size)."""
    key = (str(file), index, column)
    with _GROUPS_LOCK:
        if key in _GROUPS:
            _GROUPS.move_to_end(key)
            return _GROUPS[key]
    import pyarrow.parquet as pq

    try:
        values = pq.ParquetFile(file).read_row_group(index, columns=[column]).column(0).to_pylist()
    except (OSError, ValueError) as e:
        raise ImageError(f"cannot read the Parquet file ({str(e)[:160]})") from None
    with _GROUPS_LOCK:
        _GROUPS[key] = values
        while len(_GROUPS) > 2:
            _GROUPS.popitem(last=False)
    return values
