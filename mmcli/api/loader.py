"""A run of the settings resolved once (`Run`: the checkpoint's config.json and preprocessor config
read, the backend, the device and the precision decided), then loaded: the checkpoint read into
the model with its kernel plan, the runner, the prompt builder and the input settings."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from mmcli.compiled.backends import resolve_backend
from mmcli.config import Config, cache_root, check_vision_budget, engine_for
from mmcli.errors import ConfigError
from mmcli.inputs.images import ImageProcessorConfig, image_processor_config
from mmcli.inputs.video import VideoSampling
from mmcli.models.config import ModelConfig
from mmcli.weights.hub import local_checkpoint, read_config, resolve_model
from mmcli.weights.precision import Precision, run_precision

if TYPE_CHECKING:
    import torch
    from torch import nn

    from mmcli.compiled.graphs import CompiledGraphs
    from mmcli.engine.runner import ModelRunner
    from mmcli.inputs.prompt import PromptBuilder
    from mmcli.kernels.plan import KernelPlan
    from mmcli.weights.prepared import PreparedWeights


@dataclass(frozen=True)
class Run:
    """What a run of the settings uses, known before loading (and without fetching) the model;
    made once and handed down (torch-free)."""

    config: Config
    path: Path | None  # the checkpoint directory, None while a hub id is not downloaded
    config_bytes: bytes | None  # config.json as read (the model's identity digests these)
    model_config: ModelConfig | None
    image_cfg: ImageProcessorConfig  # the checkpoint's preprocessor under the pixel budget
    backend: str
    device: str
    precision: Precision


@dataclass(frozen=True)
class Loaded:
    """What loading a run made; the run itself (its settings, paths and precision) is held, not
    copied."""

    run: Run
    model: nn.Module
    runner: ModelRunner
    prompts: PromptBuilder
    video_sampling: VideoSampling
    stop_ids: frozenset[int]
    graphs: CompiledGraphs | None
    kernel_plan: KernelPlan
    prepared: PreparedWeights | None  # the int8 or int4 cache file: `written()` says where


def pick_device(name: str, backend: str = "eager") -> torch.device:
    """The device of a run: neuron with the neuron backend; auto is CUDA when torch sees it."""
    import torch

    if backend == "neuron":
        return torch.device("neuron")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' was asked for, but torch sees no CUDA device")
    return torch.device(name)  # the settings allow only auto, cpu and cuda


def resolve_run(cfg: Config, path: Path | None = None) -> Run:
    """The run of `cfg` (a backend that cannot run is refused first); `path`: the checkpoint
    directory where it is known, else the local one the model setting names, if any."""
    from mmcli.kernels import cpu_features

    backend = resolve_backend(cfg.compile.backend)
    path = path or local_checkpoint(cfg.model)
    config_bytes = model_cfg = None
    if path is not None:
        config_bytes, model_cfg = read_config(path)
    checkpoint_dtype = model_cfg.torch_dtype if model_cfg is not None else "bfloat16"
    device = pick_device(cfg.device, backend).type
    # the cache sized to the job (runner); a hybrid's rows' fixed states count in its budget
    grows = device == "cpu" and backend == "eager"
    cfg = replace(cfg, engine=engine_for(cfg.engine, grows, cfg.compile.decode_batch_buckets))
    bf16_matrix = device == "cpu" and backend == "eager" and cpu_features.detect().bf16_matrix()
    precision = run_precision(
        cfg.dtype, cfg.weights_dtype, cfg.quantize, checkpoint_dtype, device, bf16_matrix
    )
    image_cfg = image_processor_config(path, cfg.image.min_pixels, cfg.image.max_pixels)
    return Run(cfg, path, config_bytes, model_cfg, image_cfg, backend, device, precision)


def load_description(run: Run) -> str:
    """What is about to load, for the status line: the model, its size, the device, the
    precision."""
    cfg, dtype = run.config, run.precision.describe()
    if run.path is None:
        return f"{cfg.model} (not downloaded yet) on {run.device}, {dtype}"
    size = sum(f.stat().st_size for f in run.path.glob("*.safetensors"))
    shown = f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"
    return f"{cfg.model} ({shown}) on {run.device}, {dtype}"


def check_schemas(cfg: Config, tasks: list) -> None:
    """Compile the json tasks' schemas against the checkpoint's tokenizer before the model loads
    (a schema that cannot compile is a ConfigError naming its task). A hub id not downloaded yet
    is checked when it is, as the Labeler compiles them."""
    from mmcli.engine.grammar import compile_grammars

    path = local_checkpoint(cfg.model)
    tokenizer = path / "tokenizer.json" if path is not None else None
    if any(t.output == "json" for t in tasks) and tokenizer is not None and tokenizer.is_file():
        compile_grammars(tasks, tokenizer.read_text(), frozenset())


def load(run: Run) -> Loaded:
    """Read the checkpoint (fetching a hub id once) and build everything a run computes with."""
    from mmcli.compiled.graphs import CompiledGraphs
    from mmcli.engine.runner import ModelRunner
    from mmcli.inputs.prompt import PromptBuilder
    from mmcli.kernels.plan import vision_by_range

    if run.path is None:  # a hub id: fetched now, and its files read once
        run = resolve_run(run.config, resolve_model(run.config.model))
    cfg, path, model_cfg = run.config, run.path, run.model_config
    check_backend(run, cfg.quantize, model_cfg)
    model, kernel_plan, prepared, device = _load_model(run)
    compute = run.precision.compute_dtype
    graphs = None
    if run.backend != "eager":
        graphs = CompiledGraphs.for_run(run.backend, cfg, model_cfg, compute, device)
    one_row = vision_by_range(kernel_plan)
    runner = ModelRunner(model, device, cfg, compute, graphs, run.precision.kv_dtype, one_row)
    prompts = PromptBuilder.from_checkpoint(path, model_cfg.image_token_id, cfg.thinking)
    image_cfg = run.image_cfg
    check_vision_budget(
        cfg.vision.block_size, image_cfg.max_pixels, image_cfg.patch_size, image_cfg.merge_size
    )
    return Loaded(
        run=run,
        model=model,
        runner=runner,
        prompts=prompts,
        video_sampling=VideoSampling.from_checkpoint(path, cfg.video, image_cfg.max_pixels),
        stop_ids=stop_ids(path, prompts),
        graphs=graphs,
        kernel_plan=kernel_plan,
        prepared=prepared,
    )


def _load_model(run: Run):
    """The model with its weights in the kernel plan's form on the run's device: (model, plan,
    the prepared weights' file or None, device). The plan is chosen first: the weights are read
    into its form (int4 as read, or from the prepared file) and prepared in it (int8, packed
    float32)."""
    import torch

    from mmcli.weights.loader import build_model, prepare

    kernel_plan = choose_kernels(run, run.model_config)
    weights, prepared = _read_weights(run, kernel_plan.linears.id)
    device = torch.device(run.device)
    huge_pages = run.config.weights_memory in ("auto", "huge_pages")
    model = build_model(run.model_config, weights)
    del weights  # the model holds them now: a storage moved into huge pages is then freed at once
    model = prepare(model, kernel_plan, device, prepared, huge_pages)
    return model, kernel_plan, prepared, device


def _read_weights(run: Run, form: str):
    """The checkpoint read for the weights' `form` (the plan's `linears`), and the prepared
    weights' file where the form has one (int8, int4) and the cache is on: int4's 4-bit weights
    read from it where it holds them, else quantized as read and written to it."""
    from mmcli.weights.checkpoint import int4_shapes, load_weights
    from mmcli.weights.prepared import INT4_INT8, RECIPES, PreparedWeights

    cfg, precision = run.config, run.precision
    prepared = None
    if form in RECIPES and cfg.weights_cache:
        directory = cache_root(cfg.cache_dir)
        prepared = PreparedWeights(directory, run.path, run.config_bytes, RECIPES[form])
    int4 = form == RECIPES["int4"].form
    if int4 and prepared is not None:  # its int8 layers, where the plan takes them
        prepared.int8 = PreparedWeights(directory, run.path, run.config_bytes, INT4_INT8)
    held = prepared.read_int4(int4_shapes(run.model_config)) if int4 and prepared else None
    weights = load_weights(
        run.path,
        run.model_config,
        precision.compute_dtype,
        precision.loaded_dtype,
        int4=int4,
        int4_prepared=held,
    )
    if int4 and prepared is not None and held is None:
        prepared.write_int4(weights.int4, weights.experts_int4)
    return weights, prepared


def choose_kernels(run: Run, model_cfg: ModelConfig | None) -> KernelPlan:
    """The kernel plan of this run on this machine (kernels/plan.py); without the model's
    config (not on disk yet), a dense decoder's whose layers all fuse."""
    from mmcli.kernels import machine
    from mmcli.kernels.plan import RunShape, choose
    from mmcli.models.registry import family_of

    text = model_cfg.text if model_cfg is not None else None
    fam = family_of(model_cfg) if model_cfg is not None else None
    precision = run.precision
    shape = RunShape(
        device=run.device,
        backend=run.backend,
        compute=precision.compute,
        loaded=precision.loaded,
        quantize=precision.quantize,
        products=precision.products,
        hybrid=fam is not None and fam.hybrid(text),
        sparse=fam is not None and fam.sparse(text),
        fusable_decode=fam is None or fam.fusable_decode(text),
        tied_head=model_cfg is not None and model_cfg.tie_word_embeddings,
    )
    return choose(shape, machine.for_device(run.device))


