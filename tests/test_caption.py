"""`mmcli caption` end to end on a tiny checkpoint."""

import functools
import json
import os
import signal
import subprocess
import time

import numpy as np
import pytest
from conftest import SAMPLES, caption_cli, caption_process, encoded, photo, read_records
from PIL import Image
from typer.testing import CliRunner

from mmcli.cli.app import app
from mmcli.jobs.records import JsonlOutput
from mmcli.jobs.scan import scan, shard_of

# the caption runs of these tests: 4 new tokens, the progress and summary shown
_caption = functools.partial(caption_cli, max_new_tokens=4, quiet=False)


def _good_folder(root, n=5):
    root.mkdir(parents=True, exist_ok=True)
    names = ["astronaut.jpg", "chelsea.jpg", "coffee.jpg", "rocket.jpg"]
    for i in range(n):
        photo(names[i % 4], (64 + 16 * i, 48 + 8 * i)).save(root / f"good{i}.jpg")
    return root


def test_bad_inputs_become_error_records_and_the_run_goes_on(tiny_dir, tmp_path):
    root = _good_folder(tmp_path / "imgs")
    (root / "zero.jpg").write_bytes(b"")
    (root / "truncated.jpg").write_bytes(encoded(photo("coffee.jpg", (64, 64)), "JPEG")[:300])
    (root / "notes.jpg").write_text("this is a text file\n")
    Image.new("L", (2000, 2000)).save(root / "bomb.png")
    Image.new("RGB", (4020, 20)).save(root / "thin.png")
    os.symlink(root / "missing-target.jpg", root / "unreadable.jpg")
    photo("chelsea.jpg", (50, 40), "CMYK").save(root / "cmyk.tif")
    Image.fromarray(np.full((30, 40), 40000, np.uint16)).save(root / "grey16.png")
    photo("rocket.jpg", (40, 40)).convert("P", palette=Image.ADAPTIVE).save(root / "palette.png")
    photo("coffee.jpg", (40, 30), "LA").save(root / "grey_alpha.png")
    frames = [photo("chelsea.jpg", (32, 32)), photo("coffee.jpg", (32, 32))]
    frames[0].save(root / "anim.gif", save_all=True, append_images=frames[1:])
    cfg = tmp_path / "c.yaml"
    cfg.write_text("image:\n  max_decode_pixels: 1000000\n")
    out = tmp_path / "out.jsonl"
    result = _caption(root, "-o", out, "-c", cfg, "--quiet", model=tiny_dir)
    assert result.exit_code == 1, result.output
    records = {r["key"]: r for r in read_records(out)}
    assert len(records) == len(read_records(out)) == 16
    causes = {
        "zero.jpg": "empty file",
        "truncated.jpg": "corrupt or truncated",
        "notes.jpg": "not an image",
        "bomb.png": "decompression bomb",
        "thin.png": "aspect ratio",
        "unreadable.jpg": "unreadable",
    }
    for key, cause in causes.items():
        assert records[key]["status"] == "error" and cause in records[key]["error"]["message"], (
            records[key]
        )
    for key in [
        "good0.jpg",
        "good4.jpg",
        "cmyk.tif",
        "grey16.png",
        "palette.png",
        "grey_alpha.png",
        "anim.gif",
    ]:
        assert (
            records[key]["status"] == "ok"
            and records[key]["text"] is not None
            and records[key]["sha256"]
        )
    assert records["anim.gif"]["note"] == "first frame of 2 used"


def test_resume_prompt_change_and_overwrite(tiny_dir, tmp_path):
    root = _good_folder(tmp_path / "imgs", 3)
    out = tmp_path / "out.jsonl"
    assert _caption(root, "-o", out, "-q", model=tiny_dir).exit_code == 0
    assert len(read_records(out)) == 3
    assert _caption(root, "-o", out, "-q", model=tiny_dir).exit_code == 0
    assert len(read_records(out)) == 3  # nothing redone
    assert (
        _caption(root, "-o", out, "-q", "--prompt", "Name the colours.", model=tiny_dir).exit_code
        == 0
    )
    records = read_records(out)
    assert len(records) == 6 and {r["prompt"] for r in records[3:]} == {"Name the colours."}
    assert _caption(root, "-o", out, "-q", "--overwrite", model=tiny_dir).exit_code == 0
    assert len(read_records(out)) == 9


def test_retry_errors_only_when_asked(tiny_dir, tmp_path):
    root = _good_folder(tmp_path / "imgs", 1)
    (root / "bad.jpg").write_bytes(b"")
    out = tmp_path / "out.jsonl"
    assert _caption(root, "-o", out, "-q", model=tiny_dir).exit_code == 1
    assert (
        _caption(root, "-o", out, "-q", model=tiny_dir).exit_code == 0
        and len(read_records(out)) == 2
    )
    assert _caption(root, "-o", out, "-q", "--retry-errors", model=tiny_dir).exit_code == 1
    records = read_records(out)
    assert (
        len(records) == 3 and records[-1]["key"] == "bad.jpg" and records[-1]["status"] == "error"
    )


