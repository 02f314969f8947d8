"""Several labels per image in one pass: tasks, the shared prefix, JSON under a schema, boxes,
templates, resume."""

import json
from pathlib import Path

import jsonschema
import pytest
import yaml
from conftest import SAMPLES, photo, read_records
from PIL import Image
from typer.testing import CliRunner

from mmcli.api.labeler import Labeler
from mmcli.cli.app import app
from mmcli.config import load_config
from mmcli.engine.sampling import Choice
from mmcli.errors import ConfigError
from mmcli.inputs.images import decode_image
from mmcli.tasks import boxes_in_pixels, resolve_tasks
from mmcli.testing import EXAMPLE_SCHEMA as SCHEMA

TASKS = {
    "short": {"prompt": "One short caption for {filename}.", "max_new_tokens": 6},
    "fields": {
        "prompt": "Describe it as JSON.",
        "output": "json",
        "schema": SCHEMA,
        "max_new_tokens": 200,
    },
    "wrapped": {
        "prompt": "Name the main subject.",
        "max_new_tokens": 4,
        "prefix": "ohwx, ",
        "suffix": ".",
    },
    "refine": {"prompt": "Improve this caption: {sidecar}", "max_new_tokens": 4},
}
NAMES = ["astronaut.jpg", "chelsea.jpg", "coffee.jpg", "rocket.jpg"]


@pytest.fixture
def setup(tmp_path):
    root = tmp_path / "imgs"
    root.mkdir()
    for i in range(8):
        photo(NAMES[i % 4], (64 + 8 * i, 48 + 4 * i)).save(root / f"im{i}.png")
    settings = tmp_path / "tasks.yaml"
    settings.write_text(yaml.safe_dump({"tasks": TASKS}))
    return root, settings


def _caption(root, out, model, settings, *tasks, extra=()):
    args = [
        "caption",
        str(root),
        "-o",
        str(out),
        "--model",
        str(model),
        "-c",
        str(settings),
        "-q",
        "--dtype",
        "float32",
        *[a for t in tasks for a in ("--task", t)],
        *extra,
    ]
    return CliRunner().invoke(app, args)


def test_three_tasks_in_one_pass_equal_three_runs_and_share_the_work(tiny_dir, setup, tmp_path):
    root, settings = setup
    together = tmp_path / "together.jsonl"
    assert _caption(root, together, tiny_dir, settings, "short", "fields", "wrapped").exit_code in (
        0,
        1,
    )
    texts = {(r["key"], r["task"]): (r["status"], r["text"]) for r in read_records(together)}
    assert len(texts) == 24 and {r["schema"] for r in read_records(together)} == {2}
    alone = {}
    for task in ("short", "fields", "wrapped"):
        out = tmp_path / f"{task}.jsonl"
        _caption(root, out, tiny_dir, settings, task)
        alone.update({(r["key"], r["task"]): (r["status"], r["text"]) for r in read_records(out)})
    assert texts == alone
    cap = Labeler.from_pretrained(
        str(tiny_dir), config=load_config(settings, {"dtype": "float32", "device": "cpu"})
    )
    items = [(p.name, p) for p in sorted(root.iterdir())]
    results = list(cap.label(items, tasks=["short", "fields", "wrapped"]))
    assert len(results) == 24 and {
        (r.key, r.task): (r.text if r.ok else None) for r in results if r.ok
    }
    # once per image, not per task
    assert cap.runner.images_encoded == 8 and cap.runner.prefixes_prefilled == 8


def test_json_answers_validate_and_a_cut_answer_is_an_error(tiny_dir, setup, tmp_path):
    root, settings = setup
    out = tmp_path / "fields.jsonl"
    _caption(root, out, tiny_dir, settings, "fields")
    records = read_records(out)
    # the random model is held to the schema
    assert len(records) == 8 and all(r["status"] == "ok" for r in records)
    for record in records:
        assert record["json"] == json.loads(record["text"])
        jsonschema.validate(record["json"], SCHEMA)
    cut = tmp_path / "cut.yaml"
    cut.write_text(yaml.safe_dump({"tasks": {"fields": {**TASKS["fields"], "max_new_tokens": 3}}}))
    out2 = tmp_path / "cut.jsonl"
    assert _caption(root, out2, tiny_dir, cut, "fields").exit_code == 1
    assert all(
        r["status"] == "error" and "did not close within max_new_tokens 3" in r["error"]["message"]
        for r in read_records(out2)
    )


def test_unusable_schema_and_unknown_placeholder_are_configuration_errors(
    tiny_dir, setup, tmp_path
):
    root, _ = setup
    bad = tmp_path / "bad.yaml"
    schema = {"type": "object", "properties": {"a": {"type": 7}}}
    bad.write_text(
        yaml.safe_dump({"tasks": {"odd": {"prompt": "x", "output": "json", "schema": schema}}})
    )
    result = _caption(root, tmp_path / "o.jsonl", tiny_dir, bad, "odd")
    assert result.exit_code == 2 and "tasks.odd.schema" in result.output
    typo = tmp_path / "typo.yaml"
    typo.write_text(yaml.safe_dump({"tasks": {"t": {"prompt": "Caption {filenme}"}}}))
    with pytest.raises(ConfigError, match=r"tasks.t.prompt: unknown placeholder \{filenme\}"):
        load_config(typo)


