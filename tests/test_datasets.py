"""Datasets where they live: WebDataset shards (written by webdataset's own TarWriter) and Parquet
(written by pyarrow and by `datasets`) labeled in place, resumed, broken, and exported back."""

import functools
import io
import json
import signal
import subprocess
import tarfile
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import caption_cli, caption_process, photo, read_records
from typer.testing import CliRunner

from mmcli.cli.app import app

NAMES = ["astronaut.jpg", "chelsea.jpg", "coffee.jpg", "rocket.jpg"]


def _jpegs(n):
    """n distinct JPEG files' bytes (as a folder would hold them)."""
    out = []
    for i in range(n):
        buffer = io.BytesIO()
        photo(NAMES[i % 4], (64 + 8 * i, 48)).save(buffer, "JPEG")
        out.append(buffer.getvalue())
    return out


def _shards(folder, images, per_shard=3, text=True):
    import webdataset as wds

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for s in range(0, len(images), per_shard):
        path = folder / f"{s // per_shard:05d}.tar"
        with wds.TarWriter(str(path)) as sink:
            for k, data in enumerate(images[s : s + per_shard], start=s):
                sample = {"__key__": f"{k:09d}", "jpg": data, "json": {"k": k}}
                if text:
                    sample["txt"] = f"old caption {k}"
                sink.write(sample)
        paths.append(path)
    return paths


# the caption runs of these tests: 4 new tokens, quiet
_caption = functools.partial(caption_cli, max_new_tokens=4)


def test_a_folder_shards_and_parquet_give_the_same_texts(tiny_dir, tmp_path):
    from datasets import Dataset, Image

    images = _jpegs(5)
    folder = tmp_path / "folder"
    folder.mkdir()
    for k, data in enumerate(images):
        (folder / f"{k:09d}.jpg").write_bytes(data)
    _shards(tmp_path / "shards", images)
    pq.write_table(
        pa.table({"key": [f"{k}" for k in range(5)], "jpg": images}),
        tmp_path / "plain.parquet",
        row_group_size=2,
    )
    hf = Dataset.from_dict(
        {"image": [{"bytes": d, "path": f"{k:09d}.jpg"} for k, d in enumerate(images)]}
    ).cast_column("image", Image())
    hf.to_parquet(str(tmp_path / "hf.parquet"))
    runs = {}
    for name, source in (
        ("folder", folder),
        ("shards", tmp_path / "shards/{00000..00001}.tar"),
        ("plain", tmp_path / "plain.parquet"),
        ("hf", tmp_path / "hf.parquet"),
    ):
        out = tmp_path / f"{name}.jsonl"
        result = _caption(source, "-o", out, model=tiny_dir)
        assert result.exit_code == 0, result.output
        runs[name] = [r["text"] for r in sorted(read_records(out), key=lambda r: r["key"])]
    assert runs["folder"] == runs["shards"] == runs["plain"] == runs["hf"]
    shard_keys = sorted(r["key"] for r in read_records(tmp_path / "shards.jsonl"))
    assert shard_keys[:2] == ["00000/000000000", "00000/000000001"]
    assert [r["key"] for r in read_records(tmp_path / "plain.jsonl")][:2] == ["plain/0", "plain/1"]
    named = tmp_path / "named.jsonl"
    prompt = ["--prompt", "Describe {filename} of {folder}."]
    assert _caption(tmp_path / "hf.parquet", "-o", named, *prompt, model=tiny_dir).exit_code == 0
    # {filename} from the image struct's path, {folder} the Parquet file's name
    assert "Describe 000000000.jpg of hf." in {r["prompt"] for r in read_records(named)}


def test_sidecar_reads_the_samples_txt_member(tiny_dir, tmp_path):
    _shards(tmp_path / "s", _jpegs(2))
    out = tmp_path / "out.jsonl"
    result = _caption(
        tmp_path / "s/00000.tar", "-o", out, "--prompt", "Improve: {sidecar}", model=tiny_dir
    )
    assert result.exit_code == 0, result.output
    assert sorted(r["prompt"] for r in read_records(out)) == [
        "Improve: old caption 0",
        "Improve: old caption 1",
    ]


