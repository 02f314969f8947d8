"""The CPU paths side by side, in one run, each side in a process of its own, as ratios (issue
13's bench).

(a) images/s on compare_hf's 16 images and output lengths: `dtype: float32` (float32 weights,
packed), the default (the checkpoint's bfloat16 weights, float32 compute) and `quantize: int8`,
against the float32 path and against transformers (float32, its best batch size of
--hf-batch-sizes), each run's vision tower and text prefill at their share of the peaks of the
units they ran on; (b) `mmcli ask` for one 448x448 image and 16 tokens: wall time split into
start, load, vision, prefill, decode, next to its floor = checkpoint bytes / read bandwidth +
FLOPs / float32 matmul peak + decode weight bytes / bandwidth, and the command with `--quantize
int8` on an empty weights cache (the first run prepares the int8 weights, the later ones read
them), and cold (the checkpoint's pages dropped first) without and with the read-ahead; each
timing --repeats times, each against the limits measured just before and after it (the higher of
each), the median run counting (this shared machine's matmul peak moves by up to 2x within a
minute);
(c) peak RSS against weight bytes
+ KV bytes used (each (a) run, and the ask); (d) int8 against the unquantized run, teacher-forced
on the default run's greedy tokens: top-1 agreement and mean |difference| of the reference
token's log-prob, on the 2B-shaped checkpoint and on a tiny one whose decoder RMSNorm weights
carry three channels scaled by 30 (outliers in the activations, as real models show).

python bench/cpu.py [--smoke] [--hf-batch-sizes 1,8] [--skip-hf] [--only-ask] [--repeats 3]"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import compare_hf
import torch

from mmcli.testing import installed_command, make_outlier_checkpoint

ASK_IMAGE = 14  # compare_hf's 448x448 image
INT8 = {"dtype": "auto", "quantize": "int8"}  # (b)'s int8 ask and (d)'s, whatever --paths keeps
PATHS = {
    "float32": {"dtype": "float32"},
    "default": {"dtype": "auto"},
    "int8": INT8,
    "int4": {"dtype": "auto", "quantize": "int4"},
}
MATRIX_UNITS = {"amx_bf16", "amx_int8", "avx512_bf16", "bf16", "i8mm"}


def vector_units() -> str:
    """MMCLI_CPU_FEATURES for "before": this CPU's units less its matrix ones (the vector
    kernels mmcli ran on every CPU before the plan chose by units)."""
    from mmcli.kernels import cpu_features

    return ",".join(sorted(cpu_features.real_units() - MATRIX_UNITS)) or "none"


SIDES = {"before": lambda: {"MMCLI_CPU_FEATURES": vector_units()}, "after": dict}


def against_tree(commit: str, cache_dir: Path) -> None:
    """--against COMMIT: that commit's tree as a third side, its workers importing its mmcli (a
    git worktree, made once in the bench cache): ratios against it are measured in this run. It
    keeps an mmcli cache of its own: where its quantization code differs, the two trees would
    prepare the int8 weights again at every other run, the writer's thread beside the phases."""
    tree = cache_dir / f"tree-{commit}"
    if not (tree / "mmcli").is_dir():
        command = ["git", "-C", str(compare_hf.ROOT), "worktree", "add", "--detach", str(tree)]
        subprocess.run([*command, commit], check=True, capture_output=True)
    own_cache = cache_dir / f"tree-{commit}-cache"
    SIDES[commit] = lambda: {"PYTHONPATH": str(tree), "XDG_CACHE_HOME": str(own_cache)}


def before() -> str:
    """The side "before" stands for: "after" where the CPU has no matrix units to mask (an AVX2
    or AVX-512 CPU without BF16 or AMX runs the same kernels on both sides, so the bench runs
    them once: its after / before ratios read 1.00x)."""
    return "before" if "before" in SIDES else "after"


def without_matrix_units() -> None:
    from mmcli.kernels import cpu_features

    if not cpu_features.real_units() & MATRIX_UNITS:
        del SIDES["before"]
        print("no matrix units on this CPU: before (them masked) is after, run once", flush=True)


def third_side() -> str | None:
    return next((side for side in SIDES if side not in ("before", "after")), None)


@contextlib.contextmanager
def side_env(side: str):
    """The environment of one side for the workers started inside."""
    saved = os.environ.copy()
    os.environ.pop("MMCLI_CPU_FEATURES", None)
    os.environ.update(SIDES[side]())
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def higher(*limits: dict) -> dict:
    """Each limit at its highest of several measurements: the floor it gives is the lowest."""
    return {key: max(limit[key] for limit in limits) for key in limits[0]}


def sustained_matmul(flops: float) -> float:
    """Seconds MKL's 2048-cubed float32 matmul takes for `flops`, back to back: what the peak's
    best of three short tries becomes when it runs as long as a prefill."""
    a = torch.randn(2048, 2048)
    calls = max(1, round(flops / (2 * 2048**3)))
    start = time.perf_counter()
    for _ in range(calls):
        a @ a
    return (time.perf_counter() - start) * flops / (calls * 2 * 2048**3)


