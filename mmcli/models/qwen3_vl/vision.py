"""Qwen3-VL vision tower: patch embedding, resampled position table, 2-D rotary, blocks,
DeepStack mergers.

Patches arrive in merge-block order (2x2 blocks in raster order, the 4 patches of a block in
raster order), so the mergers only regroup 4 consecutive rows. Module names follow the checkpoint
(model.visual.*)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mmcli.kernels.attention import BlockAttention, segment_attention
from mmcli.models.config import VisionConfig
from mmcli.models.layers.linear import Linear, embedding
from mmcli.models.layers.norms import LayerNorm
from mmcli.models.layers.rotary import Rotary

# q, k, v [..., N, heads, d] -> out
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def patch_coords(
    grid_thw: list[tuple[int, int, int]], merge: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-resolution (row, col) of every patch, merge-block order, repeated per temporal patch."""
    rows, cols = [], []
    for t, h, w in grid_thw:
        r = (
            torch.arange(h)
            .view(h // merge, merge, 1, 1)
            .expand(h // merge, merge, w // merge, merge)
        )
        c = (
            torch.arange(w)
            .view(1, 1, w // merge, merge)
            .expand(h // merge, merge, w // merge, merge)
        )
        rows.append(r.permute(0, 2, 1, 3).reshape(-1).repeat(t))
        cols.append(c.permute(0, 2, 1, 3).reshape(-1).repeat(t))
    return torch.cat(rows), torch.cat(cols)


def vision_rotary_cos_sin(
    rows: torch.Tensor, cols: torch.Tensor, head_dim: int, theta: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin [N, head_dim] float32: head_dim/4 frequencies each for row and col, laid out
    [r|c|r|c]."""
    dim = head_dim // 2
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.cat([rows[:, None].float() * inv_freq, cols[:, None].float() * inv_freq], dim=-1)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def pos_embed_indices_weights(
    grid_thw: list[tuple[int, int, int]], rows: torch.Tensor, cols: torch.Tensor, side: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Bilinear corner indices [N, 4] into the side x side table and their float32 weights [N,
    4].

    Corner-aligned: patch row r of an image h patches tall samples the table at r * (side-1) /
    (h-1)."""
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
        # The kernel covers the whole patch, so the convolution is one matmul over flattened
        # patches.
        # the compute dtype; the weight may be held lower (converted exactly here)
        dtype = self.proj.bias.dtype
        w = self.proj.weight
        return F.linear(pixels.to(dtype), w.view(w.shape[0], -1).to(dtype), self.proj.bias)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = Linear(cfg.hidden_size, cfg.hidden_size)
        self.rotary = Rotary()

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """x [..., N, hidden]; the 2-D rotary in float32 (as the reference); `attend` confines
        each query."""
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).unbind(-3)
        # in the activations' dtype, as v (x may be a norm's output handed on in bfloat16)
        q = self.rotary(q.float(), cos, sin).to(v.dtype)
        k = self.rotary(k.float(), cos, sin).to(v.dtype)
        return self.proj(attend(q, k, v).flatten(-2))


class VisionMLP(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.linear_fc1 = Linear(cfg.hidden_size, cfg.intermediate_size)
        self.linear_fc2 = Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.linear_fc1(x, activation="gelu_tanh", rounded=True))


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.norm1 = LayerNorm(cfg.hidden_size, eps=1e-6)
        self.norm2 = LayerNorm(cfg.hidden_size, eps=1e-6)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def fold_groups(self) -> list[tuple[nn.Module, list[nn.Module]]]:
        """Each LayerNorm and the linear reading it (the family's fold_groups)."""
        return [(self.norm1, [self.attn.qkv]), (self.norm2, [self.mlp.linear_fc1])]

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attend: Attend,
        update: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The block's input is x + `update` (the block before's), its output the sum of the two
        it returns: each sum is taken by the norm after it, in the norm's pass (add_and_norm)."""
        if update is None:
            normed = self.norm1(x)
        else:
            x, normed = self.norm1.add_and_norm(x, update)
        x, normed = self.norm2.add_and_norm(x, self.attn(normed, cos, sin, attend))
        return x, self.mlp(normed)


class PatchMerger(nn.Module):
    """2x2 patches -> one LLM token. The main merger normalises each patch first; DeepStack
    mergers after the concatenation (postshuffle). Both use exact (erf) GELU."""

    def __init__(self, cfg: VisionConfig, postshuffle_norm: bool):
        super().__init__()
        self.merged = cfg.hidden_size * cfg.spatial_merge_size**2
        self.postshuffle_norm = postshuffle_norm
        self.norm = LayerNorm(self.merged if postshuffle_norm else cfg.hidden_size, eps=1e-6)
        self.linear_fc1 = Linear(self.merged, self.merged)
        self.linear_fc2 = Linear(self.merged, cfg.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = (
            self.norm(x.reshape(*x.shape[:-2], -1, self.merged))
            if self.postshuffle_norm
            else self.norm(x).reshape(*x.shape[:-2], -1, self.merged)
        )
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


class VisionTower(nn.Module):
    work = "vision_blocks"  # the kind of work the kernel plan installs a kernel for
    kernel: BlockAttention | None = None  # the packed blocks' bounded attention

    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg)
        self.pos_embed = embedding(cfg.num_position_embeddings, cfg.hidden_size)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg, postshuffle_norm=False)
        self.deepstack_merger_list = nn.ModuleList(
            PatchMerger(cfg, postshuffle_norm=True) for _ in cfg.deepstack_visual_indexes
        )

    def patch_inputs(self, grid_thw: list[tuple[int, int, int]]) -> dict[str, torch.Tensor]:
        """Per-patch inputs computed on the CPU from the grids alone: rotary cos/sin, pos-table
        taps."""
        rows, cols = patch_coords(grid_thw, self.cfg.spatial_merge_size)
        cos, sin = vision_rotary_cos_sin(rows, cols, self.cfg.head_dim)
        side = int(self.cfg.num_position_embeddings**0.5)
        idx, weights = pos_embed_indices_weights(grid_thw, rows, cols, side)
        return {"cos": cos, "sin": sin, "pos_idx": idx, "pos_weights": weights}

    def embed(
        self, pixels: torch.Tensor, pos_idx: torch.Tensor, pos_weights: torch.Tensor
    ) -> torch.Tensor:
        x = self.patch_embed(pixels)
        # the four corners summed one at a time, in the order sum(-2) adds them: no [N, 4, hidden]
        # temporary
        pos = self.pos_embed(pos_idx[..., 0]) * pos_weights[..., 0, None]
        for corner in range(1, pos_idx.shape[-1]):
            pos += self.pos_embed(pos_idx[..., corner]) * pos_weights[..., corner, None]
        return x + pos.to(x.dtype)

    def run_blocks(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend):
        """The blocks, with a DeepStack merger's output taken after each of
        deepstack_visual_indexes; returns (merged, [DeepStack features])."""
        deepstack, update = [], None  # each block's output is x + update, summed by a norm
        for i, block in enumerate(self.blocks):
            x, update = block(x, cos, sin, attend, update)
            if i in self.cfg.deepstack_visual_indexes:
                x, update = x + update.to(x.dtype), None  # the merger reads the sum
                deepstack.append(
                    self.deepstack_merger_list[self.cfg.deepstack_visual_indexes.index(i)](x)
                )
        return self.merger(x if update is None else x + update.to(x.dtype)), deepstack

    def forward_packed(
        self,
        pixels: torch.Tensor,
        pos_idx: torch.Tensor,
        pos_weights: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        bound_min: torch.Tensor,
        bound_max: torch.Tensor,
    ):
        """Packed path: every input is [num_blocks, block_size, ...], one block per batch row,
        attention confined by the bounds (by the installed kernel; segment_attention without
        one). Returns merged [num_blocks, block_size/4, out] and the DeepStack levels alike."""

        block_attention = self.kernel or segment_attention

        def attend(q, k, v):  # [B, S, heads, d] -> the kernels' [B, heads, S, d] and back
            out = block_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), bound_min, bound_max
            )
            return out.transpose(1, 2)

        return self.run_blocks(self.embed(pixels, pos_idx, pos_weights), cos, sin, attend)

    def forward(self, pixels: torch.Tensor, grid_thw: list[tuple[int, int, int]]):
        """Per-image path: pixels [N, C*T*P*P] -> (merged [N/4, out], [DeepStack features [N/4,
        out]])."""
        inputs = {k: v.to(pixels.device) for k, v in self.patch_inputs(grid_thw).items()}
        seqlens = [h * w for t, h, w in grid_thw for _ in range(t)]

        def attend(q, k, v):  # full attention within each image (each temporal patch), none across
            out = [
                F.scaled_dot_product_attention(
                    qs.transpose(0, 1)[None], ks.transpose(0, 1)[None], vs.transpose(0, 1)[None]
                )[0].transpose(0, 1)
                for qs, ks, vs in zip(q.split(seqlens), k.split(seqlens), v.split(seqlens))
            ]
            return torch.cat(out)  # 4-D SDPA inputs: the CPU flash kernel takes only those

        x = self.embed(pixels, inputs["pos_idx"], inputs["pos_weights"])
        return self.run_blocks(x, inputs["cos"], inputs["sin"], attend)
