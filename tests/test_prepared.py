"""Prepared int8 and int4 weights: written by the first run, read back by later ones; a damaged,
truncated or stale file, a run killed while writing, or two runs at once, never give wrong
weights."""

import json
import os
import subprocess
import sys
import threading

import pytest
import torch
from conftest import MOE_VARIANTS, photo, prefill_logits
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from mmcli.api.labeler import Labeler
from mmcli.cli.app import app
from mmcli.config import load_config
from mmcli.kernels.plan import INT4_BLOCKS
from mmcli.models.layers.quantized import Int4Linear, can_int4
from mmcli.weights import checkpoint
from mmcli.weights import int4 as int4_module
from mmcli.weights import prepared as prepared_module

needs_int4 = pytest.mark.skipif(not can_int4(), reason="no int4 CPU kernels in this torch")


def _int8(path, cache, **settings):
    settings = {"device": "cpu", "quantize": "int8", "cache_dir": str(cache), **settings}
    labeler = Labeler.from_pretrained(str(path), config=load_config(None, settings))
    labeler.prepared_weights_report()  # the file it writes whole before the test looks
    return labeler


def _logits(labeler):
    req, _ = labeler.request(
        "k", [photo("chelsea.jpg")], "Describe this image.", labeler.sampling()
    )
    return prefill_logits(labeler, req)


def _files(cache):
    return sorted((cache / "weights").iterdir()) if (cache / "weights").is_dir() else []


def test_the_second_run_reads_what_the_first_prepared(tiny_dir, tmp_path):
    first = _int8(tiny_dir, tmp_path)
    assert "prepared weights being written to" in first.kernels
    (written,) = _files(tmp_path)
    assert first.prepared_weights_report() == f"prepared weights written to {written}"
    second = _int8(tiny_dir, tmp_path)
    assert f"prepared weights read from {written}" in second.kernels
    assert torch.equal(_logits(first), _logits(second))  # the same int8 weights, bit for bit
    uncached = _int8(tiny_dir, tmp_path / "none", weights_cache=False)
    assert "prepared" not in uncached.kernels and not _files(tmp_path / "none")
    assert torch.equal(_logits(first), _logits(uncached))


def _flip_last_byte(file):
    data = bytearray(file.read_bytes())
    data[-1] ^= 0x5A
    file.write_bytes(bytes(data))


def _truncate(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def test_the_checksum_is_the_files_whatever_the_threads_and_sees_any_flipped_byte(monkeypatch):
    """The writer checks on one thread, a read on the run's: both must agree, piece by piece."""
    monkeypatch.setattr(prepared_module, "CHECKSUM_PIECE", 1000)
    torch.manual_seed(0)
    tensors = {
        "a.values": torch.randint(-127, 128, (37, 101), dtype=torch.int8),  # 4 pieces
        "a.scale": torch.rand(37),
        "b.empty": torch.zeros(0),
    }
    once = prepared_module._checksum(tensors)
    assert prepared_module._checksum(tensors, threads=3) == once
    for name, at in (("a.values", 0), ("a.values", 2500), ("a.scale", 36)):
        spoiled = {k: v.clone() for k, v in tensors.items()}
        spoiled[name].view(torch.uint8).view(-1)[at] ^= 1
        assert prepared_module._checksum(spoiled, threads=2) != once


@pytest.mark.parametrize(
    "spoil, said",
    [
        (_flip_last_byte, "damaged (its values do not match their CRC-32)"),
        (_truncate, "unreadable"),
        ("torch", "written under another torch version"),
        ("code", "written under another mmcli quantization code"),
    ],
)
def test_a_damaged_truncated_or_stale_file_is_said_and_prepared_again(
    tiny_dir, tmp_path, monkeypatch, capsys, spoil, said
):
    # another torch version is another machine key: the kernels, not only the file, kept alike
    monkeypatch.setenv("MMCLI_CPU_PREFER", "ours")
    reference = _logits(_int8(tiny_dir, tmp_path))
    (file,) = _files(tmp_path)
    if spoil == "torch":
        monkeypatch.setattr(prepared_module.torch, "__version__", "0.0.0")
    elif spoil == "code":
        monkeypatch.setattr(prepared_module, "code_digest", lambda recipe: "edited")
    else:
        spoil(file)
    capsys.readouterr()
    again = _int8(tiny_dir, tmp_path)
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"mmcli: prepared weights {file}: {lines[0].split(': ', 2)[2]}"]
    assert said in lines[0] and "preparing again" in lines[0]
    assert "prepared weights written to" in again.prepared_weights_report()
    assert torch.equal(_logits(again), reference)
    assert "read from" in _int8(tiny_dir, tmp_path).kernels  # whole again


