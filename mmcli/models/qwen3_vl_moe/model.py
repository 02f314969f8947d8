"""Qwen3-VL MoE's module tree: Qwen3-VL's, with a sparse MLP block in each sparse layer."""

from __future__ import annotations

from torch import nn

from mmcli.models.config import TextConfig
from mmcli.models.layers.moe import mlp_for
from mmcli.models.qwen3_vl.model import VisionLanguageModel
from mmcli.models.qwen3_vl.text import TextDecoder


class MoeDecoder(TextDecoder):
    def build_mlp(self, cfg: TextConfig, index: int) -> nn.Module:
        return mlp_for(cfg, index)


class Qwen3VLMoeModel(VisionLanguageModel):
    decoder_class = MoeDecoder
