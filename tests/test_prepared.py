"""Prepared int8 weights: written by the first run, read back by later ones; a damaged,
truncated or stale file, or two runs at once, never give wrong weights."""

import json
import subprocess
import sys
import threading

import pytest
import torch
from conftest import photo, prefill_logits
from safetensors import safe_open
from safetensors.torch import save_file
from typer.testing import CliRunner

from mmcli.api.labeler import Labeler
from mmcli.cli.app import app
from mmcli.config import load_config
from mmcli.weights import prepared as prepared_module


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
        monkeypatch.setattr(prepared_module, "code_digest", lambda: "edited")
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
