"""Compile-ahead: one fixed-shape graph per bucket, compiled by `mmcli compile --buckets` and
only loaded later.

Buckets: vision (num_blocks x block_size), prefill (padded prompt tokens, one prompt per call)
and decode (batch x context columns). The manifest in compile.cache_dir records, per bucket, the
key it was compiled under (model config, dtype, KV cache shape, backend and its version, a digest
of the compiled source), its compile time and its artifacts. A run uses only buckets whose key
matches and whose artifacts exist; any other shape runs eagerly and is reported, never compiled
mid-run.

Backends: inductor (torch.compile; its on-disk FX graph and AOTAutograd caches live in
cache_dir/inductor and survive a new process) and neuron (torch.compile(backend="neuron") from
the AWS Neuron SDK's TorchNeuron, its NEFF caches pointed into cache_dir/neuron). The neuron path
has not run here: no Trainium2 and no SDK."""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import hashlib
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from mmcli.compiled.backends import backend_version, require_neuron
from mmcli.compiled.buckets import Bucket, configured_buckets
from mmcli.compiled.manifest import Manifest, open_cache_dir, stale_fields
from mmcli.config import Config
from mmcli.models.config import ModelConfig

PACKAGE_ROOT = Path(__file__).parent.parent
# the bodies of the prefill and decode graphs; the vision graph is the model's forward_packed
GRAPH_ENTRY = "compiled/steps.py"


def compile_key(
    model_cfg: ModelConfig, dtype: torch.dtype, device: torch.device, cfg: Config
) -> dict:
    """What a compiled graph depends on besides its bucket shape, backend and source (see
    Manifest)."""
    model_json = json.dumps(dataclasses.asdict(model_cfg), sort_keys=True, default=str)
    return {
        "model_config": hashlib.sha256(model_json.encode()).hexdigest()[:16],
        "dtype": str(dtype).split(".")[-1],
        "device": device.type,
        "kv_cache": [cfg.engine.max_seqs + 1, cfg.engine.max_len],
    }


# every family's modules and every kernel can run inside a graph: the registry imports the families
# by name, and the kernel plan installs kernels the graph bodies do not import
GRAPH_PACKAGES = ("models", "kernels")


