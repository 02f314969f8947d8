"""`mmcli caption --ray` on a local Ray instance (2 CPUs) and a tiny checkpoint."""

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import caption_process, photo, read_records

ray = pytest.importorskip("ray", reason="the ray extra is not installed")
# one worker takes every Ray run (one instance of 2 CPUs at a time)
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("ray")]


def _images(root: Path, n: int = 20) -> Path:
    root.mkdir()
    for i in range(n):
        photo(
            ["astronaut.jpg", "chelsea.jpg", "coffee.jpg", "rocket.jpg"][i % 4], (48 + 4 * i, 64)
        ).save(root / f"{i:02d}.png")
    return root


def _cmd(root, out, model, *extra):
    return caption_process(root, "-o", out, *extra, model=model, max_new_tokens=6)


def _env():
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # a local instance, started by the run
    return env


# Qwen3.5's MoE runs its dense family's layers too (the Sparse mixin), with its experts' custom
# op (kernels/experts.py) registered in each replica's process: the dense Qwen3.5 would add 30 s
# and nothing of Ray's
@pytest.mark.parametrize("family", ["qwen3_vl", "qwen3_5_moe"])
def test_ray_replicas_match_a_local_run_and_resume_does_nothing(
    request, family, tmp_path, ray_instance
):
    fixtures = {"qwen3_vl": "tiny_dir", "qwen3_5_moe": "moe_dir"}
    tiny_dir = request.getfixturevalue(fixtures[family])
    root = _images(tmp_path / "imgs")
    local, remote = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    assert subprocess.run(_cmd(root, local, tiny_dir), timeout=300).returncode == 0
    ray_cmd = _cmd(root, remote, tiny_dir, *ray_instance["flags"])
    env = ray_instance["env"]
    assert subprocess.run(ray_cmd, timeout=600, env=env).returncode == 0
    ours = {r["key"]: r for r in read_records(remote)}
    assert len(ours) == len(read_records(remote)) == 20 and all(
        r["status"] == "ok" for r in ours.values()
    )
    assert {k: r["text"] for k, r in ours.items()} == {
        r["key"]: r["text"] for r in read_records(local)
    }
    before = remote.read_text()
    rerun = subprocess.run(ray_cmd, timeout=600, env=env, capture_output=True, text=True)
    assert rerun.returncode == 0 and remote.read_text() == before  # resume: nothing to do


def _replica_pids() -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and b"CaptionReplica" in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_killing_a_replica_still_records_every_key_once(tiny_dir, tmp_path):
    """The run starts a local Ray instance of its own (the other runs here join the session's)"""
    root = _images(tmp_path / "imgs")
    out = tmp_path / "ray.jsonl"
    cmd = _cmd(root, out, tiny_dir, "--ray", "--replicas", "2", "--max-new-tokens", "40")
    earlier = set(_replica_pids())  # another run's, going away: never this run's to kill
    proc = subprocess.Popen(cmd, env=_env())
    deadline, killed = time.time() + 240, False
    while time.time() < deadline and proc.poll() is None and not killed:
        pids = [pid for pid in _replica_pids() if pid not in earlier]
        if pids and out.exists() and len(out.read_text().splitlines()) >= 2:
            os.kill(pids[0], signal.SIGKILL)
            killed = True
        time.sleep(0.1)
    assert killed, "no replica process was found while the run was going"
    assert proc.wait(600) == 0
    keys = [r["key"] for r in read_records(out)]
    assert (
        sorted(keys) == sorted(p.name for p in root.iterdir()) and len(keys) == len(set(keys)) == 20
    )


def test_ray_replicas_run_every_task_like_a_local_run(tiny_dir, tmp_path, ray_instance):
    root = _images(tmp_path / "imgs", 6)
    local, remote = tmp_path / "local.jsonl", tmp_path / "ray.jsonl"
    tasks = ("--task", "caption", "--task", "tags")
    assert subprocess.run(_cmd(root, local, tiny_dir, *tasks), timeout=300).returncode == 0
    ray_cmd = _cmd(root, remote, tiny_dir, *tasks, *ray_instance["flags"])
    assert subprocess.run(ray_cmd, timeout=600, env=ray_instance["env"]).returncode == 0
    ours = {(r["key"], r["task"]): r["text"] for r in read_records(remote)}
    assert len(ours) == len(read_records(remote)) == 12
    assert ours == {(r["key"], r["task"]): r["text"] for r in read_records(local)}
