"""MoE and int4 on the CPU, in one run, each side in a process of its own.

(a) Qwen3-VL-30B-A3B's shapes (128 experts, 8 a token; random bfloat16 weights written once to
--cache-dir) at int4, on 8 images x 64 tokens: load time, peak RSS, weights held, images/s, the
vision / text prefill / decode split and the decode step. Writing all 48 decoder layers would take
62 GB of disk, so two checkpoints hold the first --layers and twice as many: what one layer adds
(seconds, bytes) is their difference, and the 48-layer figures are extrapolated from it, marked
so. Next to them the dense Qwen3-VL-2B (compare_hf's checkpoint) at int4 and at the default.
(b) On the dense 2B, int4 against int8 and the default: images/s, bytes a parameter, and agreement
with the default run (bench/cpu.py's: teacher-forced on its greedy tokens, top-1 and the mean
|difference| of the reference token's log-prob).
(c) The same agreement for int4 and int8 on the tests' tiny configurations (dense, both MoE
families) and on the int8 test's outlier-channel checkpoint.

python bench/moe.py [--layers 2] [--smoke]"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import compare_hf

from mmcli.models.registry import parse_config
from mmcli.testing import MOE_VARIANTS, make_outlier_checkpoint, make_tiny_checkpoint
from mmcli.weights.checkpoint import expected_shapes

LAYERS = 48
# int8 quantizes at every load here (weights_cache off): bench/cpu.py measures the prepared cache
PATHS = {
    "default": {},
    "int8": {"quantize": "int8", "weights_cache": False},
    "int4": {"quantize": "int4"},
}
DENSE = "dense 2B"  # compare_hf's Qwen3-VL-2B-shaped checkpoint (tiny with --smoke)


def moe_checkpoint(cache: Path, layers: int, smoke: bool) -> Path:
    path = cache / (f"tiny-moe-{layers}" if smoke else f"qwen3-vl-30b-a3b-first{layers}-bf16")
    if not (path / "config.json").is_file():
        print(f"writing {path} (once)", flush=True)
        make_tiny_checkpoint(
            path,
            "qwen3_vl_moe",
            dtype="bfloat16",
            released_shapes=not smoke,
            layers=None if smoke else layers,
            shards=1 if smoke else 2 * layers,
            **({} if smoke else {"max_pixels": 16777216, "min_pixels": 65536}),
        )
    return path


def run(args, ckpt: Path, settings: dict, lengths: list[int]) -> dict:
    """compare_hf's mmcli worker on `ckpt`, in a process of its own (peak RSS is its own)."""
    settings = {"device": "cpu", **settings}
    settings["engine"] = {"max_seqs": len(lengths), "max_len": 1024}
    code = (
        "import json, sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); "
        "import compare_hf; images = compare_hf.make_inputs(Path(sys.argv[2]), sys.argv[3] == "
        "'smoke', len(json.loads(sys.argv[5])))[1]; print(json.dumps(compare_hf.worker_mmcli("
        "Path(sys.argv[4]), images, json.loads(sys.argv[5]), json.loads(sys.argv[6]))))"
    )
    command = [sys.executable, "-c", code, str(Path(__file__).parent), str(args.cache_dir)]
    command += ["smoke" if args.smoke else "full", str(ckpt), json.dumps(lengths)]
    out = subprocess.run([*command, json.dumps(settings)], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"worker failed on {ckpt.name} {settings}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def load_overshoot(ckpt: Path, settings: dict) -> int:
    """The most an int4 load's resident bytes rise above what it already holds while it reads one
    file (the mapped pages read, a tensor's quantization temporaries): measured file by file, so
    the extrapolated peak can add it on top of everything 48 layers hold, as if at the last file."""
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import compare_hf; "
        "from mmcli.weights import checkpoint; from mmcli.api.labeler import Labeler; "
        "from mmcli.config import load_config; read, rise = checkpoint._read_file, [0]\n"
        "def each(file, *args):\n"
        "    before = compare_hf.resident(); compare_hf.reset_peak_rss(); read(file, *args)\n"
        "    rise[0] = max(rise[0], compare_hf.peak_rss() - before)\n"
        "checkpoint._read_file = each\n"
        "Labeler.from_pretrained(sys.argv[2], config=load_config(None, json.loads(sys.argv[3])))\n"
        "print(rise[0])"
    )
    command = [sys.executable, "-c", code, str(Path(__file__).parent), str(ckpt)]
    out = subprocess.run([*command, json.dumps({"device": "cpu", **settings})], **_CAPTURE)
    if out.returncode:
        sys.exit(f"load worker failed on {ckpt.name}:\n{out.stderr[-3000:]}")
    return int(out.stdout.strip().splitlines()[-1])


