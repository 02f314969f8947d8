"""Compile-ahead: one fixed-shape graph per bucket, compiled by `mmcli compile --buckets` and only loaded later.

Buckets: vision (num_blocks x block_size), prefill (padded prompt tokens, one prompt per call) and decode
(batch x context columns). The manifest in compile.cache_dir records, per bucket, the key it was compiled
under (model config, dtype, KV cache shape, backend and its version, a digest of the compiled source), its
compile time and its artifacts. A run uses only buckets whose key matches and whose artifacts exist; any
other shape runs eagerly and is reported, never compiled mid-run.

Backends: inductor (torch.compile; its on-disk FX graph and AOTAutograd caches live in cache_dir/inductor and
survive a new process) and neuron (torch.compile(backend="neuron") from the AWS Neuron SDK's TorchNeuron, its
NEFF caches pointed into cache_dir/neuron). The neuron path has not run here: no Trainium2 and no SDK.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from .errors import ConfigError

# What the neuron backend imports, the distributions that provide it, and where they come from.
NEURON_MODULES = {"torch_neuronx": "torch-neuronx", "neuronxcc": "neuronx-cc", "nki": "nki", "nkilib": "nki-library"}
NEURON_SOURCE = "AWS's Neuron pip repository (https://pip.repos.neuron.amazonaws.com), on a Trainium2 instance"
COMPILED_SOURCES = ("model/__init__.py", "model/text.py", "model/vision.py", "compiled.py", "positions.py")


@dataclass(frozen=True, order=True)
class Bucket:
    component: str  # vision, prefill or decode
    shape: tuple[int, ...]  # (num_blocks, block_size), (tokens,) or (batch, context)

    @property
    def label(self) -> str:
        return f"{self.component} {'x'.join(map(str, self.shape))}"


def configured_buckets(vision_buckets, block_size, prefill_buckets, decode_batch_buckets,
                       decode_context_buckets) -> list[Bucket]:
    return ([Bucket("vision", (n, block_size)) for n in sorted(set(vision_buckets))]
            + [Bucket("prefill", (t,)) for t in sorted(set(prefill_buckets))]
            + [Bucket("decode", (b, c)) for b in sorted(set(decode_batch_buckets))
               for c in sorted(set(decode_context_buckets))])


def parse_buckets(text: str, configured: list[Bucket]) -> list[Bucket]:
    """'decode 8x1024, prefill 512' (or 'decode:8x1024') -> those configured buckets; anything else is refused."""
    known = {b.label: b for b in configured}
    picked = []
    for item in filter(None, (part.strip() for part in text.split(","))):
        label = " ".join(item.replace(":", " ").split())
        if label not in known:
            raise ConfigError(f"--buckets {item!r}: not a configured bucket (configured: {', '.join(known)})")
        picked.append(known[label])
    return picked


def require_neuron() -> None:
    """The Neuron SDK packages, or one line naming what is missing and where it comes from."""
    missing = []
    for module, dist in NEURON_MODULES.items():
        try:
            mod = __import__(module)
        except ImportError:
            missing.append(dist)
            continue
        if module == "nki" and not hasattr(mod, "jit"):  # PyPI holds ~1 KB placeholder wheels under these names
            missing.append(f"{dist} (the installed one is PyPI's empty placeholder)")
    if missing:
        raise ConfigError(f"compile.backend neuron needs the AWS Neuron SDK: missing {', '.join(missing)}; "
                          f"install them from {NEURON_SOURCE}")


def backend_version(backend: str) -> str:
    if backend == "neuron":
        return ", ".join(f"{d} {metadata.version(d)}" for d in NEURON_MODULES.values())
    return f"torch {torch.__version__}"


def source_digest() -> str:
    root = Path(__file__).parent
    digest = hashlib.sha256()
    for name in COMPILED_SOURCES:
        digest.update(name.encode() + b"\0" + (root / name).read_bytes())
    return digest.hexdigest()[:16]


def open_cache_dir(path: str | Path) -> Path:
    """cache_dir, created readable by the user alone (compiled code is loaded from it and run)."""
    cache = Path(path).expanduser()
    cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    if cache.stat().st_uid != os.getuid():
        raise ConfigError(f"config compile.cache_dir {cache}: owned by another user; compiled code is not loaded "
                          "from it")
    return cache


class Manifest:
    """cache_dir/manifest.json: {entry id: {key, seconds, artifacts, created_at}}, rewritten atomically under a lock."""

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
        return bool(entry.get("artifacts")) and all((self.dir / a).exists() for a in entry["artifacts"])

    def remove_artifacts(self, entry: dict, keep: set[str]) -> None:
        for rel in entry.get("artifacts", []):
            path = self.dir / rel
            if rel not in keep:
                shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)


def stale_fields(old: dict, new: dict) -> list[str]:
    return sorted(k for k in new if old.get(k) != new[k])


class CompiledGraphs:
    """torch.compile'd step functions, one graph per bucket; `call` runs a bucket's graph once it is known to be
    compiled, and anything else eagerly (reported once), so a run never compiles."""

    def __init__(self, backend: str, cache_dir: str | Path, key: dict, buckets: list[Bucket]):
        if backend == "neuron":
            require_neuron()
        self.backend, self.base_key, self.buckets = backend, key, buckets
        self.cache_dir = open_cache_dir(cache_dir)
        self.manifest = Manifest(self.cache_dir)
        self._point_caches_into(self.cache_dir)
        # Every bucket of a component is a recompile of the same code for Dynamo: allow as many as there are buckets.
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, len(buckets) + 1)
        self.compiled: dict[str, Callable] = {}
        self.ready: set[Bucket] = set()  # compiled ahead under the current key, artifacts present
        self.loaded: set[Bucket] = set()  # traced in this process (inductor: loaded from its cache)
        self.missing_used: list[Bucket] = []  # buckets a run needed but that were not compiled ahead
        self.compiled_at_run_time: list[Bucket] = []
        self.missing = self.attach()  # configured buckets not compiled ahead under the current key

    def _point_caches_into(self, cache_dir: Path) -> None:
        if self.backend == "inductor":
            os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_dir / "inductor")
        else:  # TorchNeuron reads these once, at its first compilation
            for name, sub in (("TORCH_NEURONX_NEFF_CACHE_DIR", "neff"), ("TORCH_NEURONX_NEFF_LOCAL_CACHE_DIR",
                              "neff_local"), ("TORCH_NEURONX_HLO_CACHE_DIR", "hlo")):
                os.environ[name] = str(cache_dir / "neuron" / sub)

    def key(self, bucket: Bucket) -> dict:
        return {**self.base_key, "backend": self.backend, "backend_version": backend_version(self.backend),
                "source": source_digest(), "bucket": bucket.label}

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
        return ("cached", []) if self.manifest.artifacts_present(entry) else ("stale", ["artifacts"])

    def attach(self) -> list[Bucket]:
        """Mark the buckets compiled ahead under the current key as ready; returns the configured ones missing."""
        entries = self.manifest.entries()
        self.ready = {b for b in self.buckets if self.status(b, entries)[0] == "cached"}
        return [b for b in self.buckets if b not in self.ready]

    def compile_bucket(self, bucket: Bucket, warm: Callable[[Bucket], None]) -> tuple[str, float]:
        """Compile one bucket (unless cached) by running `warm` on synthetic inputs of its shape; record it."""
        with self.manifest.locked():
            entries = self.manifest.entries()
            state, changed = self.status(bucket, entries)
            if state == "cached":
                self.ready.add(bucket)
                return "cached", 0.0
            old = entries.get(self.entry_id(bucket))
            if old is not None:  # stale: its artifacts go, so the rebuild really compiles
                live = {a for i, e in entries.items() if i != self.entry_id(bucket) for a in e.get("artifacts", [])}
                self.manifest.remove_artifacts(old, live)
            before = self._artifacts()
            self.ready.add(bucket)  # so that `warm` goes through the compiled graph
            started = time.perf_counter()
            try:
                warm(bucket)
            except BaseException:
                self.ready.discard(bucket)
                raise
            seconds = time.perf_counter() - started
            self.manifest.put(self.entry_id(bucket), {
                "key": self.key(bucket), "seconds": round(seconds, 3), "artifacts": sorted(self._artifacts() - before),
                "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
        return ("rebuilt (" + ", ".join(changed) + " changed)") if state == "stale" else "new", seconds

    def _artifacts(self) -> set[str]:
        """Cache entries recorded so far in this process, as paths relative to cache_dir."""
        if self.backend == "neuron":
            return {str(p.relative_to(self.cache_dir)) for p in (self.cache_dir / "neuron").rglob("*.neff")}
        saved = torch.compiler.save_cache_artifacts()  # lists what was compiled or loaded from the on-disk caches
        if saved is None:
            return set()
        found = set()
        for key in saved[1].artifacts.get("inductor", []):
            found.add(f"inductor/fxgraph/{key[1:3]}/{key}")
        for key in saved[1].artifacts.get("aot_autograd", []):
            found.add(f"inductor/aotautograd/{key}")
        return {a for a in found if (self.cache_dir / a).exists()}

    def call(self, bucket: Bucket, fn: Callable, *args):
        """Run `fn` for `bucket`: its compiled graph when compiled ahead, else eagerly (never compiling now)."""
        if bucket not in self.ready:
            if bucket not in self.missing_used:
                self.missing_used.append(bucket)
            return fn(*args)
        graph = self.compiled.get(bucket.component)
        if graph is None:
            graph = self.compiled[bucket.component] = torch.compile(
                fn, backend=self.backend, dynamic=False, fullgraph=True)
        if bucket in self.loaded:
            with torch.compiler.set_stance("fail_on_recompile"):
                return graph(*args)
        misses = inductor_compilations()
        out = graph(*args)  # first use in this process: Dynamo traces, the backend loads from its cache
        self.loaded.add(bucket)
        if inductor_compilations() > misses:
            self.compiled_at_run_time.append(bucket)
        return out


def inductor_compilations() -> int:
    """Graphs Inductor generated code for in this process (FX graph cache misses); cache hits are loads."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["fxgraph_cache_miss"])
