"""The runner owns tensors: device, dtype, weights, KV cache, vision encoding, prefill and decode calls."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .checkpoint import ModelConfig
from .compiled import Bucket, CompiledGraphs
from .model import AttentionBatch, KVCache, Qwen3VL
from .model.linear import pack_linears
from .packing import choose_bucket, ffd_pack, gather_index, make_layout, unpack_index
from .positions import decode_rotary_position_ids, mrope_cos_sin, mrope_slot_axes, text_inv_freq
from .sampling import SamplingParams, choose_tokens


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was asked for, but torch sees no CUDA device")
    if name not in ("cpu", "cuda"):
        raise ValueError(f"device {name!r} is not one of auto, cpu, cuda")
    return torch.device(name)


@dataclass
class PrefillItem:
    """One sequence's prompt, as the runner needs it."""

    slot: int
    input_ids: list[int]
    rotary_position_ids: torch.Tensor  # [3, L]
    pixel_values: list[torch.Tensor]  # one [n_i, C*T*P*P] per image, in prompt order
    image_grids: list[tuple[int, int, int]]
    image_hashes: list[str] = field(default_factory=list)  # content hashes; equal images are encoded once


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


def prefill_step(model: Qwen3VL, cache: KVCache, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 slots: torch.Tensor, deepstack: list[torch.Tensor], last: torch.Tensor) -> torch.Tensor:
    """One prompt padded to its bucket (the compiled prefill graph): fills its cache row, returns the logits of
    its last real token [1, V]."""
    batch = AttentionBatch(slots=slots, seqlens=[hidden.shape[0]], fixed_shapes=True)
    out = model.language_model(hidden, cos, sin, batch, cache, deepstack or None)
    return model.lm_head(out[last]).float()


def decode_step(model: Qwen3VL, cache: KVCache, ids: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                slots: torch.Tensor, positions: torch.Tensor, context_len: int, fixed_shapes: bool = True
                ) -> torch.Tensor:
    """One token per row over `context_len` cache columns; with fixed shapes (the compiled decode graph) the batch
    and context are padded buckets."""
    batch = AttentionBatch(slots=slots, positions=positions, context_len=context_len, fixed_shapes=fixed_shapes)
    out = model.language_model(model.language_model.embed_tokens(ids), cos, sin, batch, cache)
    return model.lm_head(out).float()


