"""Attention within one range of tokens (the decoder's prefill, causal with grouped-query heads,
and one image's attention in the vision tower), and a decode step's over the KV cache, as layers
the kernel plan installs kernels for."""

from __future__ import annotations

import torch
from torch import nn

from mmcli.kernels.attention import cache_attention, sdpa_attention
from mmcli.models.cache import AttentionBatch


class RangeAttention(nn.Module):
    """softmax(q k^T / sqrt(d)) v for q [queries, heads, d] and k, v [keys, kv_heads, d]; without
    a mask, or causal (query i sees the keys up to i + keys - queries: the keys before the
    queries' own are a cached prefix). It holds no weights."""

    work = "attention"
    kernel = None  # same contract, or None where the inputs are not the kernel's

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False
    ) -> torch.Tensor:
        if self.kernel is not None and (out := self.kernel(q, k, v, causal)) is not None:
            return out
        return sdpa_attention(q, k, v, causal)


class CacheAttention(nn.Module):
    """A decode step's attention (kernels/attention.cache_attention): each row's new key and value
    written into its cache row, then its query heads against the row's context. It holds no
    weights."""

    work = "cache_attention"
    # (q, k, v, batch, k_cache, v_cache) -> [B, heads, d], or None where the inputs are not the
    # kernel's
    kernel = None

    def forward(self, q, k, v, batch: AttentionBatch, k_cache, v_cache) -> torch.Tensor:
        if self.kernel is not None:
            if (out := self.kernel(q, k, v, batch, k_cache, v_cache)) is not None:
                return out
        return cache_attention(q, k, v, batch, k_cache, v_cache)
