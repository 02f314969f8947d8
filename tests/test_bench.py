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


@pytest.mark.slow
def test_cpu_bench_smoke(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench" / "cpu.py"),
            "--smoke",
            "--skip-hf",
            "--cache-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert (
        "(a) images/s" in out.stdout
        and "(b) mmcli ask" in out.stdout
        and "int8: the first ask" in out.stdout
        and "cold (the checkpoint's pages dropped" in out.stdout
        and "outlier channels x30" in out.stdout
    )


@pytest.mark.slow
def test_video_bench_smoke(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "video.py"), "--smoke", "--cache-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "s per video-minute" in out.stdout.splitlines()[-1]


@pytest.mark.slow
def test_shards_bench_smoke():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "shards.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1].startswith("peak RSS, a ")


@pytest.mark.slow
def test_moe_bench_smoke(tmp_path):
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "moe.py"), "--smoke", "--cache-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| MoE, first 4 layers, int4 |" in out.stdout and out.stdout.count("\nint") == 2
    assert "\ntiny dense, outlier channels x30 | " in out.stdout


def test_int8_kernel_bench_smoke():
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "int8_kernel.py"), "--smoke"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "| 37 x 80 x 264 |" in out.stdout
