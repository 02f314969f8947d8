"""The runner owns the tensors of a run: the KV cache, the prompts' embedding and their prefill,
and the decode step (its variant chosen once: engine/decoding.py). The model comes to it with its
weights in their form and its kernels installed (mmcli/weights/loader.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mmcli.compiled.buckets import Bucket, choose_bucket
from mmcli.compiled.cuda_graphs import DecodeGraphs
from mmcli.compiled.graphs import CompiledGraphs
from mmcli.compiled.steps import prefill_step
from mmcli.config import Config
from mmcli.engine.batch import DecodeItem, PrefillItem
from mmcli.engine.decoding import CompiledDecode, CudaGraphsDecode, EagerDecode
from mmcli.engine.positions import (
    decode_rotary_position_ids,
    mrope_cos_sin,
    text_inv_freq,
)
from mmcli.engine.prefixes import share_prefixes
from mmcli.engine.sequence import cache_columns
from mmcli.engine.vision_encoder import VisionEncoder
from mmcli.models.cache import AttentionBatch, DecoderCache
from mmcli.models.registry import family_of


class ModelRunner:
    """Owns the device, the KV cache and the compiled graphs; runs prefill and decode calls.
    `kv_dtype`: the KV cache's (Precision.kv_dtype), the compute dtype where not given;
    `vision_in_one_row`: the vision tower's attention works range by range (VisionEncoder's
    `one_row`)."""

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        config: Config,
        compute_dtype: torch.dtype,
        graphs: CompiledGraphs | None = None,
        kv_dtype: torch.dtype | None = None,
        vision_in_one_row: bool = False,
    ):
        self.model, self.cfg, self.device, self.graphs = model, model.cfg, device, graphs
        self.family = family_of(self.cfg)
        self.dtype = compute_dtype  # matrices may be held lower
        text = self.cfg.text
        self.inv_freq = text_inv_freq(text.rotary_dim, text.rope_theta).to(device)
        self.slot_axes = self.family.rotary_axes(text).to(device)
        engine, buckets = config.engine, config.compile
        # Padding rows of a bucketed decode batch write one scratch row, past the sequences' rows.
        self.scratch_slot, self.max_len = engine.max_seqs, engine.max_len
        self.prefill_buckets = sorted(buckets.prefill_buckets)
        use_cuda_graphs = (
            device.type == "cuda"
            and graphs is None
            and buckets.cuda_graphs
            and self.family.cuda_graphs
        )
        # Compiled and CUDA graphs hold the cache's shape and addresses: all of it, allocated once.
        # Other runs start small and grow to what the job uses.
        self.fixed_cache = graphs is not None or use_cuda_graphs
        rows, columns = (engine.max_seqs + 1, engine.max_len)
        if not self.fixed_cache:
            rows, columns = 1, min(256, engine.max_len)
        self.cache = DecoderCache(text, rows, columns, self.dtype, device, kv_dtype)
        self._decode = self._decode_variant(config, use_cuda_graphs)
        self._pinned: torch.Tensor | None = None
        self.prefixes_prefilled = 0  # shared prefixes prefilled (one per group of tasks)
        self.encoder = VisionEncoder(
            model.visual,
            device,
            config.vision.block_size,
            config.vision.num_blocks_buckets,
            fixed_shapes=graphs is not None,
            graphs=graphs,
            one_row=vision_in_one_row,
        )

    def _decode_variant(self, config: Config, use_cuda_graphs: bool):
        """The decode step this runner uses, chosen once: compiled buckets, CUDA graphs, or
        eager; called with the decode rows, it returns their logits [B, V]."""
        buckets, engine = config.compile, config.engine
        batch = sorted(buckets.decode_batch_buckets)
        context = sorted(buckets.decode_context_buckets)
        if self.graphs is not None:
            return CompiledDecode(self, batch, context)
        if use_cuda_graphs:
            graphs = DecodeGraphs(
                self.model,
                self.cache,
                self.scratch_slot,
                self.cfg.text.rotary_dim,
                _covering(batch, engine.max_seqs),
                _covering(context, engine.max_len),
            )
            return CudaGraphsDecode(self, graphs)
        return EagerDecode(self)

    @torch.inference_mode()
    def decode(self, items: list[DecodeItem]) -> torch.Tensor:
        """One new token per sequence, all in one forward pass -> logits [B, V]."""
        return self._decode(items)

    @property
    def cache_shape(self) -> tuple[int, int] | None:
        """The KV cache's rows and columns as the jobs so far have grown it; None where it is
        fixed (compiled and CUDA graphs hold all of it from the start)."""
        return None if self.fixed_cache else (self.cache.rows, self.cache.columns)

    @property
    def row_columns(self) -> int:
        """What a row of the cache holds whatever its length (a hybrid decoder's linear layers'
        states), as the K/V columns of as many bytes: the scheduler's budget counts it."""
        kv, fixed = self.cache.row_bytes(self.max_len)
        return -(-fixed * self.max_len // kv) if kv else 0

    @property
    def images_encoded(self) -> int:
        return self.encoder.images_encoded

    def _reserve(self, items: list[PrefillItem]) -> None:
        """Grow the KV cache to hold these sequences' rows and every token they may reach
        (columns in whole steps, never past engine.max_len: sequence.cache_columns)."""
        if self.fixed_cache:
            return
        need = max(max(item.max_tokens, item.start + len(item.input_ids) + 1) for item in items)
        self.cache.grow(max(item.slot for item in items) + 1, cache_columns(need, self.max_len))

    def _embed_prompts(self, items: list[PrefillItem]):
        """The prompts' embeddings [T, H] with their images' features, and the DeepStack levels
        (the family's `embed_inputs`)."""
        ids = torch.tensor([i for item in items for i in item.input_ids], device=self.device)
        features = None
        if self.model.has_vision_tokens(ids):
            features = self.encoder.features(
                [p for item in items for p in item.pixel_values],
                [g for item in items for g in item.vision_grids],
                [h for item in items for h in item.vision_hashes],
            )
        return self.model.embed_inputs(ids, features)

    @torch.inference_mode()
    def prefill(self, items: list[PrefillItem]) -> torch.Tensor:
        """Prompts back to back (no padding), each filling its cache row -> logits of each last
        token [B, V]. Items of one group (an image's tasks) prefill their shared prefix once
        (eager backend)."""
        if self.graphs is None:
            self._reserve(items)  # every member's row, before a prefix is copied into it
            items = self._prefill_shared_prefixes(items)
        seqlens = [len(item.input_ids) for item in items]
        self._reserve(items)
        if self.graphs is not None:
            hidden, deepstack = self._embed_prompts(items)
            rows = zip(
                items,
                hidden.split(seqlens),
                zip(*[d.split(seqlens) for d in deepstack]) if deepstack else [[]] * len(items),
            )
            return torch.cat(
                [
                    self.prefill_padded(item.slot, h, list(ds), item.rotary_position_ids)
                    for item, h, ds in rows
                ]
            )
        out = self.forward_prompts(items)
        return self.model.lm_head(
            out[torch.tensor(seqlens, device=self.device).cumsum(0) - 1]
        ).float()

    def _prefill_shared_prefixes(self, items: list[PrefillItem]) -> list[PrefillItem]:
        """Each group's shared prefix prefilled once (every group's in one pass: their images in
        one vision call) and copied to its members' rows; returns what is left to prefill."""
        plan = share_prefixes(items)
        if plan is None:
            return items
        self.forward_prompts(plan.prefixes)
        self.prefixes_prefilled += len(plan.prefixes)
        for source, target, n in plan.copies:
            self.cache.copy_prefix(source, target, n)
        return plan.rest

    @torch.inference_mode()
    def forward_prompts(self, items: list[PrefillItem]) -> torch.Tensor:
        """The text decoder over whole prompts (eager), filling their cache rows -> final hidden
        states [T, H]."""
        self._reserve(items)
        hidden, deepstack = self._embed_prompts(items)
        seqlens = [len(item.input_ids) for item in items]
        rotary = torch.cat([item.rotary_position_ids for item in items], dim=1).to(self.device)
        cos, sin = mrope_cos_sin(rotary, self.inv_freq, self.slot_axes)
        batch = AttentionBatch(
            slots=torch.tensor([item.slot for item in items], device=self.device),
            positions=torch.cat(
                [torch.arange(i.start, i.start + n) for i, n in zip(items, seqlens)]
            ).to(self.device),
            seqlens=seqlens,
            starts=[item.start for item in items],
            rows=[item.slot for item in items],
        )
        return self.model.language_model(hidden, cos, sin, batch, self.cache, deepstack)

    def prefill_padded(
        self, slot: int, hidden: torch.Tensor, deepstack: list[torch.Tensor], rotary: torch.Tensor
    ) -> torch.Tensor:
        """One prompt through its prefill bucket's graph (padded at the end: causal attention
        never sees it)."""
        n = hidden.shape[0]
        size = choose_bucket(n, self.prefill_buckets)
        levels = self.family.vision_levels(self.cfg)
        # text only: the same graph, adding zeros
        deepstack = deepstack or [torch.zeros_like(hidden)] * levels
        pad = (0, 0, 0, size - n)
        cos, sin = mrope_cos_sin(
            F.pad(rotary.to(self.device), (0, size - n)), self.inv_freq, self.slot_axes
        )
        return self.graphs.call(
            Bucket("prefill", (size,)),
            prefill_step,
            self.model,
            self.cache,
            F.pad(hidden, pad),
            cos,
            sin,
            torch.tensor([slot], device=self.device),
            [F.pad(d, pad) for d in deepstack],
            torch.tensor([n - 1], device=self.device),
        )

    def _decode_inputs(self, rows: list[DecodeItem]) -> tuple[torch.Tensor, ...]:
        """positions, deltas, ids, slots on the device, in one copy (pinned and asynchronous on
        CUDA: the step before ended with the sampled tokens' copy, so the buffer is free)."""
        host = torch.tensor(
            [[r.position, r.rope_delta, r.token_id, r.slot] for r in rows], dtype=torch.long
        )
        if self.device.type != "cuda":
            return tuple(column.contiguous() for column in host.to(self.device).unbind(1))
        if self._pinned is None or self._pinned.shape[0] < len(rows):
            self._pinned = torch.empty(
                (max(len(rows), self.scratch_slot + 1), 4), dtype=torch.long
            ).pin_memory()
        self._pinned[: len(rows)].copy_(host)
        device = self._pinned[: len(rows)].to(self.device, non_blocking=True)
        return tuple(column.contiguous() for column in device.unbind(1))

    def decode_args(self, rows: list[DecodeItem], context: int) -> tuple:
        """decode_step's arguments for these rows reading `context` cache columns."""
        positions, deltas, ids, slots = self._decode_inputs(rows)
        rotary = decode_rotary_position_ids(positions, deltas)
        cos, sin = mrope_cos_sin(rotary, self.inv_freq, self.slot_axes)
        return self.model, self.cache, ids, cos, sin, slots, positions, context


def _covering(buckets: list[int], limit: int) -> list[int]:
    """The configured sizes up to `limit`, and `limit` itself: every size the engine can ask for
    has a bucket."""
    return sorted({min(b, limit) for b in buckets} | {limit})
