"""Attention within one range of tokens (the decoder's prefill, causal with grouped-query heads,
and one image's attention in the vision tower), as a layer the kernel plan installs a kernel
for."""

from __future__ import annotations

import torch
from torch import nn

from mmcli.kernels.attention import sdpa_attention


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
