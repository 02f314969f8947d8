"""The model's shape, read from a checkpoint's config.json (Qwen3-VL: text decoder and vision
tower).

Torch-free, so that settings, plans and `--help` never load torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from mmcli.errors import CheckpointError

DEFAULT_MODEL = "Qwen/Qwen3-VL-2B-Instruct"
# Qwen3-VL's vision geometry (preprocessor_config.json and vision_config of the released
# checkpoints): 16-pixel
# patches, 2x2 of them merged into one language-model token, two frames per temporal patch.
QWEN_PATCH_SIZE = 16
QWEN_MERGE_SIZE = 2
QWEN_TEMPORAL_PATCH_SIZE = 2


@dataclass(frozen=True)
class VisionConfig:
    depth: int = 27
    hidden_size: int = 1152
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = QWEN_PATCH_SIZE
    temporal_patch_size: int = QWEN_TEMPORAL_PATCH_SIZE
    spatial_merge_size: int = QWEN_MERGE_SIZE
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
    """Read a Qwen3-VL config.json; accepts both `rope_scaling` (released) and `rope_parameters`
    (v5)."""
    model_type = raw.get("model_type")
    if model_type != "qwen3_vl":
        archs = ",".join(raw.get("architectures") or []) or "?"
        raise CheckpointError(
            f"{where}: model_type {model_type!r} ({archs}) is not Qwen3-VL; mmcli needs a "
            "'qwen3_vl' checkpoint"
        )
    try:
        text_raw = dict(raw["text_config"])
        vision_raw = dict(raw["vision_config"])
    except KeyError as e:
        raise CheckpointError(f"{where}: missing key {e.args[0]!r}") from None
    rope = dict(text_raw.get("rope_parameters") or text_raw.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(
            f"{where}: text_config rope_type {rope_type!r} is not supported (only 'default')"
        )
    text_raw["rope_theta"] = rope.get("rope_theta", text_raw.get("rope_theta", 5_000_000.0))
    text_raw["mrope_section"] = rope.get("mrope_section", [24, 20, 20])
    text_raw.setdefault("head_dim", text_raw["hidden_size"] // text_raw["num_attention_heads"])
    text = TextConfig(**_pick(text_raw, TextConfig))
    vision = VisionConfig(**_pick(vision_raw, VisionConfig))
    if 2 * sum(text.mrope_section) != text.head_dim:
        raise CheckpointError(
            f"{where}: mrope_section {list(text.mrope_section)} does not fill head_dim "
            f"{text.head_dim}"
        )
    tie = raw.get("tie_word_embeddings", text_raw.get("tie_word_embeddings", False))
    top = {
        k: raw[k]
        for k in (
            "image_token_id",
            "video_token_id",
            "vision_start_token_id",
            "vision_end_token_id",
        )
        if k in raw
    }
    return ModelConfig(
        text=text,
        vision=vision,
        tie_word_embeddings=bool(tie),
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
        raw=raw,
        **top,
    )