def compiled_sources(root: Path, entry: str = GRAPH_ENTRY) -> list[str]:
    """Every module of the package whose code can run inside a compiled graph: the graph bodies,
    every module of the families and the kernels and, transitively, every package module they
    import (read from the source, so a new module is covered without a list to keep). Paths are
    relative to the package root."""
    found: set[str] = set()
    todo = [entry]
    for package in GRAPH_PACKAGES:
        todo += [p.relative_to(root).as_posix() for p in sorted((root / package).rglob("*.py"))]
    while todo:
        rel = todo.pop()
        if rel in found or not (root / rel).is_file():
            continue
        found.add(rel)
        for node in ast.walk(ast.parse((root / rel).read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mmcli."):
                base = Path(*node.module.split(".")[1:])
                for target in [base] + [base / alias.name for alias in node.names]:
                    todo += [f"{target.as_posix()}.py", f"{target.as_posix()}/__init__.py"]
    return sorted(found)


def source_digest(root: Path | None = None) -> str:
    """A digest of the compiled sources (see compiled_sources): editing any of them makes every
    bucket stale."""
    root = root or PACKAGE_ROOT
    digest = hashlib.sha256()
    for name in compiled_sources(root):
        digest.update(name.encode() + b"\0" + (root / name).read_bytes())
    return digest.hexdigest()[:16]


class CompiledGraphs:
    """torch.compile'd step functions, one graph per bucket; `call` runs a bucket's graph once it
    is known to be compiled, and anything else eagerly (reported once), so a run never compiles."""

    def __init__(self, backend: str, cache_dir: str | Path, key: dict, buckets: list[Bucket]):
        if backend == "neuron":
            require_neuron()
        self.backend, self.base_key, self.buckets = backend, key, buckets
        self.cache_dir = open_cache_dir(cache_dir)
        self.manifest = Manifest(self.cache_dir)
        self.compiled: dict[str, Callable] = {}
        self.ready: set[Bucket] = set()  # compiled ahead under the current key, artifacts present
        self.loaded: set[Bucket] = set()  # traced in this process (inductor: loaded from its cache)
        # buckets a run needed but that were not compiled ahead
        self.missing_used: list[Bucket] = []
        self.compiled_at_run_time: list[Bucket] = []
        self.missing = self.attach()  # configured buckets not compiled ahead under the current key

    @classmethod
    def for_run(
        cls,
        backend: str,
        cfg: Config,
        model_cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
    ) -> CompiledGraphs:
        """The configured buckets of a run under its key."""
        buckets = configured_buckets(
            cfg.vision.num_blocks_buckets,
            cfg.vision.block_size,
            cfg.compile.prefill_buckets,
            cfg.compile.decode_batch_buckets,
            cfg.compile.decode_context_buckets,
        )
        return cls(
            backend, cfg.compile.cache_dir, compile_key(model_cfg, dtype, device, cfg), buckets
        )

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """While compiling or loading graphs: the backend's caches pointed into cache_dir
        (Inductor reads TORCHINDUCTOR_CACHE_DIR when it looks a graph up; TorchNeuron its
        variables at its first compilation), and Dynamo allowed one recompile per bucket (every
        bucket of a component re-traces the same code). Both are process-wide, so they are set
        only for the call and restored after."""
        if self.backend == "inductor":
            names = {"TORCHINDUCTOR_CACHE_DIR": self.cache_dir / "inductor"}
        else:
            names = {
                name: self.cache_dir / "neuron" / sub
                for name, sub in (
                    ("TORCH_NEURONX_NEFF_CACHE_DIR", "neff"),
                    ("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR", "neff_local"),
                    ("TORCH_NEURONX_HLO_CACHE_DIR", "hlo"),
                )
            }
        saved = {name: os.environ.get(name) for name in names}
        os.environ.update({name: str(path) for name, path in names.items()})
        limit = max(torch._dynamo.config.recompile_limit, len(self.buckets) + 1)
        try:
            with torch._dynamo.config.patch(recompile_limit=limit):
                yield
        finally:
            for name, value in saved.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value

    def key(self, bucket: Bucket) -> dict:
        return {
            **self.base_key,
            "backend": self.backend,
            "backend_version": backend_version(self.backend),
            "source": source_digest(),
            "bucket": bucket.label,
        }

    def entry_id(self, bucket: Bucket) -> str:
        return f"{self.base_key['model_config']} {self.base_key['device']} {bucket.label}"

    def status(self, bucket: Bucket, entries: dict[str, dict]) -> tuple[str, list[str]]:
        """('cached' | 'new' | 'stale', fields whose change made it stale)."""
        entry = entries.get(self.entry_id(bucket))
        if entry is None:
            return "new", []
        changed = stale_fields(entry.get("key", {}), self.key(bucket))
        if changed:
            return "stale", changed
        return (
            ("cached", []) if self.manifest.artifacts_present(entry) else ("stale", ["artifacts"])
        )

    def attach(self) -> list[Bucket]:
        """Mark the buckets compiled ahead under the current key as ready; returns the configured
        ones missing."""
        entries = self.manifest.entries()
        self.ready = {b for b in self.buckets if self.status(b, entries)[0] == "cached"}
        return [b for b in self.buckets if b not in self.ready]

    def compile_bucket(self, bucket: Bucket, run: Callable[[Bucket], None]) -> tuple[str, float]:
        """Compile one bucket (unless cached) by running `run` on synthetic inputs of its shape;
        record it."""
        with self.manifest.locked():
            entries = self.manifest.entries()
            state, changed = self.status(bucket, entries)
            if state == "cached":
                self.ready.add(bucket)
                return "cached", 0.0
            old = entries.get(self.entry_id(bucket))
            if old is not None:  # stale: its artifacts go, so the rebuild really compiles
                live = {
                    a
                    for i, e in entries.items()
                    if i != self.entry_id(bucket)
                    for a in e.get("artifacts", [])
                }
                self.manifest.remove_artifacts(old, live)
            before = self._artifacts()
            self.ready.add(bucket)  # so that `run` goes through the compiled graph
            started = time.perf_counter()
            try:
                run(bucket)
            except BaseException:
                self.ready.discard(bucket)
                raise
            seconds = time.perf_counter() - started
            self.manifest.put(
                self.entry_id(bucket),
                {
                    "key": self.key(bucket),
                    "seconds": round(seconds, 3),
                    "artifacts": sorted(self._artifacts() - before),
                    "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                },
            )
        return (
            "rebuilt (" + ", ".join(changed) + " changed)"
        ) if state == "stale" else "new", seconds

    def missing_report(self) -> str | None:
        """The configured buckets not compiled ahead (they run eagerly), or None."""
        if not self.missing:
            return None
        shown = ", ".join(b.label for b in self.missing[:6]) + (
            " …" if len(self.missing) > 6 else ""
        )
        return (
            f"{self.backend} compile cache {self.cache_dir}: {len(self.missing)} of "
            f"{len(self.buckets)} buckets not compiled ahead ({shown}); they run eagerly, never "
            "compiled mid-run: `mmcli compile --buckets` compiles them"
        )

    def use_report(self) -> str:
        eager = ", ".join(b.label for b in self.missing_used) or "none"
        return (
            f"{self.backend}: {len(self.loaded)} buckets loaded from the compile cache, "
            f"{len(self.compiled_at_run_time)} compiled in this run; shapes run eagerly: {eager}"
        )

    def _artifacts(self) -> set[str]:
        """Cache entries recorded so far in this process, as paths relative to cache_dir."""
        if self.backend == "neuron":
            return {
                str(p.relative_to(self.cache_dir))
                for p in (self.cache_dir / "neuron").rglob("*.neff")
            }
        # lists what was compiled or loaded from the on-disk caches
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            return set()
        found = set()
        for key in saved[1].artifacts.get("inductor", []):
            found.add(f"inductor/fxgraph/{key[1:3]}/{key}")
        for key in saved[1].artifacts.get("aot_autograd", []):
            found.add(f"inductor/aotautograd/{key}")
        return {a for a in found if (self.cache_dir / a).exists()}

    def call(self, bucket: Bucket, fn: Callable, *args):
        """Run `fn` for `bucket`: its compiled graph when compiled ahead, else eagerly (never
        compiling now)."""
        if bucket not in self.ready:
            if bucket not in self.missing_used:
                self.missing_used.append(bucket)
            return fn(*args)
        graph = self.compiled.get(bucket.component)
        if graph is None:
            graph = self.compiled[bucket.component] = torch.compile(
                fn, backend=self.backend, dynamic=False, fullgraph=True
            )
        if bucket in self.loaded:
            with self.scope(), torch.compiler.set_stance("fail_on_recompile"):
                return graph(*args)
        misses = inductor_compilations()
        with self.scope():
            # first use in this process: Dynamo traces, the backend loads from its cache
            out = graph(*args)
        self.loaded.add(bucket)
        if inductor_compilations() > misses:
            self.compiled_at_run_time.append(bucket)
        return out


def inductor_compilations() -> int:
    """Graphs Inductor generated code for in this process (FX graph cache misses); cache hits are
    loads."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_miss"])
