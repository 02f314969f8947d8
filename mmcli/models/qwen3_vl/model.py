"""Qwen3-VL shaped like its released checkpoints: model.visual, model.language_model, lm_head;
the prompt's embedding with the vision features and their DeepStack levels."""

from __future__ import annotations

import torch
from torch import nn

from mmcli.models.config import ModelConfig
from mmcli.models.layers.linear import Linear
from mmcli.models.qwen3_vl.text import TextDecoder
from mmcli.models.qwen3_vl.vision import VisionTower


class VisionLanguageModel(nn.Module):
    decoder_class = TextDecoder  # the families that subclass this one change the decoder

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = nn.Module()
        self.model.visual = VisionTower(cfg.vision)
        self.model.language_model = self.decoder_class(cfg.text)
        self.lm_head = Linear(cfg.text.hidden_size, cfg.text.vocab_size, bias=False)
        self.lm_head.work = "head"  # the logits: a kind of work of its own for the kernel plan

    @property
    def visual(self) -> VisionTower:
        return self.model.visual

    @property
    def language_model(self) -> TextDecoder:
        return self.model.language_model

    def embed_inputs(
        self, ids: torch.Tensor, features: list | None
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """Token embeddings [T, H] with the vision features (one (merged, [DeepStack levels]) per
        image or frame pair, in prompt order) at the image and video tokens, and the DeepStack
        levels as dense [T, H] (zero off those tokens: one add per layer, the same shapes
        always), or None without vision tokens."""
        hidden = self.language_model.embed(ids)
        visual_mask = (ids == self.cfg.image_token_id) | (ids == self.cfg.video_token_id)
        if not features:
            return hidden, None
        merged = torch.cat([f for f, _ in features]).to(hidden.dtype)
        if merged.shape[0] != int(visual_mask.sum()):
            raise ValueError(
                f"{int(visual_mask.sum())} image tokens but {merged.shape[0]} image features"
            )
        hidden = hidden.index_put((visual_mask,), merged)
        deepstack = [
            torch.zeros_like(hidden).index_put(
                (visual_mask,), torch.cat([ds[level] for _, ds in features]).to(hidden.dtype)
            )
            for level in range(len(features[0][1]))
        ]
        return hidden, deepstack

    def has_vision_tokens(self, ids: torch.Tensor) -> bool:
        return bool(((ids == self.cfg.image_token_id) | (ids == self.cfg.video_token_id)).any())
