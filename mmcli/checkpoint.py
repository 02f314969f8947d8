"""Qwen3-VL checkpoints in the released Hugging Face layout: config.json and safetensors weights."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from .errors import CheckpointError

DEFAULT_MODEL = "Qwen/Qwen3-VL-2B-Instruct"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class VisionConfig:
    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: tuple[int, ...] = (8, 16, 24)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass(frozen=True)
class TextConfig:
    hidden_size: int = 4096
    intermediate_size: int = 22016
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 128
    vocab_size: int = 151936
    rms_norm_eps: float = 1e-6
    rope_theta: float = 5_000_000.0
    mrope_section: tuple[int, ...] = (24, 20, 20)
    rope_type: str = "default"


@dataclass(frozen=True)
class ModelConfig:
    text: TextConfig
    vision: VisionConfig
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    raw: dict = field(default_factory=dict, compare=False, repr=False)


def _pick(d: dict, cls) -> dict:
    names = cls.__dataclass_fields__
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in names}


def parse_config(raw: dict, where: str = "config.json") -> ModelConfig:
    """Read a Qwen3-VL config.json; accepts both `rope_scaling` (released) and `rope_parameters` (v5)."""
    model_type = raw.get("model_type")
    if model_type != "qwen3_vl":
        archs = ",".join(raw.get("architectures") or []) or "?"
        raise CheckpointError(
            f"{where}: model_type {model_type!r} ({archs}) is not Qwen3-VL; mmcli needs a 'qwen3_vl' checkpoint"
        )
    try:
        text_raw = dict(raw["text_config"])
        vision_raw = dict(raw["vision_config"])
    except KeyError as e:
        raise CheckpointError(f"{where}: missing key {e.args[0]!r}") from None
    rope = dict(text_raw.get("rope_parameters") or text_raw.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(f"{where}: text_config rope_type {rope_type!r} is not supported (only 'default')")
    text_raw["rope_theta"] = rope.get("rope_theta", text_raw.get("rope_theta", 5_000_000.0))
    text_raw["mrope_section"] = rope.get("mrope_section", [24, 20, 20])
    text_raw.setdefault("head_dim", text_raw["hidden_size"] // text_raw["num_attention_heads"])
    text = TextConfig(**_pick(text_raw, TextConfig))
    vision = VisionConfig(**_pick(vision_raw, VisionConfig))
    if 2 * sum(text.mrope_section) != text.head_dim:
        raise CheckpointError(
            f"{where}: mrope_section {list(text.mrope_section)} does not fill head_dim {text.head_dim}")
    tie = raw.get("tie_word_embeddings", text_raw.get("tie_word_embeddings", False))
    top = {k: raw[k] for k in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")
           if k in raw}
    return ModelConfig(text=text, vision=vision, tie_word_embeddings=bool(tie),
                       torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"), raw=raw, **top)


def torch_dtype(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(_DTYPES)}") from None


def resolve_model(model: str) -> Path:
    """A local checkpoint directory, or a hub id fetched (once) with huggingface_hub."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path}: no config.json; not a Hugging Face checkpoint directory")
        return path
    if path.exists() or model.startswith((".", "/", "~")) or model.count("/") != 1:
        raise CheckpointError(f"{model}: no such checkpoint directory (and not a hub id like {DEFAULT_MODEL})")
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.jinja", "*.safetensors", "*.txt"]
    try:
        return Path(snapshot_download(model, allow_patterns=patterns))
    except Exception as e:  # noqa: BLE001 - any hub failure ends the same way for the user
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{model}: cannot fetch from the Hugging Face hub ({reason[:160]}); download it elsewhere and pass "
            f"the local directory with --model /path/to/checkpoint (or set HF_HUB_OFFLINE=1 to use the cache)"
        ) from None