_CAPTURE = {"capture_output": True, "text": True}


def agreement(args, ckpt: Path, image: Path, settings: dict, reference: dict | None) -> dict:
    command = [sys.executable, str(Path(__file__).parent / "cpu.py"), "--worker", "forced"]
    command += ["--ckpt", str(ckpt), "--image", str(image), "--settings", json.dumps(settings)]
    command += ["--count", "8" if args.smoke else "32", "--cache-dir", str(args.cache_dir)]
    if reference is not None:
        command += ["--tokens", json.dumps(reference["tokens"])]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _line(name: str, r: dict, parameters: int) -> str:
    spent = r["spent"]
    return (
        f"| {name} | {r['load_seconds']:.1f} s | {r['peak_rss'] / 2**30:.2f} GiB "
        f"(load {r['load_peak_rss'] / 2**30:.2f}, run {r['run_peak_rss'] / 2**30:.2f}) | "
        f"{r['weight_bytes'] / 2**30:.2f} GiB ({r['weight_bytes'] / parameters:.2f} B/param) | "
        f"{r['images_per_s']:.3f} | {spent['vision']:.1f} / "
        f"{spent['prefill'] - spent['vision']:.1f}"
        f" / {spent['decode']:.1f} s | {r['decode_step'] * 1000:.0f} ms |"
    )


def extrapolate(small: dict, large: dict, step: int, have: int, overshoot: int) -> dict:
    """The 48-layer figures from two runs `step` layers apart, the larger with `have` layers.
    The text decoder's time, what the load leaves resident and the run's peak (its K/V and
    activations grow with the layers too) are linear in the layers; the vision tower's time is
    the larger run's (the same tower); the load's peak is what it leaves plus its largest
    overshoot while reading a file."""
    grow = (LAYERS - have) / step
    out = dict(large)

    def grown(small_value: float, large_value: float) -> float:
        return large_value + grow * (large_value - small_value)

    for key in ("load_seconds", "loaded_rss", "run_peak_rss", "weight_bytes", "decode_step"):
        out[key] = grown(small[key], large[key])
    vision = large["spent"]["vision"]
    out["seconds"] = vision + grown(*(r["seconds"] - r["spent"]["vision"] for r in (small, large)))
    out["spent"] = {
        "vision": vision,
        "prefill": vision
        + grown(*(r["spent"]["prefill"] - r["spent"]["vision"] for r in (small, large))),
        "decode": grown(small["spent"]["decode"], large["spent"]["decode"]),
    }
    out["images_per_s"] = large["images_per_s"] * large["seconds"] / out["seconds"]
    out["load_peak_rss"] = out["loaded_rss"] + overshoot
    out["peak_rss"] = max(out["load_peak_rss"], out["run_peak_rss"])
    return out