class ModelRunner:
    def __init__(self, model: Qwen3VL, device: torch.device, max_seqs: int = 1, max_len: int = 4096,
                 block_size: int | None = None, num_blocks_buckets: tuple[int, ...] = (1, 2, 4, 8),
                 fixed_shapes: bool = False, graphs: CompiledGraphs | None = None,
                 prefill_buckets: tuple[int, ...] = (), decode_batch_buckets: tuple[int, ...] = (),
                 decode_context_buckets: tuple[int, ...] = ()):
        self.model = model.to(device)
        self.cfg: ModelConfig = model.cfg
        self.device = device
        self.dtype = model.lm_head.weight.dtype
        if graphs is None:  # compiled graphs trace the plain weights
            pack_linears(model)
        text = self.cfg.text
        self.inv_freq = text_inv_freq(text.head_dim, text.rope_theta).to(device)
        self.slot_axes = mrope_slot_axes(text.mrope_section, text.head_dim).to(device)
        # Compiled graphs: every call padded to a bucket; padding rows of a decode batch write to one scratch row.
        self.graphs = graphs
        self.scratch_slot = max_seqs
        self.cache = KVCache(text, max_seqs + (graphs is not None), max_len, self.dtype, device)
        self.block_size, self.buckets = block_size, tuple(sorted(num_blocks_buckets))
        self.prefill_buckets = sorted(prefill_buckets)
        self.decode_batch_buckets, self.decode_context_buckets = sorted(decode_batch_buckets), \
            sorted(decode_context_buckets)
        # Compiled graphs need the configured shapes; eager calls may trim padding blocks and block tails.
        self.fixed_shapes = fixed_shapes or graphs is not None
        self.image_cache: OrderedDict[str, tuple] = OrderedDict()  # recent encoded images by content hash
        self.image_cache_size = 64
        self.images_encoded = 0

    @torch.inference_mode()
    def encode_images(self, pixel_values: list[torch.Tensor], grids: list[tuple[int, int, int]]):
        """Vision tower over several images at once; returns (features, deepstack levels) per image.

        With a block size, the images are packed into blocks (as many calls as the largest bucket needs);
        without one, the per-image reference path runs."""
        m2 = self.cfg.vision.spatial_merge_size**2
        sizes = [t * h * w // m2 for t, h, w in grids]
        if self.block_size is None:
            merged, deepstack = self.model.visual(torch.cat(pixel_values).to(self.device), grids)
            return list(zip(merged.split(sizes), zip(*[d.split(sizes) for d in deepstack]) if deepstack
                            else [()] * len(sizes)))
        features: list = [None] * len(grids)
        bins = ffd_pack([t * h * w for t, h, w in grids], self.block_size)
        for start in range(0, len(bins), self.buckets[-1]):  # a wave larger than the largest bucket: several calls
            group = bins[start:start + self.buckets[-1]]
            images = sorted(i for b in group for i in b)
            local = {i: n for n, i in enumerate(images)}
            merged, deepstack = self._encode_packed([pixel_values[i] for i in images], [grids[i] for i in images],
                                                    [[local[i] for i in b] for b in group])
            split = [sizes[i] for i in images]
            levels = list(zip(*[d.split(split) for d in deepstack])) if deepstack else [()] * len(images)
            for i, f, ds in zip(images, merged.split(split), levels):
                features[i] = (f, ds)
        return features

    def packed_inputs(self, pixel_values: list[torch.Tensor], grids: list[tuple[int, int, int]],
                      bins: list[list[int]], num_blocks: int | None = None
                      ) -> tuple[dict[str, torch.Tensor], list[int]]:
        """Scatter per-patch inputs into [num_blocks, block_size, ...] and build the bounds and unpack index."""
        from .packing import block_bounds

        patches = [t * h * w for t, h, w in grids]
        if self.fixed_shapes:
            num_blocks = num_blocks or choose_bucket(len(bins), list(self.buckets))
            layout = make_layout(patches, bins, num_blocks, self.block_size)
        else:
            used = max(sum(patches[i] for i in b) for b in bins)
            layout = make_layout(patches, bins, len(bins), min(self.block_size, -(-used // 128) * 128))
        flat = self.model.visual.patch_inputs(grids)
        flat["pixels"] = torch.cat(pixel_values)
        index = torch.tensor(gather_index(patches, layout))
        real = index >= 0
        shape = (layout.num_blocks, layout.block_size)
        packed = {}
        for name, value in flat.items():  # padding rows stay zero: no pixels, zero pos weights, cos = sin = 0
            out = value.new_zeros((index.numel(), *value.shape[1:]))
            out[real] = value[index[real]]
            packed[name] = out.view(*shape, *value.shape[1:]).to(self.device)
        bmin, bmax = block_bounds([[h * w] * t for t, h, w in grids], layout)
        packed["bound_min"] = torch.tensor(bmin).view(shape).to(self.device)
        packed["bound_max"] = torch.tensor(bmax).view(shape).to(self.device)
        return packed, unpack_index(patches, layout, self.cfg.vision.spatial_merge_size**2)

    def _encode_packed(self, pixel_values, grids, bins, num_blocks: int | None = None):
        inputs, unpack = self.packed_inputs(pixel_values, grids, bins, num_blocks)
        args = (inputs["pixels"], inputs["pos_idx"], inputs["pos_weights"], inputs["cos"], inputs["sin"],
                inputs["bound_min"], inputs["bound_max"])
        if self.graphs is not None:
            merged, deepstack = self.graphs.call(Bucket("vision", tuple(inputs["pixels"].shape[:2])),
                                                 self.model.visual.forward_packed, *args)
        else:
            merged, deepstack = self.model.visual.forward_packed(*args)
        index = torch.tensor(unpack, device=self.device)
        return merged.flatten(0, 1)[index], [d.flatten(0, 1)[index] for d in deepstack]

    def _embed_prompts(self, items: list[PrefillItem], image_features: list | None):
        ids = torch.tensor([i for item in items for i in item.input_ids], device=self.device)
        hidden = self.model.language_model.embed_tokens(ids)
        visual_mask = ids == self.cfg.image_token_id
        if not bool(visual_mask.any()):
            return hidden, None, None
        if image_features is None:
            image_features = self._image_features(items)
        merged = torch.cat([f for f, _ in image_features]).to(hidden.dtype)
        if merged.shape[0] != int(visual_mask.sum()):
            raise ValueError(f"{int(visual_mask.sum())} image tokens but {merged.shape[0]} image features")
        hidden = hidden.index_put((visual_mask,), merged)
        levels = len(image_features[0][1])
        # DeepStack levels as dense [T, H] (zero off the image tokens): one add per layer, the same shapes always.
        deepstack = [torch.zeros_like(hidden).index_put((visual_mask,), torch.cat([ds[level] for _, ds in
                     image_features]).to(hidden.dtype)) for level in range(levels)]
        return hidden, visual_mask, deepstack

    def _image_features(self, items: list[PrefillItem]) -> list:
        """Features of every image of `items`, in order; each distinct image not seen recently is encoded once,
        all of them in one vision call."""
        pixels = [p for item in items for p in item.pixel_values]
        grids = [g for item in items for g in item.image_grids]
        keys = [h for item in items for h in item.image_hashes]
        if len(keys) != len(pixels):  # no hashes given: encode as they are
            self.images_encoded += len(pixels)
            return self.encode_images(pixels, grids)
        todo = {k: n for n, k in enumerate(keys) if k not in self.image_cache}
        if todo:
            self.images_encoded += len(todo)
            fresh = self.encode_images([pixels[n] for n in todo.values()], [grids[n] for n in todo.values()])
            for key, feats in zip(todo, fresh):
                self.image_cache[key] = feats
        features = []
        for key in keys:
            self.image_cache.move_to_end(key)
            features.append(self.image_cache[key])
        while len(self.image_cache) > self.image_cache_size:
            self.image_cache.popitem(last=False)
        return features

    @torch.inference_mode()
    def prefill(self, items: list[PrefillItem], image_features: list | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """Prompts back to back (no padding) -> logits of each prompt's last token [B, V] (or all, [T, V])."""
        hidden, visual_mask, deepstack = self._embed_prompts(items, image_features)
        seqlens = [len(item.input_ids) for item in items]
        if self.graphs is not None and not all_logits:
            rows = zip(items, hidden.split(seqlens), zip(*[d.split(seqlens) for d in deepstack]) if deepstack
                       else [[]] * len(items))
            return torch.cat([self._prefill_padded(item.slot, h, list(ds), item.rotary_position_ids)
                              for item, h, ds in rows])
        rotary = torch.cat([item.rotary_position_ids for item in items], dim=1).to(self.device)
        cos, sin = mrope_cos_sin(rotary, self.inv_freq, self.slot_axes)
        batch = AttentionBatch(slots=torch.tensor([item.slot for item in items], device=self.device),
                               positions=torch.cat([torch.arange(n) for n in seqlens]).to(self.device),
                               seqlens=seqlens)
        out = self.model.language_model(hidden, cos, sin, batch, self.cache, deepstack)
        if not all_logits:
            out = out[torch.tensor(seqlens, device=self.device).cumsum(0) - 1]
        return self.model.lm_head(out).float()

    def _prefill_padded(self, slot: int, hidden: torch.Tensor, deepstack: list[torch.Tensor],
                        rotary: torch.Tensor) -> torch.Tensor:
        """One prompt through its prefill bucket's graph (padded at the end: causal attention never sees it)."""
        n = hidden.shape[0]
        if n > self.prefill_buckets[-1]:
            raise ValueError(f"prompt of {n} tokens is over the largest compile.prefill_buckets entry "
                             f"{self.prefill_buckets[-1]}")
        size = choose_bucket(n, self.prefill_buckets)
        levels = len(self.cfg.vision.deepstack_visual_indexes)
        deepstack = deepstack or [torch.zeros_like(hidden)] * levels  # text only: the same graph, adding zeros
        pad = (0, 0, 0, size - n)
        cos, sin = mrope_cos_sin(F.pad(rotary.to(self.device), (0, size - n)), self.inv_freq, self.slot_axes)
        return self.graphs.call(Bucket("prefill", (size,)), prefill_step, self.model, self.cache, F.pad(hidden, pad),
                                cos, sin, torch.tensor([slot], device=self.device), [F.pad(d, pad) for d in deepstack],
                                torch.tensor([n - 1], device=self.device))

    @torch.inference_mode()
    def decode(self, items: list[DecodeItem]) -> torch.Tensor:
        """One new token per sequence, all in one forward pass -> logits [B, V]. With compiled graphs the batch is
        padded to its (batch, context) bucket; padding rows write the scratch row at column 0."""
        rows, context = items, max(item.position for item in items) + 1
        if self.graphs is not None:
            batch = choose_bucket(len(items), self.decode_batch_buckets)
            context = choose_bucket(context, self.decode_context_buckets)
            rows = items + [DecodeItem(self.scratch_slot, 0, 0, 0)] * (batch - len(items))
        positions = torch.tensor([r.position for r in rows], device=self.device)
        rotary = decode_rotary_position_ids(positions, torch.tensor([r.rope_delta for r in rows], device=self.device))
        cos, sin = mrope_cos_sin(rotary, self.inv_freq, self.slot_axes)
        args = (self.model, self.cache, torch.tensor([r.token_id for r in rows], device=self.device), cos, sin,
                torch.tensor([r.slot for r in rows], device=self.device), positions, context)
        if self.graphs is None:
            return decode_step(*args, fixed_shapes=False)
        return self.graphs.call(Bucket("decode", (len(rows), context)), decode_step, *args)[:len(items)]

    @torch.inference_mode()
    def warm(self, bucket: Bucket) -> None:
        """Run one bucket once on synthetic inputs of its shape (what compiling it ahead means); writes only the
        scratch row of the KV cache."""
        if bucket.component == "vision":
            pixels = torch.zeros(4, self.model.visual.patch_embed.proj.weight[0].numel())  # one 2x2-patch image
            self._encode_packed([pixels], [(1, 2, 2)], [[0]], num_blocks=bucket.shape[0])
        elif bucket.component == "prefill":
            (size,) = bucket.shape
            hidden = torch.zeros(size, self.cfg.text.hidden_size, dtype=self.dtype, device=self.device)
            rotary = torch.arange(size).expand(3, size)
            self._prefill_padded(self.scratch_slot, hidden, [], rotary)
        else:
            batch, context = bucket.shape
            self.decode([DecodeItem(self.scratch_slot, 0, context - 1, 0)] * batch)

    def choose(self, logits: torch.Tensor, params: list[SamplingParams], histories: list[list[int]],
               seeds: list[int]) -> list[Choice]:
        tokens, logprobs = choose_tokens(logits, params, histories, seeds)
        return [Choice(t, lp) for t, lp in zip(tokens, logprobs)]
