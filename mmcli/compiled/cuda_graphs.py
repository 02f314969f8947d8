"""Decode steps on CUDA replayed from CUDA graphs, one per (batch, context) bucket, captured at
first use.

A decode step of a small model on a large GPU is hundreds of short kernels; launching them from
Python costs more than running them. A captured graph launches them all at once. Each bucket's
graph reads fixed input buffers (token ids, cos/sin, cache rows, positions); a smaller batch is
padded with rows that write the KV cache's scratch row, and the context is padded to the bucket's
columns, masked per row. The KV cache must never move once graphs hold its addresses, so the
runner allocates it whole on CUDA."""

from __future__ import annotations

import torch

from mmcli.compiled.buckets import choose_bucket
from mmcli.compiled.steps import decode_step


class DecodeGraphs:
    def __init__(
        self,
        model,
        cache,
        scratch_slot: int,
        rotary_dim: int,
        batch_buckets: list[int],
        context_buckets: list[int],
    ):
        """Buckets: compile.decode_batch_buckets and compile.decode_context_buckets."""
        self.model, self.cache, self.scratch_slot, self.rotary_dim = (
            model,
            cache,
            scratch_slot,
            rotary_dim,
        )
        self.batch_buckets, self.context_buckets = sorted(batch_buckets), sorted(context_buckets)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, dict, torch.Tensor]] = {}
        self.pool = None

    def _capture(self, batch: int, context: int):
        device = self.cache.device
        static = {
            "ids": torch.zeros(batch, dtype=torch.long, device=device),
            "cos": torch.zeros(batch, self.rotary_dim, device=device),
            "sin": torch.zeros(batch, self.rotary_dim, device=device),
            "slots": torch.full((batch,), self.scratch_slot, dtype=torch.long, device=device),
            "positions": torch.zeros(batch, dtype=torch.long, device=device),
        }

        def step():
            return decode_step(
                self.model,
                self.cache,
                static["ids"],
                static["cos"],
                static["sin"],
                static["slots"],
                static["positions"],
                context,
                fixed_shapes=True,
            )

        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # warm-up outside the graph (lazy inits, workspace allocations)
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = step()
        self.pool = graph.pool()
        return graph, static, out

    def fits(self, rows: int, context: int) -> bool:
        return rows <= self.batch_buckets[-1] and context <= self.context_buckets[-1]

    def run(
        self,
        ids: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        context: int,
    ) -> torch.Tensor:
        """Logits [B, V] of one decode step through the bucket's graph (B = the rows given)."""
        rows = ids.shape[0]
        key = (
            choose_bucket(rows, self.batch_buckets),
            choose_bucket(context, self.context_buckets),
        )
        if key not in self.graphs:
            self.graphs[key] = self._capture(*key)
        graph, static, out = self.graphs[key]
        static["ids"][:rows].copy_(ids)
        static["cos"][:rows].copy_(cos)
        static["sin"][:rows].copy_(sin)
        static["slots"][:rows].copy_(slots)
        static["positions"][:rows].copy_(positions)
        static["slots"][rows:].fill_(self.scratch_slot)  # padding rows: the scratch row, column 0
        static["positions"][rows:].zero_()
        graph.replay()
        return out[:rows]
