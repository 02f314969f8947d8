"""The JSONL output: one locked writer, whole fsynced records, torn lines set aside, disk errors
that stop the run with nothing lost, sidecars written before their records."""

import errno
import os
import subprocess
from pathlib import Path

import pytest
from conftest import SAMPLES, caption_cli, image_folder, photo, read_records
from typer.testing import CliRunner

from mmcli.cli.app import app
from mmcli.errors import OutputError
from mmcli.jobs.records import JsonlOutput, append_record


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
    assert [r["task"] for r in read_records(out)] == ["ask"]
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
    assert read_records(tmp_path / "out.jsonl") == [
        {"key": "a"}
    ]  # the failed record is cut off again


def _small_filesystem(path: Path, size: str) -> bool:
    """A tmpfs of `size` mounted at `path` (root only); False where none can be."""
    path.mkdir()
    if os.geteuid() != 0:
        return False
    mount = ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)]
    return subprocess.run(mount, capture_output=True).returncode == 0


def test_full_disk_exits_3_keeps_whole_records_and_a_rerun_finishes(
    tiny_dir, tmp_path, monkeypatch
):
    root, disk = image_folder(tmp_path / "imgs", 12), tmp_path / "disk"
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
        full = caption_cli(root, "-o", out, model=tiny_dir)
        assert full.exit_code == 3, full.output
        lines = full.output.strip().splitlines()
        assert len(lines) == 1 and "out.jsonl: cannot write (No space left on device)" in lines[0]
        first = read_records(out)  # every line parses: whole records only
        assert 1 <= len(first) < 12
        if real:
            subprocess.run(["mount", "-o", "remount,size=1m", str(disk)], check=True)
        else:
            monkeypatch.undo()
        assert caption_cli(root, "-o", out, model=tiny_dir).exit_code == 0
        assert sorted(r["key"] for r in read_records(out)) == [
            f"im{i}.jpg" for i in sorted(range(12), key=str)
        ]
    finally:
        if real:
            # even if a failed run left a file open
            subprocess.run(["umount", "--lazy", str(disk)], check=False)


def test_a_sidecar_is_written_before_its_record_and_its_failure_exits_3(tiny_dir, tmp_path):
    root, out = image_folder(tmp_path / "imgs"), tmp_path / "out.jsonl"
    (root / "im1.txt").mkdir()  # the sidecar cannot be written there
    result = caption_cli(root, "-o", out, "--sidecar", ".txt", model=tiny_dir)
    assert result.exit_code == 3 and "im1.txt: cannot write the sidecar" in result.output
    assert [r["key"] for r in read_records(out)] == ["im0.jpg"]  # no record without its sidecar
    (root / "im1.txt").rmdir()
    assert caption_cli(root, "-o", out, "--sidecar", ".txt", model=tiny_dir).exit_code == 0
    assert (root / "im1.txt").read_text() == read_records(out)[-1]["text"] + "\n"


def test_two_images_with_one_sidecar_path(tiny_dir, tmp_path):
    root, out = image_folder(tmp_path / "imgs", 1), tmp_path / "out.jsonl"
    photo("chelsea.jpg", (64, 64)).save(root / "im0.png")
    assert caption_cli(root, "-o", out, "--sidecar", ".txt", model=tiny_dir).exit_code == 1
    records = {r["key"]: r for r in read_records(out)}
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