def test_doubled_braces_are_the_literal_name_for_every_name():
    """One rule: {{name}} is the text {name}, a placeholder's name or not; {name} fills."""
    from mmcli.config import check_prompt
    from mmcli.inputs.placeholders import render_prompt
    from mmcli.tasks import Task

    prompt = "{{x}} and {{filename}} for {filename}"
    check_prompt(prompt, "prompt")  # neither doubled name is a placeholder to refuse
    task = Task("t", prompt, "text", None, None, None, "", "")
    assert render_prompt(task, "a/b.png") == "{x} and {filename} for b.png"
    with pytest.raises(ConfigError, match=r"unknown placeholder \{x\}"):
        check_prompt("{x}", "prompt")


def test_templates_and_placeholders(tiny_dir, setup, tmp_path):
    root, settings = setup
    (root / "im1.txt").write_text("a cat on a sofa\n")
    out = tmp_path / "t.jsonl"
    _caption(root, out, tiny_dir, settings, "short", "wrapped", "refine")
    records = {(r["key"], r["task"]): r for r in read_records(out)}
    assert records[("im3.png", "short")]["prompt"] == "One short caption for im3.png."
    wrapped = records[("im0.png", "wrapped")]
    assert wrapped["text"] == f"ohwx, {wrapped['raw_text']}."
    assert records[("im1.png", "refine")]["prompt"] == "Improve this caption: a cat on a sofa"
    assert records[("im2.png", "refine")]["prompt"] == "Improve this caption: "


def test_adding_a_task_computes_only_that_task(tiny_dir, setup, tmp_path):
    root, settings = setup
    out = tmp_path / "o.jsonl"
    _caption(root, out, tiny_dir, settings, "short", "fields", "wrapped")
    assert len(read_records(out)) == 24
    _caption(root, out, tiny_dir, settings, "short", "fields", "wrapped", "refine")
    records = read_records(out)
    assert len(records) == 32 and {r["task"] for r in records[24:]} == {"refine"}
    changed = tmp_path / "changed.yaml"
    changed.write_text(
        yaml.safe_dump({"tasks": {**TASKS, "short": {**TASKS["short"], "prompt": "Caption it."}}})
    )
    _caption(root, out, tiny_dir, changed, "short", "fields", "wrapped", "refine")
    assert {r["task"] for r in read_records(out)[32:]} == {"short"} and len(read_records(out)) == 40


def _oriented_jpeg(path: Path) -> Path:
    """A 200x100 JPEG whose EXIF orientation (6) shows it turned: 100 wide, 200 high."""
    exif = Image.Exif()
    exif[0x0112] = 6
    photo("rocket.jpg", (200, 100)).save(path, exif=exif)
    return path


def test_boxes_in_pixels_of_the_image_as_seen(tmp_path):
    seen = decode_image(_oriented_jpeg(tmp_path / "turned.jpg")).image
    assert seen.size == (100, 200)
    text = '```json\n[{"bbox_2d": [100, 250, 500, 1000], "label": "rocket"}]\n```'
    assert boxes_in_pixels(text, *seen.size) == [
        {"label": "rocket", "bbox": [10.0, 50.0, 50.0, 200.0]}
    ]
    assert boxes_in_pixels('{"bbox_2d": [0, 0, 1000, 500], "label": "a"}', 640, 480) == [
        {"label": "a", "bbox": [0.0, 0.0, 640.0, 240.0]}
    ]


def test_ask_detect_gives_boxes_in_the_record(tiny_dir, tmp_path, monkeypatch):
    cap = Labeler.from_pretrained(str(tiny_dir), dtype="float32", device="cpu")
    answer = iter(
        cap.prompts.tokenizer.encode('[{"bbox_2d": [100, 250, 500, 1000], "label": "x"}]').ids
    )
    monkeypatch.setattr(
        cap.engine,
        "choose",
        lambda logits, params, *rest: [
            Choice(next(answer, min(cap.stop_ids)), 0.0) for _ in params
        ],
    )
    result = cap.ask([_oriented_jpeg(tmp_path / "turned.jpg")], task="detect", max_new_tokens=80)
    assert result.ok and result.fields["boxes"] == [
        {"label": "x", "bbox": [10.0, 50.0, 50.0, 200.0]}
    ]
    assert result.prompt.startswith("Locate every distinct object") and "{" in result.prompt


def test_presets_are_documented_and_resolve():
    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "default.yaml")
    assert {"caption", "detailed", "tags", "ocr", "detect"} <= set(cfg.tasks)
    assert [t.name for t in resolve_tasks(cfg)] == ["caption"] and resolve_tasks(cfg)[
        0
    ].prompt == cfg.prompt


def test_the_python_api_takes_tasks(tiny_dir):
    cap = Labeler.from_pretrained(str(tiny_dir), dtype="float32", device="cpu")
    results = list(
        cap.label([("a", SAMPLES / "coffee.jpg")], tasks=["caption", "tags"], max_new_tokens=3)
    )
    assert sorted(r.task for r in results) == ["caption", "tags"] and all(r.ok for r in results)
