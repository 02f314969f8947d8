"""The vision tower over a wave of images: packed into blocks, padded to a bucket, and recent
images cached.

The runner hands it pixel values and grids; it returns each image's merged features and DeepStack
levels."""

from __future__ import annotations

from collections import OrderedDict

import torch

from mmcli.compiled.buckets import Bucket, choose_bucket
from mmcli.compiled.graphs import CompiledGraphs
from mmcli.engine.packing import (
    block_bounds,
    ffd_pack,
    gather_index,
    make_layout,
    unpack_index,
    vision_calls,
)

# merged [n, out], DeepStack levels [n, out] each
VisionFeatures = tuple[torch.Tensor, tuple[torch.Tensor, ...]]


class VisionEncoder:
    def __init__(
        self,
        visual: torch.nn.Module,
        device: torch.device,
        block_size: int | None,
        num_blocks_buckets: tuple[int, ...],
        fixed_shapes: bool,
        graphs: CompiledGraphs | None = None,
        cache_size: int = 64,
        one_row: bool = False,
    ):
        """`visual`: the family's vision tower (`model.visual`: called on images, `forward_packed`
        on blocks, `patch_inputs` of grids). block_size None: the per-image reference path.
        fixed_shapes: pad every call to its configured bucket (compiled graphs need it);
        otherwise eager calls trim padding blocks and block tails, and with `one_row` (the
        tower's attention works range by range: kernels/plan.py's vision_by_range) lay their
        blocks end to end in one row, no padding at all."""
        self.visual, self.device, self.graphs = visual, device, graphs
        self.block_size, self.num_blocks_buckets = block_size, tuple(sorted(num_blocks_buckets))
        self.fixed_shapes, self.one_row = fixed_shapes, one_row
        # recent encoded images by content hash
        self.cache: OrderedDict[str, VisionFeatures] = OrderedDict()
        self.cache_size = cache_size
        self.images_encoded = 0

    @property
    def merge_unit(self) -> int:
        return self.visual.cfg.spatial_merge_size**2

    def features(
        self, pixel_values: list[torch.Tensor], grids: list[tuple[int, int, int]], hashes: list[str]
    ) -> list[VisionFeatures]:
        """Features of every image, in order; each distinct image not seen recently is encoded
        once, all of them in one wave. Without a hash per image, every image is encoded."""
        if len(hashes) != len(pixel_values):
            self.images_encoded += len(pixel_values)
            return self.encode(pixel_values, grids)
        todo = {h: n for n, h in enumerate(hashes) if h not in self.cache}
        if todo:
            self.images_encoded += len(todo)
            fresh = self.encode(
                [pixel_values[n] for n in todo.values()], [grids[n] for n in todo.values()]
            )
            self.cache.update(zip(todo, fresh))
        out = []
        for h in hashes:
            self.cache.move_to_end(h)
            out.append(self.cache[h])
        while len(self.cache) > self.cache_size:
            self.cache.popitem(last=False)
        return out

    @torch.inference_mode()
    def encode(
        self, pixel_values: list[torch.Tensor], grids: list[tuple[int, int, int]]
    ) -> list[VisionFeatures]:
        """Vision tower over several images at once: packed into blocks (as many calls as the
        largest bucket needs), or without a block size the per-image reference path."""
        sizes = [t * h * w // self.merge_unit for t, h, w in grids]
        if self.block_size is None:
            merged, deepstack = self.visual(torch.cat(pixel_values).to(self.device), grids)
            return list(
                zip(
                    merged.split(sizes),
                    zip(*[d.split(sizes) for d in deepstack]) if deepstack else [()] * len(sizes),
                )
            )
        features: list = [None] * len(grids)
        bins = ffd_pack([t * h * w for t, h, w in grids], self.block_size)
        # a wave larger than the largest bucket: several calls
        for group in vision_calls(bins, self.num_blocks_buckets[-1]):
            images = sorted(i for b in group for i in b)
            local = {i: n for n, i in enumerate(images)}
            merged, deepstack = self.encode_packed(
                [pixel_values[i] for i in images],
                [grids[i] for i in images],
                [[local[i] for i in b] for b in group],
            )
            split = [sizes[i] for i in images]
            levels = (
                list(zip(*[d.split(split) for d in deepstack])) if deepstack else [()] * len(images)
            )
            for i, f, ds in zip(images, merged.split(split), levels):
                features[i] = (f, ds)
        return features

    def packed_inputs(
        self,
        pixel_values: list[torch.Tensor],
        grids: list[tuple[int, int, int]],
        bins: list[list[int]],
        num_blocks: int | None = None,
    ) -> tuple[dict[str, torch.Tensor], list[int]]:
        """Scatter per-patch inputs into [num_blocks, block_size, ...] and build the bounds and
        unpack index."""
        patches = [t * h * w for t, h, w in grids]
        if self.fixed_shapes:
            num_blocks = num_blocks or choose_bucket(len(bins), list(self.num_blocks_buckets))
            layout = make_layout(patches, bins, num_blocks, self.block_size)
        elif self.one_row:
            # the bins end to end: the bounds keep each image to itself, and attention by range
            # costs no more over one long row (a masked one would cost its square)
            images = [i for b in bins for i in b]
            layout = make_layout(patches, [images], 1, sum(patches[i] for i in images))
        else:
            # eager: each block as long as its fullest bin (padding rows are computed too)
            used = max(sum(patches[i] for i in b) for b in bins)
            layout = make_layout(patches, bins, len(bins), used)
        flat = self.visual.patch_inputs(grids)
        flat["pixels"] = torch.cat(pixel_values)
        index = torch.tensor(gather_index(patches, layout))
        real = index >= 0
        shape = (layout.num_blocks, layout.block_size)
        packed = {}
        # padding rows stay zero: no pixels, zero pos weights, cos = sin = 0
        for (
            name,
            value,
        ) in flat.items():
            out = value.new_zeros((index.numel(), *value.shape[1:]))
            out[real] = value[index[real]]
            packed[name] = out.view(*shape, *value.shape[1:]).to(self.device)
        bmin, bmax = block_bounds([[h * w] * t for t, h, w in grids], layout)
        packed["bound_min"] = torch.tensor(bmin).view(shape).to(self.device)
        packed["bound_max"] = torch.tensor(bmax).view(shape).to(self.device)
        return packed, unpack_index(patches, layout, self.merge_unit)

    def encode_packed(
        self,
        pixel_values: list[torch.Tensor],
        grids: list[tuple[int, int, int]],
        bins: list[list[int]],
        num_blocks: int | None = None,
    ):
        """One vision call over the blocks `bins` -> merged features and DeepStack levels, in
        image order."""
        inputs, unpack = self.packed_inputs(pixel_values, grids, bins, num_blocks)
        args = [
            inputs[k]
            for k in ("pixels", "pos_idx", "pos_weights", "cos", "sin", "bound_min", "bound_max")
        ]
        if self.graphs is not None:
            merged, deepstack = self.graphs.call(
                Bucket("vision", tuple(inputs["pixels"].shape[:2])),
                self.visual.forward_packed,
                *args,
            )
        else:
            merged, deepstack = self.visual.forward_packed(*args)
        index = torch.tensor(unpack, device=self.device)
        return merged.flatten(0, 1)[index], [d.flatten(0, 1)[index] for d in deepstack]
