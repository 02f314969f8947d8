"""Qwen3-VL MoE: Qwen3-VL with sparse MLP blocks (a router and experts) in its sparse layers."""

from __future__ import annotations

from mmcli.models.qwen3_vl.family import Qwen3VL


class Sparse:
    """What an MoE variant adds to its dense family (put before it among the bases): the expert
    count's alias, the experts' checkpoint layouts, the backends its routing allows."""

    # the experts are grouped by the routing read on the host, which a NEFF cannot call out to
    # and a CUDA graph cannot capture
    backends, cuda_graphs = ("eager", "inductor"), False
    backend_reason = (
        "its experts are grouped by the routing read on the host, which a NEFF cannot call out to"
    )

    def kept_linears(self, model) -> set:
        """The routers: their few logits pick the experts, so they stay as loaded."""
        from mmcli.models.layers.moe import SparseMoeBlock

        blocks = [m for m in model.language_model.modules() if isinstance(m, SparseMoeBlock)]
        return super().kept_linears(model) | {block.gate for block in blocks}

    def text_fields(self, text_raw: dict, rope: dict) -> None:
        super().text_fields(text_raw, rope)
        # transformers writes Qwen3-VL MoE's expert count under its alias
        text_raw.setdefault("num_experts", text_raw.get("num_local_experts", 0))

    def map_checkpoint(self, tensors: dict, expected: dict) -> None:
        from mmcli.models.layers.moe import experts_as_held

        experts_as_held(tensors, expected)


class Qwen3VLMoe(Sparse, Qwen3VL):
    model_type, name = "qwen3_vl_moe", "Qwen3-VL MoE"

    def build(self, cfg):
        from mmcli.models.qwen3_vl_moe.model import Qwen3VLMoeModel

        return Qwen3VLMoeModel(cfg)
