"""Keeping the process's resident memory near its live size while weights load (glibc and Linux only)."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
from functools import lru_cache
from typing import Iterable

import torch

_M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


@lru_cache(maxsize=1)
def _libc():
    """glibc with `mallopt` and `malloc_trim`, or None elsewhere."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (both must exist)
        return libc
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """Give freed heap pages back to the OS (a loader calls it between tensors: the few-MiB
    temporaries of unpacking them otherwise pile up as freed but resident pages)."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


@contextlib.contextmanager
def compact_heap():
    """Load or convert weights without leaving the process at its loading peak.

    Inside, blocks from 4 MiB up are mapped on their own (glibc's threshold otherwise rises
    after large blocks are freed, and the loaders' slices of up to 32 MiB then fragment the
    heap: seen, a peak 1.4 GB above the live size while re-quantizing the draft's head).
    After, freed memory goes back to the OS and the threshold is set to 32 MiB, so decoding's
    short-lived buffers (up to a layer's unpacked weight in a prefill) are reused, not
    re-mapped. A no-op without glibc.
    """
    libc = _libc()
    if libc is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, 4 << 20)
    try:
        yield
    finally:
        if libc is not None:
            libc.malloc_trim(0)
            libc.mallopt(_M_MMAP_THRESHOLD, 32 << 20)


def _private_file_mappings() -> list[tuple[int, int]]:
    """This process's private mappings of regular files `(start, end)`, from /proc/self/maps ([] elsewhere, and
    without glibc, whose `madvise` gives their pages back)."""
    if _libc() is None:
        return []
    try:
        lines = open("/proc/self/maps").read().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[1][3] == "p" and fields[5].startswith("/"):
            start, end = (int(address, 16) for address in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def drops_file_pages() -> bool:
    """Whether `drop_file_pages` can give pages back here (Linux's /proc and glibc): where it cannot, a kept model is
    read, not mapped, or the pages of the projections the stacking replaces would stay resident."""
    return _libc() is not None and os.path.exists("/proc/self/maps")


def drop_file_pages(tensors: Iterable[torch.Tensor]) -> None:
    """Give back this process's pages of `tensors` that lie in a private file mapping (a kept packed model read with
    `mmap`, `packed_store.read`): for tensors no longer used, whose pages would otherwise stay resident while the
    mapping lives (it is shared by the whole file's tensors). Only whole pages inside a tensor are dropped, and a
    dropped page of a private file mapping reads the file again if touched, so nothing else can lose its bytes.
    Tensors in other memory are left to `trim_heap`."""
    mappings = _private_file_mappings()
    _drop(file_ranges(tensors, mappings), mappings)


def file_ranges(tensors: Iterable[torch.Tensor],
                mappings: list[tuple[int, int]] | None = None) -> list[tuple[int, int]]:
    """The address ranges `(start, end)` of the tensors' storages that lie in a private file mapping (under
    `torch.load(mmap=True)` a storage is its record's slice of the file), each once; `mappings`: those mappings,
    where the caller has read them."""
    if mappings is None:
        mappings = _private_file_mappings()
    found = set()
    for tensor in tensors:
        storage = tensor.untyped_storage()
        start = storage.data_ptr()
        end = start + storage.nbytes()
        if any(low <= start and end <= high for low, high in mappings):
            found.add((start, end))
    return sorted(found)


def drop_file_ranges(ranges: Iterable[tuple[int, int]]) -> None:
    """`drop_file_pages` of storages named by their address ranges (`file_ranges`), for those no longer held: only
    whole pages inside a range still lying in a private file mapping are given back."""
    _drop(ranges, _private_file_mappings())


def _drop(ranges: Iterable[tuple[int, int]], mappings: list[tuple[int, int]]) -> None:
    """madvise(DONTNEED) the whole pages inside each range that lies in one of `mappings` (private file mappings)."""
    if not mappings:
        return
    libc, page = _libc(), mmap.PAGESIZE
    for start, end in ranges:
        first, last = -(-start // page) * page, end // page * page  # the whole pages inside
        if last > first and any(low <= start and end <= high for low, high in mappings):
            libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), mmap.MADV_DONTNEED)
