"""Qwen3.5 checkpoints through the commands (ask, caption with tasks, plan), thinking mode, and
the checks on its checkpoints."""

import json
import shutil

import jsonschema
import pytest
import torch
from conftest import SAMPLES, hf_processor, prefill_logits, read_records
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from mmcli.api.labeler import Labeler
from mmcli.cli.app import app
from mmcli.config import load_config
from mmcli.engine.grammar import AfterReasoning
from mmcli.models.layers.quantized import Int8Linear
from mmcli.testing import EXAMPLE_SCHEMA
from mmcli.weights.int8 import fold_norm


def _images(root, n=3):
    root.mkdir()
    for name in ["chelsea.jpg", "coffee.jpg", "rocket.jpg"][:n]:
        shutil.copy(SAMPLES / name, root / name)
    return root


def test_ask_and_caption_with_tasks_run_a_qwen3_5_checkpoint(qwen3_5_dir, tmp_path):
    out = tmp_path / "ask.jsonl"
    args = ["--model", str(qwen3_5_dir), "--max-new-tokens", "8"]
    result = CliRunner().invoke(
        app, ["ask", *args, "--image", str(SAMPLES / "chelsea.jpg"), "-o", str(out), "What?"]
    )
    assert result.exit_code == 0, result.output
    (record,) = read_records(out)
    assert result.stdout == record["text"] + "\n" and "reasoning" not in record
    settings = tmp_path / "tasks.yaml"
    fields = {"prompt": "Fill.", "output": "json", "schema": EXAMPLE_SCHEMA, "max_new_tokens": 120}
    settings.write_text(
        json.dumps({"generation": {"max_new_tokens": 8}, "tasks": {"fields": fields}})
    )
    labels = tmp_path / "labels.jsonl"
    command = ["caption", str(_images(tmp_path / "im")), "-o", str(labels), "-c", str(settings)]
    command += ["--task", "caption", "--task", "tags", "--task", "fields"]
    command += ["--model", str(qwen3_5_dir)]
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 0, result.output
    assert "delta_rule PyTorch" in result.output  # the load line names the delta rule's kernel
    records = read_records(labels)
    assert len(records) == 9 and all(r["status"] == "ok" for r in records)
    for r in records:
        if r["task"] == "fields":
            jsonschema.validate(r["json"], EXAMPLE_SCHEMA)


