"""The `mmcli` command line (Typer): options in, one call into the library, errors out as exit
codes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from mmcli.cli import options as o
from mmcli.errors import ConfigError, MmcliError

Question = typer.Argument(
    metavar="[QUESTION]", help="The question about the image(s) (or --task's own prompt)."
)
Paths = typer.Argument(
    metavar="PATHS",
    help="Image folders or files, WebDataset .tar shards, Parquet files (globs, {a..b}).",
)
Labels = typer.Argument(metavar="LABELS", help="JSONL files written by mmcli.")

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    help="Caption and question image datasets with Qwen3-VL; results as JSONL.",
)


@app.callback()
def _root() -> None:
    """Caption and question image datasets with Qwen3-VL; results as JSONL."""


@contextlib.contextmanager
def exit_codes() -> Iterator[None]:
    """Every command's errors as one line on stderr and the documented exit code (see the
    README)."""
    try:
        yield
    except MmcliError as e:
        typer.echo(f"mmcli: {e}", err=True)
        raise typer.Exit(e.exit_code) from None


def _load_config(config: Path | None, **overrides) -> dict:
    from mmcli.config import load_config

    return load_config(config, overrides)


@app.command()
@o.run_options
def ask(
    question: Annotated[str | None, Question] = None,
    image: o.Images = None,
    video: o.Videos = None,
    config: o.ConfigFile = None,
    max_new_tokens: o.MaxNewTokens = None,
    temperature: o.Temperature = None,
    top_p: o.TopP = None,
    top_k: o.TopK = None,
    repetition_penalty: o.RepetitionPenalty = None,
    seed: o.Seed = None,
    logprobs: o.Logprobs = False,
    output: o.AskOutput = None,
    stream: o.Stream = True,
    task: o.AskTask = None,
    *,
    run: dict,
) -> None:
    """Answer one question about one or more images or videos; the answer streams to stdout.

    \b
    Examples:
      mmcli ask --image samples/coffee.jpg "What is in the cup?"
      mmcli ask -i samples/coffee.jpg -i samples/rocket.jpg "What differs?"
      mmcli ask --image samples/astronaut.jpg --task detect
      mmcli ask --video clip.mp4 "What happens?"
    """
    from mmcli.cli.ask import run_ask

    given = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
    given.update(top_k=top_k, repetition_penalty=repetition_penalty, seed=seed)
    with exit_codes():
        cfg = _load_config(config, generation=given, **run)
        if question is None and task is None:
            raise ConfigError("give a QUESTION or --task NAME")
        if not image and not video:
            raise ConfigError("give at least one --image FILE or --video FILE")
        inputs = (image or [], video or [])
        code = run_ask(cfg, inputs, question, output, logprobs, stream, task, given)
    raise typer.Exit(code)


@app.command()
def plan(
    paths: list[Path] = typer.Argument(None, metavar="PATHS", help="Image files or folders."),
    tokens: str | None = typer.Option(
        None, help="Patch counts instead of images, e.g. 1024,512,256,128,128."
    ),
    block_size: int | None = typer.Option(
        None, help="Patches per vision block (default: the config's)."
    ),
    config: o.ConfigFile = None,
    image_column: o.ImageColumn = None,
    key_column: o.KeyColumn = None,
) -> None:
    """Show how images pack into vision-attention blocks, the waste, and the block size to use.

    \b
    Examples:
      mmcli plan samples
      mmcli plan --tokens 1024,512,256,128,128 --block-size 1024
    """
    from mmcli.cli.plan import image_patches, print_plan

    with exit_codes():
        cfg = _load_config(config)
        if tokens:
            try:
                patches = [int(t) for t in tokens.split(",")]
            except ValueError:
                raise ConfigError(
                    f"--tokens {tokens!r}: expected counts like 1024,512,256"
                ) from None
            names = [f"#{i}" for i in range(len(patches))]
        elif paths:
            names, patches = image_patches(paths, cfg, (image_column, key_column))
        else:
            raise ConfigError("give image paths or --tokens")
        if not patches or min(patches) < 1:
            raise ConfigError("no images to plan (or a token count below 1)")
        size = block_size or cfg.vision.block_size
        if max(patches) > size:
            raise ConfigError(
                f"{names[patches.index(max(patches))]}: {max(patches)} patches do not fit a block "
                f"of {size} (--block-size or vision.block_size)"
            )
        print_plan(names, patches, size, max(cfg.vision.num_blocks_buckets))


CAPTION_HELP = """Caption every image under PATHS, appending one JSONL record per image; resumable.

\b
Examples:
  mmcli caption samples -o captions.jsonl
  mmcli caption samples --sidecar .txt --max-new-tokens 64 --dry-run
  mmcli caption samples --shard 0/2 -o shard0.jsonl --quiet
  mmcli caption samples --task caption --task tags -o labels.jsonl
