"""Inputs ahead of the engine: each item's files are decoded, resized, patchified and tokenized
in worker threads, a bounded number of items ahead, so the engine computes while the next images
are prepared.

Pillow's decoders, numpy and torch release the GIL for their heavy parts, so threads overlap with
the model's work without copying tensors between processes. Items are submitted in key order; the
engine takes whichever is ready first (a slow file never holds back those behind it), and
`NOT_READY` tells it none is ready yet, so it goes on with the sequences it has instead of
waiting."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

NOT_READY = object()  # yielded when items are being prepared but none is finished


def default_workers(setting: int) -> int:
    """inputs.workers: 0 means one thread per core but one (the model's own threads use the cores
    too)."""
    return setting if setting > 0 else max(1, (os.cpu_count() or 2) - 1)


def prefetch(
    items: Iterable[Any], prepare: Callable[[Any], Any], workers: int, depth: int
) -> Iterator[tuple[Any, Any] | object]:
    """(item, prepare(item)) for every item, `prepare` running in `workers` threads at most
    `depth` items ahead. A ready item is yielded first (submission order among the ready ones);
    NOT_READY when none is ready yet; an exception raised by `prepare` is yielded as that item's
    result. Closing the iterator (Ctrl-C included) cancels what has not started."""
    source = iter(items)
    pending: deque[tuple[Any, Future]] = deque()
    pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="mmcli-input")
    try:
        while True:
            while len(pending) < depth:
                item = next(source, NOT_READY)
                if item is NOT_READY:
                    break
                pending.append((item, pool.submit(prepare, item)))
            if not pending:
                return
            ready = next((entry for entry in pending if entry[1].done()), None)
            if ready is None:
                yield NOT_READY
                continue
            pending.remove(ready)
            item, future = ready
            error = future.exception()
            yield item, error if error is not None else future.result()
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
