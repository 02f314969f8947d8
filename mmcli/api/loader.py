"""Loading a run: the device, the precision and the backend decided once, then the checkpoint read
into the model, the runner, the prompt builder and the input settings."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mmcli.compiled.backends import resolve_backend
from mmcli.config import Config, cache_root, check_vision_budget
from mmcli.errors import ConfigError
from mmcli.inputs.images import ImageProcessorConfig, image_processor_config
from mmcli.inputs.video import VideoSampling
from mmcli.model.hub import local_checkpoint, resolve_model

if TYPE_CHECKING:
    import torch

    from mmcli.compiled.graphs import CompiledGraphs
    from mmcli.engine.runner import ModelRunner
    from mmcli.inputs.prompt import PromptBuilder
    from mmcli.model.vlm import VisionLanguageModel


@dataclass(frozen=True)
class RunPlan:
    """What a run of the settings will use, known before loading (and without fetching) the
    model."""

    path: Path | None  # the checkpoint directory, None while a hub id is not downloaded
    backend: str
    device: str
    precision: dict  # weights, loaded, compute, quantize (see checkpoint.run_precision)


@dataclass
class Loaded:
    path: Path
    config: Config
    model: VisionLanguageModel
    runner: ModelRunner
    prompts: PromptBuilder
    image_cfg: ImageProcessorConfig
    video_sampling: VideoSampling
    precision: dict
    stop_ids: frozenset[int]
    graphs: CompiledGraphs | None


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


def plan_run(cfg: Config, path: Path | None = None) -> RunPlan:
    """The backend, device and precision of a run (a backend that cannot run is refused first)."""
    from mmcli.model.checkpoint import read_model_config, run_precision

    backend = resolve_backend(cfg.compile.backend)
    path = path or local_checkpoint(cfg.model)
    checkpoint_dtype = read_model_config(path).torch_dtype if path is not None else "bfloat16"
    device = pick_device(cfg.device, backend).type
    precision = run_precision(cfg.dtype, cfg.weights_dtype, cfg.quantize, checkpoint_dtype, device)
    return RunPlan(path, backend, device, precision)


def load_description(cfg: Config) -> str:
    """What is about to load, for the status line: the model, its size, the device, the
    precision."""
    plan = plan_run(cfg)
    dtype = f"{plan.precision['weights']} weights, {plan.precision['compute']} compute"
    if plan.path is None:
        return f"{cfg.model} (not downloaded yet) on {plan.device}, {dtype}"
    size = sum(f.stat().st_size for f in plan.path.glob("*.safetensors"))
    shown = f"{size / 1e9:.2f} GB" if size >= 1e8 else f"{size / 1e6:.1f} MB"
    return f"{cfg.model} ({shown}) on {plan.device}, {dtype}"


def check_schemas(cfg: Config, tasks: list) -> None:
    """Compile the json tasks' schemas against the checkpoint's tokenizer before the model loads
    (a schema that cannot compile is a ConfigError naming its task). A hub id not downloaded yet
    is checked when it is, as the Labeler compiles them."""
    from mmcli.engine.grammar import compile_grammars

    path = local_checkpoint(cfg.model)
    tokenizer = path / "tokenizer.json" if path is not None else None
    if any(t.output == "json" for t in tasks) and tokenizer is not None and tokenizer.is_file():
        compile_grammars(tasks, tokenizer.read_text(), frozenset())


def load(cfg: Config) -> Loaded:
    """Read the checkpoint (fetching a hub id once) and build everything a run computes with."""
    import torch

    from mmcli.compiled.graphs import CompiledGraphs
    from mmcli.engine.runner import ModelRunner
    from mmcli.inputs.prompt import PromptBuilder
    from mmcli.model.checkpoint import load_weights, read_model_config, torch_dtype
    from mmcli.model.prepared import PreparedWeights
    from mmcli.model.vlm import VisionLanguageModel

    path = resolve_model(cfg.model)
    plan = plan_run(cfg, path)
    model_cfg = read_model_config(path)
    if cfg.quantize == "int4":
        check_int4(plan)
    check_moe_backend(model_cfg, plan.backend)
    device = torch.device(plan.device)
    compute = torch_dtype(plan.precision["compute"])
    graphs = None
    if plan.backend != "eager":
        graphs = CompiledGraphs.for_run(plan.backend, cfg, model_cfg, compute, device)
    weights = load_weights(
        path,
        model_cfg,
        compute,
        torch_dtype(plan.precision["loaded"]),
        int4=cfg.quantize == "int4",
    )
    model = VisionLanguageModel.from_weights(
        model_cfg, weights.tensors, weights.int4, weights.experts_int4
    )
    prepared = None
    if cfg.quantize == "int8" and cfg.weights_cache:
        prepared = PreparedWeights(cache_root(cfg.cache_dir), path)
    runner = ModelRunner(model, device, cfg, graphs, prepared)
    prompts = PromptBuilder.from_checkpoint(path, model_cfg.image_token_id, cfg.thinking)
    image_cfg = image_processor_config(path, cfg.image.min_pixels, cfg.image.max_pixels)
    check_vision_budget(
        cfg.vision.block_size, image_cfg.max_pixels, image_cfg.patch_size, image_cfg.merge_size
    )
    videos = VideoSampling.from_checkpoint(path, cfg.video, image_cfg.max_pixels)
    return Loaded(
        path=path,
        config=cfg,
        model=model,
        runner=runner,
        prompts=prompts,
        image_cfg=image_cfg,
        video_sampling=videos,
        precision=plan.precision,
        stop_ids=stop_ids(path, prompts),
        graphs=graphs,
    )


def check_moe_backend(model_cfg, backend: str) -> None:
    if model_cfg.text.num_experts and backend == "neuron":
        raise ConfigError(
            "compile.backend neuron: the MoE models run on eager or inductor (their experts are "
            "grouped by the routing read on the host, which a NEFF cannot call out to)"
        )


def check_int4(plan: RunPlan) -> None:
    """`quantize: int4` runs on the CPU with the eager backend (torch's int4 CPU kernels): refused
    otherwise, before anything is read."""
    from mmcli.model.int4 import can_int4

    if plan.device != "cpu" or plan.backend != "eager" or not can_int4():
        raise ConfigError(
            "quantize int4 runs on the CPU with the eager backend (torch's int4 CPU kernels); "
            f"this run has device {plan.device}, backend {plan.backend}, the kernels "
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
