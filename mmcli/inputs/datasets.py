"""Datasets that are not folders of files: WebDataset tar shards and Parquet files, listed into
(key, source) items without reading their media (tar headers, Parquet key columns only).

Shards are read with the standard library's `tarfile` (headers only; the data is skipped by
seeking), which is all webdataset's layout needs: a sample is the members that share a key (the
member's name up to the first dot of its base name), as webdataset groups them. Brace ranges
(`data/{00000..00099}.tar`) are expanded with braceexpand, the expansion webdataset itself uses.
"""

from __future__ import annotations

import glob
import os
import tarfile
from pathlib import Path

from mmcli.errors import ConfigError
from mmcli.inputs.sources import Broken, ParquetCell, TarMember


def is_pattern(text: str) -> bool:
    return any(c in text for c in "*?[{")


def expand(pattern: str) -> list[Path]:
    """Brace ranges and globs, in order; a pattern that matches nothing is refused."""
    from braceexpand import braceexpand

    found = []
    for part in braceexpand(pattern):
        matches = sorted(glob.glob(part)) if any(c in part for c in "*?[") else [part]
        found += [Path(m) for m in matches if Path(m).exists()]
    if not found:
        raise ConfigError(f"{pattern}: matches no file")
    return found


def is_dataset_file(path: Path) -> bool:
    return path.suffix.lower() in (".tar", ".parquet")


def dataset_items(
    path: Path, media: tuple[str, ...], columns: tuple[str | None, str | None]
) -> list[tuple[str, object]]:
    """(key, source) per sample of a shard or row of a Parquet file."""
    if path.suffix.lower() == ".tar":
        return shard_items(path, media)
    return parquet_items(path, *columns)


def shard_items(shard: Path, media: tuple[str, ...]) -> list[tuple[str, object]]:
    """`SHARD/SAMPLEKEY` and its media member per sample, in the shard's order; a sample without
    media, or the rest of a damaged shard, is one Broken item naming what is wrong."""
    samples: dict[str, dict[str, tarfile.TarInfo]] = {}
    damage = None
    size = shard.stat().st_size
    try:
        with tarfile.open(shard, "r:") as tar:
            for info in tar:
                if not info.isfile():
                    continue
                if info.offset_data + info.size > size:
                    damage = info.offset
                    break
                folder, _, base = info.name.rpartition("/")
                key, _, ext = base.partition(".")
                sample = f"{folder}/{key}" if folder else key
                samples.setdefault(sample, {})["." + ext.lower()] = info
            damage = damage if damage is not None else _trailing_damage(shard, tar.offset, size)
    except tarfile.ReadError as e:
        damage = f"{getattr(e, 'args', [''])[0]}"
    except OSError as e:
        return [(f"{shard.stem}/#unreadable", Broken(shard, f"cannot read ({e.strerror or e})"))]
    items = [
        (f"{shard.stem}/{key}", _sample(shard, key, members, media))
        for key, members in samples.items()
    ]
    if damage is not None:
        at = f" at byte {damage}" if isinstance(damage, int) else f" ({damage})"
        items.append(
            (
                f"{shard.stem}/#damaged",
                Broken(shard, f"damaged tar{at}; the samples after it cannot be read"),
            )
        )
    return items


def _sample(shard: Path, key: str, members: dict, media: tuple[str, ...]):
    found = [ext for ext in members if ext in media]
    if not found:
        kinds = ", ".join(sorted(members)) or "none"
        return Broken(shard, f"sample {key} has no image or video member (members: {kinds})")
    info, text = members[found[0]], members.get(".txt")
    return TarMember(
        shard,
        info.name,
        info.offset_data,
        info.size,
        (text.offset_data, text.size) if text is not None else None,
    )


def _trailing_damage(shard: Path, end: int, size: int) -> int | None:
    """Where non-zero bytes follow the last header tarfile could read (a damaged header ends its
    listing without an error), else None."""
    with open(shard, "rb") as f:
        f.seek(end)
        position = end
        while chunk := f.read(1 << 20):
            if chunk.strip(b"\0"):
                return position + len(chunk) - len(chunk.lstrip(b"\0"))
            position += len(chunk)
    return None


def parquet_items(
    file: Path, image_column: str | None, key_column: str | None
) -> list[tuple[str, object]]:
    """(key, cell) per row: the key column's value (default `key` when there is one, else
    `FILE/ROW`); the image column (default: the first of bytes, or of {bytes, path} structs)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ConfigError(
            f"{file}: Parquet inputs need pyarrow: pip install 'mmcli[parquet]'"
        ) from None
    try:
        parquet = pq.ParquetFile(file)
    except (OSError, ValueError) as e:
        return [(f"{file.stem}/#unreadable", Broken(file, f"not a readable Parquet file ({e})"))]
    schema = parquet.schema_arrow
    image = image_column or next((f.name for f in schema if _holds_images(f.type, pa)), None)
    known = ", ".join(schema.names)
    if image is None or image not in schema.names:
        what = f"no column {image!r}" if image else "no column of image bytes"
        raise ConfigError(f"{file}: {what} (columns: {known}); name it with --image-column")
    key = key_column or ("key" if "key" in schema.names else None)
    if key is not None and key not in schema.names:
        raise ConfigError(f"{file}: no column {key!r} (columns: {known})")
    items, row_number = [], 0
    for group in range(parquet.num_row_groups):
        keys = parquet.read_row_group(group, columns=[key]).column(0).to_pylist() if key else None
        names = _image_names(parquet, group, image, schema, pa)
        for row in range(parquet.metadata.row_group(group).num_rows):
            label = str(keys[row]) if keys else str(row_number)
            items.append((f"{file.stem}/{label}", ParquetCell(file, group, row, image, names[row])))
            row_number += 1
    return items


def _holds_images(kind, pa) -> bool:
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return True
    return pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0


def _image_names(parquet, group: int, column: str, schema, pa) -> list[str]:
    """The image struct's `path` per row (its file name, for {filename}), else empty names."""
    kind = schema.field(column).type
    rows = parquet.metadata.row_group(group).num_rows
    if not (pa.types.is_struct(kind) and kind.get_field_index("path") >= 0):
        return [""] * rows
    # the struct's path leaf alone: the image bytes are not read here
    values = parquet.read_row_group(group, columns=[f"{column}.path"]).column(0).to_pylist()
    return [os.path.basename((v or {}).get("path") or "") for v in values]
