"""Prepared weights, made once: the int8 values a `quantize: int8` run computes (norms folded,
a scale per output channel) and the 4-bit weights a `quantize: int4` run quantizes as it reads
(torch's int4 CPU layout) are written to the cache by the first run and read back by later ones
instead of computed again (a 30B MoE's int4 load reads its 4-bit weights instead of quantizing
30B parameters: the checkpoint's int4 matrices are then not read at all).

A file per checkpoint and recipe (its name: a digest of the checkpoint's identity, each weight
file's name, size and modification time and config.json's bytes, and the recipe). Inside, the
full key (adding mmcli's quantization code and torch's version) and a CRC-32 of the values: a
file that cannot be read, whose values do not match their CRC, whose tensors are not the model's
or whose key differs is ignored with one line saying so and written again. Written to a file of
its own beside it and renamed, so a reader sees a whole file or none, and two runs at once
each write theirs; written by a thread of its own while the run goes on (the write is bound by
the disk, the run by the CPU), which the interpreter waits for before it exits. A partial file
left by a run that was killed is removed by the next writer once it has not grown for
STALE_SECONDS. The file read back is mapped, not copied: its tensors are its pages."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mmcli.kernels.weight_forms import int4_block
from mmcli.weights import int4
from mmcli.weights.int4 import GROUP
from mmcli.weights.int8 import int8_layout, int8_linears, quantize_model


@dataclass(frozen=True)
class Recipe:
    """What a prepared file holds, in words (part of its name and key), and the code whose
    output it is (from the package's root)."""

    form: str
    words: str
    code: tuple[str, ...]


INT8 = Recipe(
    "int8",
    "int8: symmetric per output channel, norms folded into the linears that read them; "
    "int8_linear.c's layout",
    (
        "weights/int8.py",
        "weights/prepared.py",
        "models/layers/quantized.py",
        "kernels/csrc/int8_weights.c",
    ),
)
INT4_INT8 = Recipe(
    "int4_int8",
    "int8 for an int4 run's vision tower and tied lm_head: " + INT8.words.removeprefix("int8: "),
    INT8.code,
)
INT4 = Recipe(
    "int4",
    f"int4: asymmetric per group of {GROUP} inputs (scale and zero in bfloat16); torch's int4 "
    "CPU layout",
    ("weights/int4.py", "weights/prepared.py", "kernels/weight_forms.py"),
)
RECIPES = {recipe.form: recipe for recipe in (INT8, INT4)}
STALE_SECONDS = 600  # a partial file not written to for this long belongs to a run that died


def checkpoint_identity(path: Path, config_bytes: bytes | None = None) -> dict:
    """The checkpoint's config.json (its bytes as the run read them, where given) and weight
    files."""
    files = sorted(path.glob("*.safetensors"))
    if config_bytes is None:
        config_bytes = (path / "config.json").read_bytes()
    return {
        "config": hashlib.sha256(config_bytes).hexdigest(),
        "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files],
    }


def code_digest(recipe: Recipe = INT8) -> str:
    digest = hashlib.sha256()
    for name in recipe.code:
        digest.update((Path(__file__).parent.parent / name).read_bytes())
    return digest.hexdigest()[:16]


_KEYS = {
    "recipe": "recipe",
    "code": "mmcli quantization code",
    "torch": "torch version",
    "layout": "int4 layout (torch packs for the kernel it dispatches to)",
}


CHECKSUM_PIECE = 64 << 20  # bytes a CRC-32 covers: a file's pieces spread over threads


def _checksum(tensors: dict[str, torch.Tensor], threads: int = 1) -> str:
    """The CRC-32 of every CHECKSUM_PIECE bytes of the tensors (in name order), hashed together,
    the pieces on `threads` threads: zlib releases the GIL, so a read checks a 2 GB file in half
    the time on two cores (mapped pages faulted in on the way)."""
    pieces = []
    for name in sorted(tensors):
        data = memoryview(tensors[name].contiguous().view(torch.uint8).reshape(-1).numpy())
        pieces += [data[i : i + CHECKSUM_PIECE] for i in range(0, len(data) or 1, CHECKSUM_PIECE)]
    with ThreadPoolExecutor(threads) as pool:
        crcs = list(pool.map(zlib.crc32, pieces))
    return hashlib.sha256(b"".join(crc.to_bytes(4, "little") for crc in crcs)).hexdigest()[:16]


class PreparedWeights:
    """The cache file of one checkpoint's weights in one recipe's form under `directory`."""

    def __init__(
        self,
        directory: Path,
        checkpoint: Path,
        config_bytes: bytes | None = None,
        recipe: Recipe = INT8,
    ):
        identity = checkpoint_identity(checkpoint, config_bytes)
        name = hashlib.sha256(json.dumps([identity, recipe.words]).encode()).hexdigest()[:24]
        self.file = Path(directory).expanduser() / "weights" / f"{name}.safetensors"
        self.key = {"recipe": recipe.words, "code": code_digest(recipe), "torch": torch.__version__}
        if recipe is INT4:  # read by torch's int4 kernel, which reads its own layout
            self.key["layout"] = f"blocks of {int4_block()}"
        self._writer: threading.Thread | None = None
        self._outcome = "prepared weights not written: none were prepared"
        self.status = "prepared weights not used"  # what the load did, for its line
        self.used = False  # read from or written to by this run
        # an int4 run's int8 layers' file (loader.int4_int8_scopes: its tower, a tied head)
        self.int8: PreparedWeights | None = None

    def quantize(self, model: torch.nn.Module, within: torch.nn.Module | None = None) -> None:
        """int8 for `model` (int8.quantize_model; `within` that module only), from the file when
        it holds this key, else computed and written (by a thread: `written` waits for it);
        `status` says which."""
        prepared = self._grouped(self._read())
        if prepared is not None and not _int8_fits(prepared, model, within):
            prepared = self._ignored("not this model's linears")
        if prepared is not None:
            quantize_model(model, prepared, within)
            self._read_from()
            return
        names = list(int8_linears(model, within))
        quantize_model(model, within=within)
        tensors = {
            f"{name}.{part}": value.contiguous()
            for name in names
            for part, value in model.get_submodule(name).weight.tensors().items()
        }
        self._write_aside(tensors)

    def read_int4(self, shapes: int4.Int4Shapes) -> tuple[dict, dict] | None:
        """The 4-bit weights of `shapes` (matrices by name, experts by prefix) from the file when
        it holds this key and exactly those weights, else None (the load quantizes as it reads,
        then `write_int4`)."""
        tensors = self._read()
        held = int4.from_tensors(tensors, shapes) if tensors is not None else None
        if tensors is not None and held is None:
            self._ignored("not this model's int4 weights")
        if held is not None:
            self._read_from()
        return held

    def write_int4(self, matrices: dict, experts: dict) -> None:
        """The 4-bit weights a load quantized, written aside (by a thread: `written` waits)."""
        self._write_aside(int4.as_tensors(matrices, experts))

    def written(self) -> str:
        """Where the prepared weights are, once the file being written (if one is) is whole or
        has failed: "prepared weights written to ...", "... read from ..." or "... not written
        (why)"."""
        if self._writer is not None:
            self._writer.join()
        if self.int8 is not None and self.int8.used:
            return f"{self._outcome}; its int8 layers' {self.int8.written()}"
        return self._outcome

    def described(self) -> str:
        """What the load did with the prepared weights, for its line."""
        if self.int8 is not None and self.int8.used:
            return f"{self.status}; its int8 layers' {self.int8.status}"
        return self.status

    def _read(self) -> dict | None:
        """The file's tensors (mapped) when it is whole and holds this key, else None (with one
        line saying why, where there is a file)."""
        if not self.file.is_file():
            return None
        try:
            with safe_open(str(self.file), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (OSError, ValueError, RuntimeError, SafetensorError) as e:
            return self._ignored(f"unreadable ({str(e)[:120]})")
        key = json.loads(meta.get("key", "{}"))
        if key != self.key:
            changed = [_KEYS[k] for k in self.key if key.get(k) != self.key[k]]
            return self._ignored(f"written under another {' and '.join(changed)}")
        if meta.get("crc32") != _checksum(tensors, torch.get_num_threads()):
            return self._ignored("damaged (its values do not match their CRC-32)")
        return tensors

    def _ignored(self, problem: str) -> None:
        print(f"mmcli: prepared weights {self.file}: {problem}; preparing again", file=sys.stderr)

    def _read_from(self) -> None:
        self.used = True
        self._outcome = self.status = f"prepared weights read from {self.file}"

    @staticmethod
    def _grouped(tensors: dict | None) -> dict[str, dict] | None:
        """int8's tensors by module: {linear: {part: tensor}}."""
        if tensors is None:
            return None
        prepared: dict[str, dict] = {}
        for name, tensor in tensors.items():
            module, part = name.rsplit(".", 1)
            prepared.setdefault(module, {})[part] = tensor
        return prepared

    def _write_aside(self, tensors: dict[str, torch.Tensor]) -> None:
        # tensors of the writer's own over the same storages: the load may move the model's into
        # huge pages meanwhile (host_memory.hold_in_huge_pages), which frees the storages only
        # once this file is written
        tensors = {name: tensor.detach() for name, tensor in tensors.items()}
        # not a daemon: the interpreter waits for the file before it exits
        self._writer = threading.Thread(target=self._write, args=(tensors,), name="mmcli-prepared")
        self._writer.start()
        self.used = True
        self.status = f"prepared weights being written to {self.file}"

    def _write(self, tensors: dict[str, torch.Tensor]) -> None:
        """The file written aside and renamed into place; the outcome kept for `written`, and a
        failure said in one line (the run goes on without it)."""
        metadata = {"key": json.dumps(self.key), "crc32": _checksum(tensors)}
        # this process's own name: runs on two hosts sharing the cache may have equal pids
        partial = self.file.with_name(
            f"{self.file.name}.{os.getpid()}.{os.urandom(4).hex()}.partial"
        )
        try:
            self.file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            remove_stale(self.file)
            save_file(tensors, str(partial), metadata=metadata)
            with open(partial, "rb") as f:
                os.fsync(f.fileno())
            os.replace(partial, self.file)
        except (OSError, SafetensorError) as e:  # a full disk, a read-only cache
            with contextlib.suppress(OSError):
                partial.unlink(missing_ok=True)
            self._outcome = f"prepared weights not written ({getattr(e, 'strerror', None) or e})"
            print(
                f"mmcli: {self.file}: {self._outcome}; the next run prepares them again",
                file=sys.stderr,
            )
            return
        self._outcome = f"prepared weights written to {self.file}"


def _int8_fits(prepared: dict[str, dict], model, within=None) -> bool:
    linears = int8_linears(model, within)
    return set(prepared) == set(linears) and all(
        {part: (tuple(t.shape), t.dtype) for part, t in prepared[n].items()} == int8_layout(m)
        for n, m in linears.items()
    )


def remove_stale(file: Path, now: float | None = None) -> list[Path]:
    """The partial files of `file` that no run has written to for STALE_SECONDS (their writer
    was killed: a full int4 file is tens of GB), removed; returns them."""
    now = time.time() if now is None else now
    removed = []
    for partial in file.parent.glob(f"{file.name}.*.partial"):
        with contextlib.suppress(OSError):
            if now - partial.stat().st_mtime > STALE_SECONDS:
                partial.unlink()
                removed.append(partial)
    return removed
