"""Qwen3-VL text decoder: Qwen3 layers (q/k RMSNorm, GQA), interleaved M-RoPE, DeepStack
injection.

Tokens of all sequences in a call are flat ([T, hidden]); the runner passes the KV cache and
where each sequence's tokens go. Module names follow the checkpoint (model.language_model.*)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mmcli.model.config import TextConfig
from mmcli.model.linear import Linear
from mmcli.model.rope import apply_rotary


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32, cast back to the activation dtype, then scale (as the reference
        # does).
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(
            x.dtype
        )


@dataclass
class AttentionBatch:
    """Where the tokens of one forward pass sit in the KV cache.

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


class KVCache:
    """K/V tensors [layers][rows, kv_heads, columns, head_dim]; a sequence owns one row, a token
    one column. `grow` reallocates to a larger shape keeping what is written (the runner sizes
    the cache to the job)."""

    def __init__(
        self, cfg: TextConfig, rows: int, columns: int, dtype: torch.dtype, device: torch.device
    ):
        self.cfg, self.dtype, self.device = cfg, dtype, device
        self.k, self.v = self._alloc(rows, columns), self._alloc(rows, columns)

    def _alloc(self, rows: int, columns: int) -> list[torch.Tensor]:
        shape = (rows, self.cfg.num_key_value_heads, columns, self.cfg.head_dim)
        return [
            torch.zeros(shape, dtype=self.dtype, device=self.device)
            for _ in range(self.cfg.num_hidden_layers)
        ]

    @property
    def rows(self) -> int:
        return self.k[0].shape[0]

    @property
    def columns(self) -> int:
        return self.k[0].shape[2]

    def grow(self, rows: int, columns: int) -> None:
        rows, columns = max(rows, self.rows), max(columns, self.columns)
        if (rows, columns) == (self.rows, self.columns):
            return
        for old in (self.k, self.v):
            for i, tensor in enumerate(old):
                new = torch.zeros(
                    (rows, tensor.shape[1], columns, tensor.shape[3]),
                    dtype=self.dtype,
                    device=self.device,
                )
                new[: tensor.shape[0], :, : tensor.shape[2]] = tensor
                old[i] = new  # layer by layer: the old layer is freed before the next is copied

    def copy_prefix(self, source: int, target: int, columns: int) -> None:
        """Row `target` starts with the first `columns` tokens of row `source` (a shared prompt
        prefix)."""
        if source != target:
            for k, v in zip(self.k, self.v):
                k[target, :, :columns] = k[source, :, :columns]
                v[target, :, :columns] = v[source, :, :columns]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class Attention(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        q = self.q_norm(self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)))
        k = self.k_norm(self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # M-RoPE after the q/k norms
        if batch.seqlens is not None:
            out = self._prefill(q, k, v, batch, k_cache, v_cache)
        else:
            out = self._decode(q, k, v, batch, k_cache, v_cache)
        return self.o_proj(out.flatten(-2))

    def _prefill(self, q, k, v, batch, k_cache, v_cache):
        out, start = [], 0
        for i, n in enumerate(batch.seqlens):
            s = slice(start, start + n)
            if batch.starts and batch.starts[i]:
                out.append(
                    self._prefill_after(
                        q[s], k[s], v[s], batch.slots[i : i + 1], batch.starts[i], k_cache, v_cache
                    )
                )
                start += n
                continue
            # a tensor index: no host sync, and one compiled graph whatever the slot
            slot = batch.slots[i : i + 1]
            k_cache[slot, :, :n] = k[s].transpose(0, 1)[None]
            v_cache[slot, :, :n] = v[s].transpose(0, 1)[None]
            # 4-D inputs: the CPU flash kernel takes only those (3-D falls back to the math path, 2x
            # slower)
            o = F.scaled_dot_product_attention(
                q[s].transpose(0, 1)[None],
                k[s].transpose(0, 1)[None],
                v[s].transpose(0, 1)[None],
                is_causal=True,
                enable_gqa=True,
            )
            out.append(o[0].transpose(0, 1))
            start += n
        return torch.cat(out)

    def _prefill_after(self, q, k, v, slot, first: int, k_cache, v_cache):
        """Tokens at positions first.. of a row whose earlier tokens are cached (a shared
        prefix): written after them, attending to all of them and causally among themselves."""
        n = q.shape[0]
        k_cache[slot, :, first : first + n] = k.transpose(0, 1)[None]
        v_cache[slot, :, first : first + n] = v.transpose(0, 1)[None]
        keys, values = k_cache[slot, :, : first + n], v_cache[slot, :, : first + n]
        mask = (
            torch.arange(first + n, device=q.device)[None, :]
            <= torch.arange(first, first + n, device=q.device)[:, None]
        )
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys, values, attn_mask=mask, enable_gqa=True
        )
        return o[0].transpose(0, 1)

    def _decode(self, q, k, v, batch, k_cache, v_cache):
        slots, pos, n = batch.slots, batch.positions, batch.context_len
        k_cache[slots, :, pos] = k
        v_cache[slots, :, pos] = v
        b = slots.shape[0]
        if batch.fixed_shapes:
            keys, values = k_cache[slots, :, :n], v_cache[slots, :, :n]
        else:
            keys = k_cache[:b, :, :n] if batch.contiguous else k_cache[slots, :, :n]
            values = v_cache[:b, :, :n] if batch.contiguous else v_cache[slots, :, :n]
            if b == 1:  # one sequence: its whole context, no mask needed
                return F.scaled_dot_product_attention(
                    q.unsqueeze(2), keys, values, enable_gqa=True
                ).squeeze(2)
        # each row sees its own past
        mask = torch.arange(n, device=pos.device)[None, :] <= pos[:, None]
        # One query per row: group the query heads under their KV head instead of expanding K/V for
        # GQA.
        qg = q.view(b, self.num_kv_heads, -1, self.head_dim)  # [B, kv, group, d]
        scores = (qg @ keys.transpose(-1, -2)).float() * self.head_dim**-0.5  # [B, kv, group, n]
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        o = scores.softmax(-1).to(values.dtype) @ values  # [B, kv, group, d]
        return o.reshape(b, self.num_heads, self.head_dim)


class MLP(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.gate_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, k_cache, v_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class TextDecoder(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings in the compute dtype (the norms' dtype; the table may be held in a
        lower precision)."""
        return self.embed_tokens(ids).to(self.norm.weight.dtype)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        cache: KVCache,
        deepstack: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """hidden [T, H] -> final-normed hidden [T, H]. DeepStack level l ([T, H], zero off the
        image tokens) is added after layer l (prefill only)."""
        cos, sin = cos.to(hidden.dtype), sin.to(hidden.dtype)
        for i, layer in enumerate(self.layers):
            hidden = layer(hidden, cos, sin, batch, cache.k[i], cache.v[i])
            if deepstack is not None and i < len(deepstack):
                hidden = hidden + deepstack[i].to(hidden.dtype)
        return self.norm(hidden)
