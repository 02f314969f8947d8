"""The command line's options, declared once (several commands share most of them)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def _option(kind, *names: str, help: str, **extra):
    return Annotated[kind, typer.Option(*names, help=help, **extra)]


Model = _option(str | None, "--model", help="Hub id or local checkpoint directory.")
ConfigFile = _option(Path | None, "--config", "-c", help="YAML settings file.")
Dtype = _option(str | None, "--dtype", help="auto, float32, bfloat16 or float16.")
Device = _option(str | None, "--device", help="auto, cpu or cuda.")
Backend = _option(str | None, "--backend", help="compile.backend: auto, eager, inductor or neuron.")
Quantize = _option(
    str | None, "--quantize", help="none, int8 or int4: weights in 8 or 4 bits (CPU)."
)
Thinking = _option(
    bool | None,
    "--thinking/--no-thinking",
    help="Qwen3.5's thinking mode: reason before answering (kept apart in `reasoning`).",
    show_default=False,
)
NoCache = _option(
    bool, "--no-cache", help="Neither read nor write prepared (int8) weights in the cache."
)
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
