"""Qwen3.5 MoE's module tree: Qwen3.5's, with a sparse MLP block in each sparse layer."""

from __future__ import annotations

from torch import nn

from mmcli.models.config import TextConfig
from mmcli.models.layers.moe import mlp_for
from mmcli.models.qwen3_5.model import HybridDecoder, Qwen3_5Model


class HybridMoeDecoder(HybridDecoder):
    def build_mlp(self, cfg: TextConfig, index: int) -> nn.Module:
        return mlp_for(cfg, index)


class Qwen3_5MoeModel(Qwen3_5Model):
    decoder_class = HybridMoeDecoder
