"""The Qwen3-VL-30B-A3B measured whole, at int4, in one run on this machine.

(1) A random checkpoint with the released config and layout (bfloat16 safetensors in shards with
an index, the experts as released: gate_up_proj [E, H, 2I], down_proj [E, I, H]) written to
--dir shard by shard (whole decoder layers a shard, never more than one shard in memory), after
checking the free disk (about 62 GB).
(2) What `mmcli ask --quantize int4` does (one 448x448 image, 16 new tokens), through the same
API in a process of its own: load time, time to first token, decode tokens/s against its floor
(the active parameters' bytes a token over the read bandwidth `mmcli doctor` measures) and peak
RSS; then the real `mmcli caption` of --images images (64 new tokens each): images/s, peak RSS.
(3) The int4 weights prepared once in the cache: the first load quantizes them and writes the
file, the second reads it; both loads are printed. Where the disk cannot hold the checkpoint
and the int4 file at once, both loads run on the checkpoint cut to the most whole decoder layers
that fit (its last shards dropped, config.json and the index rewritten), said so.
The checkpoint and the bench's cache are deleted at the end unless --keep. --sizes prints, without
writing anything, what the released Qwen3-VL-30B-A3B and Qwen3.5-35B-A3B need: parameters, the
checkpoint's bytes, the int4 file's, the weights held at int4.

python bench/big_moe.py --dir /mnt/big [--keep] [--images 8] [--smoke]
python bench/big_moe.py --sizes"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

NAME = "qwen3-vl-30b-a3b-random"
LAYERS_A_SHARD = 4  # about 5 GB of bfloat16 a shard at the released shapes (13 shards)
MARGIN = 2 * 10**9  # disk left free beyond what a step writes
ASK_TOKENS, CAPTION_TOKENS = 16, 64
PROMPT = "Describe this image."
_LAYER = re.compile(r"^model\.language_model\.layers\.(\d+)\.")


def shard_plan(shapes: dict[str, tuple], per_shard: int) -> list[list[str]]:
    """The checkpoint's tensor names by shard: everything outside the decoder layers first, then
    `per_shard` whole layers a shard (so the checkpoint can be cut at a shard's end)."""
    rest, layers = [], {}
    for name in sorted(shapes):
        match = _LAYER.match(name)
        if match is None:
            rest.append(name)
        else:
            layers.setdefault(int(match.group(1)), []).append(name)
    count = max(layers) + 1
    shards = [rest]
    for first in range(0, count, per_shard):
        shards.append([n for i in range(first, min(first + per_shard, count)) for n in layers[i]])
    return shards


def released_shape(name: str, shape: tuple) -> tuple:
    """A tensor's shape as the released checkpoints store it: the experts transposed."""
    from mmcli.models.layers.moe import held_experts

    return (shape[0], shape[2], shape[1]) if held_experts(name) else tuple(shape)


def checkpoint_bytes(shapes: dict[str, tuple]) -> int:
    return sum(2 * math.prod(shape) for shape in shapes.values())  # bfloat16


def random_shard(names: list[str], shapes: dict[str, tuple], seed: int) -> dict:
    """One shard's random bfloat16 tensors (the tests' random checkpoint's scales), as stored."""
    from mmcli.testing import random_tensor

    torch.manual_seed(seed)  # the default generator: several times faster than a seeded one
    tensors = {}
    for name in names:
        tensor = random_tensor(name, shapes[name], None, std=0.02).to(torch.bfloat16)
        if released_shape(name, shapes[name]) != tuple(shapes[name]):
            tensor = tensor.transpose(1, 2).contiguous()
        tensors[name] = tensor
    return tensors


def write_checkpoint(path: Path, smoke: bool, per_shard: int) -> tuple[dict, list[str]]:
    """The random checkpoint written shard by shard (a shard written aside and renamed: an
    interrupted run leaves no half shard under its name); returns (shapes, shard files). A
    checkpoint a --keep run left whole is used as it is."""
    from safetensors.torch import save_file

    from mmcli.testing import make_tiny_checkpoint
    from mmcli.weights.checkpoint import expected_shapes, read_model_config

    index = path / "model.safetensors.index.json"
    if not index.is_file():
        pixels = {} if smoke else {"max_pixels": 16777216, "min_pixels": 65536}
        make_tiny_checkpoint(
            path, "qwen3_vl_moe", dtype="bfloat16", released_shapes=not smoke, weights=False,
            **pixels,
        )  # fmt: skip
    shapes = expected_shapes(read_model_config(path))
    shards = shard_plan(shapes, per_shard)
    files = [f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors" for k in range(len(shards))]
    if index.is_file():
        return shapes, sorted(set(json.loads(index.read_text())["weight_map"].values()))
    need, free = checkpoint_bytes(shapes), shutil.disk_usage(path).free
    if free < need + MARGIN:
        sys.exit(
            f"{path}: the checkpoint needs {need / 1e9:.1f} GB of disk and {free / 1e9:.1f} GB "
            "is free; give --dir a larger disk"
        )
    print(f"writing {need / 1e9:.1f} GB to {path} ({len(shards)} shards)", flush=True)
    started = time.perf_counter()
    for k, (file, names) in enumerate(zip(files, shards)):
        partial = path / f"{file}.partial"
        save_file(random_shard(names, shapes, seed=k), str(partial), metadata={"format": "pt"})
        os.replace(partial, path / file)
    weight_map = {name: file for file, names in zip(files, shards) for name in names}
    index.write_text(
        json.dumps({"metadata": {"total_size": need}, "weight_map": weight_map}, indent=1)
    )
    print(f"written in {time.perf_counter() - started:.0f} s", flush=True)
    return shapes, files


def cut(path: Path, files: list[str], layers: int, per_shard: int) -> None:
    """The checkpoint cut to its first `layers` decoder layers (a multiple of `per_shard`, the
    layers a shard): the later shards deleted, config.json and the index rewritten."""
    index = json.loads((path / "model.safetensors.index.json").read_text())
    kept = files[: 1 + layers // per_shard]
    for file in files[len(kept) :]:
        (path / file).unlink(missing_ok=True)
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if f in kept}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["num_hidden_layers"] = layers
    (path / "config.json").write_text(json.dumps(config, indent=2))


def int4_bytes(path: Path) -> int:
    from mmcli.weights.checkpoint import read_model_config

    return int4_sizes(read_model_config(path))[1]


def int4_sizes(cfg) -> tuple[int, int]:
    """(the parameters int4 takes, the prepared int4 file's bytes: half a byte a weight, a
    bfloat16 scale and zero a group)."""
    from mmcli.weights.checkpoint import int4_shapes
    from mmcli.weights.int4 import GROUP

    shapes = int4_shapes(cfg)
    sides = list(shapes.matrices.values())
    for count, gate, down in shapes.expert_groups.values():
        sides += [gate, gate, down] * count
    weights = sum(out * inner for out, inner in sides)
    return weights, sum(out * inner // 2 + inner // GROUP * out * 4 for out, inner in sides)


def sizes() -> None:
    """What the released MoE checkpoints need, from their configs' layouts (nothing written):
    the weights held at int4 are the int4 file and the rest in bfloat16."""
    from mmcli.models.registry import parse_config
    from mmcli.testing import SPECIAL_TOKENS, qwen3_5_35b_a3b_config, qwen3_vl_30b_a3b_config
    from mmcli.weights.checkpoint import expected_shapes

    ids = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    print("| model | parameters | checkpoint | int4 file | held at int4 |")
    print("|---|---|---|---|---|")
    for name, config in (
        ("Qwen3-VL-30B-A3B", qwen3_vl_30b_a3b_config),
        ("Qwen3.5-35B-A3B", qwen3_5_35b_a3b_config),
    ):
        cfg = parse_config(config(ids))
        total = sum(math.prod(shape) for shape in expected_shapes(cfg).values())
        weights, file = int4_sizes(cfg)
        held = file + 2 * (total - weights)
        print(
            f"| {name} | {total / 1e9:.2f} B | {2 * total / 1e9:.1f} GB | {file / 1e9:.1f} GB | "
            f"{held / 2**30:.2f} GiB |"
        )


def images(folder: Path, count: int, side: int) -> list[Path]:
    """`count` side x side photos from samples/ (mirrored for the second four)."""
    from PIL import Image, ImageOps

    samples = sorted((Path(__file__).parent.parent / "samples").glob("*.jpg"))
    folder.mkdir(parents=True, exist_ok=True)
    made = []
    for n in range(count):
        image = Image.open(samples[n % len(samples)]).convert("RGB").resize((side, side))
        made.append(folder / f"{n:02d}.png")
        (ImageOps.mirror(image) if n >= len(samples) else image).save(made[-1])
    return made


def settings(cache: Path, weights_cache: bool) -> dict:
    return {
        "device": "cpu",
        "quantize": "int4",
        "cache_dir": str(cache),
        "weights_cache": weights_cache,
    }


def ask_worker(ckpt: Path, image: Path, run: dict) -> dict:
    """What `mmcli ask` does, through the same API, timed by phase."""
    sys.path.insert(0, str(Path(__file__).parent))
    import compare_hf

    from mmcli.api.labeler import Labeler
    from mmcli.config import load_config
    from mmcli.weights.loader import held_bytes

    started = time.perf_counter()
    labeler = Labeler.from_pretrained(str(ckpt), config=load_config(None, run))
    loaded = time.perf_counter()
    spent = compare_hf.phase_timers(labeler)
    result = labeler.ask([image], PROMPT, max_new_tokens=ASK_TOKENS)
    assert result.ok, result.error
    report = labeler.prepared_weights_report()
    written = time.perf_counter()
    model, cfg = labeler.model, labeler.model.cfg.text
    experts = sum(getattr(m, "int4_bytes", 0) for m in model.modules())
    vision = sum(t.numel() * t.element_size() for t in model.visual.parameters())
    embedding = model.language_model.embed_tokens.weight
    decoder = held_bytes(model) - vision - embedding.numel() * embedding.element_size()
    active = decoder - experts + experts * cfg.num_experts_per_tok / cfg.num_experts
    return {
        "load": loaded - started,
        "status": _how_loaded(labeler.loaded.prepared, report),
        "prepared": report,
        "written": written - loaded,
        "first_token": spent["prefill"],
        "decode": spent["decode"],
        "tokens": len(result.token_ids),
        "active_bytes": active,
        "weight_bytes": labeler.weight_bytes,
        "peak_rss": compare_hf.peak_rss(),
    }


def _how_loaded(prepared, report: str | None) -> str:
    if prepared is None:
        return "quantized as read, no cache"
    if "read from" in prepared.status:
        return "read from the int4 file"
    return "quantized as read, " + ("file written" if "written to" in report else report)


def ask(ckpt: Path, image: Path, run: dict) -> dict:
    command = [sys.executable, __file__, "--worker", str(ckpt), str(image), json.dumps(run)]
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"the ask failed on {ckpt}:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def caption(ckpt: Path, folder: Path, run: dict, out: Path) -> dict:
    """The real `mmcli caption`: its wall time, its own summary and its peak RSS (its VmHWM,
    read as it runs: wait4's would start from this process's size)."""
    config = out.with_suffix(".settings.json")
    config.write_text(json.dumps({k: v for k, v in run.items() if k != "quantize"}))
    command = [sys.executable, "-m", "mmcli", "caption", str(folder), "--model", str(ckpt)]
    command += ["--quantize", "int4", "-o", str(out), "-c", str(config)]
    command += ["--max-new-tokens", str(CAPTION_TOKENS)]
    log = out.with_suffix(".log")
    started, peak = time.perf_counter(), 0
    with open(log, "w") as sink:
        env = {**os.environ, "COLUMNS": "200"}
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=env)
        while process.poll() is None:
            peak = max(peak, _hwm(process.pid))
            time.sleep(0.2)
    output = log.read_text(errors="replace")
    if process.returncode:
        sys.exit(f"mmcli caption failed on {ckpt}:\n{output[-3000:]}")
    row = [line for line in output.splitlines() if line.count("│") == 9][-1]
    cells = [cell.strip() for cell in row.strip("│").split("│")]
    records = [json.loads(line) for line in out.read_text().splitlines()]
    return {
        "wall": time.perf_counter() - started,
        "load": float(cells[4]),
        "labeling": float(cells[5]),
        "images_per_s": float(cells[6]),
        "ok": sum(r["status"] == "ok" for r in records),
        "peak_rss": peak,
    }


def _hwm(pid: int) -> int:
    """A running process's peak resident bytes so far (0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    match = re.search(r"^VmHWM:\s+(\d+) kB", status, re.M)
    return int(match.group(1)) * 1024 if match else 0


def ask_line(label: str, r: dict, read_gb_s: float) -> str:
    floor = r["active_bytes"] / (read_gb_s * 1e9)  # seconds a token, bound by the reads
    rate = (r["tokens"] - 1) / r["decode"] if r["tokens"] > 1 else float("nan")
    return (
        f"| {label} | {r['load']:.1f} s ({r['status']}) | {r['first_token']:.1f} s | "
        f"{rate:.2f} tokens/s, floor {1 / floor:.2f} ({rate * floor:.0%} of it) | "
        f"{r['peak_rss'] / 2**30:.2f} GiB | {r['weight_bytes'] / 2**30:.2f} GiB |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, help="where the checkpoint goes (about 62 GB)")
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--keep", action="store_true", help="keep the checkpoint and the cache")
    parser.add_argument("--smoke", action="store_true", help="a tiny MoE in the same layout")
    parser.add_argument("--sizes", action="store_true", help="what the released MoEs need")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.sizes:
        return sizes()
    if args.worker:
        ckpt, image, run = args.worker
        print(json.dumps(ask_worker(Path(ckpt), Path(image), json.loads(run))))
        return
    if args.dir is None:
        parser.error("--dir is required")
    from mmcli.kernels import measure

    path, cache = args.dir / NAME, args.dir / "mmcli-cache"
    path.mkdir(parents=True, exist_ok=True)
    try:
        run_bench(args, path, cache, measure.floors()["read_gb_s"])
    finally:
        if not args.keep:
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(cache, ignore_errors=True)
            print(f"deleted {path} and {cache} (--keep keeps them)")


def run_bench(args, path: Path, cache: Path, read_gb_s: float) -> None:
    per_shard = 1 if args.smoke else LAYERS_A_SHARD
    shapes, files = write_checkpoint(path, args.smoke, per_shard)
    photos = images(args.dir / "images", args.images, 64 if args.smoke else 448)
    layers = _layers(path)
    int4_file = int4_bytes(path)
    cached = shutil.disk_usage(path).free >= int4_file + MARGIN
    fit = "fits" if cached else "does not fit"
    print(f"read bandwidth {read_gb_s:.1f} GB/s; {layers} decoder layers; the int4 file")
    print(f"{int4_file / 1e9:.1f} GB, {fit} on the disk beside the checkpoint")
    print("\n| ask, int4 | load | first token | decode | peak RSS | weights held |")
    print("|---|---|---|---|---|---|")
    first = ask(path, photos[0], settings(cache, cached))
    print(ask_line(f"{layers} layers, first load", first, read_gb_s), flush=True)
    out = args.dir / "captions.jsonl"
    out.unlink(missing_ok=True)
    shot = caption(path, args.dir / "images", settings(cache, cached), out)
    print(
        f"\nmmcli caption, {args.images} images x {CAPTION_TOKENS} tokens, {layers} layers: "
        f"{shot['images_per_s']:.3f} images/s ({shot['ok']} ok; load {shot['load']:.1f} s, "
        f"labeling {shot['labeling']:.1f} s, wall {shot['wall']:.1f} s), peak RSS "
        f"{shot['peak_rss'] / 2**30:.2f} GiB",
        flush=True,
    )
    if cached:
        print(f"loads: first {first['load']:.1f} s, second (the caption's) {shot['load']:.1f} s")
        return
    fits = [n for n in range(layers, 0, -per_shard) if _fits(path, files, n, per_shard)]
    if not fits:
        print("the int4 file fits beside no cut of the checkpoint: the second load not measured")
        return
    cut(path, files, fits[0], per_shard)
    print(f"\nall {layers} layers and their int4 file need more disk than is free: cut to the")
    print(f"first {fits[0]} layers, whose first load writes the file and whose second reads it")
    for label in ("first load", "second load"):
        r = ask(path, photos[0], settings(cache, True))
        print(ask_line(f"{fits[0]} layers, {label}", r, read_gb_s), flush=True)


def _fits(path: Path, files: list[str], layers: int, per_shard: int) -> bool:
    """Whether the int4 file of the first `layers` fits once the later shards are deleted."""
    dropped = sum((path / f).stat().st_size for f in files[1 + layers // per_shard :])
    needed = int4_bytes(path) * layers / _layers(path)  # the decoder's layers are most of it
    return shutil.disk_usage(path).free + dropped >= needed + MARGIN


def _layers(path: Path) -> int:
    return json.loads((path / "config.json").read_text())["text_config"]["num_hidden_layers"]


if __name__ == "__main__":
    main()
