import functools
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from mmcli.cli.app import app

SAMPLES = Path(__file__).resolve().parent.parent / "samples"


def test_ask_help():
    result = CliRunner().invoke(app, ["ask", "--help"])
    assert result.exit_code == 0 and "--image" in result.output


def test_ask_writes_record_with_logprobs(tiny_dir, tmp_path):
    out = tmp_path / "answers.jsonl"
    args = [
        "ask",
        "--model",
        str(tiny_dir),
        "--dtype",
        "float32",
        "--image",
        str(SAMPLES / "coffee.jpg"),
        "--image",
        str(SAMPLES / "rocket.jpg"),
        "--max-new-tokens",
        "6",
        "--logprobs",
        "-o",
        str(out),
        "What differs between these?",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    record = json.loads(out.read_text())
    assert (
        record["status"] == "ok"
        and record["task"] == "ask"
        and record["text"] == result.output.strip()
    )
    assert (record["width"], record["height"]) == (600, 400) and len(record["sha256"]) == 64
    assert record["num_output_tokens"] == len(record["token_ids"]) == len(record["logprobs"]) <= 6
    assert record["num_image_tokens"] > 0 and record["images"][1].endswith("rocket.jpg")
    assert all(lp <= 0 for lp in record["logprobs"])


def test_ask_same_answer_as_python_api(tiny_dir):
    from mmcli import Labeler

    cap = Labeler.from_pretrained(str(tiny_dir), dtype="float32", device="cpu")
    api = cap.ask([SAMPLES / "chelsea.jpg"], "Describe this image.", max_new_tokens=5)
    cli = CliRunner().invoke(
        app,
        [
            "ask",
            "--model",
            str(tiny_dir),
            "--dtype",
            "float32",
            "--image",
            str(SAMPLES / "chelsea.jpg"),
            "--max-new-tokens",
            "5",
            "Describe this image.",
        ],
    )
    assert cli.exit_code == 0 and cli.output.strip() == api.text.strip()


def test_ask_corrupt_image_is_one_line_and_exit_1(tiny_dir, tmp_path):
    bad = tmp_path / "broken.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 not really a jpeg")
    out = tmp_path / "a.jsonl"
    result = CliRunner().invoke(
        app, ["ask", "--model", str(tiny_dir), "--image", str(bad), "-o", str(out), "q"]
    )
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "broken.jpg" in lines[0] and "corrupt or truncated" in lines[0]
    record = json.loads(out.read_text())
    assert record["status"] == "error" and record["error"]["type"] == "ImageError"


def test_bad_sampling_value_is_a_usage_error(tiny_dir):
    result = CliRunner().invoke(
        app,
        [
            "ask",
            "--model",
            str(tiny_dir),
            "--image",
            str(SAMPLES / "coffee.jpg"),
            "--top-p",
            "0",
            "q",
        ],
    )
    assert result.exit_code == 2 and "top_p" in result.output


def test_caption_help_shows_the_install_extra():
    result = CliRunner().invoke(app, ["caption", "--help"], terminal_width=100)
    assert result.exit_code == 0 and "pip install 'mmcli[ray]'" in result.output


@pytest.mark.parametrize(
    ("units", "upcast"),
    [({"avx2", "fma"}, "bf16_linear.c"), ({"avx2", "fma", "amx_bf16"}, "oneDNN bfloat16 (AMX)")],
)
def test_doctor_prints_the_units_the_peaks_and_the_plan(monkeypatch, tmp_path, units, upcast):
    from mmcli.kernels import cpu, cpu_features, machine, measure

    monkeypatch.setenv("MMCLI_CPU_FEATURES", ",".join(sorted(units)))
    if units - cpu_features.real_units():
        # Units this CPU lacks: their kernels would be timed in emulation (a minute on AVX2,
        # rates that say nothing; the kernels have tests of their own). The table is what is
        # tested here: every comparison at one second a call, in a store and a machine of this
        # test's own (no other test reads them).
        monkeypatch.setattr(measure, "_seconds", lambda fn: 1.0)
        monkeypatch.setattr(measure, "store_path", lambda: tmp_path / measure.STORE)
        monkeypatch.setattr(machine, "_made", functools.cache(machine._made.__wrapped__))
    monkeypatch.setenv("COLUMNS", "250")  # Rich's table, unwrapped
    # the default model, not downloaded: a dense model's plan (nothing is fetched)
    result = CliRunner().invoke(app, ["doctor"])
    assert result.exit_code == 0, result.output
    assert "CPU: " in result.output and "from MMCLI_CPU_FEATURES" in result.output
    assert "floors: read bandwidth" in result.output and "kernel plan" in result.output
    if cpu.why_unavailable() is None:
        assert upcast in result.output and "measured kernels" in result.output
    if "amx_bf16" not in units:  # no tiles: nothing to time against them
        assert "step_rows" not in result.output
    if not cpu_features.exact_int8():  # oneDNN's int8 would saturate: never taken, never timed
        assert "int8_prefill" not in result.output and "oneDNN int8" not in result.output


LOADING_COMMANDS = ("ask", "caption", "compile", "serve", "batch")


@pytest.mark.parametrize("command", LOADING_COMMANDS)
def test_every_command_that_loads_a_model_takes_the_run_settings(command):
    import typer

    from mmcli.cli.options import RUN_SETTINGS

    options = typer.main.get_command(app).commands[command].params
    flags = {flag for option in options for flag in option.opts}
    assert {f"--{s.name.replace('_', '-')}" for s in RUN_SETTINGS} <= flags


def test_the_run_settings_become_the_settings_they_name():
    from mmcli.cli.options import run_overrides

    given = {"backend": "eager", "no_cache": True, "model": "m", "thinking": None}
    assert run_overrides(given) == {
        "compile": {"backend": "eager"},
        "weights_cache": False,
        "model": "m",
        "thinking": None,
    }
    assert run_overrides({"no_cache": False}) == {"weights_cache": None}  # left to the file


def test_batch_takes_the_backend_and_refuses_a_bad_one(tmp_path):
    requests = tmp_path / "requests.jsonl"
    requests.write_text("")
    result = CliRunner().invoke(app, ["batch", str(requests), "--backend", "tpu", "--no-cache"])
    assert result.exit_code == 2 and "compile.backend" in result.output


def test_compile_refuses_no_cache_where_it_would_prepare_the_cache(tiny_dir):
    argv = ["compile", "--buckets", "--model", str(tiny_dir), "--quantize", "int8", "--no-cache"]
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 2 and "--no-cache" in result.output
