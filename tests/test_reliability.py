"""Labels that survive failures: complete resume keys, one safe writer, disk errors, collisions,
several roots."""

import errno
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import SAMPLES, photo
from typer.testing import CliRunner

from mmcli.cli.app import app
from mmcli.errors import ConfigError, OutputError
from mmcli.jobs.records import JsonlOutput, append_record
from mmcli.jobs.scan import scan


def _caption(*args, model):
    return CliRunner().invoke(
        app, ["caption", *map(str, args), "--model", str(model), "--max-new-tokens", "3", "-q"]
    )


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def _folder(root, n=2):
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        name = ["astronaut.jpg", "chelsea.jpg", "coffee.jpg"][i % 3]
        photo(name, (64 + 16 * i, 48 + 8 * i)).save(root / f"im{i}.jpg")
    return root


@pytest.fixture
def model_copy(tiny_dir, tmp_path):
    return Path(shutil.copytree(tiny_dir, tmp_path / "model"))


def test_resume_redoes_items_when_precision_pixel_budget_or_weights_change(model_copy, tmp_path):
    root, out = _folder(tmp_path / "imgs"), tmp_path / "out.jsonl"
    assert _caption(root, "-o", out, model=model_copy).exit_code == 0
    # nothing redone
    assert _caption(root, "-o", out, model=model_copy).exit_code == 0 and len(_records(out)) == 2
    assert _caption(root, "-o", out, "--dtype", "bfloat16", model=model_copy).exit_code == 0
    assert len(_records(out)) == 4  # a new precision: every label redone
    budget = tmp_path / "budget.yaml"
    budget.write_text("image:\n  max_pixels: 8192\n")
    assert (
        _caption(root, "-o", out, "--dtype", "bfloat16", "-c", budget, model=model_copy).exit_code
        == 0
    )
    assert len(_records(out)) == 6  # a new pixel budget: redone
    weights = model_copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-8:] = bytes(8)  # other weight values behind the same directory name
    weights.write_bytes(bytes(data))
    assert (
        _caption(root, "-o", out, "--dtype", "bfloat16", "-c", budget, model=model_copy).exit_code
        == 0
    )
    assert len(_records(out)) == 8


def test_a_changed_image_is_redone_unless_the_check_is_off(tiny_dir, tmp_path):
    root, out = _folder(tmp_path / "imgs"), tmp_path / "out.jsonl"
    assert _caption(root, "-o", out, model=tiny_dir).exit_code == 0
    os.utime(root / "im0.jpg", ns=(1, 1))  # a new mtime, the same bytes: the sha256 says unchanged
    assert _caption(root, "-o", out, model=tiny_dir).exit_code == 0 and len(_records(out)) == 2
    photo("rocket.jpg", (80, 60)).save(root / "im1.jpg")  # new content at the same path
    assert (
        _caption(root, "-o", out, "--no-check-changed", model=tiny_dir).exit_code == 0
        and len(_records(out)) == 2
    )
    assert _caption(root, "-o", out, model=tiny_dir).exit_code == 0
    records = _records(out)
    assert (
        len(records) == 3
        and records[-1]["key"] == "im1.jpg"
        and records[-1]["file_size"] == (root / "im1.jpg").stat().st_size
    )


def test_ask_output_takes_the_lock_and_sets_a_torn_line_aside(tiny_dir, tmp_path):
    out = tmp_path / "answers.jsonl"
    args = [
        "ask",
        "--model",
        str(tiny_dir),
        "--image",
        str(SAMPLES / "coffee.jpg"),
        "--max-new-tokens",
        "2",
        "-o",
        str(out),
        "What is this?",
    ]
    holder = JsonlOutput(out).open()
    try:
        locked = CliRunner().invoke(app, args)
    finally:
        holder.close()
    assert locked.exit_code == 2 and "another mmcli run" in locked.output and out.read_text() == ""
    out.write_text('{"schema": 1, "key": "x", "sta')  # a torn line from a crash
    assert CliRunner().invoke(app, args).exit_code == 0
    assert [r["task"] for r in _records(out)] == ["ask"]
    assert len(list(tmp_path.glob("answers.jsonl.torn-*"))) == 1


