"""Trainium's kernels (NKI), called through torch-neuronx; imported only on a neuron backend."""

from __future__ import annotations

import torch


def nki_bounded_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bound_min: torch.Tensor,
    bound_max: torch.Tensor,
) -> torch.Tensor:
    """`bounded_attention` on Trainium: the NKI library's attention_cte kernel with its
    sequence-packing bounds (query row r sees keys [bound_min[r], bound_max[r])). Heads fold into
    the kernel's batch, q is pre-scaled (the kernel's bounded path needs scale 1.0). Written
    against the documented API; not run here (no Trainium2)."""
    from nkilib.core.attention.attention_cte import attention_cte
    from torch_neuronx import wrap_nki
    from torch_neuronx.utils import get_logical_neuron_cores

    b, heads, s, d = q.shape
    fold = (b * heads, s, d)
    bmin = bound_min.repeat_interleave(heads, 0).unsqueeze(-1).to(torch.int32)  # [B*heads, S, 1]
    bmax = bound_max.repeat_interleave(heads, 0).unsqueeze(-1).to(torch.int32)
    out = wrap_nki(attention_cte)[(int(get_logical_neuron_cores()),)](
        (q * d**-0.5).reshape(fold),
        k.reshape(fold),
        v.reshape(fold),
        scale=1.0,
        causal_mask=False,
        tp_q=True,
        tp_k=True,
        tp_out=False,
        softmax_dtype=torch.float32,
        bound_min=bmin,
        bound_max=bmax,
    )
    # padding rows: zeros, as the reference defines
    empty = (bound_max <= bound_min)[:, None, :, None]
    return out.reshape(b, heads, s, d).masked_fill(empty, 0.0)