def read_model_config(path: Path) -> ModelConfig:
    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path / 'config.json'}: cannot read ({e})") from None
    return parse_config(raw, str(path / "config.json"))


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor name of the released layout and its shape (section 1.4 of the spec)."""
    v, t = cfg.vision, cfg.text
    d, m = v.hidden_size, v.hidden_size * v.spatial_merge_size**2
    shapes: dict[str, tuple[int, ...]] = {
        "model.visual.patch_embed.proj.weight": (d, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
        "model.visual.patch_embed.proj.bias": (d,),
        "model.visual.pos_embed.weight": (v.num_position_embeddings, d),
    }
    for i in range(v.depth):
        p = f"model.visual.blocks.{i}."
        shapes.update({p + "norm1.weight": (d,), p + "norm1.bias": (d,), p + "norm2.weight": (d,),
                       p + "norm2.bias": (d,), p + "attn.qkv.weight": (3 * d, d), p + "attn.qkv.bias": (3 * d,),
                       p + "attn.proj.weight": (d, d), p + "attn.proj.bias": (d,),
                       p + "mlp.linear_fc1.weight": (v.intermediate_size, d),
                       p + "mlp.linear_fc1.bias": (v.intermediate_size,),
                       p + "mlp.linear_fc2.weight": (d, v.intermediate_size), p + "mlp.linear_fc2.bias": (d,)})
    mergers = ["model.visual.merger."] + [f"model.visual.deepstack_merger_list.{k}."
                                           for k in range(len(v.deepstack_visual_indexes))]
    for k, p in enumerate(mergers):
        norm = d if k == 0 else m
        shapes.update({p + "norm.weight": (norm,), p + "norm.bias": (norm,), p + "linear_fc1.weight": (m, m),
                       p + "linear_fc1.bias": (m,), p + "linear_fc2.weight": (v.out_hidden_size, m),
                       p + "linear_fc2.bias": (v.out_hidden_size,)})
    h, q, kv = t.hidden_size, t.num_attention_heads * t.head_dim, t.num_key_value_heads * t.head_dim
    shapes["model.language_model.embed_tokens.weight"] = (t.vocab_size, h)
    for i in range(t.num_hidden_layers):
        p = f"model.language_model.layers.{i}."
        shapes.update({p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                       p + "self_attn.q_norm.weight": (t.head_dim,), p + "self_attn.k_norm.weight": (t.head_dim,),
                       p + "mlp.gate_proj.weight": (t.intermediate_size, h),
                       p + "mlp.up_proj.weight": (t.intermediate_size, h),
                       p + "mlp.down_proj.weight": (h, t.intermediate_size),
                       p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)})
    shapes["model.language_model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (t.vocab_size, h)
    return shapes


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as e:
            raise CheckpointError(f"{index}: unreadable index ({e})") from None
        files = [path / f for f in sorted(set(weight_map.values()))]
    else:
        files = sorted(path.glob("*.safetensors"))
    missing = [f.name for f in files if not f.is_file()]
    if not files or missing:
        raise CheckpointError(f"{path}: weight files missing: {', '.join(missing) or 'no *.safetensors'}")
    return files


def load_weights(path: Path, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """All tensors, cast to `dtype`, checked by name and shape against the config (safetensors only)."""
    expected = expected_shapes(cfg)
    tensors: dict[str, torch.Tensor] = {}
    for file in _weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                names = list(f.keys())
            while names:
                # Reopen every ~512 MB: closing unmaps the file, so its pages stop counting as resident memory
                # while the copies in `dtype` are made (peak stays near the loaded weights, not weights + file).
                with safe_open(str(file), framework="pt") as f:
                    read = 0
                    while names and read < 512 << 20:
                        name = names.pop(0)
                        t = f.get_tensor(name)
                        read += t.numel() * t.element_size()
                        tensors[name] = t.to(dtype)
        except (OSError, ValueError, RuntimeError) as e:
            raise CheckpointError(f"{file}: cannot read safetensors ({str(e)[:160]})") from None
    if "lm_head.weight" not in tensors and cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = tensors.get("model.language_model.embed_tokens.weight")
    missing = sorted(n for n in expected if tensors.get(n) is None)
    unexpected = sorted(n for n in tensors if n not in expected)
    wrong = [f"{n} {tuple(tensors[n].shape)} != {expected[n]}" for n in expected
             if tensors.get(n) is not None and tuple(tensors[n].shape) != expected[n]]
    problems = []
    for label, names in (("missing tensors", missing), ("unexpected tensors", unexpected), ("wrong shapes", wrong)):
        if names:
            more = f" (+{len(names) - 3} more)" if len(names) > 3 else ""
            problems.append(f"{label}: {', '.join(names[:3])}{more}")
    if problems:
        raise CheckpointError(f"{path}: {'; '.join(problems)}")
    return tensors


def checkpoint_revision(path: Path) -> str | None:
    """The hub snapshot hash when `path` is a huggingface_hub snapshot, else None."""
    parts = Path(os.path.realpath(path)).parts
    return parts[-1] if len(parts) > 2 and parts[-2] == "snapshots" else None