"""


@app.command(help=CAPTION_HELP)
@o.run_options
def caption(
    paths: Annotated[list[Path], Paths],
    config: o.ConfigFile = None,
    output: o.Output = "captions.jsonl",
    prompt: o.Prompt = None,
    task: o.Tasks = [],  # noqa: B006 - Typer's default, never mutated
    max_new_tokens: o.MaxNewTokens = None,
    temperature: o.Temperature = None,
    seed: o.Seed = None,
    logprobs: o.Logprobs = False,
    recursive: o.Recursive = True,
    include: o.Include = [],  # noqa: B006
    exclude: o.Exclude = [],  # noqa: B006
    shard: o.Shard = None,
    limit: o.Limit = None,
    overwrite: o.Overwrite = False,
    retry_errors: o.RetryErrors = False,
    check_changed: o.CheckChanged = True,
    sidecar: o.Sidecar = None,
    dry_run: o.DryRun = False,
    quiet: o.Quiet = False,
    redo_reviewed: o.RedoReviewed = False,
    image_column: o.ImageColumn = None,
    key_column: o.KeyColumn = None,
    ray: o.Ray = False,
    ray_address: o.RayAddress = None,
    replicas: o.Replicas = 1,
    replica_resources: o.ReplicaResources = None,
    *,
    run: dict,
) -> None:
    from mmcli.cli.progress import Progress
    from mmcli.jobs.caption import CaptionJob, Redo, Selection, run_caption_job

    with exit_codes():
        given = {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}
        cfg = _load_config(config, prompt=prompt, task=tuple(task) or None, generation=given, **run)
        job = CaptionJob(
            paths=paths,
            config=cfg,
            output=output,
            select=Selection(recursive, include, exclude, shard, limit, image_column, key_column),
            redo=Redo(overwrite, retry_errors, check_changed, redo_reviewed),
            sidecar=sidecar,
            dry_run=dry_run,
            quiet=quiet,
            logprobs=logprobs,
            ray=_ray_options(ray_address, replicas, replica_resources) if ray else None,
            sampling=given,
        )
        code = run_caption_job(job, Progress(quiet=quiet))
    raise typer.Exit(code)


def _ray_options(address: str | None, replicas: int, resources: str | None):
    from mmcli.jobs.distributed import RayOptions, parse_resources, require_ray

    require_ray()
    return RayOptions(address, replicas, parse_resources(resources))


@app.command("compile")
@o.run_options
def compile_cmd(
    bucket_list: str | None = typer.Argument(
        None, metavar="[LIST]", help="Only these buckets, e.g. 'decode 8x1024, prefill 512'."
    ),
    buckets: bool = typer.Option(
        False, "--buckets", help="Compile the configured buckets (or those in LIST)."
    ),
    config: o.ConfigFile = None,
    *,
    run: dict,
) -> None:
    """Compile and cache every fixed-shape bucket ahead of time (vision blocks, prefill, decode).

    \b
    Examples:
      mmcli compile --buckets --backend inductor
      mmcli compile --buckets 'decode 8x1024, prefill 512' --backend inductor
    """
    from mmcli.cli.compile import compile_buckets, prepare_weights_only

    with exit_codes():
        if not buckets:
            raise ConfigError(
                "say --buckets (every configured bucket) or --buckets 'decode 8x1024, ...'"
            )
        cfg = _load_config(config, **run)
        if cfg.compile.backend in ("auto", "eager") and cfg.quantize in ("int8", "int4"):
            if not cfg.weights_cache:
                raise ConfigError(
                    f"--no-cache: on the eager backend compile prepares the {cfg.quantize} "
                    "weights in the cache, which this run neither reads nor writes"
                )
            return prepare_weights_only(cfg)
        if cfg.compile.backend in ("auto", "eager"):
            raise ConfigError(
                f"compile.backend {cfg.compile.backend} runs eagerly here: nothing to compile "
                "(choose --backend inductor or neuron)"
            )
        compile_buckets(cfg, bucket_list)


@app.command()
def review(
    labels: Annotated[list[Path], Labels],
    host: o.Host = "127.0.0.1",
    port: o.Port = 8765,
    config: o.ConfigFile = None,
    allowed_host: o.AllowedHost = [],  # noqa: B006 - Typer's default, never mutated
) -> None:
    """Open a local page to look at, filter and correct the records of one or more JSONL files.

    \b
    Examples:
      mmcli review captions.jsonl
      mmcli review labels.jsonl more.jsonl --port 8800
    """
    from mmcli.cli.review import serve

    with exit_codes():
        serve(labels, host, port, _load_config(config), tuple(allowed_host))


@app.command()
def export(
    labels: Annotated[list[Path], Labels],
    out: Annotated[Path, typer.Argument(metavar="OUT", help="The file (or imagefolder's folder).")],
    to: o.ExportFormat = "parquet",
    wide: o.Wide = False,
    include_errors: o.IncludeErrors = False,
    with_media: o.WithMedia = False,
) -> None:
    """Write the current label of each (key, task) as Parquet, or as an imagefolder's metadata.

    \b
    Examples:
      mmcli export captions.jsonl labels.parquet
      mmcli export captions.jsonl labels.parquet --wide
      mmcli export captions.jsonl ./images --to imagefolder
      mmcli export labels.jsonl ./label-shards --to webdataset
    """
    from mmcli.jobs.export import export as write

    with exit_codes():
        count = write(labels, to, out, wide, include_errors, with_media)
        unit = {"imagefolder": "images", "webdataset": "shards"}.get(to, "rows")
        typer.echo(f"mmcli: {count} {unit} in {out}", err=True)


@app.command("serve")
@o.run_options
def serve_cmd(
    config: o.ConfigFile = None,
    host: o.Host = "127.0.0.1",
    port: o.Port = 8000,
    api_key: o.ApiKey = None,
    served_model_name: o.ServedModel = None,
    allowed_media_dir: o.MediaDir = None,
    allow_media_url: o.MediaURL = [],  # noqa: B006 - Typer's default, never mutated
    allowed_host: o.AllowedHost = [],  # noqa: B006
    max_images: o.MaxImages = 16,
    max_body_mb: o.MaxBodyMB = 64,
    max_queue: o.MaxQueue = 64,
    max_videos: o.MaxVideos = 2,
    max_preparing: o.MaxPreparing = 4,
    max_media_mb: o.MaxMediaMB = 2048,
    request_timeout: o.RequestTimeout = 600.0,
    *,
    run: dict,
) -> None:
    """Serve the model behind the OpenAI API (chat completions) until Ctrl-C or SIGTERM.

    \b
    Examples:
      mmcli serve --model Qwen/Qwen3-VL-2B-Instruct --api-key secret --allowed-media-dir ./images
    """
    from mmcli.cli.serve import ServeOptions, serve

    with exit_codes():
        cfg = _load_config(config, **run)
        options = ServeOptions(
            host=host,
            port=port,
            api_key=api_key,
            served_model=served_model_name,
            media_dir=allowed_media_dir,
            media_domains=allow_media_url,
            allowed_hosts=allowed_host,
            max_images=max_images,
            max_body_mb=max_body_mb,
            max_queue=max_queue,
            max_videos=max_videos,
            max_preparing=max_preparing,
            max_media_mb=max_media_mb,
            request_timeout=request_timeout,
        )
        serve(cfg, options)


@app.command("batch")
@o.run_options
def batch_cmd(
    requests: Annotated[
        Path, typer.Argument(metavar="REQUESTS", help="An OpenAI Batch API input file (JSONL).")
    ],
    output: o.BatchOutput = Path("results.jsonl"),
    config: o.ConfigFile = None,
    quiet: o.Quiet = False,
    *,
    run: dict,
) -> None:
    """Run an OpenAI Batch API file offline: one output line per request; resumable.

    \b
    Examples:
      mmcli batch requests.jsonl -o results.jsonl
    """
    from mmcli.cli.batch import run_batch
    from mmcli.cli.progress import Progress

    with exit_codes():
        cfg = _load_config(config, **run)
        redo = "fix those lines and rerun: answered custom_ids are kept, the failed ones redone"
        progress = Progress(quiet=quiet, work=("answering", "requests"), redo=redo)
        code = run_batch(cfg, requests, output, progress)
    raise typer.Exit(code)


@app.command()
def doctor(
    config: o.ConfigFile = None,
    model: o.Model = None,
    dtype: o.Dtype = None,
    quantize: o.Quantize = None,
    measure: bool = typer.Option(
        False, "--measure", help="Measure the kernels again (the cache keeps the first)."
    ),
) -> None:
    """Print this machine's CPU units, the library's peak on each, the kernel plan a run of the
    settings gets, and the measured kernels against their unit's peak."""
    from mmcli.cli.doctor import doctor as report

    with exit_codes():
        cfg = _load_config(config, model=model, dtype=dtype, device="cpu", quantize=quantize)
        report(cfg, measure)


@app.command("config")
def config_cmd(
    action: str = typer.Argument("show", help="show: print the effective settings as YAML."),
    config: o.ConfigFile = None,
) -> None:
    """Print the effective configuration (defaults updated by --config)."""
    from mmcli.config import config_as_yaml

    with exit_codes():
        if action != "show":
            raise ConfigError(f"config {action!r}: only 'show' is known")
        typer.echo(config_as_yaml(_load_config(config)))
