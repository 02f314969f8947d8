"""What a person at the terminal sees: failures named, load and labeling phases, answers
streamed, --help."""

import io
import json
import shlex
from pathlib import Path

import pytest
from conftest import SAMPLES, photo
from rich.console import Console
from typer.testing import CliRunner

from mmcli.cli.app import app
from mmcli.cli.progress import Progress

ROOT = SAMPLES.parent


def _error(key: str, message: str) -> dict:
    return {"key": key, "status": "error", "error": {"type": "ImageError", "message": message}}


@pytest.mark.parametrize("terminal", [True, False])
def test_summary_names_the_failures_and_how_to_redo_them(terminal):
    console = Console(file=io.StringIO(), force_terminal=terminal, width=100, record=True)
    progress = Progress(14, console=console)
    progress.start()
    progress.update({"key": "fine.jpg", "status": "ok", "num_output_tokens": 5})
    for i in range(12):
        progress.update(
            _error(f"bad{i:02d}.jpg", f"cannot decode (corrupt or truncated): case {i}")
        )
    progress.finish()
    text = console.export_text() if terminal else console.file.getvalue()
    for i in range(10):
        assert f"failed: bad{i:02d}.jpg: cannot decode (corrupt or truncated): case {i}" in text
    assert "bad10.jpg: cannot" not in text.split("images/s")[-1] and "and 2 more" in text
    assert "12 failed" in text and "--retry-errors" in text
    quiet = Progress(2, quiet=True, console=Console(file=io.StringIO(), force_terminal=terminal))
    quiet.start()
    quiet.update(_error("bad.jpg", "broken"))
    quiet.finish()
    assert quiet.console.file.getvalue() == ""


def test_caption_off_a_terminal_prints_a_line_per_phase_and_names_failures(tiny_dir, tmp_path):
    root = tmp_path / "imgs"
    root.mkdir()
    photo("coffee.jpg", (64, 48)).save(root / "good.jpg")
    for name in ("broken1.jpg", "broken2.jpg", "broken3.jpg"):
        (root / name).write_bytes(b"\xff\xd8\xff not a jpeg")
    result = CliRunner().invoke(
        app,
        [
            "caption",
            str(root),
            "-o",
            str(tmp_path / "o.jsonl"),
            "--model",
            str(tiny_dir),
            "--max-new-tokens",
            "3",
        ],
        terminal_width=100,
    )
    assert result.exit_code == 1
    lines = result.output.splitlines()
    assert lines[0].startswith(f"mmcli: loading {tiny_dir} (") and lines[0].endswith(
        "MB) on cpu, float32 weights, float32 compute"
    )
    assert lines[1].startswith("mmcli: loaded in ") and lines[1].endswith("captioning 4 images")
    assert any("load s" in line and "labeling s" in line for line in lines)
    for name in ("broken1.jpg", "broken2.jpg", "broken3.jpg"):
        assert any(line.startswith(f"failed: {name}: ") and "corrupt" in line for line in lines)
    assert "3 failed; fix the files, then rerun with --retry-errors to redo them" in lines


def test_text_stream_emits_a_split_character_once_whole(tiny_dir):
    from mmcli.inputs.prompt import PromptBuilder, TextStream

    prompts = PromptBuilder.from_checkpoint(tiny_dir, _image_token_id(tiny_dir))
    text = "A café in 日本 🙂 done"
    ids = prompts.tokenizer.encode(text).ids
    # some character spans tokens
    assert any("\ufffd" in prompts.decode(ids[:n]) for n in range(1, len(ids)))
    stream = TextStream(prompts)
    pieces = [stream.push(i) for i in ids] + [stream.finish()]
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == prompts.decode(ids) == text


def _image_token_id(path: Path) -> int:
    return json.loads((path / "config.json").read_text())["image_token_id"]


def test_ask_streams_what_the_record_holds_even_across_split_characters(tiny_dir, monkeypatch):
    from mmcli import Labeler
    from mmcli.engine.sampling import Choice

    cap = Labeler.from_pretrained(str(tiny_dir), dtype="float32", device="cpu")
    # the model is made to say this
    forced = iter(cap.prompts.tokenizer.encode("Voilà: 日本 🙂").ids)

    def choose(logits, params, histories, seeds, constraints=None):
        return [Choice(next(forced, min(cap.stop_ids)), 0.0) for _ in params]

    monkeypatch.setattr(cap.engine, "choose", choose)
    pieces = []
    result = cap.ask([SAMPLES / "coffee.jpg"], "Say it.", on_text=pieces.append, max_new_tokens=40)
    assert result.text == "Voilà: 日本 🙂" == "".join(pieces) and result.finish_reason == "stop"
    assert len([p for p in pieces if p]) > 3 and all("\ufffd" not in p for p in pieces)


def test_ask_prints_the_record_text_streamed_or_not(tiny_dir, tmp_path):
    outputs = {}
    for flag in ("--stream", "--no-stream"):
        out = tmp_path / f"{flag}.jsonl"
        result = CliRunner().invoke(
            app,
            [
                "ask",
                "--model",
                str(tiny_dir),
                "--image",
                str(SAMPLES / "rocket.jpg"),
                "--max-new-tokens",
                "8",
                flag,
                "-o",
                str(out),
                "What is it?",
            ],
        )
        assert result.exit_code == 0
        outputs[flag] = result.output
        assert result.output == json.loads(out.read_text())["text"] + "\n"
    assert outputs["--stream"] == outputs["--no-stream"]


def _examples(help_text: str) -> list[str]:
    lines = (
        help_text.split("Examples:")[1].split("\n\n")[0].splitlines()
        if "Examples:" in help_text
        else []
    )
    return [line.strip() for line in lines if line.strip().startswith("mmcli ")]


@pytest.mark.parametrize(
    "command", ["", "ask", "plan", "caption", "compile", "review", "export", "config"]
)
def test_help_fits_80_columns_and_its_examples_parse(command, monkeypatch):
    result = CliRunner().invoke(app, [*command.split(), "--help"], terminal_width=80)
    assert result.exit_code == 0
    assert all(len(line) <= 80 for line in result.output.splitlines()), result.output
    if command == "caption":
        # the markup kept, wrapped or not
        assert "pip install 'mmcli[ray]'" in " ".join(result.output.split())
    calls = []
    for target in (
        "mmcli.cli.ask.run_ask",
        "mmcli.jobs.caption.run_caption_job",
        "mmcli.cli.compile.compile_buckets",
        "mmcli.cli.plan.print_plan",
        "mmcli.cli.review.serve",
        "mmcli.jobs.export.export",
    ):
        monkeypatch.setattr(target, lambda *a, **k: calls.append(a) or 0)
    monkeypatch.chdir(ROOT)
    examples = _examples(result.output)
    assert examples or command in ("", "config")
    for example in examples:  # each runs as written (the work itself stubbed out)
        ran = CliRunner().invoke(app, shlex.split(example)[1:])
        assert ran.exit_code == 0, (example, ran.output)
    assert len(calls) == len(examples)
