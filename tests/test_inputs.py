"""Inputs prepared ahead of the engine in worker threads: order, a slow file, a failing worker,
closing early."""

import threading
import time

import pytest
from conftest import SAMPLES

from mmcli.api.labeler import Labeler
from mmcli.config import load_config
from mmcli.inputs.prefetch import NOT_READY, prefetch

NAMES = ["astronaut.jpg", "chelsea.jpg", "coffee.jpg", "rocket.jpg"]


def _labeler(path, workers, **settings):
    return Labeler.from_pretrained(
        str(path),
        config=load_config(
            None, {"dtype": "float32", "device": "cpu", "inputs": {"workers": workers}, **settings}
        ),
    )


def _items(n=6):
    return [(f"k{i}", SAMPLES / NAMES[i % 4]) for i in range(n)]


def test_results_are_the_same_with_any_number_of_workers(tiny_dir):
    runs = [
        {
            r.key: (r.token_ids, r.images)
            for r in _labeler(tiny_dir, workers).label(_items(), max_new_tokens=5)
        }
        for workers in (1, 3)
    ]
    assert runs[0] == runs[1] and sorted(runs[0]) == [f"k{i}" for i in range(6)]


def test_a_slow_file_does_not_hold_back_the_others(tiny_dir, monkeypatch):
    cap = _labeler(tiny_dir, 2, engine={"max_seqs": 2})
    prepare = cap.requests.for_tasks
    released = threading.Event()

    def slow_first(key, *args):
        if key == "k0":
            released.wait(20)  # stands in for a huge or slow file
        return prepare(key, *args)

    monkeypatch.setattr(cap.requests, "for_tasks", slow_first)
    order = []
    for result in cap.label(_items(4), max_new_tokens=3):
        order.append(result.key)
        if len(order) == 3:
            released.set()  # the others finished while k0 was still being read
    assert order[:3] == ["k1", "k2", "k3"] and order[3] == "k0"


def test_an_exception_in_a_worker_is_that_items_error(tiny_dir, monkeypatch):
    cap = _labeler(tiny_dir, 2)
    prepare = cap.requests.for_tasks

    def failing(key, *args):
        if key == "k2":
            raise RuntimeError("decoder crashed")
        return prepare(key, *args)

    monkeypatch.setattr(cap.requests, "for_tasks", failing)
    results = {r.key: r for r in cap.label(_items(4), max_new_tokens=3)}
    assert results["k2"].error == {"type": "RuntimeError", "message": "decoder crashed"}
    assert all(results[k].ok for k in ("k0", "k1", "k3"))


def test_the_engine_counts_the_time_it_waits_for_inputs(tiny_dir, monkeypatch):
    cap = _labeler(tiny_dir, 1)
    prepare = cap.requests.for_tasks
    monkeypatch.setattr(cap.requests, "for_tasks", lambda *a: (time.sleep(0.3), prepare(*a))[1])
    list(cap.label(_items(2), max_new_tokens=2))
    assert cap.engine.input_wait >= 0.25  # nothing to run until the first input was ready


def test_closing_early_cancels_what_has_not_started():
    started = []

    def prepare(item):
        started.append(item)
        time.sleep(0.05)
        return item * 2

    feed = prefetch(range(100), prepare, workers=2, depth=4)
    got = []
    for ready in feed:
        if ready is not NOT_READY:
            got.append(ready)
        if len(got) == 3:
            break
    feed.close()  # what Ctrl-C does to the generator
    time.sleep(0.2)
    assert all(result == item * 2 for item, result in got) and len(started) <= 8


@pytest.mark.parametrize("workers", [0, 2])
def test_workers_setting(workers):
    from mmcli.inputs.prefetch import default_workers

    assert default_workers(workers) >= 1 and (workers == 0 or default_workers(workers) == workers)
