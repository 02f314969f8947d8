"""The runner's decode step, one of three chosen once per run: eager, through the compiled
buckets' graphs, or replayed from CUDA graphs. Each takes the decode rows and returns their
logits [B, V]."""

from __future__ import annotations

import sys

import torch

from mmcli.compiled.buckets import Bucket, choose_bucket
from mmcli.compiled.steps import decode_step
from mmcli.engine.batch import DecodeItem


class EagerDecode:
    def __init__(self, runner):
        self.runner = runner

    def __call__(self, items: list[DecodeItem]) -> torch.Tensor:
        context = max(item.position for item in items) + 1
        contiguous = [r.slot for r in items] == list(range(len(items)))
        args = self.runner.decode_args(items, context)
        return decode_step(*args, fixed_shapes=False, contiguous=contiguous)


class CompiledDecode:
    """The batch padded to its (batch, context) bucket, through that bucket's graph; padding rows
    write the runner's scratch row."""

    def __init__(self, runner, batch_buckets: list[int], context_buckets: list[int]):
        self.runner, self.batch_buckets, self.context_buckets = (
            runner,
            batch_buckets,
            context_buckets,
        )

    def __call__(self, items: list[DecodeItem]) -> torch.Tensor:
        batch = choose_bucket(len(items), self.batch_buckets)
        context = choose_bucket(max(item.position for item in items) + 1, self.context_buckets)
        rows = items + [DecodeItem(self.runner.scratch_slot, 0, 0, 0)] * (batch - len(items))
        args = self.runner.decode_args(rows, context)
        graphs = self.runner.graphs
        return graphs.call(Bucket("decode", (batch, context)), decode_step, *args)[: len(items)]


class CudaGraphsDecode:
    """A CUDA graph of the step's bucket, replayed; a shape past the buckets decodes eagerly. A
    capture this torch or driver refuses turns CUDA graphs off for the run, said once."""

    def __init__(self, runner, graphs):
        self.runner, self.graphs, self.eager = runner, graphs, EagerDecode(runner)
        self.refused = False

    def __call__(self, items: list[DecodeItem]) -> torch.Tensor:
        context = max(item.position for item in items) + 1
        if self.refused or not self.graphs.fits(len(items), context):
            return self.eager(items)
        _, _, ids, cos, sin, slots, positions, _ = self.runner.decode_args(items, context)
        try:
            return self.graphs.run(ids, cos, sin, slots, positions, context)
        except RuntimeError as e:
            self.refused = True
            print(
                f"mmcli: CUDA graphs off for this run ({str(e).splitlines()[0][:200]})",
                file=sys.stderr,
            )
            return self.eager(items)
