"""Resume: a record is current only under the settings it was made with and for the file it was
made from; one run reads the checkpoint's config once."""

import builtins
import collections
import io
import os
import shutil
from pathlib import Path

import pytest
from conftest import caption_cli, image_folder, photo, read_records


@pytest.fixture
def model_copy(tiny_dir, tmp_path):
    return Path(shutil.copytree(tiny_dir, tmp_path / "model"))


def test_resume_redoes_items_when_precision_pixel_budget_or_weights_change(model_copy, tmp_path):
    root, out = image_folder(tmp_path / "imgs"), tmp_path / "out.jsonl"
    assert caption_cli(root, "-o", out, model=model_copy).exit_code == 0
    # nothing redone
    assert (
        caption_cli(root, "-o", out, model=model_copy).exit_code == 0
        and len(read_records(out)) == 2
    )
    assert caption_cli(root, "-o", out, "--dtype", "bfloat16", model=model_copy).exit_code == 0
    assert len(read_records(out)) == 4  # a new precision: every label redone
    budget = tmp_path / "budget.yaml"
    budget.write_text("image:\n  max_pixels: 8192\n")
    assert (
        caption_cli(
            root, "-o", out, "--dtype", "bfloat16", "-c", budget, model=model_copy
        ).exit_code
        == 0
    )
    assert len(read_records(out)) == 6  # a new pixel budget: redone
    weights = model_copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8)  # other weight values behind the same directory name
    weights.write_bytes(bytes(data))
    assert (
        caption_cli(
            root, "-o", out, "--dtype", "bfloat16", "-c", budget, model=model_copy
        ).exit_code
        == 0
    )
    assert len(read_records(out)) == 8


def test_a_changed_image_is_redone_unless_the_check_is_off(tiny_dir, tmp_path):
    root, out = image_folder(tmp_path / "imgs"), tmp_path / "out.jsonl"
    assert caption_cli(root, "-o", out, model=tiny_dir).exit_code == 0
    os.utime(root / "im0.jpg", ns=(1, 1))  # a new mtime, the same bytes: the sha256 says unchanged
    assert (
        caption_cli(root, "-o", out, model=tiny_dir).exit_code == 0 and len(read_records(out)) == 2
    )
    photo("rocket.jpg", (80, 60)).save(root / "im1.jpg")  # new content at the same path
    assert (
        caption_cli(root, "-o", out, "--no-check-changed", model=tiny_dir).exit_code == 0
        and len(read_records(out)) == 2
    )
    assert caption_cli(root, "-o", out, model=tiny_dir).exit_code == 0
    records = read_records(out)
    assert (
        len(records) == 3
        and records[-1]["key"] == "im1.jpg"
        and records[-1]["file_size"] == (root / "im1.jpg").stat().st_size
    )


def test_one_caption_run_reads_the_checkpoints_configs_once(tiny_dir, tmp_path, monkeypatch):
    """The run is resolved once (api.loader.Run) and handed down: config.json and the
    preprocessor config are read once, for the resume keys, the precision and the model alike;
    each image is read once, its record's sha256 taken from the bytes decoded."""
    root, out = image_folder(tmp_path / "imgs"), tmp_path / "out.jsonl"
    reads = collections.Counter()
    real_open = io.open

    def counting_open(file, *args, **kwargs):
        if isinstance(file, (str, os.PathLike)):
            reads[os.path.basename(os.fspath(file))] += 1
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(io, "open", counting_open)
    monkeypatch.setattr(builtins, "open", counting_open)
    assert caption_cli(root, "-o", out, model=tiny_dir).exit_code == 0
    assert len(read_records(out)) == 2
    assert reads["config.json"] == 1 and reads["preprocessor_config.json"] == 1, reads
    assert reads["im0.jpg"] == reads["im1.jpg"] == 1, reads


def test_auto_labels_stay_current_on_a_cpu_that_resolves_auto_to_other_products(
    tmp_path, monkeypatch
):
    """A cluster of mixed CPUs: `dtype: auto` labeled with float32 products on one machine and
    bfloat16 on another is one job; each record says what ran."""
    from mmcli.testing import make_tiny_checkpoint

    model = make_tiny_checkpoint(tmp_path / "bf16", dtype="bfloat16")
    root, out = image_folder(tmp_path / "imgs"), tmp_path / "out.jsonl"
    # the units decide the products; nothing measured (units this CPU lacks would be timed in
    # emulation, 50 s on AVX2)
    monkeypatch.setenv("MMCLI_CPU_PREFER", "ours")
    for units, made in (("avx2,fma", 2), ("avx2,fma,amx_bf16", 3)):
        monkeypatch.setenv("MMCLI_CPU_FEATURES", units)
        if made == 3:
            photo("coffee.jpg", (80, 64)).save(root / "extra.jpg")
        assert caption_cli(root, "-o", out, model=model).exit_code == 0
        assert len(read_records(out)) == made
    products = [record["precision"]["products"] for record in read_records(out)]
    assert products == ["float32", "float32", "bfloat16"]
