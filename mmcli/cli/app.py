"""The `mmcli` command line (Typer): options in, one call into the library, errors out as exit
codes."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated

import typer

from mmcli.errors import ConfigError, MmcliError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=None,
    help="Caption and question image datasets with Qwen3-VL; results as JSONL.",
)

# Options several commands share, declared once.
ModelOption = Annotated[
    str | None, typer.Option("--model", help="Hub id or local checkpoint directory.")
]
ConfigOption = Annotated[Path | None, typer.Option("--config", "-c", help="YAML settings file.")]
DtypeOption = Annotated[
    str | None, typer.Option("--dtype", help="auto, float32, bfloat16 or float16.")
]
DeviceOption = Annotated[str | None, typer.Option("--device", help="auto, cpu or cuda.")]
BackendOption = Annotated[
    str | None, typer.Option("--backend", help="compile.backend: auto, eager, inductor or neuron.")
]
QuantizeOption = Annotated[
    str | None,
    typer.Option("--quantize", help="none, or int8: linear layers in 8-bit integers (CPU)."),
]
MaxNewTokensOption = Annotated[
    int | None, typer.Option("--max-new-tokens", help="Most tokens to generate.")
]
TemperatureOption = Annotated[float | None, typer.Option("--temperature", help="0 is greedy.")]
SeedOption = Annotated[
    int | None, typer.Option("--seed", help="Sampling seed (per item and step).")
]
LogprobsOption = Annotated[
    bool, typer.Option("--logprobs", help="Add token_ids and logprobs to each record.")
]


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


def _settings(config: Path | None, **overrides) -> dict:
    from mmcli.config import load_config

    return load_config(config, overrides)


@app.command()
def ask(
    question: str | None = typer.Argument(
        None, metavar="[QUESTION]", help="The question about the image(s) (or --task's own prompt)."
    ),
    image: list[Path] = typer.Option(
        None, "--image", "-i", help="An image file; repeat for several."
    ),
    video: list[Path] = typer.Option(
        None, "--video", help="A video file; repeat for several (after the images)."
    ),
    model: ModelOption = None,
    config: ConfigOption = None,
    dtype: DtypeOption = None,
    device: DeviceOption = None,
    backend: BackendOption = None,
    quantize: QuantizeOption = None,
    max_new_tokens: MaxNewTokensOption = None,
    temperature: TemperatureOption = None,
    top_p: float | None = typer.Option(None, help="Nucleus sampling mass."),
    top_k: int | None = typer.Option(None, help="Keep the k most likely tokens (0 keeps all)."),
    repetition_penalty: float | None = typer.Option(None, help="Above 1 discourages repeats."),
    seed: SeedOption = None,
    logprobs: LogprobsOption = False,
    output: Path | None = typer.Option(
        None, "--output", "-o", help="Append the JSONL record to this file."
    ),
    stream: bool = typer.Option(
        True, "--stream/--no-stream", help="Print the answer as it is generated."
    ),
    task: str | None = typer.Option(
        None, "--task", help="A task of the settings (e.g. detect) instead of a question."
    ),
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

    generation = {
        "max_new_tokens": max_new_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "repetition_penalty": repetition_penalty,
        "seed": seed,
    }
    with exit_codes():
        cfg = _settings(
            config,
            model=model,
            dtype=dtype,
            device=device,
            quantize=quantize,
            compile={"backend": backend},
            generation=generation,
        )
        if question is None and task is None:
            raise ConfigError("give a QUESTION or --task NAME")
        if not image and not video:
            raise ConfigError("give at least one --image FILE or --video FILE")
        code = run_ask(
            cfg, image or [], question, output, logprobs, stream, task, generation, video or []
        )
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
    config: ConfigOption = None,
) -> None:
    """Show how images pack into vision-attention blocks, the waste, and the block size to use.

    \b
    Examples:
      mmcli plan samples
      mmcli plan --tokens 1024,512,256,128,128 --block-size 1024
    """
    from mmcli.cli.plan import image_patches, print_plan

    with exit_codes():
        cfg = _settings(config)
        if tokens:
            try:
                patches = [int(t) for t in tokens.split(",")]
            except ValueError:
                raise ConfigError(
                    f"--tokens {tokens!r}: expected counts like 1024,512,256"
                ) from None
            names = [f"#{i}" for i in range(len(patches))]
        elif paths:
            names, patches = image_patches(paths, cfg)
        else:
            raise ConfigError("give image paths or --tokens")
        if not patches or min(patches) < 1:
            raise ConfigError("no images to plan (or a token count below 1)")
        size = block_size or cfg.vision.block_size
        if max(patches) > size:
            raise ConfigError(
                f"{names[patches.index(max(patches))]}: {max(patches)} patches do not fit a block "
                "of "
                f"{size} (--block-size or vision.block_size)"
            )
        print_plan(names, patches, size)


@app.command()
def caption(
    paths: list[Path] = typer.Argument(..., metavar="PATHS", help="Image folders or files."),
    model: ModelOption = None,
    config: ConfigOption = None,
    output: str = typer.Option(
        "captions.jsonl", "--output", "-o", help="JSONL file to append to; - for stdout."
    ),
    prompt: str | None = typer.Option(None, help="The caption prompt (default: the config's)."),
    task: list[str] = typer.Option(
        [], "--task", help="A task to run (repeatable; default: caption)."
    ),
    max_new_tokens: MaxNewTokensOption = None,
    temperature: TemperatureOption = None,
    seed: SeedOption = None,
    dtype: DtypeOption = None,
    device: DeviceOption = None,
    backend: BackendOption = None,
    quantize: QuantizeOption = None,
    logprobs: LogprobsOption = False,
    recursive: bool = typer.Option(True, "--recursive/--no-recursive", help="Walk sub-folders."),
    include: list[str] = typer.Option(
        [], "--include", help="Only keys matching this glob (repeatable)."
    ),
    exclude: list[str] = typer.Option(
        [], "--exclude", help="Skip keys matching this glob (repeatable)."
    ),
    shard: str | None = typer.Option(
        None, help="I/N: only the keys of shard I of N (stable hash)."
    ),
    limit: int | None = typer.Option(None, help="At most this many items."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Redo items already recorded."),
    retry_errors: bool = typer.Option(
        False, "--retry-errors", help="Redo items recorded as errors."
    ),
    check_changed: bool = typer.Option(
        True,
        "--check-changed/--no-check-changed",
        help="Redo items whose image changed since its record (size, mtime, sha256).",
    ),
    sidecar: str | None = typer.Option(
        None, help="Also write each caption next to its image, e.g. .txt."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="List what would be captioned, then stop."
    ),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress or summary (for cron)."),
    ray: bool = typer.Option(
        False, "--ray", help="Run on a Ray cluster (pip install 'mmcli[ray]')."
    ),
    ray_address: str | None = typer.Option(
        None, help="Ray cluster address (default: start a local instance)."
    ),
    replicas: int = typer.Option(1, help="With --ray: model replicas, one engine each."),
    replica_resources: str | None = typer.Option(
        None,
        help="With --ray: JSON per replica, e.g. '{\"num_cpus\": 4}' or "
        '\'{"resources": {"neuron_cores": 2}}\'.',
    ),
) -> None:
    """Caption every image under PATHS, appending one JSONL record per image; resumable.

    \b
    Examples:
      mmcli caption samples -o captions.jsonl
      mmcli caption samples --sidecar .txt --max-new-tokens 64 --dry-run
      mmcli caption samples --shard 0/2 -o shard0.jsonl --quiet
      mmcli caption samples --task caption --task tags -o labels.jsonl
    """
    from mmcli.cli.progress import Progress
    from mmcli.jobs.caption import CaptionJob, run_caption_job

    with exit_codes():
        ray_options = None
        if ray:
            from mmcli.jobs.distributed import RayOptions, parse_resources, require_ray

            require_ray()
            ray_options = RayOptions(ray_address, replicas, parse_resources(replica_resources))
        sampling = {"max_new_tokens": max_new_tokens, "temperature": temperature, "seed": seed}
        cfg = _settings(
            config,
            model=model,
            dtype=dtype,
            device=device,
            prompt=prompt,
            quantize=quantize,
            task=tuple(task) or None,
            compile={"backend": backend},
            generation=sampling,
        )
        job = CaptionJob(
            paths=paths,
            config=cfg,
            output=output,
            recursive=recursive,
            include=include,
            exclude=exclude,
            shard=shard,
            limit=limit,
            overwrite=overwrite,
            retry_errors=retry_errors,
            sidecar=sidecar,
            dry_run=dry_run,
            quiet=quiet,
            logprobs=logprobs,
            ray=ray_options,
            check_changed=check_changed,
            sampling=sampling,
        )
        code = run_caption_job(job, Progress(quiet=quiet))
    raise typer.Exit(code)


@app.command("compile")
def compile_cmd(
    bucket_list: str | None = typer.Argument(
        None, metavar="[LIST]", help="Only these buckets, e.g. 'decode 8x1024, prefill 512'."
    ),
    buckets: bool = typer.Option(
        False, "--buckets", help="Compile the configured buckets (or those in LIST)."
    ),
    model: ModelOption = None,
    config: ConfigOption = None,
    dtype: DtypeOption = None,
    device: DeviceOption = None,
    backend: str | None = typer.Option(None, help="compile.backend: inductor or neuron."),
    quantize: QuantizeOption = None,
) -> None:
    """Compile and cache every fixed-shape bucket ahead of time (vision blocks, prefill, decode).

    \b
    Examples:
      mmcli compile --buckets --backend inductor
      mmcli compile --buckets 'decode 8x1024, prefill 512' --backend inductor
    """
    from mmcli.cli.compile import compile_buckets

    with exit_codes():
        if not buckets:
            raise ConfigError(
                "say --buckets (every configured bucket) or --buckets 'decode 8x1024, ...'"
            )
        cfg = _settings(
            config,
            model=model,
            dtype=dtype,
            device=device,
            quantize=quantize,
            compile={"backend": backend},
        )
        if cfg.compile.backend in ("auto", "eager"):
            raise ConfigError(
                f"compile.backend {cfg.compile.backend} runs eagerly here: nothing to compile "
                "(choose --backend inductor or neuron)"
            )
        compile_buckets(cfg, bucket_list)


@app.command("config")
def config_cmd(
    action: str = typer.Argument("show", help="show: print the effective settings as YAML."),
    config: ConfigOption = None,
) -> None:
    """Print the effective configuration (defaults updated by --config)."""
    from mmcli.config import config_as_yaml

    with exit_codes():
        if action != "show":
            raise ConfigError(f"config {action!r}: only 'show' is known")
        typer.echo(config_as_yaml(_settings(config)))