def test_resume_over_shards_redoes_only_an_edited_shard(tiny_dir, tmp_path):
    shards = _shards(tmp_path / "s", _jpegs(6))
    out = tmp_path / "out.jsonl"
    pattern = tmp_path / "s/*.tar"
    assert _caption(pattern, "-o", out, model=tiny_dir).exit_code == 0
    assert len(read_records(out)) == 6
    assert _caption(pattern, "-o", out, model=tiny_dir).exit_code == 0
    assert len(read_records(out)) == 6  # nothing to do, nothing decoded
    _shards(tmp_path / "s", _jpegs(6)[3:] + _jpegs(1), per_shard=4)  # 00000.tar rewritten
    assert shards[0].stat().st_size > 0
    assert _caption(pattern, "-o", out, model=tiny_dir).exit_code == 0
    redone = {r["key"] for r in read_records(out)[6:]}
    assert redone == {f"00000/{k:09d}" for k in range(4)}  # the edited shard, its new sample too


@pytest.mark.slow
def test_an_interrupted_shard_run_finishes_with_every_sample_once(tiny_dir, tmp_path):
    _shards(tmp_path / "s", _jpegs(24), per_shard=8)
    out, settings = tmp_path / "out.jsonl", tmp_path / "c.yaml"
    settings.write_text("engine:\n  max_seqs: 4\n")  # six waves: the kill lands within the run
    cmd = caption_process(
        tmp_path / "s/*.tar", "-o", out, "-c", settings, model=tiny_dir, max_new_tokens=24
    )
    proc = subprocess.Popen(cmd)
    deadline = time.time() + 120
    while time.time() < deadline and (not out.exists() or len(out.read_text().splitlines()) < 3):
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait(60)
    assert 3 <= len(out.read_text().splitlines()) < 24
    assert subprocess.run(cmd, timeout=300).returncode == 0
    keys = [r["key"] for r in read_records(out)]
    assert sorted(keys) == sorted(set(keys)) and len(keys) == 24