def test_an_fsync_error_on_a_regular_file_is_not_swallowed(tmp_path, monkeypatch):
    def failing_fsync(fd):
        raise OSError(errno.EIO, "Input/output error")

    with open(tmp_path / "plain.jsonl", "w") as f:
        monkeypatch.setattr(os, "fsync", failing_fsync)
        with pytest.raises(OSError, match="Input/output error"):
            append_record(f, {"key": "a"})
    monkeypatch.undo()
    out = JsonlOutput(tmp_path / "out.jsonl").open()
    try:
        out.append({"key": "a"})
        monkeypatch.setattr(os, "fsync", failing_fsync)
        with pytest.raises(OutputError, match="out.jsonl: cannot write \\(Input/output error\\)"):
            out.append({"key": "b"})
    finally:
        monkeypatch.undo()
        out.close()
    assert _records(tmp_path / "out.jsonl") == [{"key": "a"}]  # the failed record is cut off again


def _small_filesystem(path: Path, size: str) -> bool:
    path.mkdir()
    if os.geteuid() != 0:
        return False
    return (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True
        ).returncode
        == 0
    )


def test_full_disk_exits_3_keeps_whole_records_and_a_rerun_finishes(
    tiny_dir, tmp_path, monkeypatch
):
    root, disk = _folder(tmp_path / "imgs", 12), tmp_path / "disk"
    real = _small_filesystem(disk, "8k")  # two pages: the lock file and a few records
    try:
        if not real:  # no tmpfs here: the same failure, injected after 3 records
            writes = {"n": 0}
            os_write = os.write

            def write(fd, data):
                writes["n"] += 1
                if writes["n"] > 3:
                    raise OSError(errno.ENOSPC, "No space left on device")
                return os_write(fd, data)

            monkeypatch.setattr("mmcli.jobs.records.os.write", write)
        out = disk / "out.jsonl"
        full = _caption(root, "-o", out, model=tiny_dir)
        assert full.exit_code == 3, full.output
        lines = full.output.strip().splitlines()
        assert len(lines) == 1 and "out.jsonl: cannot write (No space left on device)" in lines[0]
        first = _records(out)  # every line parses: whole records only
        assert 1 <= len(first) < 12
        if real:
            subprocess.run(["mount", "-o", "remount,size=1m", str(disk)], check=True)
        else:
            monkeypatch.undo()
        assert _caption(root, "-o", out, model=tiny_dir).exit_code == 0
        assert sorted(r["key"] for r in _records(out)) == [
            f"im{i}.jpg" for i in sorted(range(12), key=str)
        ]
    finally:
        if real:
            # even if a failed run left a file open
            subprocess.run(["umount", "--lazy", str(disk)], check=False)


def test_a_sidecar_is_written_before_its_record_and_its_failure_exits_3(tiny_dir, tmp_path):
    root, out = _folder(tmp_path / "imgs"), tmp_path / "out.jsonl"
    (root / "im1.txt").mkdir()  # the sidecar cannot be written there
    result = _caption(root, "-o", out, "--sidecar", ".txt", model=tiny_dir)
    assert result.exit_code == 3 and "im1.txt: cannot write the sidecar" in result.output
    assert [r["key"] for r in _records(out)] == ["im0.jpg"]  # no record without its sidecar
    (root / "im1.txt").rmdir()
    assert _caption(root, "-o", out, "--sidecar", ".txt", model=tiny_dir).exit_code == 0
    assert (root / "im1.txt").read_text() == _records(out)[-1]["text"] + "\n"


def test_two_images_with_one_sidecar_path(tiny_dir, tmp_path):
    root, out = _folder(tmp_path / "imgs", 1), tmp_path / "out.jsonl"
    photo("chelsea.jpg", (64, 64)).save(root / "im0.png")
    assert _caption(root, "-o", out, "--sidecar", ".txt", model=tiny_dir).exit_code == 1
    records = {r["key"]: r for r in _records(out)}
    assert (
        records["im0.jpg"]["status"] == "ok"
        and (root / "im0.txt").read_text() == records["im0.jpg"]["text"] + "\n"
    )
    assert (
        records["im0.png"]["status"] == "error"
        and "is also the sidecar of im0.jpg" in records["im0.png"]["error"]["message"]
    )


