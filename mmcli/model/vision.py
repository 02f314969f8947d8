"""Qwen3-VL vision tower: patch embedding, resampled position table, 2-D rotary, blocks, DeepStack mergers.

Patches arrive in merge-block order (2x2 blocks in raster order, the 4 patches of a block in raster order), so
the mergers only regroup 4 consecutive rows. Module names follow the checkpoint (model.visual.*).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import VisionConfig
from .linear import Linear


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def patch_coords(grid_thw: list[tuple[int, int, int]], merge: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-resolution (row, col) of every patch, merge-block order, repeated per temporal patch."""
    rows, cols = [], []
    for t, h, w in grid_thw:
        r = torch.arange(h).view(h // merge, merge, 1, 1).expand(h // merge, merge, w // merge, merge)
        c = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, w // merge, merge)
        rows.append(r.permute(0, 2, 1, 3).reshape(-1).repeat(t))
        cols.append(c.permute(0, 2, 1, 3).reshape(-1).repeat(t))
    return torch.cat(rows), torch.cat(cols)


def vision_rotary_cos_sin(rows: torch.Tensor, cols: torch.Tensor, head_dim: int,
                          theta: float = 10000.0) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [N, head_dim] float32: head_dim/4 frequencies each for row and col, laid out [r|c|r|c]."""
    dim = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.cat([rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq], dim=-1)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def pos_embed_indices_weights(grid_thw: list[tuple[int, int, int]], rows: torch.Tensor, cols: torch.Tensor,
                              side: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear corner indices [N, 4] into the side x side table and their float32 weights [N, 4].

    Corner-aligned: patch row r of an image h patches tall samples the table at r * (side-1) / (h-1).
    """
    heights = torch.cat([torch.full((t * h * w,), h) for t, h, w in grid_thw])
    widths = torch.cat([torch.full((t * h * w,), w) for t, h, w in grid_thw])

    def axis(index: torch.Tensor, size: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        src = index.float() * (side - 1) / torch.clamp(size - 1, min=1)
        lo = torch.floor(src)
        taps = (lo.long()[:, None] + torch.arange(2)).clamp(0, side - 1)
        weights = (1 - (src[:, None] - lo[:, None] - torch.arange(2)).abs()).clamp(min=0)
        return taps, weights

    h_taps, h_w = axis(rows, heights)
    w_taps, w_w = axis(cols, widths)
    indices = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)
    weights = (h_w[:, :, None] * w_w[:, None, :]).reshape(-1, 4)
    return indices, weights


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        k = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        self.proj = nn.Conv3d(cfg.in_channels, cfg.hidden_size, kernel_size=k, stride=k, bias=True)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        # The kernel covers the whole patch, so the convolution is one matmul over flattened patches.
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.view(w.shape[0], -1), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = Linear(cfg.hidden_size, cfg.hidden_size)

    def qkv_rotated(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """q, k, v [..., N, heads, head_dim] with the 2-D rotary applied in float32."""
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).unbind(-3)
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        q = (q.float() * cos + rotate_half(q.float()) * sin).to(x.dtype)
        k = (k.float() * cos + rotate_half(k.float()) * sin).to(x.dtype)
        return q, k, v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, seqlens: list[int]) -> torch.Tensor:
        q, k, v = self.qkv_rotated(x, cos, sin)
        out = []
        start = 0
        for n in seqlens:  # full attention within each image (each temporal patch), none across
            s = slice(start, start + n)
            # 4-D inputs: the CPU flash kernel takes only those (3-D falls back to the math path, 2x slower)
            o = F.scaled_dot_product_attention(q[s].transpose(0, 1)[None], k[s].transpose(0, 1)[None],
                                               v[s].transpose(0, 1)[None])
            out.append(o[0].transpose(0, 1))
            start += n
        return self.proj(torch.cat(out).flatten(-2))


def bounded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bound_min: torch.Tensor,
                      bound_max: torch.Tensor) -> torch.Tensor:
    """Reference for the Neuron kernel's bounded attention (attention_cte with bound_min / bound_max).

    q, k, v [B, heads, S, d]; bounds [B, S]: query row r sees keys in [bound_min[r], bound_max[r]). A row with
    an empty range (padding) attends to nothing and outputs zeros.
    """
    keys = torch.arange(q.shape[-2], device=q.device)
    allowed = (keys >= bound_min[..., None]) & (keys < bound_max[..., None])  # [B, S, S]
    empty = bound_max <= bound_min
    allowed = allowed | (empty[..., None] & (keys == 0))  # keep softmax finite; zeroed below
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
    return out.masked_fill(empty[:, None, :, None], 0.0)