def test_broken_shards_and_parquet_are_clear_errors_and_the_run_goes_on(tiny_dir, tmp_path):
    images = _jpegs(4)
    (good,) = _shards(tmp_path / "s", images, per_shard=4)
    data = good.read_bytes()
    (tmp_path / "s/cut.tar").write_bytes(data[: len(data) // 2])
    with tarfile.open(tmp_path / "s/odd.tar", "w") as tar:
        for name, payload in (
            ("a.txt", b"no image here"),
            ("b.jpg", b"not a jpeg"),
            ("c.jpg", images[0]),
        ):
            info = tarfile.TarInfo(name)
            info.size = len(payload)
            tar.addfile(info, io.BytesIO(payload))
    (tmp_path / "s/junk.parquet").write_bytes(b"PAR1 this is not parquet")
    out = tmp_path / "out.jsonl"
    result = _caption(tmp_path / "s/*", "-o", out, model=tiny_dir)
    assert result.exit_code == 1, result.output
    records = {r["key"]: r for r in read_records(out)}
    cut = [k for k in records if k.startswith("cut/")]
    assert "cut/#damaged" in cut and len(cut) >= 2  # samples before the damage, then one error
    assert "damaged tar" in records["cut/#damaged"]["error"]["message"]
    assert "cut.tar" in records["cut/#damaged"]["error"]["message"]
    assert "has no image or video member" in records["odd/a"]["error"]["message"]
    assert "odd.tar:b.jpg" in records["odd/b"]["error"]["message"]
    assert records["odd/c"]["status"] == "ok"
    assert "not a readable Parquet file" in records["junk/#unreadable"]["error"]["message"]
    assert all(records[f"00000/{k:09d}"]["status"] == "ok" for k in range(4))


def test_a_parquet_file_without_the_column_exits_2_listing_the_columns(tiny_dir, tmp_path):
    pq.write_table(pa.table({"id": [1], "caption": ["x"]}), tmp_path / "t.parquet")
    result = _caption(tmp_path / "t.parquet", "-o", tmp_path / "o.jsonl", model=tiny_dir)
    assert (
        result.exit_code == 2 and "no column of image bytes (columns: id, caption)" in result.output
    )
    named = _caption(
        tmp_path / "t.parquet", "-o", tmp_path / "o.jsonl", "--image-column", "pic", model=tiny_dir
    )
    assert named.exit_code == 2 and "no column 'pic'" in named.output


def test_label_shards_pair_with_the_originals(tiny_dir, tmp_path):
    import webdataset as wds

    _shards(tmp_path / "s", _jpegs(4), per_shard=2)
    out = tmp_path / "out.jsonl"
    tasks = ["--task", "caption", "--task", "tags"]
    assert _caption(tmp_path / "s/*.tar", "-o", out, *tasks, model=tiny_dir).exit_code == 0
    assert (
        CliRunner()
        .invoke(app, ["export", str(out), str(tmp_path / "l"), "--to", "webdataset"])
        .exit_code
        == 0
    )
    assert (
        CliRunner()
        .invoke(
            app, ["export", str(out), str(tmp_path / "m"), "--to", "webdataset", "--with-media"]
        )
        .exit_code
        == 0
    )
    texts = {r["key"].split("/")[1]: r["text"] for r in read_records(out) if r["task"] == "caption"}
    labels = list(wds.WebDataset(str(tmp_path / "l/{00000..00001}.tar"), shardshuffle=False))
    assert {s["__key__"]: s["caption.txt"].decode() for s in labels} == texts
    media = list(wds.WebDataset(str(tmp_path / "m/{00000..00001}.tar"), shardshuffle=False))
    originals = list(wds.WebDataset(str(tmp_path / "s/{00000..00001}.tar"), shardshuffle=False))
    assert [s["jpg"] for s in media] == [s["jpg"] for s in originals]  # byte for byte
    assert all({"jpg", "txt", "json", "caption.txt", "tags.txt"} <= set(s) for s in media)
    stats = json.loads((tmp_path / "l/00000_stats.json").read_text())
    assert stats["samples"] == 2 and stats["ok"] == 4 and stats["failed"] == 0


def test_the_review_page_shows_shard_and_parquet_samples(tiny_dir, tmp_path):
    import threading
    import urllib.request

    from mmcli.review.server import ReviewServer
    from mmcli.review.store import ReviewStore

    images = _jpegs(2)
    _shards(tmp_path / "s", images)
    pq.write_table(pa.table({"jpg": images}), tmp_path / "t.parquet")
    out = tmp_path / "out.jsonl"
    for source in (tmp_path / "s/00000.tar", tmp_path / "t.parquet"):
        assert _caption(source, "-o", out, model=tiny_dir).exit_code == 0
    server = ReviewServer(ReviewStore([out]), "127.0.0.1", 0, 1 << 27)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for key in ("00000/000000001", "t/1"):
            url = f"{server.url}media/{server.store.index[key]}"
            with urllib.request.urlopen(url) as response:
                assert response.status == 200 and response.read()[:2] == b"\xff\xd8"
    finally:
        server.shutdown()
        server.server_close()


def test_plan_and_dry_run_take_shards(tiny_dir, tmp_path):
    _shards(tmp_path / "s", _jpegs(3))
    plan = CliRunner().invoke(app, ["plan", str(tmp_path / "s/00000.tar")])
    assert plan.exit_code == 0 and "3 images" in plan.output
    dry = CliRunner().invoke(
        app,
        [
            "caption",
            str(tmp_path / "s/00000.tar"),
            "-o",
            str(tmp_path / "o.jsonl"),
            "--dry-run",
            "--shard",
            "0/1",
            "--model",
            str(tiny_dir),
        ],
    )
    assert dry.exit_code == 0 and "00000/000000002" in dry.output


@pytest.mark.slow
@pytest.mark.xdist_group("ray")  # with test_ray.py's runs: one worker, one Ray instance
def test_ray_replicas_read_their_own_shards(tiny_dir, tmp_path, ray_instance):
    _shards(tmp_path / "s", _jpegs(6))
    local, remote = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    base = caption_process(tmp_path / "s/*.tar", model=tiny_dir, max_new_tokens=4)
    assert subprocess.run([*base, "-o", str(local)], timeout=300).returncode == 0
    ray = [*base, "-o", str(remote), *ray_instance["flags"]]
    assert subprocess.run(ray, timeout=600, env=ray_instance["env"]).returncode == 0
    ours = {r["key"]: r["text"] for r in read_records(remote)}
    assert len(ours) == 6 and ours == {r["key"]: r["text"] for r in read_records(local)}