def test_a_family_mmcli_does_not_run_and_a_missing_tensor_are_one_line(qwen3_5_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(qwen3_5_dir, broken)
    tensors = load_file(str(broken / "model.safetensors"))
    gone = "model.language_model.layers.1.linear_attn.A_log"
    del tensors[gone]
    save_file(tensors, str(broken / "model.safetensors"))
    ask = ["ask", "--image", str(SAMPLES / "coffee.jpg"), "q"]
    result = CliRunner().invoke(app, [*ask, "--model", str(broken)])
    assert result.exit_code == 3 and f"missing tensors: {gone}" in result.output
    config = json.loads((broken / "config.json").read_text())
    config["model_type"] = "qwen2_5_vl"
    (broken / "config.json").write_text(json.dumps(config))
    result = CliRunner().invoke(app, [*ask, "--model", str(broken)])
    assert result.exit_code == 2 and len(result.output.strip().splitlines()) == 1
    assert (
        "model_type 'qwen2_5_vl'" in result.output and "qwen3_5_moe (Qwen3.5 MoE)" in result.output
    )


def test_the_thinking_prompt_is_the_references(qwen3_5_dir):
    processor = hf_processor(qwen3_5_dir)
    for thinking in (False, True):
        labeler_prompts = Labeler.from_pretrained(
            str(qwen3_5_dir), config=load_config(None, {"device": "cpu", "thinking": thinking})
        ).prompts
        ours = labeler_prompts.render("Describe.", ["image"])
        content = [{"type": "image"}, {"type": "text", "text": "Describe."}]
        reference = processor.apply_chat_template(
            [{"role": "user", "content": content}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=thinking,
        )
        assert ours == reference
        assert ours.endswith("<think>\n" if thinking else "<think>\n\n</think>\n\n")


@pytest.fixture(scope="module")
def thinker(qwen3_5_dir, tmp_path_factory):
    """A copy whose output head makes </think> likely after a few tokens: its embedding row is
    the mean of the others plus a push, so the reasoning is short but not empty."""
    path = tmp_path_factory.mktemp("thinker") / "m"
    shutil.copytree(qwen3_5_dir, path)
    tensors = load_file(str(path / "model.safetensors"))
    vocab = json.loads((path / "tokenizer.json").read_text())
    end = next(t["id"] for t in vocab["added_tokens"] if t["content"] == "</think>")
    head = (
        "lm_head.weight"
        if "lm_head.weight" in tensors
        else ("model.language_model.embed_tokens.weight")
    )
    weight = tensors[head]
    weight[end] = weight.mean(0) + 3.0 * weight.std(0) * torch.sign(weight.mean(0) + 1e-3)
    save_file(tensors, str(path / "model.safetensors"))
    return path, end


def test_thinking_keeps_the_reasoning_apart_and_sidecars_get_the_answer(thinker, tmp_path):
    path, end = thinker
    labels = tmp_path / "labels.jsonl"
    command = [
        "caption",
        str(_images(tmp_path / "im")),
        "-o",
        str(labels),
        "--model",
        str(path),
        "--thinking",
        "--max-new-tokens",
        "40",
        "--sidecar",
        ".txt",
    ]
    result = CliRunner().invoke(app, command)
    records = read_records(labels)
    answered = [r for r in records if r["status"] == "ok"]
    assert answered, result.output
    for r in answered:
        assert "</think>" not in r["reasoning"]  # the reasoning ends at the first one
        sidecar = (tmp_path / "im" / r["key"]).with_suffix(".txt")
        assert sidecar.read_text() == r["text"] + "\n"
    labeler = Labeler.from_pretrained(
        str(path), config=load_config(None, {"device": "cpu", "thinking": True})
    )
    (one,) = labeler.label([("cat", SAMPLES / "chelsea.jpg")], max_new_tokens=40)
    reasoning, answer, ended = labeler.prompts.split_reasoning(one.token_ids)
    assert ended and end in one.token_ids and (one.reasoning, one.text) == (reasoning, answer)
    pieces = []  # `ask` streams the answer alone
    asked = labeler.ask([SAMPLES / "chelsea.jpg"], "Describe.", pieces.append, max_new_tokens=40)
    assert asked.ok and asked.reasoning and "".join(pieces) == asked.text


def test_a_json_task_is_constrained_after_the_reasoning(thinker, tmp_path):
    path, end = thinker
    config = load_config(
        None,
        {
            "device": "cpu",
            "thinking": True,
            "tasks": {
                "fields": {
                    "prompt": "Fill.",
                    "output": "json",
                    "schema": EXAMPLE_SCHEMA,
                    "max_new_tokens": 120,
                }
            },
        },
    )
    labeler = Labeler.from_pretrained(str(path), config=config)
    (grammar,) = labeler.grammars(labeler.tasks(["fields"])).values()
    assert isinstance(grammar.start(), AfterReasoning)
    (result,) = labeler.label([("cat", SAMPLES / "chelsea.jpg")], tasks=["fields"])
    assert result.ok, result.error
    cut = result.token_ids.index(end)
    assert cut > 0  # it reasoned, unconstrained, before the answer
    jsonschema.validate(result.fields["json"], EXAMPLE_SCHEMA)


def test_thinking_needs_a_tokenizer_that_reasons(tiny_dir):
    result = CliRunner().invoke(
        app,
        [
            "ask",
            "--model",
            str(tiny_dir),
            "--image",
            str(SAMPLES / "coffee.jpg"),
            "--thinking",
            "q",
        ],
    )
    assert result.exit_code == 2 and "has no </think> token" in result.output


def _image_logits(labeler):
    req, _ = labeler.request("k", [SAMPLES / "chelsea.jpg"], "Describe.", labeler.sampling())
    return prefill_logits(labeler, req)


def test_folding_norms_that_scale_by_one_plus_weight_is_exact(qwen3_5_dir, vector_units):
    labeler = Labeler.from_pretrained(
        str(qwen3_5_dir), config=load_config(None, {"device": "cpu", "weights_dtype": "bfloat16"})
    )
    before = _image_logits(labeler)
    for layer in labeler.model.language_model.layers:
        fold_norm(*layer.fold_groups()[0])
        fold_norm(layer.post_attention_layernorm, [layer.mlp.gate_proj, layer.mlp.up_proj])
        assert not layer.input_layernorm.weight.any()  # now scaling by exactly 1
    torch.testing.assert_close(_image_logits(labeler), before, atol=1e-4, rtol=0)


def test_int8_runs_the_hybrid_layers_close_to_float32(qwen3_5_dir):
    reference = _image_logits(
        Labeler.from_pretrained(str(qwen3_5_dir), dtype="float32", device="cpu")
    )
    int8 = Labeler.from_pretrained(
        str(qwen3_5_dir), config=load_config(None, {"device": "cpu", "quantize": "int8"})
    )
    assert int8.precision.weights == "int8"
    linear = int8.model.language_model.layers[0].linear_attn
    assert isinstance(linear.in_proj_qkv, Int8Linear) and isinstance(linear.out_proj, Int8Linear)
    error = (_image_logits(int8) - reference).norm() / reference.norm()
    # one activation scale per call instead of per token: what the per-token scales buy
    naive = Labeler.from_pretrained(
        str(qwen3_5_dir), config=load_config(None, {"device": "cpu", "quantize": "int8"})
    )
    for layer in naive.model.modules():
        if isinstance(layer, Int8Linear):
            layer.per_token = False
    naive_error = (_image_logits(naive) - reference).norm() / reference.norm()
    print(
        f"int8 relative L2 error of the prefill logits: {error:.3f} (one scale a call: "
        f"{naive_error:.3f})"
    )
    # Wider than Qwen3-VL's 0.12: Gated DeltaNet's RMSNorm magnifies the rounding of a random
    # model's small delta-rule outputs (tests/test_qwen3_5.py), int8's included.
    assert error < 0.35 and error < naive_error


def test_serve_thinks_when_a_request_asks_and_keeps_the_reasoning_apart(thinker):
    """Off by default; on with chat_template_kwargs.enable_thinking, the reasoning in
    message.reasoning_content apart from the answer, as a --thinking run of ask gives them."""
    openai = pytest.importorskip("openai")
    from mmcli.serve.service import EngineService
    from mmcli.testing import live_server

    path, _ = thinker
    labeler = Labeler.from_pretrained(str(path), config=load_config(None, {"device": "cpu"}))
    thinking = Labeler.from_pretrained(
        str(path), config=load_config(None, {"device": "cpu", "thinking": True})
    )
    expected = thinking.ask([], "Describe a cat.", max_new_tokens=40)
    service = EngineService(labeler).start()
    try:
        with live_server(labeler, service, model="q") as url:
            client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
            messages = [{"role": "user", "content": "Describe a cat."}]
            plain = client.chat.completions.create(model="q", messages=messages, max_tokens=40)
            reasoned = client.chat.completions.create(
                model="q",
                messages=messages,
                max_tokens=40,
                extra_body={"chat_template_kwargs": {"enable_thinking": True}},
            )
    finally:
        service.close()
    assert getattr(plain.choices[0].message, "reasoning_content", None) is None
    message = reasoned.choices[0].message
    assert (message.reasoning_content, message.content) == (expected.reasoning, expected.text)
    assert expected.reasoning and message.content != plain.choices[0].message.content
