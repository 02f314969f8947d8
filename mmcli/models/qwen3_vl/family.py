"""Qwen3-VL as a family: its config.json read into the model's shape, its module tree, its rotary
index. Torch-free until a model is built."""

from __future__ import annotations

from mmcli.errors import CheckpointError
from mmcli.models.config import ModelConfig, TextConfig, VisionConfig, pick_fields
from mmcli.models.family import Family

# config.json keys of the special tokens, where a checkpoint sets them
TOKEN_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


class Qwen3VL(Family):
    model_type, name = "qwen3_vl", "Qwen3-VL"
    default_mrope_section = (24, 20, 20)
    token_embedding = "model.language_model.embed_tokens.weight"

    def hybrid(self, text) -> bool:
        return bool(text.layer_types)

    def sparse(self, text) -> bool:
        return text.num_experts > 0

    def fusable_decode(self, text) -> bool:
        """Attention without an output gate, rotary over whole heads, plain RMSNorms, dense MLPs."""
        return not (
            self.hybrid(text)
            or self.sparse(text)
            or text.attn_output_gate
            or text.norm_unit_offset
            or text.rotary_dim != text.head_dim
        )

    def read_config(self, raw: dict, where: str) -> ModelConfig:
        """Accepts both `rope_scaling` (released) and `rope_parameters` (transformers v5)."""
        try:
            text_raw = dict(raw["text_config"])
            vision_raw = dict(raw["vision_config"])
        except KeyError as e:
            raise CheckpointError(f"{where}: missing key {e.args[0]!r}") from None
        text = self.text_config(text_raw, where)
        vision = VisionConfig(**pick_fields(self.vision_fields(vision_raw), VisionConfig))
        tie = raw.get("tie_word_embeddings", text_raw.get("tie_word_embeddings", False))
        return ModelConfig(
            text=text,
            vision=vision,
            family=self.model_type,
            tie_word_embeddings=bool(tie),
            torch_dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "bfloat16"),
            raw=raw,
            **{k: raw[k] for k in TOKEN_KEYS if k in raw},
        )

    def text_config(self, text_raw: dict, where: str) -> TextConfig:
        rope = dict(text_raw.get("rope_parameters") or text_raw.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise CheckpointError(
                f"{where}: text_config rope_type {rope_type!r} is not supported (only 'default')"
            )
        text_raw["rope_theta"] = rope.get("rope_theta", text_raw.get("rope_theta", 5_000_000.0))
        text_raw["mrope_section"] = rope.get("mrope_section", list(self.default_mrope_section))
        text_raw.setdefault("head_dim", text_raw["hidden_size"] // text_raw["num_attention_heads"])
        self.text_fields(text_raw, rope)
        text = TextConfig(**pick_fields(text_raw, TextConfig))
        check_text_config(text, where)
        return text

    def text_fields(self, text_raw: dict, rope: dict) -> None:
        """The family's own reading of text_config (in place): none for Qwen3-VL."""

    def vision_fields(self, vision_raw: dict) -> dict:
        return vision_raw

    def build(self, cfg: ModelConfig):
        from mmcli.models.qwen3_vl.model import VisionLanguageModel

        return VisionLanguageModel(cfg)

    def rope_index(self, input_ids, vision_grids, visual_token_ids, spatial_merge_size):
        from mmcli.models.qwen3_vl.rope_index import rope_index

        return rope_index(input_ids, vision_grids, visual_token_ids, spatial_merge_size)

    def rotary_axes(self, text):
        from mmcli.models.qwen3_vl.rope_index import interleaved_axes

        return interleaved_axes(text.mrope_section, text.rotary_dim)

    def vision_levels(self, cfg: ModelConfig) -> int:
        return len(cfg.vision.deepstack_visual_indexes)  # DeepStack's taps

    def fold_groups(self, model):
        scopes = [*model.language_model.layers, *model.visual.blocks]
        return [(scope, scope.fold_groups()) for scope in scopes]


def check_text_config(text: TextConfig, where: str) -> None:
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
