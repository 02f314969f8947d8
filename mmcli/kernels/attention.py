"""Attention kernels in torch: attention within one range (SDPA, and its flash attention on
bfloat16 q, k, v for runs with bfloat16 products), and the packed vision blocks' bounded
attention, as the fixed-shape reference and as the eager kernel that computes only inside the
bounds.

Every block kernel computes what `bounded_attention` defines: per batch row (one block), query row r
attends to the keys [bound_min[r], bound_max[r]) (its own image's temporal patch) and a padding
row (empty range) gives zeros."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

BlockAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor
]


# q [queries, heads, d], k and v [keys, kv_heads, d], causal -> [queries, heads, d]
Attend = Callable[..., torch.Tensor]


def bounded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bound_min: torch.Tensor,
    bound_max: torch.Tensor,
) -> torch.Tensor:
    """Reference for the Neuron kernel's bounded attention (attention_cte with bound_min /
    bound_max).

    q, k, v [B, heads, S, d]; bounds [B, S]: query row r sees keys in [bound_min[r],
    bound_max[r]). A row with an empty range (padding) attends to nothing and outputs zeros."""
    keys = torch.arange(q.shape[-2], device=q.device)
    allowed = (keys >= bound_min[..., None]) & (keys < bound_max[..., None])  # [B, S, S]
    empty = bound_max <= bound_min
    allowed = allowed | (empty[..., None] & (keys == 0))  # keep softmax finite; zeroed below
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
    return out.masked_fill(empty[:, None, :, None], 0.0)


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d)) v by torch's SDPA, q [queries, heads, d], k and v [keys, kv_heads,
    d] (GQA where kv_heads < heads) -> [queries, heads, d]; without a mask, or causal: query i
    sees the keys up to i + keys - queries (the keys before the queries' own are a cached
    prefix)."""
    queries, keys = q.shape[0], k.shape[0]
    mask = None
    if causal and keys != queries:  # SDPA's is_causal aligns the queries with the first keys
        seen = torch.arange(keys, device=q.device)[None, :] - (keys - queries)
        mask = seen <= torch.arange(queries, device=q.device)[:, None]
    # 4-D inputs: the CPU flash kernel takes only those
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        attn_mask=mask,
        is_causal=causal and mask is None,
        enable_gqa=k.shape[1] != q.shape[1],
    )
    return out[0].transpose(0, 1)


def cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch, k_cache, v_cache):
    """A decode step's attention in torch: each row's k and v [B, kv_heads, d] written at column
    batch.positions[r] of cache row batch.slots[r] (k_cache, v_cache [rows, kv_heads, columns,
    d], rounded to their dtype), then its query heads q [B, heads, d] against the row's columns up
    to its position (batch.context_len of them read) -> [B, heads, d]."""
    slots, pos, n = batch.slots, batch.positions, batch.context_len
    (b, heads, d), kv_heads = q.shape, k.shape[1]
    k_cache[slots, :, pos] = k.to(k_cache.dtype)  # the cache's dtype: rounded to it
    v_cache[slots, :, pos] = v.to(v_cache.dtype)
    # a cache of the products' dtype (bfloat16) under float32 compute: widened, exactly
    if batch.fixed_shapes:
        keys, values = k_cache[slots, :, :n].to(q.dtype), v_cache[slots, :, :n].to(q.dtype)
    else:
        keys = k_cache[:b, :, :n] if batch.contiguous else k_cache[slots, :, :n]
        values = v_cache[:b, :, :n] if batch.contiguous else v_cache[slots, :, :n]
        keys, values = keys.to(q.dtype), values.to(q.dtype)
        if b == 1:  # one sequence: its whole context, no mask needed
            # each KV head's query heads as its queries: one call, no GQA expansion
            grouped = q.view(1, kv_heads, -1, d)
            return F.scaled_dot_product_attention(grouped, keys, values).reshape(1, heads, d)
    # each row sees its own past
    mask = torch.arange(n, device=pos.device)[None, :] <= pos[:, None]
    # one query per row: the query heads grouped under their KV head, K/V not expanded for GQA
    qg = q.view(b, kv_heads, -1, d)  # [B, kv, group, d]
    scores = (qg @ keys.transpose(-1, -2)).float() * d**-0.5  # [B, kv, group, n]
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    o = scores.softmax(-1).to(values.dtype) @ values  # [B, kv, group, d]
    return o.reshape(b, heads, d)


def segment_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bound_min: torch.Tensor,
    bound_max: torch.Tensor,
    attend: Attend = sdpa_attention,
) -> torch.Tensor:
    """The same result as `bounded_attention`, computing only inside the bounds: each run of rows
    that share a [bound_min, bound_max) range attends to that range alone (what a bounds-aware
    kernel skips, we skip too). For eager execution; compiled graphs keep the fixed-shape
    reference. `attend`: the attention within one range (`sdpa_attention`, or a kernel of the
    same contract)."""
    bmin, bmax = bound_min.tolist(), bound_max.tolist()
    # [B, heads, S, d] -> [B, S, heads, d]: the layout the rows come in and go out in
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if len(bmin) == 1 and len(set(bmin[0])) == 1 and len(set(bmax[0])) == 1 and bmax[0][0] > 0:
        # one block of one image, no padding: its attention is the whole output
        lo, hi = bmin[0][0], bmax[0][0]
        return attend(q[0], k[0, lo:hi], v[0, lo:hi])[None].transpose(1, 2)
    out = q.new_empty(q.shape)  # every row written below: no pass of zeros first
    for b, (lo_row, hi_row) in enumerate(zip(bmin, bmax)):
        r = 0
        while r < len(lo_row):
            lo, hi = lo_row[r], hi_row[r]
            end = r + 1
            while end < len(lo_row) and lo_row[end] == lo and hi_row[end] == hi:
                end += 1
            if hi > lo:
                out[b, r:end] = attend(q[b, r:end], k[b, lo:hi], v[b, lo:hi])
            else:  # padding
                out[b, r:end] = 0
            r = end
    return out.transpose(1, 2)


def bf16_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False
) -> torch.Tensor | None:
    """Attention within one range by torch's CPU flash attention on bfloat16 q, k, v (its
    products through oneDNN's brgemm, float32 softmax and sums), the output in float32."""
    if q.dtype != torch.float32 or q.device.type != "cpu" or torch.compiler.is_compiling():
        return None
    out = sdpa_attention(q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16), causal)
    return out.float()