def check_backend(run: Run, quantize: str, model_cfg) -> None:
    """What this run's device and backend cannot run, refused before the weights are read: the
    quantized forms off the CPU's eager backend, a family on a backend it has no graphs for."""
    if quantize == "int4":
        check_int4(run)
    if quantize == "int8" and (run.device != "cpu" or run.backend != "eager"):
        raise ConfigError(
            "quantize int8 runs on the CPU with the eager backend; this run has device "
            f"{run.device}, backend {run.backend}"
        )
    check_family_backend(model_cfg, run.backend)


def check_family_backend(model_cfg, backend: str) -> None:
    from mmcli.models.registry import family_of

    family = family_of(model_cfg)
    if backend not in family.backends:
        raise ConfigError(
            f"compile.backend {backend}: {family.name} runs on {' or '.join(family.backends)} "
            f"({family.backend_reason})"
        )


def check_int4(run: Run) -> None:
    """`quantize: int4` runs on the CPU with the eager backend (torch's int4 CPU kernels): refused
    otherwise, before anything is read."""
    from mmcli.models.layers.quantized import can_int4

    if run.device != "cpu" or run.backend != "eager" or not can_int4():
        raise ConfigError(
            "quantize int4 runs on the CPU with the eager backend (torch's int4 CPU kernels); "
            f"this run has device {run.device}, backend {run.backend}, the kernels "
            f"{'present' if can_int4() else 'missing in this torch'}"
        )


def stop_ids(path: Path, prompts: PromptBuilder) -> frozenset[int]:
    """generation_config.json's eos ids, else the tokenizer's eos token."""
    ids: list[int] = []
    gen = path / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids = eos if isinstance(eos, list) else [eos] if eos is not None else []
    if not ids:
        eos_token = prompts.special_tokens.get("eos_token")
        ids = [prompts.tokenizer.token_to_id(eos_token)] if eos_token else []
    return frozenset(int(i) for i in ids if i is not None)
