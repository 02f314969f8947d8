"""The command line's options, declared once (several commands share most of them)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import typer


def _option(kind, *names: str, help: str, **extra):
    return Annotated[kind, typer.Option(*names, help=help, **extra)]


@dataclass(frozen=True)
class RunSetting:
    """A setting of the run every command that loads a model takes: its parameter, its option
    (`--name`, `_` as `-`, unless `flags` says), its help, and the settings key it overrides
    (`to_setting` turns the option's value into the setting's; None leaves the setting alone)."""

    name: str
    kind: object
    help: str
    key: str
    default: object = None
    flags: tuple[str, ...] = ()
    to_setting: Callable[[Any], Any] = lambda value: value  # noqa: E731
    extra: dict = field(default_factory=dict)

    def parameter(self) -> inspect.Parameter:
        flags = self.flags or ("--" + self.name.replace("_", "-"),)
        option = typer.Option(*flags, help=self.help, **self.extra)
        return inspect.Parameter(
            self.name,
            inspect.Parameter.KEYWORD_ONLY,
            annotation=Annotated[self.kind, option],
            default=self.default,
        )


RUN_SETTINGS = (
    RunSetting("model", str | None, "Hub id or local checkpoint directory.", "model"),
    RunSetting("dtype", str | None, "auto, float32, bfloat16 or float16.", "dtype"),
    RunSetting("device", str | None, "auto, cpu or cuda.", "device"),
    RunSetting(
        "backend",
        str | None,
        "compile.backend: auto, eager, inductor or neuron.",
        "compile.backend",
    ),
    RunSetting(
        "quantize", str | None, "none, int8 or int4: weights in 8 or 4 bits (CPU).", "quantize"
    ),
    RunSetting(
        "no_cache",
        bool,
        "Neither read nor write prepared (int8) weights in the cache.",
        "weights_cache",
        default=False,
        to_setting=lambda no_cache: False if no_cache else None,
    ),
    RunSetting(
        "thinking",
        bool | None,
        "Qwen3.5's thinking mode: reason before answering (kept apart in `reasoning`).",
        "thinking",
        flags=("--thinking/--no-thinking",),
        extra={"show_default": False},
    ),
)
_BY_NAME = {setting.name: setting for setting in RUN_SETTINGS}


def run_overrides(given: dict[str, Any]) -> dict:
    """The run settings' options as given, as the nested overrides load_config takes."""
    overrides: dict = {}
    for name, value in given.items():
        *parents, leaf = _BY_NAME[name].key.split(".")
        inner = overrides
        for parent in parents:
            inner = inner.setdefault(parent, {})
        inner[leaf] = _BY_NAME[name].to_setting(value)
    return overrides


def run_options(command: Callable) -> Callable:
    """`command` with every run setting as an option after its own, handed to it as `run`: the
    settings overrides of those given (load_config's nested dict). The settings are declared here
    once, so every command that loads a model takes the same set."""
    own = inspect.signature(command, eval_str=True)
    parameters = [p for p in own.parameters.values() if p.name != "run"]
    parameters += [setting.parameter() for setting in RUN_SETTINGS]

    @functools.wraps(command)
    def with_run(**options):
        given = {name: options.pop(name) for name in _BY_NAME}
        return command(**options, run=run_overrides(given))

    with_run.__signature__ = own.replace(parameters=parameters)
    with_run.__annotations__ = {p.name: p.annotation for p in parameters}
    return with_run


def run_option(name: str):
    """One run setting's option, for a command that reads a few of them without loading."""
    parameter = _BY_NAME[name].parameter()
    return parameter.annotation


Model, Dtype, Quantize = run_option("model"), run_option("dtype"), run_option("quantize")
ConfigFile = _option(Path | None, "--config", "-c", help="YAML settings file.")
MaxNewTokens = _option(int | None, "--max-new-tokens", help="Most tokens to generate.")
Temperature = _option(float | None, "--temperature", help="0 is greedy.")
TopP = _option(float | None, "--top-p", help="Nucleus sampling mass.")
TopK = _option(int | None, "--top-k", help="Keep the k most likely tokens (0 keeps all).")
RepetitionPenalty = _option(
    float | None, "--repetition-penalty", help="Above 1 discourages repeats."
)
Seed = _option(int | None, "--seed", help="Sampling seed (per item and step).")
Logprobs = _option(bool, "--logprobs", help="Add token_ids and logprobs to each record.")

