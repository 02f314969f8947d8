"""Bucket warm-up: one call of a bucket's shape on synthetic inputs (with a compiled backend, the
first run compiles it), for `mmcli compile --buckets`."""

from __future__ import annotations

import torch

from mmcli.compiled.buckets import Bucket
from mmcli.engine.batch import DecodeItem


@torch.inference_mode()
def run_bucket(runner, bucket: Bucket) -> None:
    """Run `bucket`'s call once; writes only the scratch row of the KV cache."""
    if bucket.component == "vision":
        # one 2x2-patch image
        vision = runner.cfg.vision
        patch = vision.in_channels * vision.temporal_patch_size * vision.patch_size**2
        pixels = torch.zeros(4, patch)
        runner.encoder.encode_packed([pixels], [(1, 2, 2)], [[0]], num_blocks=bucket.shape[0])
    elif bucket.component == "prefill":
        (size,) = bucket.shape
        width = runner.model.cfg.text.hidden_size
        hidden = torch.zeros(size, width, dtype=runner.dtype, device=runner.device)
        rotary = torch.arange(size).expand(3, size)
        runner.prefill_padded(runner.scratch_slot, hidden, [], rotary)
    else:
        batch, context = bucket.shape
        runner.decode([DecodeItem(runner.scratch_slot, 0, context - 1, 0)] * batch)
