"""Qwen3.5 as a family: Qwen3-VL's layout with a hybrid text decoder (Gated DeltaNet layers where
`layer_types` says), an output gate on attention, norms scaling by (1 + weight), rotary on the
first quarter of each head, and a vision tower without DeepStack."""

from __future__ import annotations

from mmcli.models.qwen3_vl.family import Qwen3VL


class Qwen3_5(Qwen3VL):
    model_type, name = "qwen3_5", "Qwen3.5"
    default_mrope_section = (11, 11, 10)

    def text_fields(self, text_raw: dict, rope: dict) -> None:
        factor = rope.get("partial_rotary_factor", text_raw.get("partial_rotary_factor", 0.25))
        text_raw.update(partial_rotary_factor=factor, attn_output_gate=True, norm_unit_offset=True)
        if not text_raw.get("layer_types"):
            interval = text_raw.get("full_attention_interval", 4)
            text_raw["layer_types"] = [
                "linear_attention" if (i + 1) % interval else "full_attention"
                for i in range(text_raw["num_hidden_layers"])
            ]

    def unused_tensor(self, name: str) -> bool:
        return name.startswith("mtp.")  # the released multi-token-prediction head

    def vision_fields(self, vision_raw: dict) -> dict:
        return {**vision_raw, "deepstack_visual_indexes": ()}  # no DeepStack taps

    def build(self, cfg):
        from mmcli.models.qwen3_5.model import Qwen3_5Model

        return Qwen3_5Model(cfg)
