"""The model's shape as the families read it from a checkpoint's config.json (each family's
package reads its own: models/qwen3_vl/family.py and those that subclass it): the text decoder
and the vision tower.

Torch-free, so that settings, plans and `--help` never load torch."""

from __future__ import annotations

from dataclasses import dataclass, field

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


def pick_fields(d: dict, cls) -> dict:
    """The entries of `d` that are fields of the dataclass `cls` (lists as tuples)."""
    names = cls.__dataclass_fields__
    return {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in names}
