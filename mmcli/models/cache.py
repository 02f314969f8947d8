"""What a forward pass needs to know about where its tokens go, and the per-sequence state it
reads and writes: a KV cache for full-attention layers, conv and recurrent states for linear
(Gated DeltaNet) layers. A sequence owns one row of every layer's state."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mmcli.kernels.host_memory import zeros_in_huge_pages
from mmcli.models.config import TextConfig


@dataclass
class AttentionBatch:
    """Where the tokens of one forward pass sit in the cache.

    Prefill: `seqlens` gives each sequence's prompt length (tokens are back to back, no padding)
    and `slots` its cache row; positions start at 0. Decode: one token per sequence, at
    `positions`, reading `context_len` cache columns. `fixed_shapes` (compiled graphs): rows are
    gathered by slot whatever they are, and the context is a padded bucket, masked per row, so
    nothing depends on the values of the inputs."""

    slots: torch.Tensor  # [B] cache rows
    positions: torch.Tensor | None = None  # decode: [B] sequential positions (cache columns)
    seqlens: list[int] | None = None  # prefill only
    context_len: int = 0  # decode only: cache columns read (max(positions) + 1, or its bucket)
    fixed_shapes: bool = False
    # decode: slots are 0..B-1 (known to the caller, so no device round trip here)
    contiguous: bool = False
    # prefill: each sequence's first position (> 0: its row holds a prefix)
    starts: list[int] | None = None
    # prefill, eager: `slots` as host ints, so that each row is written through its view
    rows: list[int] | None = None
    # padded prefill (fixed shapes): the index of the last real token, as a tensor [1]
    last: torch.Tensor | None = None


class DecoderCache:
    """Per layer: K/V [rows, kv_heads, columns, head_dim] for a full-attention layer; a conv
    state [rows, conv_dim, kernel - 1] (the last inputs of its causal conv) and a recurrent
    state [rows, heads, key_dim, value_dim] (float32) for a linear-attention layer, fixed in size
    whatever the length. K/V are held in `kv_dtype` (Precision.kv_dtype: bfloat16 where the
    products are or the weights are quantized, half the bytes a decode step reads over its
    context), on the CPU in 2 MiB pages; the conv state in the compute dtype. `grow` reallocates
    to more rows or columns keeping what is written (the runner sizes the cache to the job)."""

    def __init__(
        self,
        cfg: TextConfig,
        rows: int,
        columns: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_dtype: torch.dtype | None = None,
    ):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.kv_dtype = kv_dtype or dtype
        self.rows, self.columns = rows, columns
        self.k, self.v, self.conv, self.recurrent = [], [], [], []
        for layer in range(cfg.num_hidden_layers):
            linear = cfg.is_linear(layer)
            kv = self._kv_shape(rows, columns)
            self.k.append(None if linear else self._kv_zeros(kv))
            self.v.append(None if linear else self._kv_zeros(kv))
            self.conv.append(self._zeros(self._conv_shape(rows)) if linear else None)
            self.recurrent.append(
                self._zeros(self._recurrent_shape(rows), torch.float32) if linear else None
            )

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.zeros(shape, dtype=dtype or self.dtype, device=self.device)

    def _kv_zeros(self, shape: tuple[int, ...]) -> torch.Tensor:
        """K or V: on the CPU in 2 MiB pages, which a decode step streams faster than 4 KiB ones
        (docs/performance.md), as the weights are held."""
        if torch.device(self.device).type == "cpu":
            return zeros_in_huge_pages(shape, self.kv_dtype)
        return self._zeros(shape, self.kv_dtype)

    def _kv_shape(self, rows: int, columns: int) -> tuple[int, ...]:
        return (rows, self.cfg.num_key_value_heads, columns, self.cfg.head_dim)

    def _conv_shape(self, rows: int) -> tuple[int, ...]:
        return (rows, self.cfg.linear_conv_dim, self.cfg.linear_conv_kernel_dim - 1)

    def _recurrent_shape(self, rows: int) -> tuple[int, ...]:
        c = self.cfg
        return (rows, c.linear_num_value_heads, c.linear_key_head_dim, c.linear_value_head_dim)

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's state: (K, V) or (conv, recurrent)."""
        return (self.conv[i], self.recurrent[i]) if self.k[i] is None else (self.k[i], self.v[i])

    def grow(self, rows: int, columns: int) -> None:
        rows, columns = max(rows, self.rows), max(columns, self.columns)
        if (rows, columns) == (self.rows, self.columns):
            return
        for states in (self.k, self.v, self.conv, self.recurrent):
            for i, old in enumerate(states):
                if old is None:
                    continue
                if states is self.k or states is self.v:
                    new = self._kv_zeros(self._kv_shape(rows, columns))
                else:
                    new = self._zeros((rows, *old.shape[1:]), old.dtype)
                new[tuple(slice(0, n) for n in old.shape)] = old
                states[i] = new  # layer by layer: the old one is freed before the next is copied
        self.rows, self.columns = rows, columns

    def copy_prefix(self, source: int, target: int, columns: int) -> None:
        """Row `target` starts as row `source` after its first `columns` tokens (a shared prompt
        prefix): those K/V columns, and the linear layers' states as they were at its end."""
        if source == target:
            return
        for k, v, conv, recurrent in zip(self.k, self.v, self.conv, self.recurrent):
            if k is None:
                conv[target], recurrent[target] = conv[source], recurrent[source]
            else:
                k[target, :, :columns] = k[source, :, :columns]
                v[target, :, :columns] = v[source, :, :columns]

    def row_bytes(self, columns: int) -> tuple[int, int]:
        """One sequence's state: (K/V bytes over `columns` tokens, the linear layers' fixed
        bytes)."""
        attention = sum(k is not None for k in self.k)
        kv = 2 * attention * math.prod(self._kv_shape(1, columns)) * self.kv_dtype.itemsize
        per_linear = math.prod(self._conv_shape(1)) * self.dtype.itemsize
        per_linear += 4 * math.prod(self._recurrent_shape(1))  # float32
        return kv, (len(self.k) - attention) * per_linear

    @property
    def nbytes(self) -> int:
        tensors = self.k + self.v + self.conv + self.recurrent
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)