def prefill_linears(cap, image: Path) -> list[tuple]:
    """The linear layers' calls of one ask's vision tower and prompt (every call of more than one
    row: a decode step's one row left out) as (phase, layer, input, activation), the inputs
    copied, in order."""
    from mmcli.models.layers.linear import Linear, PackedLinear
    from mmcli.models.layers.quantized import Int4Linear, Int8Linear

    calls, phase = [], ["text prefill"]
    encoder = cap.runner.encoder
    encode = encoder.encode

    def in_vision(*a, **k):
        phase[0] = "vision"
        try:
            return encode(*a, **k)
        finally:
            phase[0] = "text prefill"

    def record(layer, args, kwargs):
        x, activation = args[0], kwargs.get("activation", args[1] if len(args) > 1 else None)
        if x.numel() // x.shape[-1] > 1:
            calls.append((phase[0], layer, x.clone(), activation))

    kinds = (Linear, PackedLinear, Int8Linear, Int4Linear)
    layers = [m for m in cap.model.modules() if isinstance(m, kinds)]
    hooks = [m.register_forward_pre_hook(record, with_kwargs=True) for m in layers]
    encoder.encode = in_vision
    encoder.cache.clear()  # the image encoded again, not taken from the ask's features
    try:
        cap.ask([image], compare_hf.PROMPT, max_new_tokens=1)
    finally:
        encoder.encode = encode
        for hook in hooks:
            hook.remove()
    return calls


def replayed_linears(cap, image: Path) -> dict:
    """The ask's vision and prompt linears (prefill_linears) replayed alone, back to back, as the
    ask called them: each phase's FLOPs and best seconds of 3. Their rate is the most vision and
    prefill could reach on these kernels were the rest of their work (attention, norms,
    conversions) free."""
    calls, out = prefill_linears(cap, image), {}
    for phase in ("vision", "text prefill"):
        mine = [(layer, x, act) for p, layer, x, act in calls if p == phase]
        flops = sum(2 * x.numel() * m.out_features for m, x, _ in mine)  # x: rows x in
        best = float("inf")
        with torch.inference_mode():
            for _ in range(3):
                start = time.perf_counter()
                for layer, x, activation in mine:
                    layer(x, activation=activation)
                best = min(best, time.perf_counter() - start)
        out[phase] = {"flops": flops, "seconds": best}
    return out


