"""Prompts, sidecars, tasks and settings that must never crash a run or write an untrue record:
each case is one clear error (exit 2 before any work, or that item's and task's error record)."""

import pytest
import yaml
from conftest import caption_cli, photo, read_records
from typer.testing import CliRunner

from mmcli.api.labeler import Labeler
from mmcli.cli.app import app
from mmcli.config import load_config
from mmcli.errors import ConfigError

NAMES = ["astronaut.jpg", "chelsea.jpg", "coffee.jpg"]


@pytest.fixture
def root(tmp_path):
    folder = tmp_path / "imgs"
    folder.mkdir()
    for i, name in enumerate(NAMES):
        photo(name, (64 + 8 * i, 48)).save(folder / f"im{i}.png")
    return folder


def _settings(tmp_path, **data):
    path = tmp_path / "settings.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _caption(root, out, model, *args):
    return caption_cli(
        root, "-o", out, "--dtype", "float32", *args, model=model, max_new_tokens=None
    )


def _no_load(monkeypatch):
    """Loading the model fails the test: what these cases refuse, they refuse before it."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(Labeler, "from_pretrained", refuse)


def test_prompts_keep_their_braces_and_only_known_placeholders_are_filled(tiny_dir, root, tmp_path):
    out = tmp_path / "out.jsonl"
    prompt = 'Answer as JSON: {"label": "x"} about {filename}, not {{filename}}'
    result = _caption(root, out, tiny_dir, "--prompt", prompt, "--max-new-tokens", "2")
    assert result.exit_code == 0, result.output
    prompts = {r["key"]: r["prompt"] for r in read_records(out)}
    assert prompts["im0.png"] == 'Answer as JSON: {"label": "x"} about im0.png, not {filename}'
    # through the API alike: braces as written, an unknown placeholder refused
    cap = Labeler.from_pretrained(str(tiny_dir), dtype="float32", device="cpu")
    (done,) = cap.label([("a", root / "im0.png")], prompt='Say {"a": 1}.', max_new_tokens=2)
    assert done.ok and done.prompt == 'Say {"a": 1}.'
    with pytest.raises(ConfigError, match=r"unknown placeholder \{foo\}"):
        list(cap.label([("a", root / "im0.png")], prompt="What is {foo}?"))


def test_an_unknown_placeholder_exits_2_before_loading(tiny_dir, root, tmp_path, monkeypatch):
    _no_load(monkeypatch)
    out = tmp_path / "out.jsonl"
    result = _caption(root, out, tiny_dir, "--prompt", "What is {foo}?")
    assert result.exit_code == 2 and "unknown placeholder {foo}" in result.output
    bad_task = _settings(tmp_path, tasks={"t": {"prompt": "Name {subject}."}}, task=["t"])
    result = _caption(root, out, tiny_dir, "-c", bad_task)
    assert (
        result.exit_code == 2 and "tasks.t.prompt: unknown placeholder {subject}" in result.output
    )
    assert not out.exists()


def test_a_sidecar_that_cannot_be_read_is_that_items_error(tiny_dir, root, tmp_path):
    (root / "im0.txt").write_bytes(b"\xff\xfe not utf-8 \xc3")
    (root / "im1.txt").mkdir()  # a folder where the sidecar would be
    (root / "im2.txt").write_text("a cat on a mat")
    settings = _settings(
        tmp_path,
        tasks={"refine": {"prompt": "Improve: {sidecar}", "max_new_tokens": 2}},
        task=["caption", "refine"],
    )
    out = tmp_path / "out.jsonl"
    result = _caption(root, out, tiny_dir, "-c", settings, "--max-new-tokens", "2")
    assert result.exit_code == 1, result.output
    records = {(r["key"], r["task"]): r for r in read_records(out)}
    assert len(records) == 6 and records[("im2.png", "refine")]["status"] == "ok"
    assert all(records[(f"im{i}.png", "caption")]["status"] == "ok" for i in range(3))
    assert (
        "im0.txt: the sidecar is not UTF-8 text"
        in records[("im0.png", "refine")]["error"]["message"]
    )
    assert "im1.txt: cannot read the sidecar" in records[("im1.png", "refine")]["error"]["message"]


@pytest.mark.parametrize("value", ["txt", ".", "a/b.txt", "../x"])
def test_a_bad_sidecar_setting_exits_2_before_loading(tiny_dir, root, tmp_path, monkeypatch, value):
    _no_load(monkeypatch)
    out = tmp_path / "out.jsonl"
    result = _caption(root, out, tiny_dir, "--sidecar", value)
    assert result.exit_code == 2 and f"--sidecar: value {value!r}" in result.output
    settings = _settings(tmp_path, tasks={"t": {"prompt": "Hi.", "sidecar": value}}, task=["t"])
    result = _caption(root, out, tiny_dir, "-c", settings)
    assert result.exit_code == 2 and "tasks.t.sidecar" in result.output and not out.exists()


def test_the_record_holds_the_prompt_the_model_saw(tiny_dir, root, tmp_path):
    # refine reads the .txt sidecar that caption (finishing first) rewrites during the run
    for i in range(3):
        (root / f"im{i}.txt").write_text("old text")
    settings = _settings(
        tmp_path,
        tasks={"refine": {"prompt": "Improve: {sidecar}", "max_new_tokens": 6}},
        task=["caption", "refine"],
    )
    out = tmp_path / "out.jsonl"
    result = _caption(
        root, out, tiny_dir, "-c", settings, "--sidecar", ".txt", "--max-new-tokens", "1"
    )
    assert result.exit_code == 0, result.output
    refine = [r for r in read_records(out) if r["task"] == "refine"]
    assert [r["prompt"] for r in refine] == ["Improve: old text"] * 3
    assert (root / "im0.txt").read_text() != "old text\n"  # the caption did rewrite it


def test_a_task_that_cannot_run_fails_alone_and_is_named(tiny_dir, root, tmp_path):
    settings = _settings(
        tmp_path,
        tasks={
            "pad": {"prompt": "Look at <|image_pad|> here."},
            "long": {"prompt": "Describe it. " * 400},
        },
        task=["caption", "pad", "long"],
        engine={"max_len": 512},
    )
    out = tmp_path / "out.jsonl"
    result = _caption(root, out, tiny_dir, "-c", settings, "--max-new-tokens", "2")
    assert result.exit_code == 1, result.output
    records = read_records(out)
    assert len(records) == 9
    by_task = {t: [r for r in records if r["task"] == t] for t in ("caption", "pad", "long")}
    assert all(r["status"] == "ok" for r in by_task["caption"])
    assert all(r["error"]["message"].startswith("task pad: ") for r in by_task["pad"])
    assert all("task long: " in r["error"]["message"] for r in by_task["long"])
    assert all("engine.max_len" in r["error"]["message"] for r in by_task["long"])


def test_ask_refuses_a_task_or_schema_before_loading(tiny_dir, root, tmp_path, monkeypatch):
    _no_load(monkeypatch)
    image = ["--image", str(root / "im0.png"), "--model", str(tiny_dir)]
    result = CliRunner().invoke(app, ["ask", *image, "--task", "nope"])
    assert result.exit_code == 2 and "task 'nope' is not defined" in result.output
    settings = _settings(
        tmp_path, tasks={"bad": {"prompt": "JSON.", "output": "json", "schema": {"type": "nah"}}}
    )
    result = CliRunner().invoke(app, ["ask", *image, "-c", str(settings), "--task", "bad"])
    assert result.exit_code == 2 and "tasks.bad.schema" in result.output


@pytest.mark.parametrize("stream", ["--stream", "--no-stream"])
def test_ask_prints_the_records_text_or_only_the_error(tiny_dir, root, tmp_path, stream):
    settings = _settings(
        tmp_path, tasks={"wrapped": {"prompt": "Hi.", "prefix": "<", "suffix": ">"}}
    )
    image = ["--image", str(root / "im0.png"), "--model", str(tiny_dir), "-c", str(settings)]
    out = tmp_path / "ask.jsonl"
    ok = CliRunner().invoke(
        app, ["ask", *image, "--task", "wrapped", "--max-new-tokens", "3", stream, "-o", str(out)]
    )
    assert ok.exit_code == 0 and ok.stdout == read_records(out)[-1]["text"] + "\n"
    # the tiny model's answer holds no boxes: exit 1, one line on stderr, nothing on stdout
    failed = CliRunner().invoke(
        app, ["ask", *image, "--task", "detect", "--max-new-tokens", "3", stream, "-o", str(out)]
    )
    assert failed.exit_code == 1 and failed.stdout == ""
    assert failed.stderr.strip().count("\n") == 0 and "task detect:" in failed.stderr
    assert read_records(out)[-1]["status"] == "error"


def test_resume_redoes_only_the_task_or_the_kind_of_file_that_changed(tiny_dir, root, tmp_path):
    out = tmp_path / "out.jsonl"
    tasks = ["--task", "caption", "--task", "tags", "--max-new-tokens", "2"]
    assert _caption(root, out, tiny_dir, *tasks).exit_code == 0
    assert len(read_records(out)) == 6
    assert _caption(root, out, tiny_dir, *tasks, "--prompt", "Another prompt.").exit_code == 0
    redone = read_records(out)[6:]
    assert len(redone) == 3 and {r["task"] for r in redone} == {"caption"}
    video = _settings(tmp_path, video={"fps": 1.0})
    rerun = _caption(root, out, tiny_dir, *tasks, "--prompt", "Another prompt.", "-c", video)
    assert rerun.exit_code == 0, rerun.output
    assert len(read_records(out)) == 9  # image-only folder: a video setting redoes nothing


def test_duplicate_tasks_and_shared_sidecars_exit_2_before_loading(
    tiny_dir, root, tmp_path, monkeypatch
):
    _no_load(monkeypatch)
    out = tmp_path / "out.jsonl"
    twice = _caption(root, out, tiny_dir, "--task", "caption", "--task", "caption")
    assert twice.exit_code == 2 and "'caption' is given twice" in twice.output
    both = _settings(tmp_path, tasks={"tags": {"sidecar": ".txt"}})
    shared = _caption(
        root, out, tiny_dir, "-c", both, "--task", "caption", "--task", "tags", "--sidecar", ".txt"
    )
    assert shared.exit_code == 2 and "both write the sidecar .txt" in shared.output
    empty = _caption(root, out, tiny_dir, "-c", _settings(tmp_path, task=[]))
    assert empty.exit_code == 2 and "config task: the list is empty" in empty.output
    assert not out.exists()


@pytest.mark.parametrize(
    "data, where",
    [
        ({"video": {"fps": float("inf")}}, "video.fps: inf is not a finite number"),
        ({"generation": {"temperature": float("nan")}}, "generation.temperature: nan"),
        ({"video": {"max_decode_pixels": 0}}, "video.max_decode_pixels: value 0"),
        ({"video": {"max_decode_pixels": -1}}, "video.max_decode_pixels: value -1"),
        ({"tasks": {"tags": {"max_new_tokens": 0}}}, "tasks.tags.max_new_tokens: value 0"),
        ({"tasks": {"tags": {"temperature": -1.0}}}, "tasks.tags.temperature: value -1.0"),
        (
            {"tasks": {"j": {"output": "json", "schema": {"type": "object"}, "prefix": "x"}}},
            "tasks.j: output json",
        ),
    ],
)
def test_settings_are_checked_when_read_with_their_full_key(tmp_path, data, where):
    assert _settings_error(tmp_path, data) and where in _settings_error(tmp_path, data)
    result = CliRunner().invoke(
        app, ["plan", "--tokens", "64", "-c", str(_settings(tmp_path, **data))]
    )
    assert result.exit_code == 2 and where in result.output


def _settings_error(tmp_path, data) -> str:
    try:
        load_config(_settings(tmp_path, **data))
    except ConfigError as e:
        return str(e)
    return ""


def test_each_task_draws_its_own_random_stream(tiny_dir, root):
    cfg = load_config(
        None,
        {
            "tasks": {n: {"prompt": "Describe it.", "temperature": 1.0} for n in ("one", "two")},
            "generation": {"max_new_tokens": 8, "seed": 3},
        },
    )
    cap = Labeler.from_pretrained(str(tiny_dir), dtype="float32", device="cpu", config=cfg)
    items = [("a", root / "im0.png")]
    first = {r.task: r.token_ids for r in cap.label(items, tasks=["one", "two"])}
    again = {r.task: r.token_ids for r in cap.label(items, tasks=["one", "two"])}
    assert first == again and first["one"] != first["two"]