def test_a_file_of_another_models_linears_is_not_used(tiny_dir, variant_dirs, tmp_path):
    _int8(tiny_dir, tmp_path)
    (file,) = _files(tmp_path)
    other = prepared_module.PreparedWeights(tmp_path, variant_dirs["wide_attn"])
    other.file.parent.mkdir(parents=True, exist_ok=True)
    other.file.write_bytes(file.read_bytes())  # this model's key, another model's tensors
    labeler = _int8(variant_dirs["wide_attn"], tmp_path)
    assert "prepared weights written to" in labeler.prepared_weights_report()


def test_a_file_missing_a_part_or_of_another_dtype_is_not_used(tiny_dir, tmp_path, capsys):
    """Whole, with this key and a CRC that matches, but one layer's sums gone, or its scales
    in float64: said, and prepared again."""
    _int8(tiny_dir, tmp_path)
    (file,) = _files(tmp_path)
    with safe_open(str(file), framework="pt") as f:
        metadata, tensors = f.metadata(), {name: f.get_tensor(name) for name in f.keys()}
    sums = next(name for name in tensors if name.endswith(".sums"))
    scale = next(name for name in tensors if name.endswith(".scale"))
    without_sums = {k: v for k, v in tensors.items() if k != sums}
    for broken in (without_sums, {**tensors, scale: tensors[scale].double()}):
        metadata["crc32"] = prepared_module._checksum(broken)
        save_file(broken, str(file), metadata=metadata)
        labeler = _int8(tiny_dir, tmp_path)
        assert "not this model's linears; preparing again" in capsys.readouterr().err
        assert "prepared weights written to" in labeler.prepared_weights_report()


def test_a_cache_that_cannot_be_written_leaves_the_run_going(tiny_dir, tmp_path, capsys):
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "weights").write_text("a file where the directory would be")
    labeler = _int8(tiny_dir, cache)
    assert "prepared weights not written" in labeler.prepared_weights_report()
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "prepared weights not written" in line and "the next run prepares them" in line
    assert labeler.ask([photo("coffee.jpg")], "What?", max_new_tokens=3).token_ids


def test_the_run_answers_while_the_file_is_written(tiny_dir, tmp_path, monkeypatch):
    """The write (bound by the disk) is a thread's: the load returns and the run answers while
    it is held back; the report waits for it, and then the file is whole."""
    release = threading.Event()

    def held_back(*args, **kwargs):
        assert release.wait(120)
        save_file(*args, **kwargs)

    monkeypatch.setattr(prepared_module, "save_file", held_back)
    settings = {"device": "cpu", "quantize": "int8", "cache_dir": str(tmp_path)}
    labeler = Labeler.from_pretrained(str(tiny_dir), config=load_config(None, settings))
    assert "prepared weights being written to" in labeler.kernels
    assert labeler.ask([photo("coffee.jpg")], "What?", max_new_tokens=3).token_ids
    assert not _files(tmp_path)
    release.set()
    report = labeler.prepared_weights_report()
    (file,) = _files(tmp_path)
    assert report == f"prepared weights written to {file}"
    assert "read from" in _int8(tiny_dir, tmp_path).kernels