def nki_bounded_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bound_min: torch.Tensor,
                          bound_max: torch.Tensor) -> torch.Tensor:
    """`bounded_attention` on Trainium: the NKI library's attention_cte kernel with its sequence-packing bounds
    (query row r sees keys [bound_min[r], bound_max[r])). Heads fold into the kernel's batch, q is pre-scaled
    (the kernel's bounded path needs scale 1.0). Written against the documented API; not run here (no Trainium2)."""
    from nkilib.core.attention.attention_cte import attention_cte
    from torch_neuronx import wrap_nki
    from torch_neuronx.utils import get_logical_neuron_cores

    b, heads, s, d = q.shape
    fold = (b * heads, s, d)
    bmin = bound_min.repeat_interleave(heads, 0).unsqueeze(-1).to(torch.int32)  # [B*heads, S, 1]
    bmax = bound_max.repeat_interleave(heads, 0).unsqueeze(-1).to(torch.int32)
    out = wrap_nki(attention_cte)[(int(get_logical_neuron_cores()),)](
        (q * d**-0.5).reshape(fold), k.reshape(fold), v.reshape(fold), scale=1.0, causal_mask=False,
        tp_q=True, tp_k=True, tp_out=False, softmax_dtype=torch.float32, bound_min=bmin, bound_max=bmax)
    empty = (bound_max <= bound_min)[:, None, :, None]  # padding rows: zeros, as the reference defines
    return out.reshape(b, heads, s, d).masked_fill(empty, 0.0)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bound_min: torch.Tensor,
                      bound_max: torch.Tensor) -> torch.Tensor:
    """The same result as `bounded_attention`, computing only inside the bounds: each run of rows that share a
    [bound_min, bound_max) range attends to that range alone (what a bounds-aware kernel skips, we skip too).
    For eager execution; compiled graphs keep the fixed-shape reference."""
    out = torch.zeros_like(q)
    bmin, bmax = bound_min.tolist(), bound_max.tolist()
    for b, (lo_row, hi_row) in enumerate(zip(bmin, bmax)):
        r = 0
        while r < len(lo_row):
            lo, hi = lo_row[r], hi_row[r]
            end = r + 1
            while end < len(lo_row) and lo_row[end] == lo and hi_row[end] == hi:
                end += 1
            if hi > lo:
                out[b, :, r:end] = F.scaled_dot_product_attention(q[b:b + 1, :, r:end], k[b:b + 1, :, lo:hi],
                                                                  v[b:b + 1, :, lo:hi])[0]
            r = end
    return out


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(F.gelu(self.linear_fc1(x), approximate="tanh"))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = nn.LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)


class PatchMerger(nn.Module):
    """2x2 patches -> one LLM token. The main merger normalises each patch first; DeepStack mergers after the
    concatenation (postshuffle). Both use exact (erf) GELU."""

    def __init__(self, cfg: VisionConfig, postshuffle_norm: bool):
        super().__init__()
        self.merged = cfg.hidden_size * cfg.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = nn.LayerNorm(self.merged if postshuffle_norm else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = Linear(self.merged, self.merged)
        self.linear_fc2 = Linear(self.merged, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.reshape(*x.shape[:-2], -1, self.merged)) if self.postshuffle_norm else \
            self.norm(x).reshape(*x.shape[:-2], -1, self.merged)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = nn.Embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg, postshuffle_norm=True) for _ in cfg.deepstack_visual_indexes)

    def patch_inputs(self, grid_thw: list[tuple[int, int, int]]) -> dict[str, torch.Tensor]:
        """Per-patch inputs computed on the CPU from the grids alone: rotary cos/sin, pos-table taps."""
        rows, cols = patch_coords(grid_thw, self.cfg.spatial_merge_size)
        cos, sin = vision_rotary_cos_sin(rows, cols, self.cfg.head_dim)
        side = int(self.cfg.num_position_embeddings**0.5)
        idx, weights = pos_embed_indices_weights(grid_thw, rows, cols, side)
        return {"cos": cos, "sin": sin, "pos_idx": idx, "pos_weights": weights}

    def embed(self, pixels: torch.Tensor, pos_idx: torch.Tensor, pos_weights: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(pixels)
        pos = (self.pos_embed(pos_idx) * pos_weights.unsqueeze(-1)).sum(-2)
        return x + pos.to(x.dtype)

    def forward_packed(self, pixels: torch.Tensor, pos_idx: torch.Tensor, pos_weights: torch.Tensor,
                       cos: torch.Tensor, sin: torch.Tensor, bound_min: torch.Tensor, bound_max: torch.Tensor):
        """Packed path: every input is [num_blocks, block_size, ...], one block per batch row, attention confined
        by the bounds. Returns merged [num_blocks, block_size/4, out] and the DeepStack levels alike."""
        x = self.embed(pixels, pos_idx, pos_weights)
        deepstack = []
        for i, blk in enumerate(self.blocks):
            attn = blk.attn
            q, k, v = attn.qkv_rotated(blk.norm1(x), cos, sin)
            # Trainium: the NKI kernel; other compiled graphs: the fixed-shape reference; eager: only inside bounds.
            attend = nki_bounded_attention if x.device.type == "neuron" else \
                bounded_attention if torch.compiler.is_compiling() else segment_attention
            o = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bound_min, bound_max)
            x = x + attn.proj(o.transpose(1, 2).flatten(-2))
            x = x + blk.mlp(blk.norm2(x))
            if i in self.cfg.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.cfg.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack

    def forward(self, pixels: torch.Tensor, grid_thw: list[tuple[int, int, int]]):
        """Per-image path: pixels [N, C*T*P*P] -> (merged [N/4, out], [DeepStack features [N/4, out]])."""
        dev = pixels.device
        inputs = {k: v.to(dev) for k, v in self.patch_inputs(grid_thw).items()}
        x = self.embed(pixels, inputs["pos_idx"], inputs["pos_weights"])
        seqlens = [h * w for t, h, w in grid_thw for _ in range(t)]
        deepstack = []
        for i, blk in enumerate(self.blocks):
            x = x + blk.attn(blk.norm1(x), inputs["cos"], inputs["sin"], seqlens)
            x = x + blk.mlp(blk.norm2(x))
            if i in self.cfg.deepstack_visual_indexes:
                deepstack.append(self.deepstack_merger_list[self.cfg.deepstack_visual_indexes.index(i)](x))
        return self.merger(x), deepstack
