"""Vision tower time on the CPU for a mixed-size set: packed blocks vs one flat masked sequence
vs padded batch.

Random weights with the Qwen3-VL-2B vision shapes (hidden 1024, 16 heads, MLP 4096); --depth sets
how many of its 24 blocks run (time per block is the same for every block, so the ratios do not
depend on it). All three layouts run through the same bounded-attention path and give the same
features; only the layout differs.

python bench/vision_packing.py [--depth 4] [--block-size 1024] [--threads N]"""

from __future__ import annotations

import argparse
import time

import torch

from mmcli.engine.packing import ffd_pack, flat_efficiency, packed_efficiency, padded_efficiency
from mmcli.engine.vision_encoder import VisionEncoder
from mmcli.kernels.attention import bounded_attention
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


def run(visual, pixels, bins, block_size, repeats):
    encoder = VisionEncoder(
        visual, torch.device("cpu"), block_size, (1, 2, 4, 8, 16), fixed_shapes=True
    )
    inputs, unpack = encoder.packed_inputs(pixels, GRIDS, bins)
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
    args = parser.parse_args()
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
    patches = [t * h * w for t, h, w in GRIDS]
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
        times[name], outputs[name], shape = run(visual, pixels, bins, size, args.repeats)
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


if __name__ == "__main__":
    main()
