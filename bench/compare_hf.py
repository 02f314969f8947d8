"""mmcli vs transformers on the same checkpoint and images, in one run, with the machine's own
limits; for each model family asked for (--families qwen3_vl,qwen3_5), side by side.

Random weights with the real Qwen3-VL-2B-Instruct or Qwen3.5-2B shapes (bfloat16, written once to
--cache-dir),
16 images from 224x224 to 640x480, per-image output lengths from a fixed schedule between 16 and
96 tokens (standing in for eos; transformers gets a per-row stopping criterion with the same
lengths). Both sides compute in --dtype (default float32, what mmcli picks on a CPU). Each side
runs in a process of its own (peak RSS is per process).

python bench/compare_hf.py [--smoke] [--cache-dir DIR] [--dtype float32] [--hf-batch-sizes 1,4,8]
python bench/compare_hf.py --device cuda --dtype bfloat16 --images 256 --max-seqs 64
--hf-batch-sizes 16,64

With --images N the 16 sizes and lengths repeat. mmcli reads its inputs through its input
pipeline (worker threads ahead of the engine) and reports the fraction of the run its engine
waited for them."""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SIZES = [
    (224, 224),
    (640, 480),
    (320, 240),
    (512, 384),
    (256, 256),
    (480, 360),
    (300, 300),
    (640, 360),
    (224, 336),
    (400, 300),
    (288, 288),
    (360, 480),
    (560, 420),
    (240, 320),
    (448, 448),
    (600, 400),
]
LENGTHS = [16, 96, 32, 64, 24, 80, 48, 16, 96, 40, 72, 20, 56, 88, 32, 64]
PROMPT = "Describe this image."


CHECKPOINTS = {"qwen3_vl": "qwen3-vl-2b-random-bf16", "qwen3_5": "qwen3.5-2b-random-bf16"}


