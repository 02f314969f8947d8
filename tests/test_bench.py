"""The benchmarks' smoke modes, so they keep working (their figures are not asserted: machines
are noisy)."""

import ast
import json
import subprocess
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mmcli.kernels import cpu as cpu_kernels
from mmcli.models.cache import DecoderCache
from mmcli.models.config import TextConfig
from mmcli.weights.checkpoint import expected_shapes, read_model_config

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
import big_moe  # noqa: E402 (the big MoE bench's pieces, tested on a tiny MoE)
import cpu as cpu_bench  # noqa: E402 (the CPU bench's arithmetic)
import decode_attention  # noqa: E402 (the decode attention bench's stream)
import decode_products  # noqa: E402 (the decode products bench's kernels)
import gpu_parity  # noqa: E402 (the GPU parity's bfloat16 gate)
import kernel_ab  # noqa: E402 (the kernels A/B bench's guard)


@pytest.mark.slow
def test_compare_hf_smoke(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "compare_hf.py"),
            "--smoke",
            "--hf-batch-sizes",
            "8",
            "--families",
            "qwen3_vl,qwen3_5",
            "--cache-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    ratios = out.stdout.strip().splitlines()[-2:]
    for line, family in zip(ratios, ["qwen3_vl", "qwen3_5"]):
        assert line.startswith(f"images/s ratio (mmcli / transformers), {family}: ")
        assert float(line.split()[-1]) > 0
    assert "| state per sequence at 512 tokens: K/V + linear |" in out.stdout


@pytest.mark.slow
def test_vision_packing_bench_runs(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "vision_packing.py"),
            "--depth",
            "1",
            "--repeats",
            "1",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "speed-up of packed blocks" in out.stdout
    assert "eager, one row:" in out.stdout  # and its outputs equal the packed blocks'


