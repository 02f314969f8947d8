"""Prepared weights, made once: the int8 values a `quantize: int8` run computes (norms folded,
a scale per output channel) are written to the cache by the first run and read back by later
ones instead of computed again.

A file per checkpoint and recipe (its name: a digest of the checkpoint's identity, each weight
file's name, size and modification time and config.json's bytes, and the recipe). Inside, the
full key (adding mmcli's quantization code and torch's version) and a CRC-32 of the values: a
file that cannot be read, whose values do not match their CRC, whose tensors are not the model's
or whose key differs is ignored with one line saying so and written again. Written to a file of
its own beside it and renamed, so a reader sees a whole file or none, and two runs at once
each write theirs; written by a thread of its own while the run goes on (the write is bound by
the disk, the run by the CPU), which the interpreter waits for before it exits."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import sys
import threading
import zlib
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from mmcli.weights.int8 import int8_layout, int8_linears, quantize_model

RECIPE = (
    "int8: symmetric per output channel, norms folded into the linears that read them; "
    "int8_linear.c's layout"
)
# the code whose output the file holds, from the package's root
CODE = (
    "weights/int8.py",
    "weights/prepared.py",
    "models/layers/quantized.py",
    "kernels/csrc/int8_weights.c",
)


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


def code_digest() -> str:
    digest = hashlib.sha256()
    for name in CODE:
        digest.update((Path(__file__).parent.parent / name).read_bytes())
    return digest.hexdigest()[:16]


_KEYS = {"recipe": "recipe", "code": "mmcli quantization code", "torch": "torch version"}


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    crc = 0
    for name in sorted(tensors):
        crc = zlib.crc32(memoryview(tensors[name].contiguous().view(torch.uint8).numpy()), crc)
    return f"{crc:08x}"


class PreparedWeights:
    """The cache file of one checkpoint's int8 weights under `directory`."""

    def __init__(self, directory: Path, checkpoint: Path, config_bytes: bytes | None = None):
        identity = checkpoint_identity(checkpoint, config_bytes)
        name = hashlib.sha256(json.dumps([identity, RECIPE]).encode()).hexdigest()[:24]
        self.file = Path(directory).expanduser() / "weights" / f"{name}.safetensors"
        self.key = {"recipe": RECIPE, "code": code_digest(), "torch": torch.__version__}
        self._writer: threading.Thread | None = None
        self._outcome = "prepared weights not written: none were prepared"
        self.status = "prepared weights not used"  # what the load did, for its line

    def quantize(self, model: torch.nn.Module) -> None:
        """int8 for `model` (int8.quantize_model), from the file when it holds this key, else
        computed and written (by a thread: `written` waits for it); `status` says which."""
        prepared, problem = self._read(model)
        if prepared is not None:
            quantize_model(model, prepared)
            self._outcome = self.status = f"prepared weights read from {self.file}"
            return
        if problem is not None:
            print(
                f"mmcli: prepared weights {self.file}: {problem}; preparing again", file=sys.stderr
            )
        names = list(int8_linears(model))
        quantize_model(model)
        tensors = {
            f"{name}.{part}": value.contiguous()
            for name in names
            for part, value in model.get_submodule(name).weight.tensors().items()
        }
        # not a daemon: the interpreter waits for the file before it exits
        self._writer = threading.Thread(target=self._write, args=(tensors,), name="mmcli-prepared")
        self._writer.start()
        self.status = f"prepared weights being written to {self.file}"

    def written(self) -> str:
        """Where the prepared weights are, once the file being written (if one is) is whole or
        has failed: "prepared weights written to ...", "... read from ..." or "... not written
        (why)"."""
        if self._writer is not None:
            self._writer.join()
        return self._outcome

    def _read(self, model) -> tuple[dict | None, str | None]:
        if not self.file.is_file():
            return None, None
        try:
            with safe_open(str(self.file), framework="pt") as f:
                meta = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except (OSError, ValueError, RuntimeError, SafetensorError) as e:
            return None, f"unreadable ({str(e)[:120]})"
        key = json.loads(meta.get("key", "{}"))
        if key != self.key:
            changed = [_KEYS[k] for k in self.key if key.get(k) != self.key[k]]
            return None, f"written under another {' and '.join(changed)}"
        if meta.get("crc32") != _checksum(tensors):
            return None, "damaged (its values do not match their CRC-32)"
        prepared: dict[str, dict] = {}
        for name, tensor in tensors.items():
            module, part = name.rsplit(".", 1)
            prepared.setdefault(module, {})[part] = tensor
        linears = int8_linears(model)
        shapes_match = set(prepared) == set(linears) and all(
            {part: (tuple(t.shape), t.dtype) for part, t in prepared[n].items()} == int8_layout(m)
            for n, m in linears.items()
        )
        return (prepared, None) if shapes_match else (None, "not this model's linears")

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