def test_second_concurrent_run_exits_2_and_writes_nothing(tiny_dir, tmp_path):
    root = _good_folder(tmp_path / "imgs", 2)
    out = tmp_path / "out.jsonl"
    holder = JsonlOutput(out).open()  # another run holds the output
    try:
        result = _caption(root, "-o", out, model=tiny_dir)
    finally:
        holder.close()
    assert result.exit_code == 2 and f"pid {os.getpid()}" in result.output
    assert out.read_text() == ""


def test_torn_last_line_is_set_aside(tiny_dir, tmp_path):
    root = _good_folder(tmp_path / "imgs", 2)
    out = tmp_path / "out.jsonl"
    assert _caption(root, "-o", out, "-q", "--limit", "1", model=tiny_dir).exit_code == 0
    with open(out, "a") as f:
        f.write('{"schema": 1, "key": "good1.jpg", "status": "o')  # a crash mid-write
    assert _caption(root, "-o", out, "-q", model=tiny_dir).exit_code == 0
    records = read_records(out)
    assert [r["key"] for r in records] == ["good0.jpg", "good1.jpg"] and all(
        r["status"] == "ok" for r in records
    )
    torn = list(tmp_path.glob("out.jsonl.torn-*"))
    assert len(torn) == 1 and torn[0].read_text().startswith('{"schema": 1, "key": "good1.jpg"')


def test_shards_cover_every_key_once(tmp_path):
    root = _good_folder(tmp_path / "imgs", 5)
    sub = root / "sub" / "deeper"
    sub.mkdir(parents=True)
    for i in range(12):
        Image.new("RGB", (8, 8)).save(sub / f"x{i}.png")
    (root / ".hidden.jpg").write_bytes(b"x")
    os.symlink(root, sub / "loop")  # a symlink loop is walked once
    keys = [k for k, _ in scan([root])]
    assert len(keys) == 17 and keys == sorted(keys) and not any(".hidden" in k for k in keys)
    shards = [{k for k in keys if shard_of(k, 3) == i} for i in range(3)]
    assert set().union(*shards) == set(keys) and sum(map(len, shards)) == len(keys)
    listed = [
        CliRunner()
        .invoke(
            app,
            [
                "caption",
                str(root),
                "--shard",
                f"{i}/3",
                "--dry-run",
                "-o",
                str(tmp_path / "o.jsonl"),
            ],
        )
        .output.split()
        for i in range(3)
    ]
    assert sorted(k for lst in listed for k in lst if k in keys) == keys


def test_sidecar_and_stdout(tiny_dir, tmp_path):
    root = _good_folder(tmp_path / "imgs", 1)
    result = _caption(root, "-o", "-", "-q", "--sidecar", ".txt", model=tiny_dir)
    assert result.exit_code == 0
    record = json.loads(result.output.strip().splitlines()[-1])
    assert (root / "good0.txt").read_text() == record["text"] + "\n"


def test_config_show(tmp_path):
    result = CliRunner().invoke(app, ["config", "show"])
    assert result.exit_code == 0 and "block_size: 5120" in result.output


def _interruptible() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL])
def test_killed_run_then_rerun_records_every_key_once(tiny_dir, tmp_path, sig):
    root = tmp_path / "imgs"
    root.mkdir()
    for i in range(40):
        photo(["astronaut.jpg", "chelsea.jpg", "coffee.jpg"][i % 3], (64 + i, 64)).save(
            root / f"{i:02d}.png"
        )
    out = tmp_path / "out.jsonl"
    config = SAMPLES.parent / "configs" / "default.yaml"
    cmd = caption_process(root, "-o", out, "-c", config, model=tiny_dir, max_new_tokens=24)
    # Ctrl-C's default restored in the run: a suite started in the background (`cmd &` in a
    # script) hands its processes SIGINT ignored, and Python then keeps it so
    proc = subprocess.Popen(cmd, preexec_fn=_interruptible)
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 5):
        time.sleep(0.05)
    proc.send_signal(sig)
    code = proc.wait(60)
    assert code == (130 if sig == signal.SIGINT else -signal.SIGKILL)
    partial = out.read_text().splitlines()
    assert 5 <= len(partial) < 40
    rerun = subprocess.run(cmd, timeout=300)
    assert rerun.returncode == 0
    records = read_records(out)
    assert sorted(r["key"] for r in records) == sorted(p.name for p in root.iterdir())
    assert all(r["status"] == "ok" for r in records)


def test_without_ray_installed_the_flag_says_how_to_install(monkeypatch, tmp_path):
    import builtins

    real_import = builtins.__import__

    def no_ray(name, *args, **kwargs):
        if name == "ray" or name.startswith("ray."):
            raise ImportError("no ray")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_ray)
    result = CliRunner().invoke(app, ["caption", str(tmp_path), "--ray"])
    assert result.exit_code == 2 and "pip install 'mmcli[ray]'" in result.output


def test_duplicate_keys_are_refused_before_any_work(tiny_dir):
    from mmcli import Labeler

    cap = Labeler.from_pretrained(str(tiny_dir), dtype="float32", device="cpu")
    image = SAMPLES / "coffee.jpg"
    with pytest.raises(ValueError, match="key 'a' is given twice"):
        next(iter(cap.label([("a", image), ("b", image), ("a", image)])))
    assert cap.runner.images_encoded == 0
