"""Compile-ahead: buckets, the manifest and its keys, the neuron check, and inductor end to end
on a tiny checkpoint."""

import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import photo
from typer.testing import CliRunner

from mmcli.api.labeler import Labeler
from mmcli.cli.app import app
from mmcli.compiled.buckets import Bucket, configured_buckets, parse_buckets
from mmcli.compiled.graphs import CompiledGraphs
from mmcli.config import load_config
from mmcli.engine.decoding import CompiledDecode, EagerDecode
from mmcli.errors import ConfigError

NAMES = ["astronaut.jpg", "chelsea.jpg", "coffee.jpg", "rocket.jpg"]
SMALL = {
    "image": {"max_pixels": 65536},
    "engine": {"max_seqs": 2, "max_len": 256},
    "vision": {"block_size": 256, "num_blocks_buckets": [1, 2]},
    "compile": {
        "prefill_buckets": [128, 256],
        "decode_batch_buckets": [1, 2],
        "decode_context_buckets": [256],
    },
}


def _images(root, n=4):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        photo(NAMES[i % 4], (96 + 40 * i, 80 + 24 * i)).save(root / f"im{i}.png")
    return root


def _graphs(tmp_path, **key):
    buckets = configured_buckets((1, 2), 256, (128,), (1, 2), (256,))
    base = {"model_config": "m0", "dtype": "float32", "device": "cpu", "kv_cache": [3, 256], **key}
    return CompiledGraphs("inductor", tmp_path / "cache", base, buckets)


def test_configured_buckets_and_lists():
    buckets = configured_buckets((2, 1), 256, (512, 128), (1, 2), (256, 512))
    assert [b.label for b in buckets] == [
        "vision 1x256",
        "vision 2x256",
        "prefill 128",
        "prefill 512",
        "decode 1x256",
        "decode 1x512",
        "decode 2x256",
        "decode 2x512",
    ]
    assert parse_buckets("decode 2x512, prefill:128", buckets) == [
        Bucket("decode", (2, 512)),
        Bucket("prefill", (128,)),
    ]
    with pytest.raises(ConfigError, match="'decode 3x512': not a configured bucket"):
        parse_buckets("decode 3x512", buckets)


def test_cache_dir_is_user_only_and_stale_keys_are_never_loaded(tmp_path, monkeypatch):
    # restored after the test
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))
    graphs = _graphs(tmp_path)
    assert stat.S_IMODE(os.stat(graphs.cache_dir).st_mode) == 0o700
    assert graphs.attach() == graphs.buckets  # nothing compiled yet: every bucket missing
    bucket = graphs.buckets[0]

    def warm(b):  # stands in for a compilation: one artifact file
        artifact = graphs.cache_dir / "inductor" / f"{b.component}-{b.shape}-{time.time_ns()}"
        artifact.parent.mkdir(exist_ok=True)
        artifact.write_text("compiled")
        warmed.append(b)

    warmed = []
    monkeypatch.setattr(
        graphs,
        "_artifacts",
        lambda: {str(p.relative_to(graphs.cache_dir)) for p in graphs.cache_dir.glob("inductor/*")},
    )
    assert graphs.compile_bucket(bucket, warm)[0] == "new"
    assert graphs.compile_bucket(bucket, warm) == ("cached", 0.0) and len(warmed) == 1
    entry = next(iter(graphs.manifest.entries().values()))
    assert entry["key"]["bucket"] == "vision 1x256" and len(entry["artifacts"]) == 1
    assert _graphs(tmp_path).attach() == graphs.buckets[1:]  # a new process sees it compiled

    # changed config (KV cache shape), changed dtype, edited source: detected, not loaded, rebuilt
    for change, field in (
        ({"kv_cache": [5, 256]}, "kv_cache"),
        ({"kv_cache": [5, 256], "dtype": "bfloat16"}, "dtype"),
    ):
        other = _graphs(tmp_path, **change)
        assert bucket in other.attach()
        monkeypatch.setattr(other, "_artifacts", graphs._artifacts)
        assert other.compile_bucket(bucket, warm)[0] == f"rebuilt ({field} changed)"
    monkeypatch.setattr("mmcli.compiled.graphs.source_digest", lambda: "edited")
    edited = _graphs(tmp_path, kv_cache=[5, 256], dtype="bfloat16")
    assert bucket in edited.attach()
    monkeypatch.setattr(edited, "_artifacts", graphs._artifacts)
    assert edited.compile_bucket(bucket, warm)[0] == "rebuilt (source changed)"
    # old artifacts removed
    assert len(warmed) == 4 and len(list(graphs.cache_dir.glob("inductor/*"))) == 1
    # an entry whose artifacts vanished is not loaded either
    for path in graphs.cache_dir.glob("inductor/*"):
        path.unlink()
    assert bucket in _graphs(tmp_path, kv_cache=[5, 256], dtype="bfloat16").attach()


