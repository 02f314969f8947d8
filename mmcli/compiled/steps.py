"""The bodies of the compiled graphs: one prefill of a padded prompt, one decode step over padded
rows.

Everything these functions (and the model modules they call) run is traced into a graph; the
compile cache's source digest covers this file, the families and the kernels (see
compiled.source_digest)."""

from __future__ import annotations

import torch

from mmcli.models.cache import AttentionBatch, DecoderCache


def prefill_step(
    model: torch.nn.Module,
    cache: DecoderCache,
    hidden: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    deepstack: list[torch.Tensor],
    last: torch.Tensor,
) -> torch.Tensor:
    """One prompt padded to its bucket: fills its cache row, returns the logits of its last real
    token [1, V]."""
    batch = AttentionBatch(slots=slots, seqlens=[hidden.shape[0]], fixed_shapes=True, last=last)
    out = model.language_model(hidden, cos, sin, batch, cache, deepstack or None)
    return model.lm_head(out[last]).float()


def decode_step(
    model: torch.nn.Module,
    cache: DecoderCache,
    ids: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    slots: torch.Tensor,
    positions: torch.Tensor,
    context_len: int,
    fixed_shapes: bool = True,
    contiguous: bool = False,
) -> torch.Tensor:
    """One token per row over `context_len` cache columns; with fixed shapes (the compiled decode
    graph, a CUDA graph) the batch and context are padded buckets."""
    batch = AttentionBatch(
        slots=slots,
        positions=positions,
        context_len=context_len,
        fixed_shapes=fixed_shapes,
        contiguous=contiguous,
    )
    out = model.language_model(model.language_model.embed(ids), cos, sin, batch, cache)
    return model.lm_head(out).float()