def ask_worker(ckpt: Path, image: Path, settings: dict, started: float) -> dict:
    """What `mmcli ask` does, through the same API, timed by phase (the parent adds the
    interpreter's start)."""
    from mmcli.api.labeler import Labeler
    from mmcli.config import Config, load_config

    imported = time.perf_counter()
    if "weights_memory" in Config.__dataclass_fields__:  # as the command resolves it (--against)
        settings = {"weights_memory": "mapped", **settings}
    cap = Labeler.from_pretrained(
        str(ckpt), config=load_config(None, {"device": "cpu", **settings})
    )
    loaded = time.perf_counter()
    # the machine's limits next to the ask, in this process (this machine moves by 2x at times)
    before = compare_hf.machine_limits()
    spent = compare_hf.phase_timers(cap)
    asking = time.perf_counter()
    result = cap.ask([image], compare_hf.PROMPT, max_new_tokens=16)
    done = time.perf_counter()
    after = compare_hf.machine_limits()
    assert result.ok, result.error
    spent = dict(spent)  # the ask's own: the replay's ask below runs through the same timers
    replayed = replayed_linears(cap, image)
    flops = total(ask_flops(cap.model.cfg, result.num_image_tokens, result.num_input_tokens)[0])
    return {
        "imports": imported - started,
        "load": loaded - imported,
        "ask": done - asking,
        "sustained": sustained_matmul(flops),
        "measuring": asking - loaded + time.perf_counter() - done,
        "replayed": replayed,
        "limits": higher(before, after),
        "spent": spent,
        "tokens": len(result.token_ids),
        "image_tokens": result.num_image_tokens,
        "input_tokens": result.num_input_tokens,
        "weight_bytes": cap.weight_bytes,
        "kv_bytes": cap.runner.cache.nbytes,
        "precision": compare_hf.precision_record(cap),
        "units": compare_hf.units_of(cap),
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


STEP_ROWS = (1, 8, 32)
STEP_CONTEXT = 300  # cache columns each sequence attends over (a 448x448 image and its prompt)


def step_tensors(model) -> list:
    """The weights a decode step reads: the decoder's and the lm_head's, in their form (quantized
    weights' own tensors), not the vision tower's nor the embedding table's (a row a token);
    each once."""
    from mmcli.kernels.weight_forms import Int4Weight, Int8Weight

    decoder, head = model.language_model, model.lm_head
    tensors = [t for n, t in decoder.named_parameters() if "embed_tokens" not in n]
    tensors += [head.weight] if isinstance(head.weight, torch.Tensor) else []
    for module in [*decoder.modules(), head]:
        for value in vars(module).values():
            if isinstance(value, (Int8Weight, Int4Weight)):  # by its fields: --against's tree
                tensors += [t for t in vars(value).values() if isinstance(t, torch.Tensor)]
    return list({t.data_ptr(): t for t in tensors}.values())


def weights_stream(tensors: list) -> tuple[Callable[[], object], int]:
    """A function that reads the step's weights once, as its pages are (the largest byte of
    each, both cores: as fast as a float sum, and blind to what the bytes hold), and the bytes
    it reads: the read bandwidth these weights give, wherever the host placed them. On these
    machines a fresh 1 GiB buffer streams at 33 GB/s in one process and 60 in the next. Tensors
    of 1 MiB and more (a call each: the norms' few KiB would time the calls), or every one of a
    model that has none (the smoke run's tiny one)."""
    large = [t for t in tensors if t.numel() * t.element_size() >= 1 << 20] or tensors
    large = [t.reshape(-1).view(torch.uint8) for t in large]
    return (lambda: [t.amax() for t in large]), sum(t.numel() for t in large)


def best_seconds(*fns, runs: int = 5) -> list[float]:
    """Each function's best time of `runs`, the functions taking turns: a neighbour's load
    falls on all of them alike (the parts of a step are told apart by their difference)."""
    best = [float("inf")] * len(fns)
    for attempt in range(runs + 1):  # the first a warm-up
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            if attempt:
                best[i] = min(best[i], time.perf_counter() - start)
    return best


def head_bytes(head) -> int:
    """The lm_head's bytes in their form (a quantized head's own tensors)."""
    tensors = head.held() if hasattr(head, "held") else [head.weight]
    return sum(t.numel() * t.element_size() for t in tensors)


def step_worker(ckpt: Path, settings: dict) -> dict:
    """Decode steps of 1, 8 and 32 sequences at STEP_CONTEXT, each the best of 5, with what
    the step reads (weights, the KV cache) and multiplies, and where its time goes: the
    lm_head alone at the step's rows, and the attention over the cache as the step at
    STEP_CONTEXT less the same step at its first column. The read bandwidth is the step's own
    weights streamed (weights_stream) in the same turns, as many times as each step: a step is
    held to what these pages gave while it ran."""
    from mmcli.api.labeler import Labeler
    from mmcli.config import load_config
    from mmcli.engine.batch import DecodeItem
    from mmcli.weights.checkpoint import expected_shapes

    engine = {"max_seqs": max(STEP_ROWS), "max_len": 512}
    cfg = load_config(None, {"device": "cpu", "engine": engine, **settings})
    cap = Labeler.from_pretrained(str(ckpt), config=cfg)
    runner, text = cap.runner, cap.model.cfg.text
    runner.cache.grow(max(STEP_ROWS) + 1, 512)
    tensors = step_tensors(cap.model)
    weights = sum(t.numel() * t.element_size() for t in tensors)
    stream, streamed = weights_stream(tensors)
    per_token = text.num_hidden_layers * text.num_key_value_heads * text.head_dim  # k and v
    keys = next(k for k in runner.cache.k if k is not None)  # any tree's cache: its own dtype
    per_token *= 2 * keys.element_size()
    steps = {}
    for rows in STEP_ROWS:
        items = [DecodeItem(i, 100 + i, STEP_CONTEXT, 0) for i in range(rows)]
        first = [DecodeItem(i, 100 + i, 0, 0) for i in range(rows)]
        hidden = torch.randn(rows, text.hidden_size)
        with torch.inference_mode():
            seconds, first_column, head, stream_seconds = best_seconds(
                lambda items=items: runner.decode(items),
                lambda first=first: runner.decode(first),
                lambda hidden=hidden: cap.model.lm_head(hidden),
                stream,
            )
        steps[rows] = {
            "seconds": seconds,
            "kv_bytes": rows * (STEP_CONTEXT + 1) * per_token,
            "attention": seconds - first_column,
            "head": head,
            "read_gb_s": streamed / stream_seconds / 1e9,
        }
    shapes = expected_shapes(cap.model.cfg)
    matrices = sum(
        math.prod(s) for n, s in shapes.items()
        if "visual" not in n and "embed_tokens" not in n and n != "lm_head.weight" and len(s) == 2
    )  # fmt: skip
    plan = cap.kernel_plan
    return {
        "weights": weights,
        "head_bytes": head_bytes(cap.model.lm_head),
        "flops_per_row": 2 * (matrices + text.vocab_size * text.hidden_size),
        "head_flops_per_row": 2 * text.vocab_size * text.hidden_size,
        "steps": steps,
        "kernels": {"decode_step": plan.decode_step.kernel, "head": plan.head.kernel},
        "products": compare_hf.precision_record(cap).get("products"),
    }


def teacher_forced(
    ckpt: Path, image: Path, settings: dict, tokens: list[int] | None, count: int
) -> dict:
    """Log-probs of every generated position given the reference tokens (generated here when
    `tokens` is None), as the engine makes them: the prompt's prefill, then a decode step a
    token (the step's kernels, its KV cache in the run's dtype)."""
    from mmcli.api.labeler import Labeler
    from mmcli.config import load_config
    from mmcli.testing import forced_logits  # here: a tree run beside (--against) may lack it

    cap = Labeler.from_pretrained(
        str(ckpt), config=load_config(None, {"device": "cpu", **settings})
    )
    if tokens is None:
        # eos may end it sooner
        tokens = cap.ask([image], compare_hf.PROMPT, max_new_tokens=count).token_ids
    req, _ = cap.request("k", [image], compare_hf.PROMPT, cap.sampling())
    logprobs = torch.log_softmax(forced_logits(cap, [req], [tokens])[0], -1)
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


def agreement(
    args, ckpt: Path, image: Path, label: str, test: dict, test_side: str = "after"
) -> str:
    """Teacher-forced on the float32-products run's greedy tokens (the default settings on the
    vector units): top-1 agreement and mean |difference| of the reference token's log-prob."""
    count = 8 if args.smoke else 32
    worker = ["--worker", "forced", "--ckpt", str(ckpt), "--image", str(image), "--settings"]
    with side_env(before()):
        reference, _ = run(args, *worker, "{}", "--count", str(count))
    with side_env(test_side):
        tested, _ = run(
            args, *worker, json.dumps(test), "--tokens", json.dumps(reference["tokens"])
        )
    count = len(reference["tokens"])
    same = sum(a == b for a, b in zip(reference["top1"], tested["top1"])) / count
    pairs = zip(reference["reference_logprob"], tested["reference_logprob"])
    diff = sum(abs(a - b) for a, b in pairs) / count
    return f"| {label} | {count} | {100 * same:.1f}% | {diff:.4f} |"


def start_times() -> None:
    """`mmcli --help`, `config show` and `plan` (no torch): best of 5 wall times each, as a
    user's shell runs them."""
    mmcli = installed_command("mmcli")
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


def ask_flops(cfg, image_tokens: int, input_tokens: int) -> tuple[dict, int, int]:
    """The ask's prefill FLOPs by phase, its linears' and its attention's apart (they may run on
    different units): the vision tower's (its linears on every patch, its mergers on the merged
    tokens, its attention products) and the text prefill's (the decoder's linears on every prompt
    token and the lm_head on the last, its attention products); with the decoder's and the head's
    parameter counts."""
    from mmcli.weights.checkpoint import expected_shapes

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
    vision = {
        "linears": 2 * (count["patch"] * patches + count["merged"] * image_tokens),
        "attention": 4 * patches**2 * cfg.vision.hidden_size * cfg.vision.depth,  # QK^T and PV
    }
    width = cfg.text.num_attention_heads * cfg.text.head_dim
    text = {
        "linears": 2 * (count["text"] * input_tokens + head),
        "attention": 2 * input_tokens**2 * width * full_layers,  # causal: half the products
    }
    return {"vision": vision, "text prefill": text}, count["text"], head


def total(phases: dict) -> float:
    """All the FLOPs of ask_flops' phases."""
    return sum(sum(parts.values()) for parts in phases.values())


def split(label: str, runs: list[dict], flops: float) -> str:
    """The median instrumented ask's phases, and its vision and prefill against the matmul peak
    measured next to it (every run's figure after it)."""
    ratios = [flops / r["limits"]["matmul_flops"] / r["spent"]["prefill"] for r in runs]
    sustained = [flops / r["limits"]["matmul_flops"] / r["sustained"] for r in runs]
    timed = runs[sorted(range(len(runs)), key=ratios.__getitem__)[len(runs) // 2]]
    s = timed["spent"]
    return (
        f"{label}: {timed['wall']:.1f} s = start {timed['start']:.1f} + load {timed['load']:.1f} + "
        f"vision {s['vision']:.1f} + text prefill {s['prefill'] - s['vision']:.1f} + decode "
        f"{s['decode']:.1f} + rest {timed['ask'] - s['prefill'] - s['decode']:.1f}; vision and "
        f"prefill at {statistics.median(ratios):.0%} of the matmul peak (runs: "
        + ", ".join(f"{r:.0%}" for r in ratios)
        + f"); MKL's matmul itself, the same FLOPs back to back after it, at "
        f"{statistics.median(sustained):.0%} of that peak, and vision and prefill at "
        f"{statistics.median(r['sustained'] / r['spent']['prefill'] for r in runs):.0%} of its "
        "rate"
    )


def instrumented(args, worker: list[str], settings: dict, env: dict | None = None) -> list[dict]:
    """The instrumented ask, args.repeats times, each in a fresh process; its start-up is the
    wall time less the load, the ask and the limits measured around it."""
    runs = []
    for _ in range(args.repeats):
        timed, wall = run(args, *worker, json.dumps(settings), env=env)
        timed["wall"] = wall - timed["measuring"]
        timed["start"] = timed["wall"] - timed["load"] - timed["ask"]
        runs.append(timed)
    return runs


def commands(args, command: list[str], env: dict | None = None) -> tuple[list, float]:
    """The real command, args.repeats times: its wall time and the machine's limits measured
    just before and after it (the higher of each); and its largest peak RSS."""
    runs, rss = [], 0.0
    for _ in range(args.repeats):
        before = compare_hf.machine_limits()
        wall, peak = cli_ask(command, env)
        runs.append((wall, higher(before, compare_hf.machine_limits())))
        rss = max(rss, peak)
    return runs, rss


def ask_floor(limits: dict, checkpoint_bytes: int, flops: float, text: int, head: int) -> dict:
    """The ask's floor at these limits: the checkpoint read once, the prefill's FLOPs at the
    matmul peak, and 15 decode steps reading the decoder's and the head's bfloat16 weights."""
    return {
        "read checkpoint": checkpoint_bytes / limits["bandwidth"],
        "compute": flops / limits["matmul_flops"],
        "decode weights": 15 * 2 * (text + head) / limits["bandwidth"],
    }


def median_run(runs: list[tuple[float, dict]], floor) -> tuple[float, float, dict]:
    """The run of median ratio to its own floor: (ratio, wall time, limits)."""
    ratios = sorted((wall / sum(floor(limits).values()), wall, limits) for wall, limits in runs)
    return ratios[len(ratios) // 2]


def against(runs: list[tuple[float, dict]], floor, start_s: float) -> str:
    """The median run's wall time against its floor, with and without the start-up (the floor
    counts none); every run's ratio after it."""
    ratio, wall, _ = median_run(runs, floor)
    whole = wall / ratio
    every = ", ".join(f"{w / sum(floor(at).values()):.2f}x" for w, at in runs)
    return (
        f"{wall:.1f} s ({ratio:.2f}x the floor; {(wall - start_s) / whole:.2f}x without the "
        f"start-up's {start_s:.1f} s; runs: {every})"
    )


def ask_part(args, ckpt: Path, image: Path) -> None:
    """(b) and (c) for `mmcli ask`: the instrumented run, then the real command for its wall time
    and peak RSS; the same at int8 on an empty weights cache (the first run prepares it). Each
    timing args.repeats times against the limits measured next to it; the median counts."""
    from mmcli.models.registry import parse_config

    worker = ["--worker", "ask", "--ckpt", str(ckpt), "--image", str(image), "--settings"]
    timed = instrumented(args, worker, {})
    command = [installed_command("mmcli"), "ask", "--model", str(ckpt), "--device", "cpu"]
    command += ["--image", str(image), "--max-new-tokens", "16", compare_hf.PROMPT]
    default, cli_rss = commands(args, command)
    cold = {}
    for label, env in (("without read-ahead", {"MMCLI_READ_AHEAD": "0"}), ("with it", {})):
        evict(ckpt)
        cold[label] = cli_ask(command, {**os.environ, **env})[0]
    with tempfile.TemporaryDirectory() as cache:
        # an empty weights cache, which the first int8 ask of the checkpoint prepares (the
        # machine's built kernels and their measurements kept, as a user's earlier runs left them)
        int8 = {**INT8, "cache_dir": cache}  # the command's settings file and the worker's
        config = Path(cache) / "config.yaml"
        config.write_text(json.dumps(int8))  # JSON is YAML
        int8_ask = [*command, "--config", str(config)]
        first8, first_rss8 = cli_ask(int8_ask)
        second8, rss8 = commands(args, int8_ask)
        timed8 = instrumented(args, worker, int8)
    cfg = parse_config(json.loads((ckpt / "config.json").read_text()))
    phases, text, head = ask_flops(cfg, timed[0]["image_tokens"], timed[0]["input_tokens"])
    flops = total(phases)
    checkpoint_bytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))

    def floor(at: dict) -> dict:
        return ask_floor(at, checkpoint_bytes, flops, text, head)

    start_s = statistics.median(r["start"] for r in timed)
    print(
        f"\n(b) mmcli ask, one 448x448 image, {timed[0]['tokens']} tokens "
        f"({timed[0]['input_tokens']} prompt tokens); {args.repeats} runs of each, each against "
        "the machine's limits measured next to it, the median run shown:"
    )
    print(split("instrumented", timed, flops))
    print(split("int8, instrumented (cache read)", timed8, flops))
    pieces = floor(median_run(default, floor)[2])
    print(
        f"floor at the median command run's limits: {sum(pieces.values()):.1f} s = "
        + " + ".join(f"{k} {v:.1f}" for k, v in pieces.items())
        + f" ({flops / 1e12:.2f} TFLOP)"
    )
    print(f"the command itself: {against(default, floor, start_s)}")
    wall, wall8 = (statistics.median(w for w, _ in runs) for runs in (default, second8))
    print(
        f"int8: the first ask {first8:.1f} s ({first8 / sum(pieces.values()):.2f}x that floor; "
        f"it prepares the cache; peak RSS {first_rss8 / 2**30:.2f} GiB), the second "
        f"{against(second8, floor, start_s)}, {wall8 / wall:.2f}x the default ask; peak RSS "
        f"{rss8 / 2**30:.2f} GiB"
    )
    print(
        "cold (the checkpoint's pages dropped from the page cache first): "
        + ", ".join(f"{label} {seconds:.1f} s" for label, seconds in cold.items())
    )
    used = timed[0]["weight_bytes"] + timed[0]["kv_bytes"]
    print(
        f"(c) ask peak RSS {cli_rss / 2**30:.2f} GiB against weights + KV "
        f"{timed[0]['weight_bytes'] / 2**30:.2f} + {timed[0]['kv_bytes'] / 2**30:.3f} GiB: "
        f"{cli_rss / used:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="a tiny checkpoint and few images")
    parser.add_argument("--cache-dir", type=Path, default=None)
    parser.add_argument("--hf-batch-sizes", default="1,8")
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--only-ask", action="store_true", help="only (b) and (c) for `mmcli ask`")
    parser.add_argument(
        "--phases-only", action="store_true", help="only the asks' phases before and after"
    )
    parser.add_argument(
        "--matrix-only",
        action="store_true",
        help="only the units, (a), the asks before and after, and (d)",
    )
    parser.add_argument("--images", type=int, default=None, help="the first N images only")
    parser.add_argument("--rounds", type=int, default=1, help="(a)'s rounds, sides alternating")
    parser.add_argument("--repeats", type=int, default=None, help="runs of each ask (3; smoke 1)")
    parser.add_argument(
        "--decode-only", action="store_true", help="only (e): decode steps against their floors"
    )
    parser.add_argument(
        "--batched-only", action="store_true", help="only (a): the batched runs, sides alternating"
    )
    parser.add_argument(
        "--paths", help=f"only these paths, comma-separated (of {', '.join(PATHS)})"
    )
    parser.add_argument("--against", metavar="COMMIT", help="that tree as a third side, beside")
    parser.add_argument("--agreement-only", action="store_true", help="only (d)")
    parser.add_argument("--worker", choices=["ask", "forced", "step"], help=argparse.SUPPRESS)
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
    if args.worker == "step":
        print(json.dumps(step_worker(Path(args.ckpt), json.loads(args.settings))))
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
    if args.repeats is None:
        args.repeats = 1 if args.smoke else 3
    for name in set(PATHS) - set(args.paths.split(",") if args.paths else PATHS):
        del PATHS[name]
    if args.cache_dir is None:
        args.cache_dir = compare_hf.ROOT / (".bench_cache/smoke" if args.smoke else ".bench_cache")
    args.cache_dir.mkdir(parents=True, exist_ok=True)
    ckpt, images, lengths = compare_hf.make_inputs(args.cache_dir, args.smoke)
    without_matrix_units()
    if args.against:
        against_tree(args.against, args.cache_dir)
    ask_image = images[ASK_IMAGE % len(images)]  # the 448x448 one, whatever --images keeps
    images, lengths = images[: args.images], lengths[: args.images]
    limits = compare_hf.machine_limits()
    print(
        f"machine: read bandwidth {limits['bandwidth'] / 1e9:.1f} GB/s, float32 matmul "
        f"{limits['matmul_flops'] / 1e9:.1f} GFLOP/s, {torch.get_num_threads()} threads; "
        f"{len(images)} images, {sum(lengths)} output tokens",
        flush=True,
    )
    if args.only_ask:
        ask_part(args, ckpt, ask_image)
        return
    if args.agreement_only:
        agreements(args, ckpt, images[0])
        return
    if args.phases_only:
        print_units(ckpt)
        ask_sides(args, ckpt, ask_image)
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
    from mmcli.models.registry import parse_config
    from mmcli.weights.checkpoint import expected_shapes

    cfg = parse_config(json.loads((ckpt / "config.json").read_text()))
    parameters = sum(
        math.prod(s)
        for n, s in expected_shapes(cfg).items()
        if not (n == "lm_head.weight" and cfg.tie_word_embeddings)
    )
    print_units(ckpt)
    if not args.batched_only:
        decode_floors(args, ckpt)
    if args.decode_only:
        return
    rates = batched(args, rate_args, cfg, parameters)
    if args.batched_only:
        return
    if not args.matrix_only:
        hf_part(args, rate_args, rates)
        print("\nstart-up, no model:")
        start_times()
        ask_part(args, ckpt, ask_image)
    ask_sides(args, ckpt, ask_image)
    agreements(args, ckpt, images[0])


def decode_floors(args, ckpt: Path) -> None:
    """(e) each path's decode step at 1, 8 and 32 sequences, before (vector units) and after,
    against its floor: the larger of the bytes it reads (weights in their form, the KV cache)
    over the read bandwidth measured in turns with its steps and its FLOPs over the peak of the
    unit it can use; then (e') each step's parts against their own floors. The peaks are the
    higher of two measurements, before the steps and after: a disturbed moment never lowers a
    floor."""
    from mmcli.kernels import measure

    results = {}
    for name, settings in PATHS.items():
        if name == "float32":
            continue
        for side in SIDES:
            with side_env(side):
                results[name, side], _ = run(args, "--worker", "step", "--ckpt", str(ckpt),
                                             "--settings", json.dumps(settings))  # fmt: skip
    peaks = BENCH["peaks"] = higher(BENCH["peaks"], measure.peaks())
    print(
        f"\n(e) decode steps at {STEP_CONTEXT} columns; peaks "
        + ", ".join(f"{unit} {rate:.0f}" for unit, rate in peaks.items())
        + " G(FL)OP/s (each the higher of its measurements before and after the steps); the read"
        + " bandwidth: the step's own weights streamed in turns with it, as many times"
    )
    print(
        "path | side | rows | step ms | bytes read | read GB/s | floor ms (bound) | step / floor"
        " | kernels"
    )
    parts = []
    for (name, side), r in results.items():
        unit = step_unit(name, r["kernels"]["decode_step"], r["products"])
        for rows, step in r["steps"].items():
            read = step["read_gb_s"] * 1e9
            read_bytes = r["weights"] + step["kv_bytes"]
            memory = read_bytes / read
            compute = r["flops_per_row"] * int(rows) / peaks[unit] / 1e9
            floor = max(memory, compute)
            print(
                f"{name} | {side} | {rows} | {step['seconds'] * 1e3:.0f} | "
                f"{read_bytes / 1e9:.2f} GB | {read / 1e9:.1f} | {floor * 1e3:.0f} "
                f"({'memory' if memory >= compute else unit}) | {step['seconds'] / floor:.2f}x | "
                f"{r['kernels']['decode_step']}; head {r['kernels']['head']}"
            )
            head_peak = peaks[head_unit(r["kernels"]["head"])]
            floors = step_floors(r, int(rows), step, read, peaks[unit], head_peak)
            parts.append(f"{name} | {side} | {rows} | {floors}")
    print("\n(e') where each step's time goes: ms, and each part against its own floor (bytes")
    print("over the read bandwidth or FLOPs over its unit's peak, the larger): the decoder's")
    print("layers but their attention over the cache, the lm_head alone (the default path's")
    print("split: 16 bits of each activation, twice its products), that attention (the step less")
    print("the same step at its first column)")
    print("path | side | rows | layers | lm_head | attention over the cache")
    print("\n".join(parts), flush=True)


def step_floors(r: dict, rows: int, step: dict, read: float, peak: float, head_peak: float) -> str:
    """A step's parts, each as "ms (x its floor)"."""

    def part(seconds: float, nbytes: float, flops: float, unit_peak: float) -> str:
        if seconds <= 0:  # a part within the timings' noise (attention over one row's cache)
            return "~0"
        floor = max(nbytes / read, flops / unit_peak / 1e9)
        return f"{seconds * 1e3:.0f} ({seconds / floor:.2f}x)"

    head_flops = r["head_flops_per_row"] * rows
    layers = step["seconds"] - step["attention"] - step["head"]
    layer_flops = r["flops_per_row"] * rows - head_flops
    return " | ".join(
        (
            part(layers, r["weights"] - r["head_bytes"], layer_flops, peak),
            part(step["head"], r["head_bytes"], head_flops, head_peak),
            part(step["attention"], step["kv_bytes"], 0.0, peak),
        )
    )


def step_unit(path: str, kernel: str, products: str | None) -> str:
    """The unit a path's decode step multiplies on: int8's dot products for int8, and for int4
    on int4_vnni.c (VNNI is never masked); else its run's products' (bfloat16 or float32)."""
    if path == "int8" or "int4_vnni" in kernel:
        return "int8"
    return "bfloat16" if products == "bfloat16" else "float32"


def head_unit(kernel: str) -> str:
    """The lm_head's unit: int8 for an int8 head, bfloat16 on the AMX tiles or AVX-512 BF16's
    dot products, else float32 FMAs."""
    if kernel.startswith("int8 split"):
        return "int8"
    return "bfloat16" if "AMX" in kernel or "bf16_dot" in kernel else "float32"


def print_units(ckpt: Path) -> None:
    """The CPU's units, the library's peak on each, and each path's plan after."""
    from mmcli.api.loader import choose_kernels, resolve_run
    from mmcli.config import load_config
    from mmcli.kernels import cpu_features, measure

    peaks = measure.peaks()
    print(f"CPU: {cpu_features.detect().describe()}")
    print("library peaks: " + ", ".join(f"{u} {r:.0f} G(FL)OP/s" for u, r in peaks.items()))
    BENCH["peaks"] = peaks
    for name, settings in PATHS.items():
        cfg = load_config(None, {"model": str(ckpt), "device": "cpu", **settings})
        run = resolve_run(cfg)
        print(f"plan, {name} after: {choose_kernels(run, run.model_config).summary()}")


BENCH: dict = {}  # the peaks, measured once at the start


def batched(args, rate_args, cfg, parameters: int) -> dict:
    """(a) each path's batched run before (vector units) and after (this CPU's units), the
    sides alternating for --rounds rounds (this shared machine drifts by tens of percent within
    minutes); the median round of each counts."""
    runs: dict = {}
    for round_ in range(args.rounds):
        for name, settings in PATHS.items():
            for side in SIDES if round_ % 2 == 0 else reversed(SIDES):
                with side_env(side):
                    r = compare_hf.run_worker(
                        argparse.Namespace(**vars(rate_args), settings=json.dumps(settings)),
                        "mmcli",
                    )
                runs.setdefault((name, side), []).append(r)
                print_batched(name, side, r, cfg, parameters)
    rates = {
        key: sorted(rs, key=lambda r: r["images_per_s"])[len(rs) // 2] for key, rs in runs.items()
    }
    print(
        f"\n(a) images/s, median of {args.rounds} | before | after | after / before | "
        "vs float32 before | vision, text prefill, decode after / before"
    )
    base = rates.get(("float32", before()), {}).get("images_per_s")  # --paths may leave it
    for name in PATHS:
        print_ratios(name, rates[name, before()], rates[name, "after"], base)
        tree = third_side()
        if tree is not None:
            ratio = rates[name, "after"]["images_per_s"] / rates[name, tree]["images_per_s"]
            print(
                f"{name}: after {ratio:.2f}x the tree at {tree} ({phase_ratios(rates, name, tree)})"
            )
    return rates


def phase_ratios(rates: dict, name: str, side: str) -> str:
    after, other = rates[name, "after"]["spent"], rates[name, side]["spent"]
    phases = ("vision", "text", "decode")
    return ", ".join(f"{p} {after[p] / other[p]:.2f}x" for p in phases)


def print_ratios(name: str, before: dict, after: dict, base: float | None) -> None:
    phases = ", ".join(
        f"{after['spent'][p] / before['spent'][p]:.2f}x" for p in ("vision", "text", "decode")
    )
    ratio = after["images_per_s"] / before["images_per_s"]
    of_base = f"{after['images_per_s'] / base:.2f}x" if base else "-"
    print(
        f"{name} | {before['images_per_s']:.4f} | {after['images_per_s']:.4f} | "
        f"{ratio:.2f}x | {of_base} | {phases}"
    )


def print_batched(name: str, side: str, r: dict, cfg, parameters: int) -> None:
    """A batched run: images/s, its phases' seconds, each prefill phase's rate and share of the
    peaks of the units it ran on (item 4 on the batched images), its weights, load and peak RSS."""
    spent = r["spent"]
    spent["text"] = spent["prefill"] - spent["vision"]
    shares = phase_shares(cfg, r, r["prompts"])
    rates = ", ".join(
        f"{phase} {rate:.0f} G(FL)OP/s, {share:.0%} of {r['units'][phase]}'s peak"
        for phase, (_, rate, share) in shares.items()
    )
    print(
        f"{name} {side}: {r['images_per_s']:.4f} images/s ({r['seconds']:.1f} s: vision "
        f"{spent['vision']:.1f}, text prefill {spent['text']:.1f}, decode {spent['decode']:.1f}; "
        f"{rates}; {r['precision']}); weights {r['weight_bytes'] / 2**30:.2f} GiB "
        f"({r['weight_bytes'] / parameters:.2f} bytes a parameter), load "
        f"{r['load_seconds']:.1f} s, peak RSS {r['peak_rss'] / 2**30:.2f} GiB",
        flush=True,
    )


def hf_part(args, rate_args, rates: dict) -> None:
    hf = [
        compare_hf.run_worker(argparse.Namespace(**vars(rate_args), settings="{}"), "hf", int(b))
        for b in ([] if args.skip_hf else args.hf_batch_sizes.split(","))
    ]
    if not hf:
        return
    best = max(hf, key=lambda r: r["images_per_s"])
    print(f"\ntransformers (float32, best batch {best['batch_size']}): {best['images_per_s']:.4f}")
    for (name, side), r in rates.items():
        print(f"{name} {side}: {r['images_per_s'] / best['images_per_s']:.2f}x transformers")


def ask_sides(args, ckpt: Path, image: Path) -> None:
    """(b') the instrumented ask at each precision before and after: its phases, and vision and
    prefill's rate against the peak of the unit they ran on."""
    from mmcli.models.registry import parse_config

    worker = ["--worker", "ask", "--ckpt", str(ckpt), "--image", str(image), "--settings"]
    cfg = parse_config(json.loads((ckpt / "config.json").read_text()))
    print("\n(b) the ask, before and after: wall = load + vision + text prefill + decode (s);")
    print("vision and text prefill each at its G(FL)OP/s and its share of its units' peaks; then")
    print("their linear layers alone (the same calls replayed back to back), their ceiling")
    print("| path | side | wall | vision | text prefill | decode | unit |")
    print("|---|---|---|---|---|---|---|")
    walls, once = {}, argparse.Namespace(**{**vars(args), "repeats": 1})
    for name, settings in PATHS.items():
        runs = {side: [] for side in SIDES}
        for repeat in range(args.repeats):  # the sides alternating, as in (a)
            for side in SIDES if repeat % 2 == 0 else reversed(SIDES):
                with side_env(side):
                    runs[side] += instrumented(once, worker, settings)
        for side in SIDES:
            timed = sorted(runs[side], key=lambda r: r["wall"])[len(runs[side]) // 2]
            walls[name, side] = timed["wall"]
            row = f"| {name} | {side} | {timed['wall']:.1f} | {phase_rates(cfg, timed)}"
            print(row, flush=True)
    for name in PATHS:
        tree = third_side()
        against = f", {walls[name, 'after'] / walls[name, tree]:.2f}x {tree}" if tree else ""
        print(
            f"{name} ask: after {walls[name, 'after'] / walls[name, before()]:.2f}x before{against}"
        )


def phase_shares(cfg, run: dict, prompts: list) -> dict[str, tuple[float, float, float]]:
    """Each prefill phase's seconds, G(FL)OP/s and share of the peaks of the units it ran on (its
    floor over its time: the linears at their unit's peak, the attention at bfloat16's where the
    products are bfloat16, else float32's), for a run's phases and its prompts' (image tokens,
    input tokens)."""
    spent, units, peaks = run["spent"], run["units"], BENCH["peaks"]
    attention = "bfloat16" if run["precision"].get("products") == "bfloat16" else "float32"
    seconds = {"vision": spent["vision"], "text prefill": spent["prefill"] - spent["vision"]}
    per_prompt = [ask_flops(cfg, image, text)[0] for image, text in prompts]
    shares = {}
    for phase, taken in seconds.items():
        linears = sum(flops[phase]["linears"] for flops in per_prompt)
        products = sum(flops[phase]["attention"] for flops in per_prompt)
        floor = linears / peaks[units[phase]] + products / peaks[attention]
        shares[phase] = (taken, (linears + products) / taken / 1e9, floor / 1e9 / taken)
    return shares


def phase_rates(cfg, timed: dict) -> str:
    """The ask's vision tower and text prefill: seconds, rate and share of the peaks of the units
    they ran on (phase_shares), then their linears alone; the decode's seconds; the linears'
    unit."""
    units, cells = timed["units"], []
    prompts = [(timed["image_tokens"], timed["input_tokens"])]
    for phase, (taken, rate, share) in phase_shares(cfg, timed, prompts).items():
        alone = timed["replayed"][phase]
        alone_rate = alone["flops"] / alone["seconds"] / 1e9
        of_peak = alone_rate / BENCH["peaks"][units[phase]]
        cells.append(
            f"{taken:.2f} s, {rate:.0f} ({share:.0%}); linears alone "
            f"{alone['seconds']:.2f} s, {alone_rate:.0f} ({of_peak:.0%})"
        )
    unit = " / ".join(dict.fromkeys(units.values()))  # vision / text prefill where they differ
    attention = "bfloat16" if timed["precision"].get("products") == "bfloat16" else "float32"
    return (
        " | ".join(cells) + f" | {timed['spent']['decode']:.2f} s | {unit}, attention {attention} |"
    )


def agreements(args, ckpt: Path, image: Path) -> None:
    """(d) bfloat16 products and int8 against float32 products, teacher-forced."""
    tiny, _, _ = compare_hf.make_inputs(args.cache_dir / "tiny", smoke=True)
    outliers = make_outlier_checkpoint(tiny, args.cache_dir / "tiny-outliers")
    checkpoints = {"2B-shaped random" if not args.smoke else "tiny": ckpt}
    checkpoints["tiny, RMSNorm outlier channels x30"] = outliers
    print("\n(d) against the float32-products run, teacher-forced on its greedy tokens")
    print("| run | checkpoint | positions | top-1 agreement | mean abs log-prob difference |")
    print("|---|---|---|---|---|")
    for label, test, side in (
        ("bfloat16 products (default, after)", {}, "after"),
        ("int8 (after)", INT8, "after"),
    ):
        for name, path in checkpoints.items():
            print(f"| {label} " + agreement(args, path, image, name, test, side), flush=True)


if __name__ == "__main__":
    main()
