"""Vision tower time on the CPU for a mixed-size set: packed blocks vs one flat masked sequence
vs padded batch (fixed shapes, as compiled graphs take them), then the eager CPU's two layouts:
a row per block, trimmed to its fullest, vs the blocks end to end in one row.

Random weights with the Qwen3-VL-2B vision shapes (hidden 1024, 16 heads, MLP 4096); --depth sets
how many of its 24 blocks run (time per block is the same for every block, so the ratios do not
depend on it). The three fixed layouts run through the same bounded-attention path, the eager ones
through attention range by range (segment_attention, the eager CPU's), and all give the same
features; only the layout differs.

python bench/vision_packing.py [--depth 4] [--block-size 1024] [--threads N] [--same 448]
(--same S: 8 images of S x S pixels, where the mixed set's sizes were)"""

from __future__ import annotations

import argparse
import time

import torch

from mmcli.engine.packing import ffd_pack, flat_efficiency, packed_efficiency, padded_efficiency
from mmcli.engine.vision_encoder import VisionEncoder
from mmcli.kernels.attention import bounded_attention, segment_attention
from mmcli.models.config import VisionConfig
from mmcli.models.qwen3_vl.vision import VisionTower

# Patch grids (t, h, w) of a mixed set: 640x480, 512x512, 448x336, 320x320, 256x256 x2, 224x448,
# 256x512
GRIDS = [
    (1, 30, 40),
    (1, 32, 32),
    (1, 28, 20),
    (1, 20, 20),
    (1, 16, 16),
    (1, 16, 16),
    (1, 14, 28),
    (1, 16, 32),
]


def run(visual, pixels, grids, bins, block_size, repeats, fixed=True, one_row=False):
    encoder = VisionEncoder(
        visual, torch.device("cpu"), block_size, (1, 2, 4, 8, 16), fixed, one_row=one_row
    )
    inputs, unpack = encoder.packed_inputs(pixels, grids, bins)
    args = [
        inputs[k]
        for k in ("pixels", "pos_idx", "pos_weights", "cos", "sin", "bound_min", "bound_max")
    ]
    best = float("inf")
    with torch.inference_mode():
        for _ in range(repeats):
            start = time.perf_counter()
            merged, _ = visual.forward_packed(*args)
            best = min(best, time.perf_counter() - start)
    return best, merged.flatten(0, 1)[torch.tensor(unpack)], inputs["pixels"].shape[:2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=1280)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--same", type=int, default=0, help="8 images of this many pixels a side")
    args = parser.parse_args()
    grids = [(1, args.same // 16, args.same // 16)] * 8 if args.same else GRIDS
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = VisionConfig(
        depth=args.depth,
        hidden_size=1024,
        intermediate_size=4096,
        num_heads=16,
        out_hidden_size=2048,
        num_position_embeddings=2304,
        deepstack_visual_indexes=(),
    )
    visual = VisionTower(cfg).eval()
    # every layout through the same kernel: only the layout differs
    visual.kernel = bounded_attention
    for p in visual.parameters():
        torch.nn.init.normal_(p, std=0.02)
    patches = [t * h * w for t, h, w in grids]
    pixels = [torch.randn(n, 1536) for n in patches]
    total = sum(patches)
    layouts = {
        "packed blocks": (ffd_pack(patches, args.block_size), args.block_size),
        "flat + mask": ([list(range(len(patches)))], -(-total // 128) * 128),
        "padded batch": ([[i] for i in range(len(patches))], -(-max(patches) // 128) * 128),
    }
    efficiency = {
        "packed blocks": packed_efficiency(
            patches, len(layouts["packed blocks"][0]), args.block_size
        ),
        "flat + mask": flat_efficiency(patches),
        "padded batch": padded_efficiency(patches),
    }
    print(
        f"{len(patches)} images, {total} patches, vision depth {args.depth} of 24, threads "
        f"{torch.get_num_threads()}"
    )
    times, outputs = {}, {}
    for name, (bins, size) in layouts.items():
        times[name], outputs[name], shape = run(visual, pixels, grids, bins, size, args.repeats)
        print(
            f"{name:14s} {shape[0]:2d} x {shape[1]:5d} rows  attention efficiency "
            f"{100 * efficiency[name]:5.1f}%  {times[name] * 1000:8.1f} ms"
        )
    for name in ("flat + mask", "padded batch"):
        torch.testing.assert_close(outputs[name], outputs["packed blocks"], atol=1e-4, rtol=1e-4)
    print(
        f"speed-up of packed blocks: {times['flat + mask'] / times['packed blocks']:.2f}x over "
        f"flat + mask, {times['padded batch'] / times['packed blocks']:.2f}x over padded batch"
    )
    eager(visual, pixels, grids, layouts["packed blocks"], args.repeats, outputs["packed blocks"])


def eager(visual, pixels, grids, packed, repeats, reference) -> None:
    """The eager CPU's layouts of the packed blocks, attention range by range."""
    visual.kernel = segment_attention
    bins, size = packed
    times = {}
    for name, one_row in (("a row per block", False), ("one row", True)):
        times[name], out, shape = run(visual, pixels, grids, bins, size, repeats, False, one_row)
        torch.testing.assert_close(out, reference, atol=1e-4, rtol=1e-4)
        print(f"eager, {name:15s} {shape[0]:2d} x {shape[1]:5d} rows  {times[name] * 1000:8.1f} ms")
    ratio = times["a row per block"] / times["one row"]
    print(f"eager, one row: {ratio:.2f}x a row per block")


if __name__ == "__main__":
    main()
