"""Qwen3.5's module tree: Qwen3-VL's, with Gated DeltaNet in the decoder's linear layers."""

from __future__ import annotations

from mmcli.models.config import TextConfig
from mmcli.models.qwen3_5.gated_delta_net import GatedDeltaNet
from mmcli.models.qwen3_vl.model import VisionLanguageModel
from mmcli.models.qwen3_vl.text import DecoderLayer, TextDecoder


class HybridDecoder(TextDecoder):
    def build_layer(self, cfg: TextConfig, index: int) -> DecoderLayer:
        if cfg.is_linear(index):
            return DecoderLayer(cfg, self.build_mlp(cfg, index), GatedDeltaNet(cfg))
        return super().build_layer(cfg, index)


class Qwen3_5Model(VisionLanguageModel):
    decoder_class = HybridDecoder
