"""The host memory of a run on the CPU: the allocator's setting, and the weights' pages mapped in.

glibc's malloc hands each block over its mmap threshold (a few MB, raised as blocks are freed)
back to the kernel when freed, and trims the heap's free top, so every activation of a
prefill's size is mapped afresh and page-faulted on first write (docs/performance.md has the
cost). Keeping freed blocks in the heap costs at most one forward pass's largest activations,
held until the process ends.

Quantizing at load frees a float32 copy of each weight as the next is made, between the kept
int8 ones: malloc keeps those holes (docs/performance.md has what they held), so the load hands
them back a layer at a time.

The weights are mapped from the checkpoint (or the prepared file) and their pages would enter
the page table one fault per 64 KiB during the first forward pass; one madvise a file enters
them all at once, in the kernel.

A decode step streams every weight once, and a file's mapped pages stream slower than anonymous
memory in 2 MiB pages: 20 against 28 GB/s on a 2-core AMX Xeon (docs/performance.md). A long
run copies its weights into such memory at load (the `weights_memory` setting); a short one
keeps them mapped, which loads at once. The KV cache, the step's other large read, is held in
such pages from the start (zeros_in_huge_pages).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import math
import mmap
import sys

import torch

MADV_POPULATE_READ = 22  # Linux 5.14 and later
PAGE = 4096
HUGE_PAGE = 2 << 20
# mallopt's parameters (malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 256 << 20  # a block over this (a whole weight, the KV cache) is still mapped
TRIM_THRESHOLD = 1 << 30


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    except OSError:
        return None


def populate(extents: list[tuple[int, int]]) -> bool:
    """Enter the pages of these (address, bytes) extents into the page table now, reading what
    the page cache lacks; adjacent extents (one file's tensors) in one call. False where the
    kernel cannot (older than 5.14, or not Linux): the pages then come in as they are touched."""
    libc = _libc()
    if libc is None:
        return False
    merged: list[list[int]] = []
    for start, size in sorted(extents):
        start, end = start // PAGE * PAGE, -(-(start + size) // PAGE) * PAGE
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return all(libc.madvise(start, end - start, MADV_POPULATE_READ) == 0 for start, end in merged)


@functools.cache
def keep_freed_memory() -> bool:
    """Ask glibc to keep freed activation memory for reuse; False where malloc is not glibc's
    (the run goes on as before)."""
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:  # not Linux, or not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )


def release_freed_memory() -> bool:
    """Hand the pages of malloc's free blocks back to the kernel (glibc's malloc_trim); False
    where malloc is not glibc's."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def _huge_page_region(size: int) -> tuple[torch.Tensor, int] | None:
    """An untouched anonymous mapping of `size` bytes and more, advised into 2 MiB pages, as a
    uint8 tensor that holds it (unmapped with its last holder), and the offset of its first
    2 MiB boundary; None where the kernel takes no such advice or the mapping is refused."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):  # Linux's advice only
        return None
    try:  # a mapping of its own, untouched (malloc may hand back used heap): advised before a fault
        mapping = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError:  # refused (no overcommit)
        return None
    region = torch.frombuffer(mapping, dtype=torch.uint8)
    place = -region.data_ptr() % HUGE_PAGE
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, place, size)
    except OSError:  # transparent huge pages not built in
        return None
    return region, place


def zeros_in_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor in anonymous memory advised into 2 MiB pages (a fresh mapping reads as
    zeros: nothing is written), where the kernel takes the advice; torch.zeros elsewhere."""
    size = math.prod(shape) * dtype.itemsize
    held = _huge_page_region(size) if size >= HUGE_PAGE else None
    if held is None:
        return torch.zeros(shape, dtype=dtype)
    region, place = held
    return region[place : place + size].view(dtype).view(shape)


def hold_in_huge_pages(tensors: list[torch.Tensor]) -> bool:
    """Copy these tensors' storages into one anonymous region in 2 MiB pages and point each
    tensor at its copy, in place (every holder of a tensor sees it moved), a storage at a time:
    each old one is freed, or its file's pages unmapped, with its last holder, so the load holds
    little more than one copy. False, nothing moved, where the kernel takes no such advice (not
    Linux, or transparent huge pages not built in) or the region cannot be had."""
    holders: dict[int, list[torch.Tensor]] = {}
    # a view holds its base, and with it the old storage: the bases move too
    bases = [t._base for t in tensors if t._base is not None]
    for tensor in {id(t): t for t in [*tensors, *bases]}.values():
        if tensor.untyped_storage().nbytes():
            holders.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
    if not holders:
        return False
    sizes = {address: ts[0].untyped_storage().nbytes() for address, ts in holders.items()}
    size = sum(-(-n // 64) * 64 for n in sizes.values())  # each storage on lines of its own
    region_place = _huge_page_region(size)
    if region_place is None:  # the weights stay where they are
        return False
    region, place = region_place
    held = region.untyped_storage()
    with torch.no_grad():
        for address, holding in sorted(holders.items()):
            source = torch.empty(0, dtype=torch.uint8).set_(holding[0].untyped_storage())
            region[place : place + sizes[address]].copy_(source)
            for tensor in holding:
                byte = place + tensor.storage_offset() * tensor.itemsize
                tensor.set_(held, byte // tensor.itemsize, tensor.shape, tensor.stride())
            place += -(-sizes[address] // 64) * 64
    return True