@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5"])
def test_padded_buckets_give_the_eager_tokens(request, family, tmp_path, monkeypatch):
    """Fixed shapes (prefill padded to its bucket, decode batch and context padded, padding rows
    on the scratch row) through the eager fallback: the same greedy tokens as the unpadded
    engine, with 3 in flight (Qwen3.5: the linear layers' states as of each prompt's last real
    token)."""
    tiny_dir = request.getfixturevalue("tiny_dir" if family == "qwen3_vl" else "qwen3_5_dir")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    root = _images(tmp_path / "im", 6)
    items = [(p.name, p) for p in sorted(root.iterdir())]
    base = {
        **SMALL,
        "dtype": "float32",
        "device": "cpu",
        "engine": {"max_seqs": 3, "max_len": 256},
        "generation": {"max_new_tokens": 10},
    }
    eager = Labeler.from_pretrained(str(tiny_dir), config=load_config(None, base))
    expected = {r.key: r.token_ids for r in eager.label(items)}
    padded_cfg = {
        **base,
        "compile": {
            "backend": "inductor",
            "cache_dir": str(tmp_path / "cache"),
            "prefill_buckets": [64, 128, 256],
            "decode_batch_buckets": [1, 4],
            "decode_context_buckets": [64, 256],
        },
    }
    padded = Labeler.from_pretrained(str(tiny_dir), config=load_config(None, padded_cfg))
    # each runner chose its decode step once, at construction
    assert isinstance(eager.runner._decode, EagerDecode)
    assert isinstance(padded.runner._decode, CompiledDecode)
    assert padded.graphs.attach() == padded.graphs.buckets  # nothing compiled: all run eagerly
    assert {r.key: r.token_ids for r in padded.label(items)} == expected
    used = {b.label for b in padded.graphs.missing_used}
    assert {"decode 4x64", "prefill 64", "vision 1x256"} <= used and not padded.graphs.loaded
    # a prompt longer than the largest prefill bucket is refused for its item, the rest goes on
    small = Labeler.from_pretrained(
        str(tiny_dir),
        config=load_config(
            None, {**padded_cfg, "compile": {**padded_cfg["compile"], "prefill_buckets": [64]}}
        ),
    )
    results = {
        r.key: r for r in small.label(items[:2], prompt="Describe " + "this image in detail, " * 6)
    }
    assert all(
        "over the largest compile.prefill_buckets entry 64" in r.error["message"]
        for r in results.values()
    )


def test_neuron_without_the_sdk_is_one_line_exit_2(tiny_dir, tmp_path, monkeypatch):
    root = _images(tmp_path / "im", 1)
    for command in (
        ["caption", str(root), "-o", str(tmp_path / "out.jsonl")],
        ["compile", "--buckets"],
        ["ask", "--image", str(root / "im0.png"), "What?"],
    ):
        result = CliRunner().invoke(
            app, [*command, "--model", str(tiny_dir), "--backend", "neuron"]
        )
        assert result.exit_code == 2, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and "torch-neuronx, neuronx-cc, nki, nki-library" in lines[0]
        assert "pip.repos.neuron.amazonaws.com" in lines[0]
    assert not (tmp_path / "out.jsonl").exists() or not (tmp_path / "out.jsonl").read_text()
    # PyPI's placeholder `nki` (an empty package) is named as such
    monkeypatch.setitem(sys.modules, "nki", type(sys)("nki"))
    from mmcli.compiled.backends import require_neuron

    with pytest.raises(ConfigError, match=r"nki \(the installed one is PyPI's empty placeholder\)"):
        require_neuron()


