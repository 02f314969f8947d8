"""Qwen3.5 MoE: Qwen3.5 with sparse MLP blocks (and a shared expert behind a sigmoid gate)."""

from __future__ import annotations

from mmcli.models.qwen3_5.family import Qwen3_5
from mmcli.models.qwen3_vl_moe.family import Sparse


class Qwen3_5Moe(Sparse, Qwen3_5):
    model_type, name = "qwen3_5_moe", "Qwen3.5 MoE"

    def build(self, cfg):
        from mmcli.models.qwen3_5_moe.model import Qwen3_5MoeModel

        return Qwen3_5MoeModel(cfg)