def make_inputs(
    cache: Path, smoke: bool, count: int = 16, family: str = "qwen3_vl"
) -> tuple[Path, list[Path], list[int]]:
    from PIL import Image

    from mmcli.testing import make_tiny_checkpoint

    name = CHECKPOINTS[family]
    ckpt = cache / (("tiny" if family == "qwen3_vl" else f"tiny-{family}") if smoke else name)
    if not (ckpt / "config.json").is_file():
        print(
            f"writing {'a tiny' if smoke else 'a 2B-shaped'} random checkpoint to {ckpt} (once)",
            flush=True,
        )
        make_tiny_checkpoint(
            ckpt,
            "qwen3_5" if family == "qwen3_5" else "base",
            dtype="bfloat16",
            released_shapes=not smoke,
            **({} if smoke else {"max_pixels": 16777216, "min_pixels": 65536}),
        )
    images = []
    names = ["astronaut.jpg", "chelsea.jpg", "coffee.jpg", "rocket.jpg"]
    count = 6 if smoke else count
    for n in range(count):
        w, h = SIZES[n % len(SIZES)]
        f = (
            cache
            / "images"
            / (f"{n:02d}_{w}x{h}.png" if n < len(SIZES) else f"{n:03d}_{w}x{h}.png")
        )
        if not f.is_file():
            f.parent.mkdir(parents=True, exist_ok=True)
            im = Image.open(ROOT / "samples" / names[n % 4]).convert("RGB")
            # repeats differ: no cache hits
            im.rotate(n // len(SIZES) * 7).resize((w, h), Image.BICUBIC).save(f)
        images.append(f)
    lengths = (
        [max(2, n // 8) for n in LENGTHS[:count]]
        if smoke
        else [LENGTHS[n % len(LENGTHS)] for n in range(count)]
    )
    return ckpt, images, lengths


def machine_limits(device: str = "cpu", dtype: str = "float32") -> dict:
    """Read bandwidth (sum over a 512 MiB tensor; 4 GiB on a GPU) and matmul FLOP/s, best of a
    few tries."""
    x = torch.ones(
        (1 << 30) if device == "cuda" else (128 << 20), dtype=torch.float32, device=device
    )
    x.sum()
    bw = max(x.numel() * 4 / _timed(x.sum) for _ in range(5))
    del x
    n = 8192 if device == "cuda" else 2048
    a = torch.randn(n, n, device=device, dtype=getattr(torch, dtype))
    a @ a
    flops = max(2 * n**3 / _timed(lambda: a @ a) for _ in range(3))
    return {"bandwidth": bw, "matmul_flops": flops}


def _timed(fn) -> float:
    _sync()
    start = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - start


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def phase_timers(cap) -> dict[str, float]:
    """Seconds spent in the vision tower, in prefill (vision included) and in decode, summed as
    `cap` runs."""
    spent = {"vision": 0.0, "prefill": 0.0, "decode": 0.0}

    def timed(name, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                spent[name] += time.perf_counter() - t

        return wrapper

    for name in spent:
        owner, attr = (cap.runner.encoder, "encode") if name == "vision" else (cap.runner, name)
        setattr(owner, attr, timed(name, getattr(owner, attr)))
    return spent


def precision_record(cap) -> dict:
    """The run's precision in words: its Precision's record, or the dict that a tree from before
    7b323d4 holds (`bench/cpu.py --against` runs one)."""
    precision = cap.precision
    return precision.record() if hasattr(precision, "record") else dict(precision)


def units_of(cap) -> dict[str, str]:
    """The unit each phase's linears ran on: int8 where the kernel plan puts them on int8 (int8's
    two towers, int4's vision tower, int4's prompt widened to int8), else the run's products'
    (int4's prompt on dequantized tiles, or torch's int4 kernel: bfloat16's activations where
    the run's products are bfloat16, else float32 FMAs)."""
    precision = precision_record(cap)  # --against's tree may hold a dict
    products = "bfloat16" if precision.get("products") == "bfloat16" else "float32"
    plan = cap.kernel_plan  # --against's tree may name its choices in words only
    int4 = "int8" if "int4_widened" in getattr(plan.int4, "id", plan.int4.kernel) else products
    text = {"int8": "int8", "int4": int4}.get(precision.get("quantize"), products)
    vision = "int8" if plan.vision_int8.install is not None else text
    return {"vision": vision, "text prefill": text}


def worker_mmcli(ckpt: Path, images: list[Path], lengths: list[int], settings: dict) -> dict:
    from dataclasses import replace

    from mmcli.api.labeler import Labeler
    from mmcli.config import load_config
    from mmcli.inputs.prefetch import NOT_READY, default_workers, prefetch
    from mmcli.weights.checkpoint import expected_shapes

    cfg = load_config(None, settings)
    loading = time.perf_counter()
    cap = Labeler.from_pretrained(str(ckpt), config=cfg)
    load_seconds = time.perf_counter() - loading
    load_peak, loaded = peak_rss(), resident()
    reset_peak_rss()  # from here VmHWM is the run's own peak
    spent = phase_timers(cap)
    start = time.perf_counter()

    def prepare(item):
        n, path, length = item
        req, _ = cap.request(f"img{n}", [path], PROMPT, cap.sampling(max_new_tokens=length))
        return replace(req, stop_ids=frozenset())  # the length schedule stands in for eos

    def requests():  # the input pipeline `caption` uses: worker threads ahead of the engine
        workers = default_workers(cfg.inputs.workers)
        items = [(n, path, length) for n, (path, length) in enumerate(zip(images, lengths))]
        for ready in prefetch(
            items, prepare, workers, max(cap.config.engine.max_seqs, cfg.vision.lookahead) + workers
        ):
            yield None if ready is NOT_READY else ready[1]

    finished = list(cap.engine.generate(requests()))
    done = {r.key: len(r.token_ids) for r in finished}
    _sync()
    elapsed = time.perf_counter() - start
    split = dict(spent)
    assert [done[f"img{n}"] for n in range(len(images))] == lengths, done
    # Decode step at batch 1: one sequence alone, timed step by step after its prefill.
    from mmcli.engine.batch import DecodeItem, PrefillItem

    req, _ = cap.request("solo", [images[0]], PROMPT, cap.sampling())
    runner = cap.runner
    runner.prefill(
        [PrefillItem(0, req.input_ids, req.rotary_position_ids, req.pixel_values, req.vision_grids)]
    )
    steps = []
    for k in range(12):
        pos = len(req.input_ids) + k
        steps.append(_timed(lambda pos=pos: runner.decode([DecodeItem(0, 1, pos, req.rope_delta)])))
    # A decode step reads every text weight but the embedding (one row of it), and the lm_head (tied
    # or not).
    shapes = expected_shapes(cap.model.cfg)
    precision = precision_record(cap)
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2, "int8": 1, "int4": 0.625}[
        precision["weights"]
    ]
    decode_bytes = itemsize * sum(
        math.prod(shape)
        for name, shape in shapes.items()
        if name == "lm_head.weight"
        or name.startswith("model.language_model.")
        and "embed" not in name
    )
    gpu = torch.cuda.max_memory_allocated() if cap.runner.device.type == "cuda" else 0
    return {
        "images_per_s": len(images) / elapsed,
        "seconds": elapsed,
        "load_seconds": load_seconds,
        "decode_step": statistics.median(steps[2:]),
        "weight_bytes": cap.weight_bytes,
        "decode_weight_bytes": decode_bytes,
        "kv_bytes": runner.cache.nbytes,
        # one sequence's state at engine.max_len tokens: K/V, and the linear layers' fixed part
        "state_bytes": runner.cache.row_bytes(cfg.engine.max_len),
        "peak_rss": max(load_peak, peak_rss()),
        "load_peak_rss": load_peak,  # the load's, and what it leaves resident
        "loaded_rss": loaded,
        "run_peak_rss": peak_rss(),
        "gpu_peak": gpu,
        "input_wait": cap.engine.input_wait / elapsed,
        "generated": sum(lengths),
        "spent": split,
        "precision": precision,
        # each prompt's image and input tokens, and the units its phases ran on: their FLOPs and
        # floors (bench/cpu.py)
        "prompts": [(r.num_image_tokens, r.num_input_tokens) for r in finished],
        "units": units_of(cap),
    }


def _status(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def resident() -> int:
    return _status("VmRSS") or 0


def reset_peak_rss() -> None:
    """Start VmHWM again from the resident bytes now (Linux: 5 to clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_rss() -> int:
    """This process's peak resident bytes since it started or since reset_peak_rss: VmHWM
    (getrusage's ru_maxrss is kept across exec on Linux, so a worker started by a large parent
    would report the parent's)."""
    peak = _status("VmHWM")
    return peak if peak is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _hf_processor(ckpt: Path):
    from transformers import AutoTokenizer
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.processing_utils import ProcessorMixin

    pre = json.loads((ckpt / "preprocessor_config.json").read_text())
    pre = {k: v for k, v in pre.items() if k not in ("image_processor_type", "processor_class")}
    template = json.loads((ckpt / "chat_template.json").read_text())["chat_template"]
    # no torchvision: no video processor
    ProcessorMixin.check_argument_for_proper_class = lambda *a, **k: None
    tokenizer = AutoTokenizer.from_pretrained(ckpt, padding_side="left")
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessorPil(**pre),
        tokenizer=tokenizer,
        video_processor=None,
        chat_template=template,
    )


def worker_hf(
    ckpt: Path,
    images: list[Path],
    lengths: list[int],
    dtype: str,
    batch_size: int,
    device: str = "cpu",
) -> dict:
    from PIL import Image
    from transformers import AutoModelForImageTextToText, GenerationConfig, StoppingCriteria

    model = (
        AutoModelForImageTextToText.from_pretrained(ckpt, dtype=getattr(torch, dtype))
        .eval()
        .to(device)
    )
    model.generation_config.eos_token_id = None
    processor = _hf_processor(ckpt)
    content = [{"type": "image"}, {"type": "text", "text": PROMPT}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}],
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,  # as mmcli labels (Qwen3-VL's template has no such switch)
    )

    class RowLengths(StoppingCriteria):
        def __init__(self, prompt_len: int, targets: list[int]):
            self.prompt_len, self.targets = prompt_len, torch.tensor(targets)

        def __call__(self, input_ids, scores, **kwargs):
            return (input_ids.shape[1] - self.prompt_len) >= self.targets.to(input_ids.device)

    start = time.perf_counter()
    generated = 0
    with torch.inference_mode():
        for b in range(0, len(images), batch_size):
            chunk = [Image.open(p).convert("RGB") for p in images[b : b + batch_size]]
            targets = lengths[b : b + batch_size]
            inputs = processor(
                text=[text] * len(chunk), images=chunk, padding=True, return_tensors="pt"
            ).to(device)
            gen = GenerationConfig(max_new_tokens=max(targets), do_sample=False, pad_token_id=0)
            out = model.generate(
                **inputs,
                generation_config=gen,
                stopping_criteria=[RowLengths(inputs["input_ids"].shape[1], targets)],
            )
            generated += (out.shape[1] - inputs["input_ids"].shape[1]) * len(chunk)
    _sync()
    elapsed = time.perf_counter() - start
    return {
        "images_per_s": len(images) / elapsed,
        "seconds": elapsed,
        "batch_size": batch_size,
        "peak_rss": peak_rss(),
        "rows_computed": generated,
        "gpu_peak": torch.cuda.max_memory_allocated() if device == "cuda" else 0,
    }


def mmcli_settings(args) -> dict:
    # On the CPU all 16 images in flight (the KV cache for 16 x 512 tokens is 1.9 GB in float32);
    # --max-seqs 0 is the run's own (32 on the CPU, within 8 x max_len tokens of KV cache).
    return {
        "dtype": args.dtype,
        "device": args.device,
        "engine": {"max_seqs": args.max_seqs, "max_len": args.max_len},
        **json.loads(args.settings),
    }


def run_worker(args, kind: str, batch_size: int = 0) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        kind,
        "--cache-dir",
        str(args.cache_dir),
        "--dtype",
        args.dtype,
        "--batch-size",
        str(batch_size),
        "--device",
        args.device,
        "--images",
        str(args.images),
        "--max-seqs",
        str(args.max_seqs),
        "--max-len",
        str(args.max_len),
        "--settings",
        args.settings,
        "--families",
        getattr(args, "family", "qwen3_vl"),
    ] + (["--smoke"] if args.smoke else [])
    out = subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--smoke", action="store_true", help="a tiny checkpoint and few images (runs in the tests)"
    )
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--hf-batch-sizes", default="1,4,8")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--images", type=int, default=16, help="images (the 16 sizes and lengths repeat)"
    )
    parser.add_argument("--families", default="qwen3_vl", help="qwen3_vl, qwen3_5 or both")
    parser.add_argument(
        "--max-seqs", type=int, default=16, help="mmcli's sequences in flight (0: its own)"
    )
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--settings", default="{}", help="more mmcli settings, JSON")
    parser.add_argument("--worker", choices=["mmcli", "hf"], help=argparse.SUPPRESS)
    parser.add_argument("--batch-size", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.cache_dir is None:
        args.cache_dir = (
            Path(tempfile.gettempdir()) / "mmcli-bench" if args.smoke else ROOT / ".bench_cache"
        )
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    families = args.families.split(",")
    if args.worker is not None:
        ckpt, images, lengths = make_inputs(args.cache_dir, args.smoke, args.images, families[0])
        if args.worker == "mmcli":
            print(json.dumps(worker_mmcli(ckpt, images, lengths, mmcli_settings(args))))
        else:
            hf = worker_hf(ckpt, images, lengths, args.dtype, args.batch_size, args.device)
            print(json.dumps(hf))
        return
    limits = machine_limits(args.device, args.dtype)
    runs = {family: run_family(args, family) for family in families}
    # The machine's limits are what it can do at best: measured again at the end (a shared
    # machine, or the writeback of a freshly written checkpoint, can slow one measurement), the
    # higher figure counts.
    after = machine_limits(args.device, args.dtype)
    for name, before in (("before", limits), ("after", after)):
        print(
            f"machine, {name} the runs: read bandwidth {before['bandwidth'] / 1e9:.1f} GB/s, "
            f"{args.dtype} matmul {before['matmul_flops'] / 1e9:.1f} GFLOP/s",
            flush=True,
        )
    print_table(args, runs, max(limits["bandwidth"], after["bandwidth"]))


def run_family(args, family: str) -> tuple[dict, dict]:
    """mmcli, then transformers at each batch size, on one family's checkpoint: (ours, best)."""
    args.family = family
    _, images, lengths = make_inputs(args.cache_dir, args.smoke, args.images, family)
    print(
        f"{family}: {len(images)} images, output lengths {min(lengths)}-{max(lengths)} tokens "
        f"({sum(lengths)} in all), dtype {args.dtype}, {torch.get_num_threads()} threads",
        flush=True,
    )
    ours = run_worker(args, "mmcli")
    spent = ours["spent"]
    print(
        f"{family} mmcli: {ours['images_per_s']:.3f} images/s ({ours['seconds']:.1f} s: vision "
        f"{spent['vision']:.1f} s, text prefill {spent['prefill'] - spent['vision']:.1f} s, "
        f"decode {spent['decode']:.1f} s)",
        flush=True,
    )
    theirs = []
    for bs in [int(b) for b in args.hf_batch_sizes.split(",")]:
        theirs.append(run_worker(args, "hf", bs))
        print(
            f"{family} transformers, batch {bs}: {theirs[-1]['images_per_s']:.3f} images/s "
            f"({theirs[-1]['seconds']:.1f} s)",
            flush=True,
        )
    return ours, max(theirs, key=lambda r: r["images_per_s"])


def _rows(args, ours: dict, best: dict, bandwidth: float) -> dict[str, str]:
    spent = ours["spent"]
    bound = ours["decode_weight_bytes"] / bandwidth
    budget = ours["weight_bytes"] + ours["kv_bytes"]
    kv, fixed = ours["state_bytes"]
    rows = {
        "mmcli images/s": f"{ours['images_per_s']:.3f}",
        "transformers images/s (best batch)": f"{best['images_per_s']:.3f} "
        f"(batch {best['batch_size']})",
        "images/s ratio": f"{ours['images_per_s'] / best['images_per_s']:.2f}x",
        "vision / text prefill / decode": f"{spent['vision']:.1f} / "
        f"{spent['prefill'] - spent['vision']:.1f} / {spent['decode']:.1f} s",
        "decode step, batch 1": f"{ours['decode_step'] * 1000:.1f} ms",
        f"decode weight bytes / {bandwidth / 1e9:.1f} GB/s": f"{bound * 1000:.1f} ms (step "
        f"{ours['decode_step'] / bound:.2f}x)",
        "mmcli peak RSS": f"{ours['peak_rss'] / 2**30:.2f} GiB",
        "weights + cache": f"{ours['weight_bytes'] / 2**30:.2f} + {ours['kv_bytes'] / 2**30:.2f} "
        f"GiB (RSS {ours['peak_rss'] / budget:.2f}x)",
        f"state per sequence at {args.max_len} tokens: K/V + linear": f"{kv / 2**20:.1f} + "
        f"{fixed / 2**20:.1f} MiB",
        "engine waiting for inputs": f"{100 * ours['input_wait']:.1f}% of the run",
    }
    if args.device == "cuda":
        rows["GPU memory peak, mmcli / transformers"] = (
            f"{ours['gpu_peak'] / 2**30:.2f} / {best['gpu_peak'] / 2**30:.2f} GiB"
        )
    return rows


def print_table(args, runs: dict[str, tuple[dict, dict]], bandwidth: float) -> None:
    columns = {family: _rows(args, *run, bandwidth) for family, run in runs.items()}
    print("")
    print("| measure | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for measure in next(iter(columns.values())):
        print(f"| {measure} | " + " | ".join(c[measure] for c in columns.values()) + " |")
    for family, (ours, best) in runs.items():
        ratio = ours["images_per_s"] / best["images_per_s"]
        print(f"images/s ratio (mmcli / transformers), {family}: {ratio:.2f}")


if __name__ == "__main__":
    main()