def _mmcli(*args, cwd):
    started = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "mmcli", *map(str, args)],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, time.perf_counter() - started


@pytest.mark.slow
def test_inductor_compile_ahead_then_load_with_zero_compilations(tiny_dir, tmp_path):
    # one bucket of each kind, which the four images' run fills (padded: its prompts to 128
    # tokens, its last lone sequence to a batch of 2): each bucket's compile takes 15-35 s
    cfg = tmp_path / "cfg.yaml"
    compiled = {"backend": "inductor", "cache_dir": str(tmp_path / "cache")}
    compiled |= {"prefill_buckets": [128], "decode_batch_buckets": [2]}
    vision = {**SMALL["vision"], "num_blocks_buckets": [2]}
    cfg.write_text(
        json.dumps({**SMALL, "vision": vision, "compile": {**SMALL["compile"], **compiled}})
    )
    common = ["--model", tiny_dir, "-c", cfg]
    first, _ = _mmcli("compile", "--buckets", *common, cwd=tmp_path)
    assert first.stdout.count(" new ") == 3
    second, _ = _mmcli("compile", "--buckets", *common, cwd=tmp_path)
    assert second.stdout.count(" cached ") == 3 and " new " not in second.stdout
    # the command's own seconds for its buckets (a process's start would be most of the second)
    first_s, second_s = (float(re.search(r" in ([\d.]+) s", p.stdout)[1]) for p in (first, second))
    print(f"first compile {first_s} s, second {second_s} s ({100 * second_s / first_s:.1f}%)")
    assert second_s <= 0.10 * first_s

    root = _images(tmp_path / "im", 4)
    run, _ = _mmcli(
        "caption",
        root,
        "-o",
        tmp_path / "ind.jsonl",
        "--logprobs",
        "--max-new-tokens",
        "12",
        "-q",
        *common,
        cwd=tmp_path,
    )
    assert "0 compiled in this run; shapes run eagerly: none" in run.stderr, run.stderr
    _mmcli(
        "caption",
        root,
        "-o",
        tmp_path / "eager.jsonl",
        "--logprobs",
        "--max-new-tokens",
        "12",
        "-q",
        "--backend",
        "eager",
        *common,
        cwd=tmp_path,
    )
    compiled, eager = (
        {r["key"]: r for r in map(json.loads, (tmp_path / f).read_text().splitlines())}
        for f in ("ind.jsonl", "eager.jsonl")
    )
    assert len(compiled) == 4 and {k: r["token_ids"] for k, r in compiled.items()} == {
        k: r["token_ids"] for k, r in eager.items()
    }
    for key in eager:
        torch.testing.assert_close(
            torch.tensor(compiled[key]["logprobs"]),
            torch.tensor(eager[key]["logprobs"]),
            atol=1e-4,
            rtol=0,
        )

    # a changed dtype: that bucket is rebuilt; a run under the old dtype no longer loads it, and
    # says so
    rebuilt, _ = _mmcli(
        "compile", "--buckets", "prefill 128", "--dtype", "bfloat16", *common, cwd=tmp_path
    )
    assert "rebuilt (dtype changed)" in rebuilt.stdout, rebuilt.stdout
    again, _ = _mmcli(
        "caption",
        root,
        "-o",
        tmp_path / "again.jsonl",
        "--max-new-tokens",
        "4",
        "-q",
        *common,
        cwd=tmp_path,
    )
    assert "1 of 3 buckets not compiled ahead (prefill 128)" in again.stderr, again.stderr
    assert "0 compiled in this run" in again.stderr


