import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from mmcli.api.labeler import Labeler
from mmcli.cli.app import app
from mmcli.errors import CheckpointError
from mmcli.models.registry import parse_config
from mmcli.testing import make_tiny_checkpoint, tiny_config
from mmcli.weights.checkpoint import load_weights, read_model_config
from mmcli.weights.hub import read_ahead


def test_both_rope_config_forms_parse_the_same():
    a = parse_config(tiny_config("base", "rope_scaling"))
    b = parse_config(tiny_config("base", "rope_parameters"))
    assert a.text == b.text and a.text.mrope_section == (24, 20, 20) and a.text.rope_theta == 5e6


@pytest.mark.parametrize(
    "saved,loaded", [("bfloat16", "float32"), ("float32", "bfloat16"), ("float16", "float16")]
)
def test_dtypes(tmp_path, saved, loaded):
    path = make_tiny_checkpoint(tmp_path / "m", dtype=saved)
    cap = Labeler.from_pretrained(str(path), dtype=loaded, device="cpu")
    embed = cap.model.language_model.embed_tokens.weight
    assert cap.runner.dtype == embed.dtype == getattr(torch, loaded)
    x = torch.randn(3, embed.shape[1], dtype=embed.dtype)
    with torch.inference_mode():  # tied (on the CPU in float32 the lm_head holds a packed copy)
        torch.testing.assert_close(cap.model.lm_head(x), x @ embed.t())
    result = cap.ask([], "Hello there", max_new_tokens=4)
    assert result.ok and 1 <= result.num_output_tokens <= 4


def _edit_weights(path, edit):
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.mark.parametrize(
    "edit,message",
    [
        (
            lambda t: t.pop("model.visual.blocks.0.attn.qkv.bias"),
            "missing tensors: model.visual.blocks.0.attn.qkv.bias",
        ),
        (
            lambda t: t.__setitem__("model.extra.weight", torch.zeros(2)),
            "unexpected tensors: model.extra.weight",
        ),
        (
            lambda t: t.__setitem__("model.language_model.norm.weight", torch.zeros(7)),
            "wrong shapes: model.language_model.norm.weight (7,) != (64,)",
        ),
    ],
)
def test_bad_weights_name_the_tensors(tmp_path, tiny_dir, edit, message):
    path = tmp_path / "m"
    shutil.copytree(tiny_dir, path)
    _edit_weights(path, edit)
    with pytest.raises(CheckpointError) as e:
        load_weights(path, read_model_config(path), torch.float32)
    assert message in str(e.value) and "\n" not in str(e.value)
    result = CliRunner().invoke(
        app, ["ask", "--model", str(path), "--image", "samples/coffee.jpg", "q"]
    )
    assert result.exit_code == 3 and message in result.output


def test_other_architecture_is_refused(tmp_path, tiny_dir):
    path = tmp_path / "m"
    shutil.copytree(tiny_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type="qwen2_5_vl", architectures=["Qwen2_5_VLForConditionalGeneration"])
    (path / "config.json").write_text(json.dumps(cfg))
    result = CliRunner().invoke(
        app, ["ask", "--model", str(path), "--image", "samples/coffee.jpg", "q"]
    )
    assert result.exit_code == 2
    assert (
        "model_type 'qwen2_5_vl' (Qwen2_5_VLForConditionalGeneration) is not a family mmcli "
        "runs: qwen3_vl (Qwen3-VL), qwen3_5 (Qwen3.5)" in result.output
    )
    assert len(result.output.strip().splitlines()) == 1


def test_unreachable_hub_says_how_to_pass_a_local_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    result = CliRunner().invoke(
        app, ["ask", "--model", "Qwen/Qwen3-VL-2B-Instruct", "--image", "samples/coffee.jpg", "q"]
    )
    assert result.exit_code == 3
    assert "pass the local directory with --model /path/to/checkpoint" in result.output
    assert len(result.output.strip().splitlines()) == 1


def test_read_ahead_asks_for_every_weight_file_and_can_be_turned_off(tiny_dir, monkeypatch):
    expected = sum(f.stat().st_size for f in tiny_dir.glob("*.safetensors"))
    assert read_ahead(str(tiny_dir)) == expected > 0
    assert read_ahead("no/such-model-here") == 0  # not downloaded: nothing to read ahead
    monkeypatch.setenv("MMCLI_READ_AHEAD", "0")
    assert read_ahead(str(tiny_dir)) == 0
