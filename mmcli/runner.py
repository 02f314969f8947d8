"""The runner owns tensors: device, dtype, weights, KV cache, vision encoding, prefill and decode calls."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .checkpoint import ModelConfig
from .model import AttentionBatch, KVCache, Qwen3VL
from .positions import decode_rotary_position_ids, mrope_cos_sin, mrope_slot_axes, text_inv_freq
from .sampling import SamplingParams, choose_tokens


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not one of auto, cpu, cuda")
    return torch.device(name)


@dataclass
class PrefillItem:
    """One sequence's prompt, as the runner needs it."""

    slot: int
    input_ids: list[int]
    rotary_position_ids: torch.Tensor  # [3, L]
    pixel_values: list[torch.Tensor]  # one [n_i, C*T*P*P] per image, in prompt order
    image_grids: list[tuple[int, int, int]]


@dataclass
class DecodeItem:
    slot: int
    token_id: int
    position: int  # sequential position of this token (= tokens already in the cache)
    rope_delta: int


@dataclass
class Choice:
    token_id: int
    logprob: float


class ModelRunner:
    def __init__(self, model: Qwen3VL, device: torch.device, max_seqs: int = 1, max_len: int = 4096):
        self.model = model.to(device)
        self.cfg: ModelConfig = model.cfg
        self.device = device
        self.dtype = model.lm_head.weight.dtype
        text = self.cfg.text
        self.inv_freq = text_inv_freq(text.head_dim, text.rope_theta).to(device)
        self.slot_axes = mrope_slot_axes(text.mrope_section, text.head_dim).to(device)
        self.cache = KVCache(text, max_seqs, max_len, self.dtype, device)

    @torch.inference_mode()
    def encode_images(self, pixel_values: list[torch.Tensor], grids: list[tuple[int, int, int]]):
        """Vision tower over several images at once; returns (features, deepstack levels) per image."""
        pixels = torch.cat(pixel_values).to(self.device)
        merged, deepstack = self.model.visual(pixels, grids)
        m2 = self.cfg.vision.spatial_merge_size**2
        sizes = [t * h * w // m2 for t, h, w in grids]
        return list(zip(merged.split(sizes), zip(*[d.split(sizes) for d in deepstack]) if deepstack
                        else [()] * len(sizes)))

    def _embed_prompts(self, items: list[PrefillItem], image_features: list | None):
        ids = torch.tensor([i for item in items for i in item.input_ids], device=self.device)
        hidden = self.model.language_model.embed_tokens(ids)
        visual_mask = ids == self.cfg.image_token_id
        if not bool(visual_mask.any()):
            return hidden, None, None
        if image_features is None:
            pixels = [p for item in items for p in item.pixel_values]
            grids = [g for item in items for g in item.image_grids]
            image_features = self.encode_images(pixels, grids)
        merged = torch.cat([f for f, _ in image_features]).to(hidden.dtype)
        if merged.shape[0] != int(visual_mask.sum()):
            raise ValueError(f"{int(visual_mask.sum())} image tokens but {merged.shape[0]} image features")
        hidden = hidden.index_put((visual_mask,), merged)
        levels = len(image_features[0][1])
        deepstack = [torch.cat([ds[level] for _, ds in image_features]) for level in range(levels)]
        return hidden, visual_mask, deepstack

    @torch.inference_mode()
    def prefill(self, items: list[PrefillItem], image_features: list | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """Prompts back to back (no padding) -> logits of each prompt's last token [B, V] (or all, [T, V])."""
        hidden, visual_mask, deepstack = self._embed_prompts(items, image_features)
        seqlens = [len(item.input_ids) for item in items]
        rotary = torch.cat([item.rotary_position_ids for item in items], dim=1).to(self.device)
        cos, sin = mrope_cos_sin(rotary, self.inv_freq, self.slot_axes)
        batch = AttentionBatch(slots=torch.tensor([item.slot for item in items], device=self.device),
                               positions=torch.cat([torch.arange(n) for n in seqlens]).to(self.device),
                               seqlens=seqlens)
        out = self.model.language_model(hidden, cos, sin, batch, self.cache, visual_mask, deepstack)
        if not all_logits:
            out = out[torch.tensor(seqlens, device=self.device).cumsum(0) - 1]
        return self.model.lm_head(out).float()

    @torch.inference_mode()
    def decode(self, items: list[DecodeItem]) -> torch.Tensor:
        """One new token per sequence, all in one forward pass -> logits [B, V]."""
        ids = torch.tensor([item.token_id for item in items], device=self.device)
        positions = torch.tensor([item.position for item in items], device=self.device)
        deltas = torch.tensor([item.rope_delta for item in items], device=self.device)
        rotary = decode_rotary_position_ids(positions, deltas)
        cos, sin = mrope_cos_sin(rotary, self.inv_freq, self.slot_axes)
        batch = AttentionBatch(slots=torch.tensor([item.slot for item in items], device=self.device),
                               positions=positions, context_len=int(positions.max()) + 1)
        hidden = self.model.language_model.embed_tokens(ids)
        out = self.model.language_model(hidden, cos, sin, batch, self.cache)
        return self.model.lm_head(out).float()

    def choose(self, logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
               seeds: list[int]) -> list[Choice]:
        tokens, logprobs = choose_tokens(logits, params, histories, seeds)
        return [Choice(t, lp) for t, lp in zip(tokens, logprobs)]
