"""The CPU paths side by side, in one run, each side in a process of its own, as ratios (issue
13's bench).

(a) images/s on compare_hf's 16 images and output lengths: `dtype: float32` (float32 weights,
packed), the default (the checkpoint's bfloat16 weights, float32 compute) and `quantize: int8`,
against the float32 path and against transformers (float32, its best batch size of
--hf-batch-sizes); (b) `mmcli ask` for one 448x448 image and 16 tokens: wall time split into
start, load, vision, prefill, decode, next to its floor = checkpoint bytes / read bandwidth +
FLOPs / float32 matmul peak + decode weight bytes / bandwidth, and the command with `--quantize
int8` twice on an empty cache (the first prepares the int8 weights, the second reads them), and
cold (the checkpoint's pages dropped first) without and with the read-ahead;
(c) peak RSS against weight bytes
+ KV bytes used (each (a) run, and the ask); (d) int8 against the unquantized run, teacher-forced
on the default run's greedy tokens: top-1 agreement and mean |difference| of the reference
token's log-prob, on the 2B-shaped checkpoint and on a tiny one whose decoder RMSNorm weights
carry three channels scaled by 30 (outliers in the activations, as real models show).

python bench/cpu.py [--smoke] [--hf-batch-sizes 1,8] [--skip-hf] [--only-ask]"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import compare_hf
import torch

from mmcli.testing import make_outlier_checkpoint

ASK_IMAGE = 14  # compare_hf's 448x448 image
PATHS = {
    "float32": {"dtype": "float32"},
    "default": {"dtype": "auto"},
    "int8": {"dtype": "auto", "quantize": "int8"},
}


def ask_worker(ckpt: Path, image: Path, settings: dict, started: float) -> dict:
    """What `mmcli ask` does, through the same API, timed by phase (the parent adds the
    interpreter's start)."""
    from mmcli.api.labeler import Labeler
    from mmcli.config import load_config

    imported = time.perf_counter()
    cap = Labeler.from_pretrained(
        str(ckpt), config=load_config(None, {"device": "cpu", **settings})
    )
    loaded = time.perf_counter()
    spent = compare_hf.phase_timers(cap)
    result = cap.ask([image], compare_hf.PROMPT, max_new_tokens=16)
    done = time.perf_counter()
    assert result.ok, result.error
    return {
        "imports": imported - started,
        "load": loaded - imported,
        "ask": done - loaded,
        "spent": spent,
        "tokens": len(result.token_ids),
        "image_tokens": result.num_image_tokens,
        "input_tokens": result.num_input_tokens,
        "weight_bytes": cap.weight_bytes,
        "kv_bytes": cap.runner.cache.nbytes,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def teacher_forced(
    ckpt: Path, image: Path, settings: dict, tokens: list[int] | None, count: int
) -> dict:
    """Log-probs of every generated position given the reference tokens (generated here when
    `tokens` is None)."""
    from mmcli.api.labeler import Labeler
    from mmcli.config import load_config
    from mmcli.engine.positions import rope_index
    from mmcli.engine.runner import PrefillItem

    cap = Labeler.from_pretrained(
        str(ckpt), config=load_config(None, {"device": "cpu", **settings})
    )
    if tokens is None:
        # eos may end it sooner
        tokens = cap.ask([image], compare_hf.PROMPT, max_new_tokens=count).token_ids
    req, _ = cap.request("k", [image], compare_hf.PROMPT, cap.sampling())
    ids = list(req.input_ids) + tokens[:-1]
    rotary, _ = rope_index(
        ids, req.vision_grids, cap.model.cfg.image_token_id, cap.model.cfg.vision.spatial_merge_size
    )
    with torch.inference_mode():
        hidden = cap.runner.forward_prompts(
            [PrefillItem(0, ids, rotary, req.pixel_values, req.vision_grids)]
        )
        logprobs = torch.log_softmax(
            cap.model.lm_head(hidden[len(req.input_ids) - 1 :]).float(), -1
        )
    return {
        "tokens": tokens,
        "top1": logprobs.argmax(-1).tolist(),
        "reference_logprob": logprobs.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist(),
    }


def run(args, *worker_args: str, env: dict | None = None) -> tuple[dict, float]:
    start = time.perf_counter()
    out = subprocess.run(
        [sys.executable, __file__, *worker_args, "--cache-dir", str(args.cache_dir)]
        + (["--smoke"] if args.smoke else []),
        capture_output=True,
        text=True,
        env=env,
    )
    if out.returncode:
        sys.exit(f"{' '.join(worker_args[:2])} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1]), time.perf_counter() - start


def agreement(args, ckpt: Path, image: Path, label: str) -> str:
    count = 8 if args.smoke else 32
    reference, _ = run(
        args,
        "--worker",
        "forced",
        "--ckpt",
        str(ckpt),
        "--image",
        str(image),
        "--settings",
        "{}",
        "--count",
        str(count),
    )
    quantized, _ = run(
        args,
        "--worker",
        "forced",
        "--ckpt",
        str(ckpt),
        "--image",
        str(image),
        "--settings",
        json.dumps(PATHS["int8"]),
        "--tokens",
        json.dumps(reference["tokens"]),
    )
    count = len(reference["tokens"])
    same = sum(a == b for a, b in zip(reference["top1"], quantized["top1"])) / count
    diff = (
        sum(
            abs(a - b)
            for a, b in zip(reference["reference_logprob"], quantized["reference_logprob"])
        )
        / count
    )
    return f"| {label} | {count} | {100 * same:.1f}% | {diff:.4f} |"


def start_times() -> None:
    """`mmcli --help`, `config show` and `plan` (no torch): best of 5 wall times each, as a
    user's shell runs them."""
    mmcli = shutil.which("mmcli") or "mmcli"
    for command in (["--help"], ["config", "show"], ["plan", "--tokens", "512,256"]):
        best = math.inf
        for _ in range(5):
            start = time.perf_counter()
            subprocess.run([mmcli, *command], check=True, capture_output=True)
            best = min(best, time.perf_counter() - start)
        print(f"mmcli {' '.join(command)}: {best:.3f} s")


def cli_ask(command: list[str], env: dict | None = None) -> tuple[float, float]:
    """The command's wall time and peak RSS, from a fresh interpreter that runs it
    (RUSAGE_CHILDREN here would be the largest of every child this bench has waited for)."""
    probe = (
        "import resource, subprocess, sys, time; t = time.perf_counter(); "
        "subprocess.run(sys.argv[1:], check=True, capture_output=True); print(time.perf_counter() "
        "- t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, *command], check=True, capture_output=True, text=True, env=env
    )
    wall, rss = (float(v) for v in out.stdout.split())
    return wall, rss


def evict(ckpt: Path) -> None:
    """Drop the checkpoint's pages from the page cache (POSIX_FADV_DONTNEED: no root needed)."""
    for file in ckpt.glob("*.safetensors"):
        fd = os.open(file, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def ask_flops(cfg, image_tokens: int, input_tokens: int) -> tuple[float, int, int]:
    """The ask's prefill FLOPs (the vision tower's linears on every patch, its mergers on the
    merged tokens, both towers' attention products, the decoder's linears on every prompt token
    and the lm_head on the last), with the decoder's and the head's parameter counts."""
    from mmcli.model.checkpoint import expected_shapes

    shapes = expected_shapes(cfg)
    count = {"patch": 0, "merged": 0, "text": 0}
    for name, shape in shapes.items():
        if name.startswith("model.visual.") and "pos_embed" not in name:
            count["merged" if "merger" in name else "patch"] += math.prod(shape)
        elif name.startswith("model.language_model.") and "embed" not in name:
            count["text"] += math.prod(shape)
    head = cfg.text.vocab_size * cfg.text.hidden_size
    patches = image_tokens * cfg.vision.spatial_merge_size**2
    full_layers = sum(not cfg.text.is_linear(i) for i in range(cfg.text.num_hidden_layers))
    attention = 4 * patches**2 * cfg.vision.hidden_size * cfg.vision.depth  # QK^T and PV
    # causal: half the products
    attention += (
        2 * input_tokens**2 * cfg.text.num_attention_heads * cfg.text.head_dim * full_layers
    )
    linears = count["patch"] * patches + count["merged"] * image_tokens
    linears += count["text"] * input_tokens + head
    return 2 * linears + attention, count["text"], head


def split(label: str, timed: dict, wall: float, flops: float, peak: float) -> str:
    """An instrumented ask's phases, and its vision and prefill against the matmul peak."""
    s = timed["spent"]
    start_s = wall - timed["load"] - timed["ask"]
    return (
        f"{label}: {wall:.1f} s = start {start_s:.1f} + load {timed['load']:.1f} + vision "
        f"{s['vision']:.1f} + text prefill {s['prefill'] - s['vision']:.1f} + decode "
        f"{s['decode']:.1f} + rest {timed['ask'] - s['prefill'] - s['decode']:.1f}; vision and "
        f"prefill at {flops / peak / s['prefill']:.0%} of the matmul peak"
    )


def ask_part(args, ckpt: Path, image: Path, limits: dict) -> None:
    """(b) and (c) for `mmcli ask`: the instrumented run, then the real command for its wall time
    and peak RSS; the same at int8 on an empty cache (twice: the first prepares it)."""
    from mmcli.model.config import parse_config

    worker = ["--worker", "ask", "--ckpt", str(ckpt), "--image", str(image), "--settings"]
    timed, wall = run(args, *worker, "{}")
    command = [shutil.which("mmcli") or "mmcli", "ask", "--model", str(ckpt), "--device", "cpu"]
    command += ["--image", str(image), "--max-new-tokens", "16", compare_hf.PROMPT]
    cli_wall, cli_rss = cli_ask(command)
    cold = {}
    for label, env in (("without read-ahead", {"MMCLI_READ_AHEAD": "0"}), ("with it", {})):
        evict(ckpt)
        cold[label] = cli_ask(command, {**os.environ, **env})[0]
    with tempfile.TemporaryDirectory() as cache:  # an empty cache: the first int8 ask prepares it
        env = {**os.environ, "XDG_CACHE_HOME": cache}
        int8 = [cli_ask([*command, "--quantize", "int8"], env) for _ in range(2)]
        timed8, wall8 = run(args, *worker, json.dumps(PATHS["int8"]), env=env)
    cfg = parse_config(json.loads((ckpt / "config.json").read_text()))
    flops, text, head = ask_flops(cfg, timed["image_tokens"], timed["input_tokens"])
    checkpoint_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    floor = {
        "read checkpoint": checkpoint_bytes / limits["bandwidth"],
        "compute": flops / limits["matmul_flops"],
        "decode weights": 15 * 2 * (text + head) / limits["bandwidth"],
    }
    start_s = wall - timed["load"] - timed["ask"]
    print(
        f"\n(b) mmcli ask, one 448x448 image, {timed['tokens']} tokens ({timed['input_tokens']} "
        "prompt tokens):"
    )
    print(split("instrumented", timed, wall, flops, limits["matmul_flops"]))
    print(split("int8, instrumented (cache read)", timed8, wall8, flops, limits["matmul_flops"]))
    print(
        f"floor: {sum(floor.values()):.1f} s = "
        + " + ".join(f"{k} {v:.1f}" for k, v in floor.items())
        + f" ({flops / 1e12:.2f} TFLOP)"
    )
    whole = sum(floor.values())

    def against(seconds: float) -> str:  # the floor counts no start-up: shown with and without
        return (
            f"{seconds / whole:.2f}x the floor; {(seconds - start_s) / whole:.2f}x without the "
            f"start-up's {start_s:.1f} s"
        )

    print(f"the command itself: {cli_wall:.1f} s wall = {against(cli_wall)}")
    print(
        f"int8: the first ask {int8[0][0]:.1f} s ({against(int8[0][0])}; it prepares the cache), "
        f"the second {int8[1][0]:.1f} s ({against(int8[1][0])}; {int8[1][0] / cli_wall:.2f}x the "
        f"default ask), peak RSS {int8[1][1] / 2**30:.2f} GiB"
    )
    print(
        "cold (the checkpoint's pages dropped from the page cache first): "
        + ", ".join(f"{label} {seconds:.1f} s" for label, seconds in cold.items())
    )
    used = timed["weight_bytes"] + timed["kv_bytes"]
    print(
        f"(c) ask peak RSS {cli_rss / 2**30:.2f} GiB against weights + KV "
        f"{timed['weight_bytes'] / 2**30:.2f} + {timed['kv_bytes'] / 2**30:.3f} GiB: "
        f"{cli_rss / used:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny checkpoint and few images")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--hf-batch-sizes", default="1,8")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--only-ask", action="store_true", help="only (b) and (c) for `mmcli ask`")
    parser.add_argument("--worker", choices=["ask", "forced"], help=argparse.SUPPRESS)
    for name in ("--ckpt", "--image", "--settings", "--tokens"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    parser.add_argument("--count", type=int, default=32, help=argparse.SUPPRESS)
    args = parser.parse_args()
    started = time.perf_counter()
    if args.worker == "ask":
        print(
            json.dumps(
                ask_worker(Path(args.ckpt), Path(args.image), json.loads(args.settings), started)
            )
        )
        return
    if args.worker == "forced":
        tokens = json.loads(args.tokens) if args.tokens else None
        print(
            json.dumps(
                teacher_forced(
                    Path(args.ckpt), Path(args.image), json.loads(args.settings), tokens, args.count
                )
            )
        )
        return
    if args.cache_dir is None:
        args.cache_dir = compare_hf.ROOT / (".bench_cache/smoke" if args.smoke else ".bench_cache")
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    ckpt, images, lengths = compare_hf.make_inputs(args.cache_dir, args.smoke)
    limits = compare_hf.machine_limits()
    print(
        f"machine: read bandwidth {limits['bandwidth'] / 1e9:.1f} GB/s, float32 matmul "
        f"{limits['matmul_flops'] / 1e9:.1f} GFLOP/s, {torch.get_num_threads()} threads; "
        f"{len(images)} images, {sum(lengths)} output tokens",
        flush=True,
    )
    if args.only_ask:
        ask_part(args, ckpt, images[ASK_IMAGE % len(images)], limits)
        return
    rate_args = argparse.Namespace(
        cache_dir=args.cache_dir,
        dtype="float32",
        device="cpu",
        images=len(images),
        max_seqs=16,
        max_len=512,
        smoke=args.smoke,
    )
    from mmcli.model.checkpoint import expected_shapes
    from mmcli.model.config import parse_config

    cfg = parse_config(json.loads((ckpt / "config.json").read_text()))
    parameters = sum(
        math.prod(s)
        for n, s in expected_shapes(cfg).items()
        if not (n == "lm_head.weight" and cfg.tie_word_embeddings)
    )
    rates = {}
    for name, settings in PATHS.items():
        rates[name] = compare_hf.run_worker(
            argparse.Namespace(**vars(rate_args), settings=json.dumps(settings)), "mmcli"
        )
        r = rates[name]
        spent = r["spent"]
        print(
            f"{name}: {r['images_per_s']:.4f} images/s ({r['seconds']:.1f} s: vision "
            f"{spent['vision']:.1f}, text prefill {spent['prefill'] - spent['vision']:.1f}, "
            f"decode {spent['decode']:.1f}; {r['precision']}); weights "
            f"{r['weight_bytes'] / 2**30:.2f} GiB ({r['weight_bytes'] / parameters:.2f} bytes a "
            f"parameter) + KV {r['kv_bytes'] / 2**30:.2f} GiB, peak RSS "
            f"{r['peak_rss'] / 2**30:.2f} GiB "
            f"({r['peak_rss'] / (r['weight_bytes'] + r['kv_bytes']):.2f}x)",
            flush=True,
        )
    hf = (
        []
        if args.skip_hf
        else [
            compare_hf.run_worker(
                argparse.Namespace(**vars(rate_args), settings="{}"), "hf", int(b)
            )
            for b in args.hf_batch_sizes.split(",")
        ]
    )
    print("\n(a) images/s | vs float32 path | vs transformers (best batch)")
    best = max(hf, key=lambda r: r["images_per_s"]) if hf else None
    for name, r in rates.items():
        versus = (
            f"{r['images_per_s'] / best['images_per_s']:.2f}x (batch {best['batch_size']})"
            if best
            else "-"
        )
        print(
            f"{name}: {r['images_per_s']:.4f} | "
            f"{r['images_per_s'] / rates['float32']['images_per_s']:.2f}x | {versus}"
        )
    print("\nstart-up, no model:")
    start_times()
    ask_part(args, ckpt, images[ASK_IMAGE % len(images)], limits)
    print("\n(d) int8 against the unquantized run, teacher-forced on its greedy tokens")
    print("| checkpoint | positions | top-1 agreement | mean abs log-prob difference |")
    print("|---|---|---|---|")
    print(agreement(args, ckpt, images[0], "2B-shaped random" if not args.smoke else "tiny"))
    tiny, _, _ = compare_hf.make_inputs(args.cache_dir / "tiny", smoke=True)
    print(
        agreement(
            args,
            make_outlier_checkpoint(tiny, args.cache_dir / "tiny-outliers"),
            images[0],
            "tiny, RMSNorm outlier channels x30",
        )
    )


if __name__ == "__main__":
    main()