def _parameters(ckpt: Path) -> int:
    cfg = parse_config(json.loads((ckpt / "config.json").read_text()))
    return sum(
        math.prod(s)
        for n, s in expected_shapes(cfg).items()
        if not (n == "lm_head.weight" and cfg.tie_word_embeddings)
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny checkpoints (runs in the tests)")
    parser.add_argument("--layers", type=int, default=2, help="layers of the smaller MoE run")
    parser.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args()
    if args.cache_dir is None:
        args.cache_dir = compare_hf.ROOT / (".bench_cache/smoke" if args.smoke else ".bench_cache")
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    dense, images, _ = compare_hf.make_inputs(args.cache_dir, args.smoke, 8)
    lengths = [8 if args.smoke else 64] * len(images)
    limits = compare_hf.machine_limits()
    print(
        f"machine: read bandwidth {limits['bandwidth'] / 1e9:.1f} GB/s, float32 matmul "
        f"{limits['matmul_flops'] / 1e9:.1f} GFLOP/s; {len(images)} images x {lengths[0]} tokens",
        flush=True,
    )
    small = moe_checkpoint(args.cache_dir, args.layers, args.smoke)
    large = moe_checkpoint(args.cache_dir, 2 * args.layers, args.smoke)
    runs = {
        f"MoE, first {args.layers} layers, int4": (run(args, small, PATHS["int4"], lengths), small)
    }
    runs[f"MoE, first {2 * args.layers} layers, int4"] = (
        run(args, large, PATHS["int4"], lengths),
        large,
    )
    for name in ("int4", "default", "int8"):
        runs[f"{DENSE}, {name}"] = (run(args, dense, PATHS[name], lengths), dense)
    print(
        "\n(a) | load | peak RSS | weights held | images/s | vision / text prefill / decode "
        "| decode step |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, (r, ckpt) in runs.items():
        print(_line(name, r, _parameters(ckpt)))
    if not args.smoke:
        (a, _), (b, _) = list(runs.values())[:2]
        overshoot = load_overshoot(large, PATHS["int4"])
        whole = extrapolate(a, b, args.layers, 2 * args.layers, overshoot)
        parameters = round(
            _parameters(large)
            + (LAYERS - 2 * args.layers) * (_parameters(large) - _parameters(small)) / args.layers
        )
        print(_line("MoE, 48 layers, int4 (extrapolated)", whole, parameters))
        print(
            f"\nMoE at 48 layers (extrapolated): the load leaves {whole['loaded_rss'] / 2**30:.2f} "
            f"GiB resident and peaks at {whole['load_peak_rss'] / 2**30:.2f} GiB (its largest rise "
            f"while reading one file, {overshoot / 2**30:.2f} GiB, put on top of everything held); "
            f"the run peaks at {whole['run_peak_rss'] / 2**30:.2f} GiB"
        )
    print(
        f"\n(b) {DENSE} | images/s | bytes a parameter | top-1 agreement | mean abs log-prob "
        "difference"
    )
    for name, (same, diff) in agreements(args, dense, images[0], ("int4", "int8")).items():
        r = runs[f"{DENSE}, {name}"][0]
        print(
            f"{name} | {r['images_per_s']:.3f} | {r['weight_bytes'] / _parameters(dense):.2f} | "
            f"{100 * same:.1f}% | {diff:.4f}"
        )
    r = runs[f"{DENSE}, default"][0]
    print(
        f"default | {r['images_per_s']:.3f} | {r['weight_bytes'] / _parameters(dense):.2f} | - | -"
    )
    tiny_agreement(args, images[0])


def agreements(args, ckpt: Path, image: Path, precisions) -> dict[str, tuple[float, float]]:
    """Per precision: (top-1 agreement, mean |log-prob difference| of the reference token),
    teacher-forced on the default run's greedy tokens."""
    reference = agreement(args, ckpt, image, {}, None)
    out = {}
    for name in precisions:
        forced = agreement(args, ckpt, image, PATHS[name], reference)
        same = sum(a == b for a, b in zip(reference["top1"], forced["top1"])) / len(forced["top1"])
        diff = sum(
            abs(a - b) for a, b in zip(reference["reference_logprob"], forced["reference_logprob"])
        ) / len(forced["top1"])
        out[name] = (same, diff)
    return out


def tiny_agreement(args, image: Path) -> None:
    """(c) The same agreement on the tests' tiny configurations (their seeds; bfloat16 as stored)
    and on the int8 test's outlier-channel copy of the dense one."""
    root = args.cache_dir / "agreement"
    dense = make_tiny_checkpoint(root / "dense", dtype="bfloat16")
    outlier = make_outlier_checkpoint(dense, root / "outlier")
    checkpoints = {"tiny dense, outlier channels x30": outlier}
    if not args.smoke:  # with --smoke the script is checked on this one only
        checkpoints = {"tiny dense": dense, **checkpoints}
        for seed, variant in enumerate(MOE_VARIANTS, start=3):
            checkpoints[f"tiny {variant}"] = make_tiny_checkpoint(
                root / variant, variant, seed=seed, dtype="bfloat16"
            )
    print("\n(c) checkpoint | int4 top-1 | int4 mean abs log-prob diff | int8 top-1 | int8 diff")
    for name, ckpt in checkpoints.items():
        found = agreements(args, ckpt, image, ("int4", "int8"))
        print(
            f"{name} | "
            + " | ".join(f"{100 * same:.1f}% | {diff:.4f}" for same, diff in found.values())
        )


if __name__ == "__main__":
    main()