def _smoke(script: str, *args: str) -> str:
    """The bench's output in its smoke mode; it must exit 0."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / script), "--smoke", *args],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


@pytest.mark.slow
def test_cpu_bench_smoke(tmp_path):
    # two of the four paths: every section's code runs for each path alike, and each path's
    # runs are processes of their own (4-5 s of start each; (b) and (d) run int8 whatever
    # --paths keeps)
    stdout = _smoke("cpu.py", "--skip-hf", "--paths", "default,int4", "--cache-dir", str(tmp_path))
    assert (
        "(a) images/s" in stdout
        and "'s peak; {" in stdout  # (a)'s runs: each prefill phase against its unit's peak
        and "(b) mmcli ask" in stdout
        and "linears alone" in stdout
        and "int8: the first ask" in stdout
        and "cold (the checkpoint's pages dropped" in stdout
        and "outlier channels x30" in stdout
        and "(e) decode steps" in stdout
        and "(e') where each step's time goes" in stdout
    )


def test_a_steps_parts_are_each_held_to_their_own_floor():
    """(e'): the layers (the step less its head and attention) against the larger of their
    bytes over the bandwidth and their FLOPs over their unit's peak, the head against its own,
    the attention against the cache's bytes."""
    r = {"weights": 3e9, "head_bytes": 1e9, "flops_per_row": 4e9, "head_flops_per_row": 1e9}
    step = {"seconds": 0.3, "attention": 0.1, "head": 0.05, "kv_bytes": 1e9}
    read, peak = 20e9, 1000.0  # 2 GB of layers: 0.1 s; 1 GB of head or cache: 0.05 s
    assert (
        cpu_bench.step_floors(r, 1, step, read, peak, peak)
        == "150 (1.50x) | 50 (1.00x) | 100 (2.00x)"
    )
    # 50 rows: the layers' 150 GFLOP take 0.15 s at the peak, more than their bytes
    assert cpu_bench.step_floors(r, 50, step, read, peak, peak).startswith("150 (1.00x) | ")
    assert cpu_bench.step_floors(r, 1, {**step, "attention": -0.001}, read, peak, peak).endswith(
        "~0"
    )


def test_a_steps_bandwidth_is_its_own_weights_streamed():
    """The floor's bandwidth reads the step's tensors of 1 MiB and more, whatever their dtype,
    and counts those bytes only; all of a model that has none."""
    weights = [torch.ones(1 << 18), torch.ones(1 << 20, dtype=torch.int8), torch.ones(64)]
    stream, streamed = cpu_bench.weights_stream(weights)
    assert streamed == (1 << 20) * 2
    assert [int(top) for top in stream()] == [0x80, 1]  # 1.0 is 0x3f800000; int8 1
    assert cpu_bench.weights_stream(weights[2:])[1] == 64 * 4  # a tiny model: all of it


def test_the_attentions_stream_reads_the_columns_its_rows_attend_over():
    """Of every full-attention layer's K and V, the first rows' first columns: their bytes, and
    nothing past them."""
    cfg = TextConfig(
        hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        intermediate_size=64, num_hidden_layers=3, vocab_size=16, mrope_section=(2, 1, 1),
    )  # fmt: skip
    cache = DecoderCache(cfg, 4, 16, torch.float32, torch.device("cpu"))
    for layer in range(3):
        for states in (cache.k, cache.v):
            states[layer].fill_(1.0)
            states[layer][2:] = 5.0  # rows past the two read
            states[layer][:, :, 6:] = 7.0  # columns past the six read
    stream, streamed = decode_attention.cache_stream(cache, rows=2, columns=6)
    assert streamed == 3 * 2 * (2 * 2 * 6 * 8) * 4
    assert [float(top) for top in stream()] == [1.0] * 6


@pytest.mark.slow
def test_decode_attention_bench_smoke():
    out = _smoke("decode_attention.py", "--rows", "1,3", "--columns", "20")
    rows = [line.split(" | ") for line in out.splitlines() if line[:1].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("1", "20"), ("3", "20")]
    assert all(len(r) == 6 and r[-1].endswith("x") for r in rows)


@pytest.mark.skipif(cpu_kernels.why_unavailable() is not None, reason="no kernels build here")
@pytest.mark.slow
def test_decode_attention_bench_times_the_cache_in_both_page_sizes():
    """--pages: each cache dtype, row count and column count, with both pages' times and their
    ratio."""
    out = _smoke("decode_attention.py", "--pages", "--rows", "1,3", "--columns", "20")
    rows = [line.split(" | ") for line in out.splitlines() if line[:1].isalpha() and " | " in line]
    cases = [(r[0], r[1], r[2]) for r in rows[1:]]
    assert cases == [(t, n, "20") for t in ("float32", "bfloat16") for n in ("1", "3")]
    assert all(len(r) == 7 and r[-1].endswith("x") for r in rows[1:])


@pytest.mark.skipif(cpu_kernels.why_unavailable() is not None, reason="no kernels build here")
@pytest.mark.slow
def test_decode_products_bench_smoke():
    """Each kernel the build has, at each row count: hot, its stream, cold and their ratios."""
    out = _smoke("decode_products.py", "--rows", "1,3")
    kinds = list(decode_products.KERNELS)
    rows = [line.split(" | ") for line in out.splitlines() if line.split(" | ")[0] in kinds]
    assert [(r[0], r[1]) for r in rows] == [(k, n) for n in ("1", "3") for k in kinds]
    built = [r for r in rows if r[2] != "not in this build"]
    assert built and all(len(r) == 7 and r[-1].endswith("x") for r in built)


def test_kernels_of_a_commit_are_compared_only_through_the_same_declarations(monkeypatch, tmp_path):
    ours = (ROOT / "mmcli" / "kernels" / "cpu.py").read_text()
    changed = ours.replace('("eps", ctypes.c_float)', '("eps", ctypes.c_double)')
    assert changed != ours
    monkeypatch.setattr(kernel_ab, "git_show", lambda commit, path: changed.encode())
    with pytest.raises(SystemExit, match="C declarations differ"):
        kernel_ab.commit_library("theirs", tmp_path)


@pytest.mark.skipif(cpu_kernels.why_unavailable() is not None, reason="no C kernels here")
@pytest.mark.slow
def test_kernel_ab_bench_smoke():
    out = _smoke(
        "kernel_ab.py", "--against", "HEAD", "--rows", "1,3", "--columns", "20", "--repeats", "1"
    )
    rows = [line.split(" | ") for line in out.splitlines() if line[:1].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("1", "20"), ("3", "20")]
    assert all(len(r) == 5 and r[-1].endswith("x") for r in rows)


@pytest.mark.skipif(cpu_kernels.why_unavailable() is not None, reason="no C kernels here")
@pytest.mark.slow
def test_kernel_ab_bench_times_attention_alone():
    out = _smoke("kernel_ab.py", "--against", "HEAD", "--attention", "--repeats", "1")
    rows = [line.split(" | ") for line in out.splitlines() if line[:1].isdigit()]
    assert [r[0] for r in rows] == ["100 x 2/2 x 64", "50 x 4/2 x 32, causal"]
    assert all(len(r) == 4 and r[-1].endswith("x") for r in rows)


@pytest.mark.skipif(cpu_kernels.why_unavailable() is not None, reason="no C kernels here")
@pytest.mark.slow
def test_kernel_ab_bench_times_the_cache_attention_alone_for_both_cache_dtypes():
    out = _smoke(
        "kernel_ab.py", "--against", "HEAD", "--cache-attention", "--rows", "2", "--columns",
        "20", "--repeats", "1",
    )  # fmt: skip
    rows = [line.split(" | ") for line in out.splitlines() if line.startswith(("float", "bfloat"))]
    assert [r[:3] for r in rows] == [["float32", "2", "20"], ["bfloat16", "2", "20"]]
    assert all(len(r) == 6 and r[-1].endswith("x") for r in rows)


def test_a_tree_run_beside_keeps_an_mmcli_cache_of_its_own(tmp_path, monkeypatch):
    """--against's tree imports its own mmcli and keeps its own cache: two trees whose int8
    quantization code differs would otherwise prepare the weights again at every other run."""
    (tmp_path / "tree-abc1234" / "mmcli").mkdir(parents=True)  # the worktree, made before
    monkeypatch.setattr(cpu_bench, "SIDES", dict(cpu_bench.SIDES))
    cpu_bench.against_tree("abc1234", tmp_path)
    assert cpu_bench.SIDES["abc1234"]() == {
        "PYTHONPATH": str(tmp_path / "tree-abc1234"),
        "XDG_CACHE_HOME": str(tmp_path / "tree-abc1234-cache"),
    }
    assert cpu_bench.third_side() == "abc1234"


BESIDE = "2f9fc9a"  # the tree docs/performance.md's AMX figures are measured beside (--against)


def top_level_names(source: str) -> set[str]:
    """What a module defines or imports at its top level."""
    names = set()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def test_the_cpu_bench_loads_in_the_tree_it_runs_beside():
    """--against runs this bench's workers on that tree's mmcli, so what the bench imports from
    mmcli at its top level must be there too (a helper imported there once failed every run)."""
    known = subprocess.run(["git", "-C", str(ROOT), "cat-file", "-e", f"{BESIDE}^{{commit}}"])
    if known.returncode:
        pytest.skip(f"{BESIDE} is not in this clone's history")
    for node in ast.parse((ROOT / "bench" / "cpu.py").read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.module.startswith("mmcli"):
            path = node.module.replace(".", "/") + ".py"
            show = ["git", "-C", str(ROOT), "show", f"{BESIDE}:{path}"]
            source = subprocess.run(show, capture_output=True, text=True, check=True).stdout
            missing = {a.name for a in node.names} - top_level_names(source)
            assert not missing, (
                f"bench/cpu.py imports {sorted(missing)} from {path}: not at {BESIDE}"
            )


@pytest.mark.parametrize(
    "path, kernel, products, unit",
    [
        ("int8", "decode_layer.c, int8 on int8_linear.c", "bfloat16", "int8"),
        ("int4", "decode_layer.c, int4 on int4_vnni.c", "float32", "int8"),
        (
            "default",
            "decode_layer.c on AVX-512 BF16 dot products (bf16_dot.c)",
            "bfloat16",
            "bfloat16",
        ),
        ("default", "layer by layer", "bfloat16", "bfloat16"),
        ("default", "decode_layer.c", "float32", "float32"),
        ("int4", "layer by layer", None, "float32"),
    ],
)
def test_a_step_is_held_to_the_unit_its_kernel_multiplies_on(path, kernel, products, unit):
    assert cpu_bench.step_unit(path, kernel, products) == unit


@pytest.mark.parametrize(
    "kernel, unit",
    [
        ("bf16_dot.c, split", "bfloat16"),
        ("AMX tiles to 32 rows", "bfloat16"),
        ("bf16_linear.c", "float32"),
        ("int8 split: int8_linear.c, VNNI to 2 rows, AMX tiles above", "int8"),
    ],
)
def test_the_lm_head_is_held_to_the_unit_it_multiplies_on(kernel, unit):
    assert cpu_bench.head_unit(kernel) == unit


@pytest.mark.slow
def test_video_bench_smoke(tmp_path):
    stdout = _smoke("video.py", "--cache-dir", str(tmp_path))
    assert "s per video-minute" in stdout.splitlines()[-1]


@pytest.mark.slow
def test_shards_bench_smoke():
    assert _smoke("shards.py").strip().splitlines()[-1].startswith("peak RSS, a ")


@pytest.mark.slow
def test_moe_bench_smoke(tmp_path):
    stdout = _smoke("moe.py", "--cache-dir", str(tmp_path))
    assert "| MoE, first 4 layers, int4 |" in stdout and stdout.count("\nint") == 2
    assert "\ntiny dense, outlier channels x30 | " in stdout


@pytest.mark.slow
def test_int8_kernel_bench_smoke():
    out = _smoke("int8_kernel.py")
    assert "| 37 x 80 x 264 |" in out
    int8 = out[out.index("int8, 2 copies") : out.index("int4, 2 copies")]
    assert all(f"| {rows} | " in int8 for rows in (1, 3, 5))
    int4 = out[out.index("int4, 2 copies") :]
    assert all(f"| {rows} | " in int4 for rows in (1, 3, 5))


@pytest.mark.slow
def test_float_kernels_bench_smoke():
    stdout = _smoke("float_kernels.py")
    for row in (
        "| 25 x 70 x 300 |",
        "| 100 x 2/2 x 64 |",
        "| 50 x 4/2 x 32, causal |",
        "| 1 x 2048 |",
        "| GELU (tanh), bfloat16 products widened |",
        "| SiLU(gate) x up, bfloat16 |",
    ):
        assert row in stdout
    decode = stdout[stdout.index("bfloat16, 2 copies") :]
    assert all(f"| {rows} | " in decode for rows in (1, 3))


@pytest.mark.slow
def test_serve_bench_smoke(tmp_path):
    stdout = _smoke("serve.py", "--cache-dir", str(tmp_path))
    assert "8 concurrent clients:" in stdout and "x ask's (target <= 1.1)" in stdout
    assert "8 of 8 answers as caption's" in stdout
    assert "8 concurrent clients, 448x448 images:" in stdout and "answered 429" in stdout
    assert "mmcli batch peak RSS: 2,000 lines" in stdout.splitlines()[-1]


@pytest.mark.slow
def test_big_moe_bench_smoke(tmp_path):
    stdout = _smoke("big_moe.py", "--dir", str(tmp_path))
    assert "| 3 layers, first load |" in stdout and "(quantized as read, file written)" in stdout
    assert "mmcli caption, 8 images x 64 tokens, 3 layers:" in stdout and "(8 ok;" in stdout
    assert "loads: first" in stdout and not (tmp_path / big_moe.NAME).exists()


def test_the_big_checkpoint_is_written_shard_by_shard_in_the_released_layout(tmp_path, monkeypatch):
    alive, made = [], big_moe.random_shard

    def one_at_a_time(names, shapes, seed):
        assert all(ref() is None for ref in alive), "an earlier shard is still held"
        tensors = made(names, shapes, seed)
        alive.append(weakref.ref(next(iter(tensors.values()))))
        return tensors

    monkeypatch.setattr(big_moe, "random_shard", one_at_a_time)
    path = tmp_path / "ckpt"
    shapes, files = big_moe.write_checkpoint(path, smoke=True, per_shard=1)
    assert len(alive) == len(files) == 1 + big_moe._layers(path)
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(weight_map) == set(expected_shapes(read_model_config(path)))
    for k, file in enumerate(files[1:]):  # whole layers a shard
        assert {
            n.split(".layers.")[1].split(".")[0] for n, f in weight_map.items() if f == file
        } == {str(k)}
    experts = next(n for n in weight_map if n.endswith("experts.gate_up_proj"))
    with safe_open(str(path / weight_map[experts]), framework="pt") as f:
        count, double, hidden = shapes[experts]
        assert tuple(f.get_slice(experts).get_shape()) == (count, hidden, double)  # as released
    big_moe.cut(path, files, 2, per_shard=1)
    assert big_moe._layers(path) == 2 and not (path / files[-1]).exists()
    from mmcli import Labeler

    labeler = Labeler.from_pretrained(str(path), device="cpu")
    assert len(labeler.model.language_model.layers) == 2


def test_the_big_checkpoint_is_refused_where_the_disk_cannot_hold_it(tmp_path, monkeypatch):
    monkeypatch.setattr(big_moe.shutil, "disk_usage", lambda p: types.SimpleNamespace(free=10**6))
    with pytest.raises(SystemExit, match="the checkpoint needs .* GB of disk and 0.0 GB is free"):
        big_moe.write_checkpoint(tmp_path / "ckpt", smoke=True, per_shard=1)


def test_big_moe_sizes_are_the_released_models(capsys):
    """The layouts' arithmetic: the released parameter counts (31.1B and 35.1B), bfloat16
    checkpoints of 62 and 70 GB."""
    big_moe.sizes()
    out = capsys.readouterr().out
    assert "| Qwen3-VL-30B-A3B | 31.07 B | 62.1 GB | 18.9 GB |" in out
    assert "| Qwen3.5-35B-A3B | 35.11 B | 70.2 GB | 21.3 GB |" in out


def test_gpu_paritys_bfloat16_gate_holds_rounding_and_refuses_a_wrong_kernel():
    """mmcli's bfloat16 logits pass within MARGIN of float32's or FACTOR times transformers'
    distance, and a wrong kernel (other logits altogether) fails either way."""
    torch.manual_seed(0)
    truth = torch.randn(32, 400)
    rounded = truth.bfloat16().float()
    assert gpu_parity.distance(rounded, truth) < gpu_parity.MARGIN
    assert gpu_parity.bfloat16_parity(rounded, rounded, truth)[0]
    wrong = torch.randn(32, 400)
    assert not gpu_parity.bfloat16_parity(wrong, rounded, truth)[0]
    drifted = truth + 0.1 * torch.randn(32, 400)  # a reference that moves further in bfloat16
    assert gpu_parity.bfloat16_parity(truth + 0.15 * torch.randn(32, 400), drifted, truth)[0]
    assert not gpu_parity.bfloat16_parity(truth + 0.3 * torch.randn(32, 400), drifted, truth)[0]
    assert gpu_parity.unlike(truth.flip(-1), truth) == list(range(32))
