"""The runner owns tensors: device, dtype, weights, KV cache, vision encoding, prefill and decode
calls."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from mmcli.compiled.buckets import Bucket, choose_bucket
from mmcli.compiled.cuda_graphs import DecodeGraphs
from mmcli.compiled.graphs import CompiledGraphs
from mmcli.compiled.steps import decode_step, prefill_step
from mmcli.config import Config, SamplingParams
from mmcli.engine.positions import (
    decode_rotary_position_ids,
    mrope_cos_sin,
    mrope_slot_axes,
    text_inv_freq,
)
from mmcli.engine.sampling import choose_tokens
from mmcli.engine.vision_encoder import VisionEncoder, VisionFeatures
from mmcli.errors import ConfigError
from mmcli.model import cpu_kernel
from mmcli.model.attention import choose_block_attention
from mmcli.model.cache import AttentionBatch, DecoderCache
from mmcli.model.config import ModelConfig
from mmcli.model.fused_decode import FusedDecode
from mmcli.model.host_memory import keep_freed_memory, populate
from mmcli.model.linear import KERNEL_ROWS, held_tensors, int8_kernel_name, pack_linears
from mmcli.model.prepared import PreparedWeights
from mmcli.model.quantize import quantize_model
from mmcli.model.qwen3_5 import delta_rule
from mmcli.model.vlm import VisionLanguageModel


def prepare_weights(
    model: VisionLanguageModel,
    device: torch.device,
    quantize: str,
    compiled: bool,
    prepared: PreparedWeights | None = None,
) -> str:
    """Choose the linear kernels (see model/linear.py) and convert the weights for them (int8's
    through the `prepared` cache file when given); returns which."""
    if quantize == "int4":  # quantized as read (model/int4_load.py)
        count = sum(getattr(m, "kernel", "") == "int4" for m in model.modules())
        return f"int4 ({count} linears and the MoE experts, torch's int4 CPU kernel)"
    if quantize == "int8":
        if device.type != "cpu" or compiled:
            raise ConfigError(
                "quantize int8 runs on the CPU with the eager backend; this run has device "
                f"{device.type}, compiled {compiled}"
            )
        if prepared is not None:
            return f"int8 ({prepared.quantize(model)})"
        return f"int8 ({quantize_model(model)} linears, {int8_kernel_name()})"
    if compiled:
        return "plain (traced into the compiled graphs)"
    if device.type == "cpu" and pack_linears(model):
        return "packed float32 (oneDNN)"
    if device.type != "cpu":
        return "plain"
    # built now, at load, rather than inside the first decode step
    library, reason = cpu_kernel.load()
    few_rows = "compiled bf16 kernel" if library is not None else f"chunks ({reason})"
    return (
        f"upcast: bfloat16 weights, float32 compute; up to {KERNEL_ROWS} rows {few_rows}, more "
        "rows chunks"
    )


def choose_delta_rule(model: VisionLanguageModel, device: torch.device) -> str | None:
    """The gated delta rule's kernels for a hybrid model's linear layers (None without any):
    flash-linear-attention's on CUDA when it is installed, else PyTorch's (model/qwen3_5)."""
    layers = [layer.linear_attn for layer in model.language_model.layers if layer.linear]
    if not layers:
        return None
    fla = delta_rule.fla_kernels() if device.type == "cuda" else None
    if fla is None:
        return "Gated DeltaNet: PyTorch (chunked prefill, one-step decode)"
    for layer in layers:
        layer.chunked, layer.step = fla
    return "Gated DeltaNet: flash-linear-attention"


@dataclass
class PrefillItem:
    """One sequence's prompt, as the runner needs it."""

    slot: int
    input_ids: list[int]
    rotary_position_ids: torch.Tensor  # [3, L]
    pixel_values: list[torch.Tensor]  # one [n_i, C*T*P*P] per image, in prompt order
    vision_grids: list[tuple[int, int, int]]
    # content hashes; equal images are encoded once
    vision_hashes: list[str] = field(default_factory=list)
    # prompt and output tokens the sequence may reach (KV cache columns to hold)
    max_tokens: int = 0
    # items of one group share their first prefix_len tokens (prefilled once)
    group: str | None = None
    prefix_len: int = 0
    start: int = 0  # the first token's position: its row already holds the tokens before it


@dataclass
class DecodeItem:
    slot: int
    token_id: int
    position: int  # sequential position of this token (= tokens already in the cache)
    rope_delta: int


@dataclass
class Choice:
    token_id: int
    logprob: float


