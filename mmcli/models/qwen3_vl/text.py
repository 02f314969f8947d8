"""Qwen3-VL's text decoder: Qwen3 layers (q/k RMSNorm, GQA), interleaved M-RoPE, DeepStack
injection. Qwen3.5's attention gates its output and scales its norms by (1 + weight), as its config
says; its hybrid stack (models/qwen3_5) and the MoE variants' sparse MLPs subclass the decoder.

Tokens of all sequences in a call are flat ([T, hidden]); the runner passes the cache and where
each sequence's tokens go. Module names follow the checkpoint (model.language_model.*)."""

from __future__ import annotations

import torch
from torch import nn

from mmcli.kernels.fused_decode import FusableLayer
from mmcli.models.cache import AttentionBatch, DecoderCache
from mmcli.models.config import TextConfig
from mmcli.models.layers.attention import CacheAttention, RangeAttention
from mmcli.models.layers.linear import Linear, embedding
from mmcli.models.layers.mlp import MLP
from mmcli.models.layers.norms import RMSNorm
from mmcli.models.layers.rotary import Rotary


class Attention(nn.Module):
    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim, self.output_gate = cfg.head_dim, cfg.attn_output_gate
        # with the output gate, each head's query is followed by its gate in q_proj's rows
        width = self.num_heads * self.head_dim * (2 if self.output_gate else 1)
        self.q_proj = Linear(cfg.hidden_size, width, bias=False)
        self.k_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.rotary, self.attend = Rotary(), RangeAttention()
        self.attend_cache = CacheAttention()

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        # q and k as their products give them (bfloat16 where the run's are): the rotary widens
        # them, with the q/k norms before it (M-RoPE after the norms), in one pass
        if self.output_gate:
            q, gate = self.q_proj(x).unflatten(-1, (self.num_heads, -1)).chunk(2, dim=-1)
        else:
            q = self.q_proj(x, rounded=True).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(x, rounded=True).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        q, k = self.rotary(q, cos, sin, self.q_norm), self.rotary(k, cos, sin, self.k_norm)
        if batch.seqlens is not None:
            out = self._prefill(q, k, v, batch, k_cache, v_cache)
        else:
            out = self.attend_cache(q, k, v, batch, k_cache, v_cache)
        out = out.flatten(-2)
        if self.output_gate:
            out = out * torch.sigmoid(gate.flatten(-2))
        # as its product gives it (bfloat16 where the run's are): the post norm adds it
        return self.o_proj(out, rounded=True)

    def _prefill(self, q, k, v, batch, k_cache, v_cache):
        out, start = [], 0
        for i, n in enumerate(batch.seqlens):
            s = slice(start, start + n)
            # a host int where the caller has one (eager): the row's view; else a tensor index
            # (no host sync, one compiled graph whatever the slot)
            row = batch.rows[i] if batch.rows else batch.slots[i : i + 1]
            first = batch.starts[i] if batch.starts else 0
            write_columns(k_cache, row, first, k[s])
            write_columns(v_cache, row, first, v[s])
            if first:  # a cached prefix before them: attended too, causal among the new ones
                k_seen = read_columns(k_cache, row, first + n).to(q.dtype)
                v_seen = read_columns(v_cache, row, first + n).to(q.dtype)
                out.append(self.attend(q[s], k_seen, v_seen, causal=True))
            else:
                out.append(self.attend(q[s], k[s], v[s], causal=True))
            start += n
        return out[0] if len(out) == 1 else torch.cat(out)


def write_columns(cache: torch.Tensor, row, first: int, values: torch.Tensor) -> None:
    """values [n, kv_heads, d] into a K or V cache [rows, kv_heads, columns, d] at `row` (an int,
    written through its view: a third of an index's time, or a [1] tensor), columns first..,
    rounded to the cache's dtype."""
    n = values.shape[0]
    if isinstance(row, int):
        cache[row, :, first : first + n].copy_(values.transpose(0, 1))
    else:
        cache[row, :, first : first + n] = values.transpose(0, 1)[None].to(cache.dtype)


def read_columns(cache: torch.Tensor, row, n: int) -> torch.Tensor:
    """A cache row's first n columns as [n, kv_heads, d] (`row` as write_columns takes it)."""
    held = cache[row, :, :n] if isinstance(row, int) else cache[row, :, :n][0]
    return held.transpose(0, 1)


