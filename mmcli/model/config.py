"""The model's shape, read from a checkpoint's config.json: the text decoder and the vision tower
of the families mmcli runs (Qwen3-VL, and Qwen3.5's hybrid decoder).

Torch-free, so that settings, plans and `--help` never load torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from mmcli.errors import CheckpointError, UnsupportedModel

DEFAULT_MODEL = "Qwen/Qwen3-VL-2B-Instruct"
# model_type -> the family's name; all share the checkpoint layout, vision tower and prompts. The
# MoE models are their dense siblings with sparse MLP blocks.
FAMILIES = {
    "qwen3_vl": "Qwen3-VL",
    "qwen3_5": "Qwen3.5",
    "qwen3_vl_moe": "Qwen3-VL MoE",
    "qwen3_5_moe": "Qwen3.5 MoE",
}
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
    # Qwen3.5: rotary on the first fraction of each head, a sigmoid gate on the attention output,
    # RMSNorm scaling by (1 + weight), and Gated DeltaNet layers where layer_types says so.
    partial_rotary_factor: float = 1.0
    attn_output_gate: bool = False
    norm_unit_offset: bool = False
    layer_types: tuple[str, ...] = ()
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # mixture of experts: a router picks num_experts_per_tok experts per token (weights normalised)
    # in the sparse layers; Qwen3.5's add a shared expert behind a sigmoid gate
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    shared_expert_intermediate_size: int = 0

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer `layer` has a sparse (mixture-of-experts) MLP block."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def is_linear(self, layer: int) -> bool:
        """Whether decoder layer `layer` is a linear-attention (Gated DeltaNet) layer."""
        return bool(self.layer_types) and self.layer_types[layer] == "linear_attention"

    @property
    def linear_conv_dim(self) -> int:
        """Channels through a linear layer's causal conv: query, key and value together."""
        key_dim = self.linear_key_head_dim * self.linear_num_key_heads
        return 2 * key_dim + self.linear_value_head_dim * self.linear_num_value_heads


@dataclass(frozen=True)
class ModelConfig:
    text: TextConfig
    vision: VisionConfig
    family: str = "qwen3_vl"
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


def _family(raw: dict, where: str) -> str:
    model_type = raw.get("model_type")
    if model_type not in FAMILIES:
        archs = ",".join(raw.get("architectures") or []) or "?"
        runs = ", ".join(f"{k} ({v})" for k, v in FAMILIES.items())
        raise UnsupportedModel(
            f"{where}: model_type {model_type!r} ({archs}) is not a family mmcli runs: {runs}"
        )
    return model_type


def _text_config(text_raw: dict, family: str, where: str) -> TextConfig:
    rope = dict(text_raw.get("rope_parameters") or text_raw.get("rope_scaling") or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise CheckpointError(
            f"{where}: text_config rope_type {rope_type!r} is not supported (only 'default')"
        )
    hybrid = family.startswith("qwen3_5")
    # transformers writes Qwen3-VL MoE's expert count under its alias
    text_raw.setdefault("num_experts", text_raw.get("num_local_experts", 0))
    text_raw["rope_theta"] = rope.get("rope_theta", text_raw.get("rope_theta", 5_000_000.0))
    default_section = [11, 11, 10] if hybrid else [24, 20, 20]
    text_raw["mrope_section"] = rope.get("mrope_section", default_section)
    text_raw.setdefault("head_dim", text_raw["hidden_size"] // text_raw["num_attention_heads"])
    if hybrid:
        factor = rope.get("partial_rotary_factor", text_raw.get("partial_rotary_factor", 0.25))
        text_raw.update(partial_rotary_factor=factor, attn_output_gate=True, norm_unit_offset=True)
        if not text_raw.get("layer_types"):
            interval = text_raw.get("full_attention_interval", 4)
            text_raw["layer_types"] = [
                "linear_attention" if (i + 1) % interval else "full_attention"
                for i in range(text_raw["num_hidden_layers"])
            ]
    text = TextConfig(**_pick(text_raw, TextConfig))
    kinds = set(text.layer_types) - {"linear_attention", "full_attention"}
    if kinds or (text.layer_types and len(text.layer_types) != text.num_hidden_layers):
        raise CheckpointError(
            f"{where}: text_config layer_types {list(text.layer_types)} must name "
            f"{text.num_hidden_layers} layers, each linear_attention or full_attention"
        )
    if 2 * sum(text.mrope_section) != text.rotary_dim:
        raise CheckpointError(
            f"{where}: mrope_section {list(text.mrope_section)} does not fill the rotary "
            f"dimension {text.rotary_dim}"
        )
    return text


def parse_config(raw: dict, where: str = "config.json") -> ModelConfig:
    """Read a Qwen3-VL or Qwen3.5 config.json; accepts both `rope_scaling` (released) and
    `rope_parameters` (v5)."""
    family = _family(raw, where)
    try:
        text_raw = dict(raw["text_config"])
        vision_raw = dict(raw["vision_config"])
    except KeyError as e:
        raise CheckpointError(f"{where}: missing key {e.args[0]!r}") from None
    text = _text_config(text_raw, family, where)
    if family.startswith("qwen3_5"):
        vision_raw["deepstack_visual_indexes"] = ()  # Qwen3.5's tower has no DeepStack taps
    vision = VisionConfig(**_pick(vision_raw, VisionConfig))
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
        family=family,
        tie_word_embeddings=bool(tie),
        torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
        raw=raw,
        **top,
    )