class ModelRunner:
    """Owns the device, the weights, the KV cache and the compiled graphs; runs prefill and
    decode calls."""

    def __init__(
        self,
        model: VisionLanguageModel,
        device: torch.device,
        config: Config,
        graphs: CompiledGraphs | None = None,
        prepared: PreparedWeights | None = None,
    ):
        self.model = model.to(device)
        self.cfg: ModelConfig = model.cfg
        self.device = device
        self.dtype = model.language_model.norm.weight.dtype  # compute dtype; matrices may be lower
        self.prepared = prepared  # the int8 cache file: `written()` says where it is
        self.kernels = self._prepare(model, device, config.quantize, graphs is not None, prepared)
        backend = "eager" if graphs is None else graphs.backend
        model.visual.block_attention = choose_block_attention(backend, device.type)
        text = self.cfg.text
        self.inv_freq = text_inv_freq(text.rotary_dim, text.rope_theta).to(device)
        self.slot_axes = mrope_slot_axes(text.mrope_section, text.rotary_dim).to(device)
        engine, buckets = config.engine, config.compile
        # Padding rows of a bucketed decode batch write one scratch row, past the sequences' rows.
        self.scratch_slot, self.max_len = engine.max_seqs, engine.max_len
        self.prefill_buckets = sorted(buckets.prefill_buckets)
        self.decode_batch_buckets = sorted(buckets.decode_batch_buckets)
        self.decode_context_buckets = sorted(buckets.decode_context_buckets)
        self.graphs = graphs
        # the experts' grouping reads the routing on the host: not capturable
        moe = self.cfg.text.num_experts > 0
        use_cuda_graphs = (
            device.type == "cuda" and graphs is None and buckets.cuda_graphs and not moe
        )
        # Compiled and CUDA graphs hold the cache's shape and addresses: all of it, allocated once.
        # Other runs start small and grow to what the job uses.
        self.fixed_cache = graphs is not None or use_cuda_graphs
        rows, columns = (engine.max_seqs + 1, engine.max_len)
        if not self.fixed_cache:
            rows, columns = 1, min(256, engine.max_len)
        self.cache = DecoderCache(text, rows, columns, self.dtype, device)
        self.cuda_graphs = None
        if use_cuda_graphs:
            self.cuda_graphs = DecodeGraphs(
                model,
                self.cache,
                self.scratch_slot,
                text.rotary_dim,
                _covering(self.decode_batch_buckets, engine.max_seqs),
                _covering(self.decode_context_buckets, engine.max_len),
            )
        self._decode = self._decode_implementation()
        self._pinned: torch.Tensor | None = None
        self.prefixes_prefilled = 0  # shared prefixes prefilled (one per group of tasks)
        self.mask_seconds = 0.0  # time spent masking logits to grammars
        self.encoder = VisionEncoder(
            model.visual,
            device,
            config.vision.block_size,
            config.vision.num_blocks_buckets,
            fixed_shapes=graphs is not None,
            graphs=graphs,
        )

    @staticmethod
    def _prepare(model, device, quantize: str, compiled: bool, prepared) -> str:
        """The weights prepared for their kernels, the host allocator set for the run; returns
        the kernels in words."""
        kernels = [prepare_weights(model, device, quantize, compiled, prepared)]
        if device.type == "cpu" and not compiled:
            decoder = model.language_model
            decoder.fused_decode = FusedDecode.for_decoder(decoder, model.cfg.text)
            if decoder.fused_decode is not None:
                kernels.append("a decode step one call a layer")
        if device.type == "cpu":
            keep_freed_memory()  # after the load: its temporaries are returned as before
            populate([(t.data_ptr(), t.numel() * t.element_size()) for t in held_tensors(model)])
        return "; ".join(kernels + [k for k in [choose_delta_rule(model, device)] if k])

    def _decode_implementation(self):
        """The decode step this runner uses, chosen once: compiled buckets, CUDA graphs, or
        eager."""
        if self.graphs is not None:
            return self._decode_compiled
        if self.cuda_graphs is not None:
            return self._decode_cuda_graphs
        return self._decode_eager

    @property
    def images_encoded(self) -> int:
        return self.encoder.images_encoded

    def _reserve(self, items: list[PrefillItem]) -> None:
        """Grow the KV cache to hold these sequences' rows and every token they may reach
        (columns in steps of 256, never past engine.max_len)."""
        if self.fixed_cache:
            return
        need = max(max(item.max_tokens, item.start + len(item.input_ids) + 1) for item in items)
        self.cache.grow(
            max(item.slot for item in items) + 1, min(self.max_len, -(-need // 256) * 256)
        )

    def _embed_prompts(self, items: list[PrefillItem], image_features: list | None):
        ids = torch.tensor([i for item in items for i in item.input_ids], device=self.device)
        hidden = self.model.language_model.embed(ids)
        # segments in prompt order
        visual_mask = (ids == self.cfg.image_token_id) | (ids == self.cfg.video_token_id)
        if not bool(visual_mask.any()):
            return hidden, None, None
        if image_features is None:
            image_features = self.encoder.features(
                [p for item in items for p in item.pixel_values],
                [g for item in items for g in item.vision_grids],
                [h for item in items for h in item.vision_hashes],
            )
        merged = torch.cat([f for f, _ in image_features]).to(hidden.dtype)
        if merged.shape[0] != int(visual_mask.sum()):
            raise ValueError(
                f"{int(visual_mask.sum())} image tokens but {merged.shape[0]} image features"
            )
        hidden = hidden.index_put((visual_mask,), merged)
        levels = len(image_features[0][1])
        # DeepStack levels as dense [T, H] (zero off the image tokens): one add per layer, the same
        # shapes always.
        deepstack = [
            torch.zeros_like(hidden).index_put(
                (visual_mask,), torch.cat([ds[level] for _, ds in image_features]).to(hidden.dtype)
            )
            for level in range(levels)
        ]
        return hidden, visual_mask, deepstack

    @torch.inference_mode()
    def prefill(
        self, items: list[PrefillItem], image_features: list[VisionFeatures] | None = None
    ) -> torch.Tensor:
        """Prompts back to back (no padding), each filling its cache row -> logits of each last
        token [B, V]. Items of one group (an image's tasks) prefill their shared prefix once
        (eager backend)."""
        if self.graphs is None and image_features is None:
            self._reserve(items)  # every member's row, before a prefix is copied into it
            items = self._share_prefixes(items)
        seqlens = [len(item.input_ids) for item in items]
        self._reserve(items)
        if self.graphs is not None:
            hidden, _, deepstack = self._embed_prompts(items, image_features)
            rows = zip(
                items,
                hidden.split(seqlens),
                zip(*[d.split(seqlens) for d in deepstack]) if deepstack else [[]] * len(items),
            )
            return torch.cat(
                [
                    self._prefill_padded(item.slot, h, list(ds), item.rotary_position_ids)
                    for item, h, ds in rows
                ]
            )
        out = self.forward_prompts(items, image_features)
        return self.model.lm_head(
            out[torch.tensor(seqlens, device=self.device).cumsum(0) - 1]
        ).float()

    def _share_prefixes(self, items: list[PrefillItem]) -> list[PrefillItem]:
        """Prefill each group's shared prefix once, in its first member's cache row, copy it to
        the other members' rows, and return the items with only their own tokens left (starting
        after the prefix)."""
        groups: dict[str, list[PrefillItem]] = {}
        for item in items:
            if item.group is not None and item.prefix_len > 0:
                groups.setdefault(item.group, []).append(item)
        shared = {g: members for g, members in groups.items() if len(members) > 1}
        if not shared:
            return items
        out, prefixes, copies = list(items), [], []
        for members in shared.values():
            n = min(min(m.prefix_len for m in members), min(len(m.input_ids) for m in members) - 1)
            lead = members[0]
            prefixes.append(
                PrefillItem(
                    slot=lead.slot,
                    input_ids=lead.input_ids[:n],
                    rotary_position_ids=lead.rotary_position_ids[:, :n],
                    pixel_values=lead.pixel_values,
                    vision_grids=lead.vision_grids,
                    vision_hashes=lead.vision_hashes,
                    max_tokens=max(m.max_tokens for m in members),
                )
            )
            for member in members:
                copies.append((lead.slot, member.slot, n))
                out[items.index(member)] = PrefillItem(
                    slot=member.slot,
                    input_ids=member.input_ids[n:],
                    rotary_position_ids=member.rotary_position_ids[:, n:],
                    pixel_values=[],  # the prefix holds the vision tokens
                    vision_grids=[],
                    max_tokens=member.max_tokens,
                    start=n,
                )
        # every group's prefix in one pass: their images in one vision call
        self.forward_prompts(prefixes)
        self.prefixes_prefilled += len(prefixes)
        for source, target, n in copies:
            self.cache.copy_prefix(source, target, n)
        return out

    @torch.inference_mode()
    def forward_prompts(
        self, items: list[PrefillItem], image_features: list[VisionFeatures] | None = None
    ) -> torch.Tensor:
        """The text decoder over whole prompts (eager), filling their cache rows -> final hidden
        states [T, H]."""
        self._reserve(items)
        hidden, _, deepstack = self._embed_prompts(items, image_features)
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
        )
        return self.model.language_model(hidden, cos, sin, batch, self.cache, deepstack)

    def _prefill_padded(
        self, slot: int, hidden: torch.Tensor, deepstack: list[torch.Tensor], rotary: torch.Tensor
    ) -> torch.Tensor:
        """One prompt through its prefill bucket's graph (padded at the end: causal attention
        never sees it)."""
        n = hidden.shape[0]
        size = choose_bucket(n, self.prefill_buckets)
        levels = len(self.cfg.vision.deepstack_visual_indexes)
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

    @torch.inference_mode()
    def decode(self, items: list[DecodeItem]) -> torch.Tensor:
        """One new token per sequence, all in one forward pass -> logits [B, V]."""
        return self._decode(items)

    def _decode_args(self, rows: list[DecodeItem], context: int) -> tuple:
        positions, deltas, ids, slots = self._decode_inputs(rows)
        rotary = decode_rotary_position_ids(positions, deltas)
        cos, sin = mrope_cos_sin(rotary, self.inv_freq, self.slot_axes)
        return self.model, self.cache, ids, cos, sin, slots, positions, context

    def _decode_eager(self, items: list[DecodeItem]) -> torch.Tensor:
        context = max(item.position for item in items) + 1
        contiguous = [r.slot for r in items] == list(range(len(items)))
        return decode_step(
            *self._decode_args(items, context), fixed_shapes=False, contiguous=contiguous
        )

    def _decode_compiled(self, items: list[DecodeItem]) -> torch.Tensor:
        """The batch padded to its (batch, context) bucket, through that bucket's graph."""
        batch = choose_bucket(len(items), self.decode_batch_buckets)
        context = choose_bucket(
            max(item.position for item in items) + 1, self.decode_context_buckets
        )
        rows = items + [DecodeItem(self.scratch_slot, 0, 0, 0)] * (batch - len(items))
        args = self._decode_args(rows, context)
        return self.graphs.call(Bucket("decode", (batch, context)), decode_step, *args)[
            : len(items)
        ]

    def _decode_cuda_graphs(self, items: list[DecodeItem]) -> torch.Tensor:
        """A CUDA graph of the step's bucket, replayed; a shape past the buckets decodes eagerly. A
        capture this torch or driver refuses turns CUDA graphs off for the run, said once."""
        context = max(item.position for item in items) + 1
        if not self.cuda_graphs.fits(len(items), context):
            return self._decode_eager(items)
        _, _, ids, cos, sin, slots, positions, _ = self._decode_args(items, context)
        try:
            return self.cuda_graphs.run(ids, cos, sin, slots, positions, context)
        except RuntimeError as e:
            print(
                f"mmcli: CUDA graphs off for this run ({str(e).splitlines()[0][:200]})",
                file=sys.stderr,
            )
            self._decode = self._decode_eager
            return self._decode_eager(items)

    @torch.inference_mode()
    def run_bucket(self, bucket: Bucket) -> None:
        """Run one bucket's call once on synthetic inputs of its shape (with a compiled backend,
        the first run compiles it); writes only the scratch row of the KV cache."""
        if bucket.component == "vision":
            # one 2x2-patch image
            pixels = torch.zeros(4, self.model.visual.patch_embed.proj.weight[0].numel())
            self.encoder.encode_packed([pixels], [(1, 2, 2)], [[0]], num_blocks=bucket.shape[0])
        elif bucket.component == "prefill":
            (size,) = bucket.shape
            hidden = torch.zeros(
                size, self.cfg.text.hidden_size, dtype=self.dtype, device=self.device
            )
            rotary = torch.arange(size).expand(3, size)
            self._prefill_padded(self.scratch_slot, hidden, [], rotary)
        else:
            batch, context = bucket.shape
            self.decode([DecodeItem(self.scratch_slot, 0, context - 1, 0)] * batch)

    def choose(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        histories: list[list[int]],
        seeds: list[int],
        constraints: list | None = None,
    ) -> list[Choice]:
        """Next tokens; a row with a grammar constraint chooses among the tokens it allows (its
        log-probability is still the model's own)."""
        scores = logits
        if constraints and any(c is not None for c in constraints):
            started = time.perf_counter()
            scores = logits.float().clone()
            for row, constraint in zip(scores, constraints):
                if constraint is not None:
                    constraint.mask(row)
            self.mask_seconds += time.perf_counter() - started
        tokens, logprobs = choose_tokens(scores, params, histories, seeds, model_logits=logits)
        return [Choice(t, lp) for t, lp in zip(tokens, logprobs)]


def _covering(buckets: list[int], limit: int) -> list[int]:
    """The configured sizes up to `limit`, and `limit` itself: every size the engine can ask for
    has a bucket."""
    return sorted({min(b, limit) for b in buckets} | {limit})
