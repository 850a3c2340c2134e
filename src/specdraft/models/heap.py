"""Keeping the process's resident memory near its live size while weights load (glibc only)."""

from __future__ import annotations

import contextlib
import ctypes
from functools import lru_cache

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
