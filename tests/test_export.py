"""`mmcli export`: the current label of each (key, task) as Parquet (long and wide) and as an
imagefolder's metadata, read back with pyarrow and with Hugging Face `datasets`."""

import json

import pyarrow.parquet as pq
import pytest
import yaml
from conftest import photo
from typer.testing import CliRunner

from mmcli.cli.app import app
from mmcli.jobs.records import JsonlOutput
from mmcli.testing import EXAMPLE_SCHEMA, boxes_record

BOX = {"label": "helmet", "bbox": [40.0, 30.0, 200.0, 150.0]}


@pytest.fixture(scope="module")
def labeled(tiny_dir, tmp_path_factory):
    """caption and a JSON task over three images and one broken file, an edit appended later,
    and a boxes record."""
    base = tmp_path_factory.mktemp("export")
    root = base / "imgs"
    root.mkdir()
    for name in ("astronaut.jpg", "coffee.jpg", "chelsea.jpg"):
        photo(name, (96, 64)).save(root / name)
    (root / "broken.jpg").write_bytes(b"not an image")
    tasks = {
        "caption": {"max_new_tokens": 4},
        "fields": {
            "prompt": "JSON.",
            "output": "json",
            "schema": EXAMPLE_SCHEMA,
            "max_new_tokens": 200,
        },
    }
    settings = base / "tasks.yaml"
    settings.write_text(yaml.safe_dump({"tasks": tasks}))
    out = base / "labels.jsonl"
    args = [
        "caption",
        str(root),
        "-o",
        str(out),
        "--model",
        str(tiny_dir),
        "-q",
        "-c",
        str(settings),
    ]
    result = CliRunner().invoke(app, [*args, "--task", "caption", "--task", "fields"])
    assert result.exit_code == 1, result.output  # the broken file
    records = [json.loads(line) for line in out.read_text().splitlines()]
    edited = dict(next(r for r in records if r["key"] == "coffee.jpg" and r["task"] == "caption"))
    edited["text"], edited["review"] = "a cup of coffee", {"action": "edit", "by": "person"}
    boxes = boxes_record(root / "astronaut.jpg", [BOX], (96, 64))
    output = JsonlOutput(out).open()
    output.append(edited)
    output.append(boxes)
    output.close()
    return root, out


def _export(*args):
    return CliRunner().invoke(app, ["export", *map(str, args)])


def test_parquet_has_one_typed_row_per_current_label(labeled, tmp_path):
    _, labels = labeled
    out = tmp_path / "labels.parquet"
    result = _export(labels, out)
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    rows = table.to_pylist()
    assert len(rows) == 7  # caption and fields for three images, detect for one; errors left out
    coffee = next(r for r in rows if r["key"] == "coffee.jpg" and r["task"] == "caption")
    assert coffee["text"] == "a cup of coffee" and json.loads(coffee["review"])["by"] == "person"
    fields = [r for r in rows if r["task"] == "fields"]
    assert all(set(json.loads(r["json"])) == {"kind", "count", "title", "tags"} for r in fields)
    (detect,) = [r for r in rows if r["task"] == "detect"]
    assert detect["boxes"] == [BOX] and str(table.schema.field("boxes").type).startswith("list<")
    assert table.schema.field("num_output_tokens").type == "int64"
    import pandas as pd

    assert len(pd.read_parquet(out)) == 7
    with_errors = tmp_path / "all.parquet"
    assert _export(labels, with_errors, "--include-errors").exit_code == 0
    errors = [r for r in pq.read_table(with_errors).to_pylist() if r["status"] == "error"]
    assert {r["key"] for r in errors} == {"broken.jpg"} and len(errors) == 2


def test_wide_parquet_has_one_row_per_input_and_loads_with_datasets(labeled, tmp_path):
    from datasets import load_dataset

    _, labels = labeled
    out = tmp_path / "wide.parquet"
    assert _export(labels, out, "--wide").exit_code == 0
    rows = {r["key"]: r for r in pq.read_table(out).to_pylist()}
    assert set(rows) == {"astronaut.jpg", "coffee.jpg", "chelsea.jpg"}
    assert rows["coffee.jpg"]["caption"] == "a cup of coffee"
    assert (
        rows["astronaut.jpg"]["detect_boxes"] == [BOX]
        and rows["coffee.jpg"]["detect_boxes"] is None
    )
    assert json.loads(rows["chelsea.jpg"]["fields_json"])["kind"] in (
        "photo",
        "drawing",
        "screenshot",
    )
    dataset = load_dataset("parquet", data_files=str(out), split="train")
    assert dataset.num_rows == 3 and "fields_json" in dataset.column_names


def test_imagefolder_metadata_loads_images_and_labels_together(labeled):
    from datasets import load_dataset

    root, labels = labeled
    result = _export(labels, root, "--to", "imagefolder")
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in (root / "metadata.jsonl").read_text().splitlines()]
    assert sorted(line["file_name"] for line in lines) == [
        "astronaut.jpg",
        "chelsea.jpg",
        "coffee.jpg",
    ]
    dataset = load_dataset("imagefolder", data_dir=str(root), split="train")
    assert dataset.num_rows == 3 and dataset[0]["image"].size == (96, 64)
    by_caption = set(dataset["caption"])
    assert "a cup of coffee" in by_caption


def test_export_refuses_what_it_cannot_write(labeled, tmp_path):
    _, labels = labeled
    assert _export(labels, tmp_path / "x", "--to", "csv").exit_code == 2
    assert _export(labels, tmp_path / "nowhere", "--to", "imagefolder").exit_code == 2
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{}\n")
    result = _export(bad, tmp_path / "x.parquet")
    assert result.exit_code == 2 and "bad.jsonl:1: not a JSON record" in result.output
