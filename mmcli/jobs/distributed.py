"""`mmcli caption --ray`: one engine per replica as a Ray Data actor; records stream back to the
driver's file.

The driver owns the output (same lock, fsync and torn-line rules as a local run) and writes
records as Ray yields them. A replica that dies is restarted by Ray and its unfinished batch is
redone; a key already written is never written twice."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from mmcli.errors import ConfigError
from mmcli.inputs.sources import from_json, to_json
from mmcli.jobs.labeling import Item, label_records

INSTALL_HINT = "--ray needs Ray Data: pip install 'mmcli[ray]' (or pip install 'ray[data]')"


@dataclass
class RayOptions:
    address: str | None = None  # None: start a local instance
    replicas: int = 1
    resources: dict = field(default_factory=lambda: {"num_cpus": 1})


def require_ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise ConfigError(INSTALL_HINT) from None
    return ray


def parse_resources(text: str | None) -> dict:
    """--replica-resources JSON: {"num_cpus": 1, "num_gpus": 0, "resources": {"neuron_cores":
    2}}."""
    if not text:
        return {"num_cpus": 1}
    try:
        value = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"--replica-resources: not JSON ({e})") from None
    known = {"num_cpus", "num_gpus", "resources", "memory"}
    if not isinstance(value, dict) or set(value) - known:
        raise ConfigError(
            f"--replica-resources: expected an object with keys among {sorted(known)}, got {text}"
        )
    return value


class CaptionReplica:
    """One model and engine per replica, loaded once; labels each batch of (key, source) rows,
    reading the inputs itself."""

    def __init__(
        self, config, tasks: list, settings: dict[str, dict[str, str]], logprobs: bool, threads: int
    ):
        import torch

        from mmcli.api.labeler import Labeler

        if threads:
            torch.set_num_threads(threads)
        self.labeler = Labeler.from_pretrained(config=config)
        self.config, self.settings, self.logprobs = config, settings, logprobs
        # as the driver resolved them (command-line sampling included)
        self.tasks = {t.name: t for t in tasks}

    def __call__(self, batch: dict) -> dict:
        rows = zip(batch["key"].tolist(), batch["path"].tolist(), batch["tasks"].tolist())
        items = [(key, from_json(source), json.loads(names)) for key, source, names in rows]
        records = label_records(self.labeler, items, self.tasks, self.settings, self.logprobs)
        return {"record": [json.dumps(record) for record in records]}


def caption_on_ray(
    items: list[Item],
    config,
    tasks: list,
    settings: dict[str, dict[str, str]],
    write,
    options: RayOptions,
    logprobs: bool,
    batch_size: int = 4,
) -> None:
    """Run the captioning on a Ray cluster (a local instance without `options.address`);
    `write(record)` per record."""
    ray = require_ray()
    replicas, resources = options.replicas, options.resources
    if not ray.is_initialized():
        ray.init(
            address=options.address,
            include_dashboard=False,
            log_to_driver=False,
            configure_logging=False,
        )
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.actor_task_retry_on_errors = False  # per-item errors are records, not task failures
    # where each input is (a file, a shard member, a Parquet row), never its bytes
    rows = [{"key": k, "path": to_json(p), "tasks": json.dumps(names)} for k, p, names in items]
    ds = ray.data.from_items(rows, override_num_blocks=max(1, min(len(rows), replicas * 8)))
    threads = int(resources.get("num_cpus", 1) or 1)
    # a dead replica is replaced and its batch redone
    out = ds.map_batches(
        CaptionReplica,
        fn_constructor_kwargs={
            "config": config,
            "tasks": tasks,
            "settings": settings,
            "logprobs": logprobs,
            "threads": threads,
        },
        batch_size=batch_size,
        concurrency=replicas,
        num_cpus=resources.get("num_cpus", 1),
        **{k: resources[k] for k in ("num_gpus", "resources", "memory") if resources.get(k)},
        max_restarts=-1,
        max_task_retries=-1,
    )
    written: set[tuple[str, str]] = set()
    for row in out.iter_rows():
        record = json.loads(row["record"])
        label = (record["key"], record["task"])
        if label in written:  # a batch redone after a replica died may repeat some
            continue
        written.add(label)
        write(record)