def test_two_runs_at_once_each_write_a_whole_file(tiny_dir, tmp_path):
    code = (
        "import sys; from mmcli.api.labeler import Labeler; from mmcli.config import load_config; "
        "s = {'device': 'cpu', 'quantize': 'int8', 'cache_dir': sys.argv[2]}; "
        "print(Labeler.from_pretrained(sys.argv[1], config=load_config(None, s)).kernels)"
    )
    command = [sys.executable, "-c", code, str(tiny_dir), str(tmp_path)]
    runs = [subprocess.Popen(command, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    said = [run.communicate(timeout=300)[0] for run in runs]
    assert all(run.returncode == 0 for run in runs), said
    # both prepared and wrote, or the later one read what the first had renamed into place
    assert (
        all("written to" in s or "read from" in s for s in said)
        and "written to" in said[0] + said[1]
    )
    (file,) = _files(tmp_path)  # no partial file left
    assert "read from" in _int8(tiny_dir, tmp_path).kernels


def test_no_cache_on_the_command_line(tiny_dir, tmp_path):
    settings = tmp_path / "s.yaml"
    settings.write_text(json.dumps({"cache_dir": str(tmp_path / "cache")}))
    image = tmp_path / "a.png"
    photo("coffee.jpg").save(image)
    ask = ["ask", "-i", str(image), "q", "--model", str(tiny_dir), "--quantize", "int8"]
    ask += ["-c", str(settings), "--max-new-tokens", "2"]
    result = CliRunner().invoke(app, [*ask, "--no-cache"])
    assert result.exit_code == 0, result.output
    assert not _files(tmp_path / "cache")
    assert CliRunner().invoke(app, ask).exit_code == 0 and len(_files(tmp_path / "cache")) == 1


def test_compile_buckets_warms_the_int8_weights_on_the_eager_backend(tiny_dir, tmp_path):
    settings = tmp_path / "s.yaml"
    settings.write_text(json.dumps({"cache_dir": str(tmp_path / "cache")}))
    command = ["compile", "--buckets", "--model", str(tiny_dir), "-c", str(settings)]
    result = CliRunner().invoke(app, [*command, "--quantize", "int8"])
    output = " ".join(result.output.split())  # Rich wraps the line
    assert result.exit_code == 0 and "prepared weights written to" in output, output
    assert len(_files(tmp_path / "cache")) == 1
    again = CliRunner().invoke(app, [*command, "--quantize", "int8"])
    assert "prepared weights read from" in " ".join(again.output.split())
    # without int8 the eager backend still has nothing to warm
    assert CliRunner().invoke(app, command).exit_code == 2


# int4: the 4-bit weights a load quantized as it read, read back instead of quantized again


def _int4(path, cache, **settings):
    return _int8(path, cache, quantize="int4", **settings)


@needs_int4
@pytest.mark.parametrize("variant", ["dense", *MOE_VARIANTS])
def test_an_int4_load_reads_its_4bit_weights_instead_of_quantizing(
    tiny_dir, moe_dirs, tmp_path, monkeypatch, variant
):
    path = tiny_dir if variant == "dense" else moe_dirs[variant]
    first = _int4(path, tmp_path)
    written, vision = _int4_files(tmp_path, path)
    assert _files(tmp_path) == sorted([written, vision])  # the int8 layers in a file of their own
    assert first.prepared_weights_report() == (
        f"prepared weights written to {written}; "
        f"its int8 layers' prepared weights written to {vision}"
    )
    read = []
    monkeypatch.setattr(int4_module, "quantize_int4", None)  # never called again
    real = checkpoint._read_file
    monkeypatch.setattr(
        checkpoint,
        "_read_file",
        lambda f, keep, unused: real(f, keep, read.append(unused) or unused),
    )
    second = _int4(path, tmp_path)
    assert (
        f"prepared weights read from {written}; its int8 layers' prepared weights read from "
        f"{vision}" in second.kernels
    )
    covered = checkpoint.int4_shapes(second.model.cfg)
    names = _checkpoint_names(path)
    int4_names = [name for name in names if covered.covers(name)]
    assert int4_names and all(read[0](name) for name in int4_names)  # left unread
    assert not any(read[0](name) for name in names if name not in int4_names)


@needs_int4
def test_int4_from_the_file_computes_as_quantized(moe_dirs, tmp_path):
    path = moe_dirs["qwen3_vl_moe"]
    first, second = _int4(path, tmp_path), _int4(path, tmp_path)
    assert "read from" in second.kernels
    assert torch.equal(_logits(first), _logits(second))  # the same 4-bit weights, bit for bit
    # the file holds torch's layout; the loader puts the weights as the plan's kernels read them
    blocks = second.kernel_plan.int4.form == INT4_BLOCKS
    layouts = {m.weight.layout for m in second.model.modules() if isinstance(m, Int4Linear)}
    assert layouts == {"blocks" if blocks else "torch"}
    uncached = _int4(path, tmp_path / "none", weights_cache=False)
    assert "prepared" not in uncached.kernels and not _files(tmp_path / "none")
    assert torch.equal(_logits(first), _logits(uncached))


@needs_int4
def test_int4_weights_packed_for_another_kernel_are_prepared_again(
    tiny_dir, tmp_path, monkeypatch, capsys
):
    """torch packs int4 for the kernel it dispatches to (AVX-512 or AVX2): a file says which,
    and one of the other layout is not read."""
    _int4(tiny_dir, tmp_path)
    written, _ = _int4_files(tmp_path, tiny_dir)
    here = prepared_module.int4_block()
    monkeypatch.setattr(prepared_module, "int4_block", lambda: 32 if here == 64 else 64)
    capsys.readouterr()
    again = _int4(tiny_dir, tmp_path)
    said = capsys.readouterr().err
    assert f"prepared weights {written}: written under another int4 layout" in said
    assert "prepared weights written to" in again.prepared_weights_report()


def _int4_files(cache, checkpoint):
    """An int4 run's prepared files: its 4-bit weights' and its int8 layers' (the vision tower,
    a tied lm_head)."""
    recipes = (prepared_module.INT4, prepared_module.INT4_INT8)
    return (prepared_module.PreparedWeights(cache, checkpoint, recipe=r).file for r in recipes)


def _checkpoint_names(path):
    names = []
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            names += list(f.keys())
    return names


@needs_int4
def test_int4_and_int8_files_are_keyed_apart_and_by_the_checkpoint(tiny_dir, tmp_path):
    int8 = prepared_module.PreparedWeights(tmp_path, tiny_dir)
    int4 = prepared_module.PreparedWeights(tmp_path, tiny_dir, recipe=prepared_module.INT4)
    assert int8.file != int4.file and int4.key["recipe"].startswith("int4:")
    again = prepared_module.PreparedWeights(tmp_path, tiny_dir, recipe=prepared_module.INT4)
    assert again.file == int4.file
    other = prepared_module.PreparedWeights(
        tmp_path, tiny_dir, b'{"another": "config"}', recipe=prepared_module.INT4
    )
    assert other.file != int4.file


@needs_int4
def test_a_damaged_or_another_models_int4_file_is_said_and_prepared_again(
    moe_dirs, tmp_path, capsys
):
    path = moe_dirs["qwen3_5_moe"]
    reference = _logits(_int4(path, tmp_path))
    file, _ = _int4_files(tmp_path, path)
    _flip_last_byte(file)
    labeler = _int4(path, tmp_path)
    assert "damaged (its values do not match their CRC-32)" in capsys.readouterr().err
    assert torch.equal(_logits(labeler), reference)
    other = moe_dirs["qwen3_vl_moe"]
    shapes = checkpoint.int4_shapes(_int4(other, tmp_path / "other").model.cfg)
    with safe_open(str(file), framework="pt") as f:
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    assert int4_module.from_tensors(tensors, shapes) is None  # not that model's weights


def test_a_partial_file_of_a_killed_run_is_removed_once_stale(tmp_path):
    file = tmp_path / "weights" / "x.safetensors"
    file.parent.mkdir()
    stale, fresh = (file.with_name(f"{file.name}.{pid}.ab.partial") for pid in (1, 2))
    for partial in (stale, fresh):
        partial.write_bytes(b"half a file")
    old = stale.stat().st_mtime - prepared_module.STALE_SECONDS - 1
    os.utime(stale, (old, old))
    assert prepared_module.remove_stale(file) == [stale]
    assert not stale.exists() and fresh.exists()


@needs_int4
def test_a_run_killed_while_writing_int4_leaves_the_next_run_whole(tiny_dir, tmp_path):
    """A run killed mid-write leaves a partial file, never the file: the next run prepares and
    writes again, and removes the partial once it is stale."""
    _int4(tiny_dir, tmp_path)
    file, vision = _int4_files(tmp_path, tiny_dir)
    partial = file.with_name(f"{file.name}.999.dead.partial")
    partial.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    file.unlink()
    old = partial.stat().st_mtime - prepared_module.STALE_SECONDS - 1
    os.utime(partial, (old, old))
    labeler = _int4(tiny_dir, tmp_path)
    vision_read = f"its int8 layers' prepared weights read from {vision}"
    assert labeler.prepared_weights_report() == f"prepared weights written to {file}; {vision_read}"
    assert _files(tmp_path) == sorted([file, vision])


@needs_int4
def test_compile_buckets_warms_the_int4_weights_and_no_cache_refuses(tiny_dir, tmp_path):
    settings = tmp_path / "s.yaml"
    settings.write_text(json.dumps({"cache_dir": str(tmp_path / "cache")}))
    command = ["compile", "--buckets", "--model", str(tiny_dir), "-c", str(settings)]
    result = CliRunner().invoke(app, [*command, "--quantize", "int4"])
    assert "prepared weights written to" in " ".join(result.output.split()), result.output
    refused = CliRunner().invoke(app, [*command, "--quantize", "int4", "--no-cache"])
    assert refused.exit_code == 2 and "prepares the int4 weights" in refused.output