# ask
Images = _option(list[Path] | None, "--image", "-i", help="An image file; repeat for several.")
Videos = _option(
    list[Path] | None, "--video", help="A video file; repeat for several (after the images)."
)
AskOutput = _option(Path | None, "--output", "-o", help="Append the JSONL record to this file.")
Stream = _option(bool, "--stream/--no-stream", help="Print the answer as it is generated.")
AskTask = _option(
    str | None, "--task", help="A task of the settings (e.g. detect) instead of a question."
)

# caption and plan: Parquet inputs
ImageColumn = _option(
    str | None, "--image-column", help="Parquet: the column of images (default: found)."
)
KeyColumn = _option(
    str | None, "--key-column", help="Parquet: the column of keys (default: key, or FILE/ROW)."
)

# caption
Output = _option(str, "--output", "-o", help="JSONL file to append to; - for stdout.")
Prompt = _option(str | None, "--prompt", help="The caption prompt (default: the config's).")
Tasks = _option(list[str], "--task", help="A task to run (repeatable; default: caption).")
Recursive = _option(bool, "--recursive/--no-recursive", help="Walk sub-folders.")
Include = _option(list[str], "--include", help="Only keys matching this glob (repeatable).")
Exclude = _option(list[str], "--exclude", help="Skip keys matching this glob (repeatable).")
Shard = _option(str | None, "--shard", help="I/N: only the keys of shard I of N (stable hash).")
Limit = _option(int | None, "--limit", help="At most this many items.")
Overwrite = _option(bool, "--overwrite", help="Redo items already recorded.")
RetryErrors = _option(bool, "--retry-errors", help="Redo items recorded as errors.")
CheckChanged = _option(
    bool,
    "--check-changed/--no-check-changed",
    help="Redo items whose image changed since its record (size, mtime, sha256).",
)
Sidecar = _option(
    str | None, "--sidecar", help="Also write each caption next to its image, e.g. .txt."
)
DryRun = _option(bool, "--dry-run", help="List what would be captioned, then stop.")
Quiet = _option(bool, "--quiet", "-q", help="No progress or summary (for cron).")
Ray = _option(bool, "--ray", help="Run on a Ray cluster (pip install 'mmcli[ray]').")
RayAddress = _option(
    str | None, "--ray-address", help="Ray cluster address (default: start a local instance)."
)
Replicas = _option(int, "--replicas", help="With --ray: model replicas, one engine each.")
ReplicaResources = _option(
    str | None,
    "--replica-resources",
    help="With --ray: JSON per replica, e.g. '{\"num_cpus\": 4}' or "
    '\'{"resources": {"neuron_cores": 2}}\'.',
)
RedoReviewed = _option(
    bool, "--redo-reviewed", help="Also redo labels a person edited or approved (mmcli review)."
)

# review
Host = _option(str, "--host", help="Address to serve on (127.0.0.1: this machine only).")
Port = _option(int, "--port", help="Port to serve on (0: any free one).")

# export
ExportFormat = _option(
    str, "--to", help="parquet, or imagefolder (metadata.jsonl beside the images)."
)
Wide = _option(bool, "--wide", help="Parquet: one row per input, one column per task.")
IncludeErrors = _option(bool, "--include-errors", help="Keep the error records too.")
WithMedia = _option(bool, "--with-media", help="webdataset: copy each sample's members too.")

# serve and batch
ApiKey = _option(
    str | None,
    "--api-key",
    help="Clients must send it (Authorization: Bearer KEY); default $MMCLI_API_KEY.",
    envvar="MMCLI_API_KEY",
    show_envvar=False,
)
ServedModel = _option(
    str | None, "--served-model-name", help="The model id clients name (default: --model's)."
)
MediaDir = _option(
    Path | None, "--allowed-media-dir", help="file:// media only inside this folder (off)."
)
MediaURL = _option(
    list[str], "--allow-media-url", help="http(s) media from this domain (repeatable; off)."
)
AllowedHost = _option(
    list[str], "--allowed-host", help="Another Host name clients reach this server by."
)
MaxImages = _option(int, "--max-images", help="Most images in one request.")
MaxBodyMB = _option(int, "--max-body-mb", help="Largest request body, in MB.")
MaxQueue = _option(
    int, "--max-queue", help="Requests admitted and not yet started; more are answered 429."
)
MaxVideos = _option(int, "--max-videos", help="Most videos in one request.")
MaxPreparing = _option(
    int, "--max-preparing", help="Requests whose media are fetched and decoded at once."
)
MaxMediaMB = _option(
    int, "--max-media-mb", help="Memory the media of requests being prepared may take, in MB."
)
RequestTimeout = _option(
    float, "--request-timeout", help="Seconds a request may take, admission to last token."
)
BatchOutput = _option(
    Path, "--output", "-o", help="The Batch API's output file (JSONL) to append to."
)
