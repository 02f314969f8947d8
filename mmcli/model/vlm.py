"""A Qwen3-VL or Qwen3.5 model, shaped like their released checkpoints: model.visual,
model.language_model, lm_head (the two families differ only inside those, by their config)."""

from __future__ import annotations

import torch
from torch import nn

from mmcli.model import int4_load
from mmcli.model.config import ModelConfig
from mmcli.model.linear import Linear
from mmcli.model.text import TextDecoder
from mmcli.model.vision import VisionTower


class VisionLanguageModel(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.model.visual = VisionTower(cfg.vision)
        self.model.language_model = TextDecoder(cfg.text)
        self.lm_head = Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)

    @classmethod
    def from_weights(
        cls,
        cfg: ModelConfig,
        tensors: dict[str, torch.Tensor],
        int4: dict | None = None,
        experts_int4: dict | None = None,
    ) -> VisionLanguageModel:
        """Build without allocating, then adopt the loaded tensors (tied lm_head shares
        embed_tokens) and any 4-bit weights (checkpoint.Weights)."""
        with torch.device("meta"):
            model = cls(cfg)
        model.load_state_dict(tensors, strict=not (int4 or experts_int4), assign=True)
        int4_load.adopt(model, int4 or {}, experts_int4 or {})
        return model.eval().requires_grad_(False)

    @property
    def visual(self) -> VisionTower:
        return self.model.visual

    @property
    def language_model(self) -> TextDecoder:
        return self.model.language_model