@pytest.mark.slow
def test_an_moe_checkpoint_compiles_its_buckets_and_runs_them_as_eager(moe_dir, tmp_path):
    """The experts' grouping is a custom op inside the fixed-shape graphs: a decode graph
    compiled ahead, loaded with nothing compiled in the run, gives the eager run's tokens."""
    cfg = tmp_path / "cfg.yaml"
    compiled = {"backend": "inductor", "cache_dir": str(tmp_path / "cache")}
    compiled |= {"prefill_buckets": [256], "decode_batch_buckets": [2]}
    cfg.write_text(json.dumps({**SMALL, "compile": {**SMALL["compile"], **compiled}}))
    common = ["--model", moe_dir, "-c", cfg]
    first, _ = _mmcli("compile", "--buckets", "decode 2x256", *common, cwd=tmp_path)
    assert first.stdout.count(" new ") == 1, first.stdout
    root = _images(tmp_path / "im", 3)
    records, said = {}, {}
    for backend in ("inductor", "eager"):
        out = tmp_path / f"{backend}.jsonl"
        flags = ["--max-new-tokens", "8", "--logprobs", "-q", "--backend", backend]
        run, _ = _mmcli("caption", root, "-o", out, *flags, *common, cwd=tmp_path)
        said[backend] = run.stderr
        records[backend] = {
            r["key"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())
        }
    assert "0 compiled in this run" in said["inductor"], said
    assert "decode" not in said["inductor"].split("shapes run eagerly:")[1], said
    assert len(records["eager"]) == 3 and records["inductor"] == records["eager"]


def test_cuda_graphs_use_the_configured_decode_buckets_clipped_to_the_engine():
    from mmcli.compiled.cuda_graphs import DecodeGraphs
    from mmcli.engine.runner import _covering

    cfg = load_config(None, {"engine": {"max_seqs": 6, "max_len": 2048}})
    batch = _covering(sorted(cfg.compile.decode_batch_buckets), cfg.engine.max_seqs)
    context = _covering(sorted(cfg.compile.decode_context_buckets), cfg.engine.max_len)
    assert batch == [1, 2, 4, 6] and context == [512, 1024, 2048]
    assert _covering([1, 2, 4, 8], 64) == [1, 2, 4, 8, 64]  # the engine's largest batch too
    graphs = DecodeGraphs(None, None, 6, 128, batch, context)  # nothing is captured before use
    assert graphs.fits(6, 2048) and not graphs.fits(7, 10) and not graphs.fits(1, 2049)


def test_the_compile_digest_covers_every_module_a_graph_runs(tmp_path, monkeypatch):
    import mmcli.compiled.graphs as compiled
    from mmcli.compiled.graphs import Bucket, CompiledGraphs

    assert {
        "compiled/steps.py",
        "models/layers/linear.py",
        "models/qwen3_vl/text.py",
        "models/qwen3_vl/vision.py",
        "models/layers/attention.py",
        "models/qwen3_5/gated_delta_net.py",
        "kernels/attention.py",
    } <= set(compiled.compiled_sources(compiled.PACKAGE_ROOT))
    copy = Path(shutil.copytree(compiled.PACKAGE_ROOT, tmp_path / "pkg"))
    graphs = CompiledGraphs(
        "inductor",
        tmp_path / "cache",
        {"model_config": "m", "device": "cpu"},
        [Bucket("decode", (1, 64))],
    )
    artifact = graphs.cache_dir / "a"
    monkeypatch.setattr(graphs, "_artifacts", lambda: {"a"} if artifact.exists() else set())
    assert graphs.compile_bucket(graphs.buckets[0], lambda b: artifact.write_text("x"))[0] == "new"
    package_root = compiled.PACKAGE_ROOT
    for edited in ("models/layers/linear.py", "compiled/steps.py"):
        target = copy / edited
        target.write_text(target.read_text() + "\n# edited\n")
        monkeypatch.setattr(compiled, "PACKAGE_ROOT", copy)
        assert graphs.status(graphs.buckets[0], graphs.manifest.entries()) == ("stale", ["source"])
        monkeypatch.setattr(compiled, "PACKAGE_ROOT", package_root)
        shutil.copy(package_root / edited, target)