def test_a_failed_open_releases_the_lock_and_the_torn_line_is_durable_first(tmp_path, monkeypatch):
    out = tmp_path / "out.jsonl"
    out.write_text('{"key": "a"}\n{"key": "b", "tor')
    order = []
    real_fsync = os.fsync
    monkeypatch.setattr(
        os,
        "fsync",
        lambda fd: (
            order.append((os.readlink(f"/proc/self/fd/{fd}"), out.stat().st_size)),
            real_fsync(fd),
        ),
    )
    monkeypatch.setattr(os, "replace", os.replace)
    first = JsonlOutput(out).open()
    first.close()
    side, size_then = order[0]
    # fsynced before the truncate
    assert ".torn-" in side and size_then == len('{"key": "a"}\n{"key": "b", "tor')
    out.write_text('{"key": "a"}\n{"key": "c", "tor')

    def broken_repair(self):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(JsonlOutput, "_repair_torn_tail", broken_repair)
    with pytest.raises(OutputError, match="Read-only file system"):
        JsonlOutput(out).open()
    monkeypatch.undo()
    JsonlOutput(out).open().close()  # the lock was released


def test_several_roots_prefix_their_keys_and_a_clash_is_refused(tmp_path):
    a, b = _folder(tmp_path / "a", 1), _folder(tmp_path / "b", 1)
    assert [k for k, _ in scan([a, b])] == ["a/im0.jpg", "b/im0.jpg"]
    assert [k for k, _ in scan([a])] == ["im0.jpg"]
    twin = _folder(tmp_path / "elsewhere" / "a", 1)
    with pytest.raises(ConfigError, match="both give the key 'a/im0.jpg'"):
        scan([a, twin])
    result = CliRunner().invoke(
        app, ["caption", str(a), str(twin), "--dry-run", "-o", str(tmp_path / "o.jsonl")]
    )
    assert result.exit_code == 2 and "both give the key" in result.output


def test_the_compile_digest_covers_every_module_a_graph_runs(tmp_path, monkeypatch):
    import mmcli.compiled.graphs as compiled
    from mmcli.compiled.graphs import Bucket, CompiledGraphs

    assert {
        "compiled/steps.py",
        "model/linear.py",
        "model/text.py",
        "model/vision.py",
        "model/attention.py",
    } <= set(compiled.compiled_sources(compiled.PACKAGE_ROOT))
    copy = Path(shutil.copytree(compiled.PACKAGE_ROOT, tmp_path / "pkg"))
    graphs = CompiledGraphs(
        "inductor",
        tmp_path / "cache",
        {"model_config": "m", "device": "cpu"},
        [Bucket("decode", (1, 64))],
    )
    artifact = graphs.cache_dir / "a"
    monkeypatch.setattr(graphs, "_artifacts", lambda: {"a"} if artifact.exists() else set())
    assert graphs.compile_bucket(graphs.buckets[0], lambda b: artifact.write_text("x"))[0] == "new"
    package_root = compiled.PACKAGE_ROOT
    for edited in ("model/linear.py", "compiled/steps.py"):
        target = copy / edited
        target.write_text(target.read_text() + "\n# edited\n")
        monkeypatch.setattr(compiled, "PACKAGE_ROOT", copy)
        assert graphs.status(graphs.buckets[0], graphs.manifest.entries()) == ("stale", ["source"])
        monkeypatch.setattr(compiled, "PACKAGE_ROOT", package_root)
        shutil.copy(package_root / edited, target)


def test_duplicate_keys_are_refused_before_any_work(tiny_dir):
    from mmcli import Labeler

    cap = Labeler.from_pretrained(str(tiny_dir), dtype="float32", device="cpu")
    image = SAMPLES / "coffee.jpg"
    with pytest.raises(ValueError, match="key 'a' is given twice"):
        next(iter(cap.label([("a", image), ("b", image), ("a", image)])))
    assert cap.runner.images_encoded == 0


def test_caption_help_shows_the_install_extra():
    result = CliRunner().invoke(app, ["caption", "--help"], terminal_width=100)
    assert result.exit_code == 0 and "pip install 'mmcli[ray]'" in result.output