class DecoderLayer(nn.Module):
    """Attention (or, in a hybrid stack's linear layers, `linear_attn`: Gated DeltaNet), then the
    MLP (sparse in an MoE model's sparse layers)."""

    def __init__(self, cfg: TextConfig, mlp: nn.Module, linear_attn: nn.Module | None = None):
        super().__init__()
        if linear_attn is not None:
            self.linear_attn = linear_attn
        else:
            self.self_attn = Attention(cfg)
        self.linear = linear_attn is not None
        self.mlp = mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)
        self.post_attention_layernorm = RMSNorm(
            cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset
        )

    def fold_groups(self) -> list[tuple[nn.Module, list[nn.Module]]]:
        """Each norm and the linears reading it (the family's fold_groups): the input norm's
        attention q/k/v or Gated DeltaNet's four input projections; the post norm's gate and up
        where the MLP is dense."""
        if self.linear:
            mixer = self.linear_attn
            inputs = [mixer.in_proj_qkv, mixer.in_proj_z, mixer.in_proj_b, mixer.in_proj_a]
        else:
            inputs = [self.self_attn.q_proj, self.self_attn.k_proj, self.self_attn.v_proj]
        groups = [(self.input_layernorm, inputs)]
        if isinstance(self.mlp, MLP):
            groups.append((self.post_attention_layernorm, [self.mlp.gate_proj, self.mlp.up_proj]))
        return groups

    def as_fusable(self) -> FusableLayer | None:
        """This layer in decode_layer.c's terms, or None for Gated DeltaNet or a sparse MLP."""
        if self.linear or not isinstance(self.mlp, MLP):
            return None
        attn, mlp = self.self_attn, self.mlp
        norms = {"input_norm": self.input_layernorm, "post_norm": self.post_attention_layernorm}
        norms |= {"q_norm": attn.q_norm, "k_norm": attn.k_norm}
        linears = {"q": attn.q_proj, "k": attn.k_proj, "v": attn.v_proj, "o": attn.o_proj}
        linears |= {"gate": mlp.gate_proj, "up": mlp.up_proj, "down": mlp.down_proj}
        return FusableLayer(
            norms, linears, attn.num_heads, attn.num_kv_heads, attn.head_dim, attn.output_gate
        )

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        state: tuple[torch.Tensor, torch.Tensor],
        update: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`state`: this layer's cache tensors, (K, V) or (conv, recurrent). The layer's input is
        x + `update` (the layer before's), its output the sum of the two it returns: each sum
        is taken by the norm after it, in the norm's pass (add_and_norm)."""
        if update is None:
            normed = self.input_layernorm(x)
        else:
            x, normed = self.input_layernorm.add_and_norm(x, update)
        if self.linear:
            update = self.linear_attn(normed, batch, *state)
        else:
            update = self.self_attn(normed, cos, sin, batch, *state)
        h, normed = self.post_attention_layernorm.add_and_norm(x, update)
        return h, self.mlp(normed)


class TextDecoder(nn.Module):
    work = "decode_step"  # the kind of work the kernel plan installs a kernel for
    # a decode step through every layer at once (kernels/fused_decode.py) where it fits
    kernel = None

    def __init__(self, cfg: TextConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.build_layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)

    def build_layer(self, cfg: TextConfig, index: int) -> DecoderLayer:
        """Decoder layer `index`: attention and the MLP (subclasses: other mixers and MLPs)."""
        return DecoderLayer(cfg, self.build_mlp(cfg, index))

    def build_mlp(self, cfg: TextConfig, index: int) -> nn.Module:
        return MLP(cfg.hidden_size, cfg.intermediate_size)

    def fusable_layers(self) -> list[FusableLayer] | None:
        """Every layer as kernels/fused_decode.py reads it, or None where one is of another kind."""
        layers = [layer.as_fusable() for layer in self.layers]
        return None if None in layers else layers

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
        cache: DecoderCache,
        deepstack: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """hidden [T, H] -> final-normed hidden [T, H]. DeepStack level l ([T, H], zero off the
        image tokens) is added after layer l (prefill only)."""
        cos, sin = cos.to(hidden.dtype), sin.to(hidden.dtype)
        if self.kernel is not None and self.kernel.fits(hidden, batch, deepstack):
            return self.norm(self.kernel(hidden, cos, sin, batch, cache))
        update = None  # each layer's output is hidden + update, summed by the next norm
        for i, layer in enumerate(self.layers):
            hidden, update = layer(hidden, cos, sin, batch, cache.layer(i), update)
            if deepstack is not None and i < len(deepstack):
                hidden = hidden + update.to(hidden.dtype) + deepstack[i].to(hidden.dtype)
                update = None
        return self.norm(hidden) if update is None else self.norm.add_and_norm(hidden, update)[1]
