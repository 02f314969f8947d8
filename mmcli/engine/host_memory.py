"""The host allocator's setting for a run on the CPU.

glibc's malloc hands each block over its mmap threshold (a few MB, raised as blocks are freed)
back to the kernel when freed, and trims the heap's free top, so every activation of a
prefill's size is mapped afresh and page-faulted on first write: 10-20% of the vision tower's
and the prefill's time on a 2-core machine (bench/cpu.py). Keeping freed blocks in the heap
costs at most one forward pass's largest activations, held until the process ends.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 256 << 20  # a block over this (a whole weight, the KV cache) is still mapped
TRIM_THRESHOLD = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Ask glibc to keep freed activation memory for reuse; False where malloc is not glibc's
    (the run goes on as before)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
