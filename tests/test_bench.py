"""The benchmarks' smoke modes, so they keep working (their figures are not asserted: machines
are noisy)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


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
    stdout = _smoke("cpu.py", "--skip-hf", "--cache-dir", str(tmp_path))
    assert (
        "(a) images/s" in stdout
        and "(b) mmcli ask" in stdout
        and "int8: the first ask" in stdout
        and "cold (the checkpoint's pages dropped" in stdout
        and "outlier channels x30" in stdout
        and "(e) decode steps" in stdout
    )


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


def test_int8_kernel_bench_smoke():
    assert "| 37 x 80 x 264 |" in _smoke("int8_kernel.py")


def test_float_kernels_bench_smoke():
    stdout = _smoke("float_kernels.py")
    for row in (
        "| 25 x 70 x 300 |",
        "| 100 x 2/2 x 64 |",
        "| 50 x 4/2 x 32, causal |",
        "| 1 x 2048 |",
    ):
        assert row in stdout


@pytest.mark.slow
def test_serve_bench_smoke(tmp_path):
    stdout = _smoke("serve.py", "--cache-dir", str(tmp_path))
    assert "8 concurrent clients:" in stdout and "x ask's (target <= 1.1)" in stdout
    assert "8 of 8 answers as caption's" in stdout
    assert "8 concurrent clients, 448x448 images:" in stdout and "answered 429" in stdout
    assert "mmcli batch peak RSS: 2,000 lines" in stdout.splitlines()[-1]
