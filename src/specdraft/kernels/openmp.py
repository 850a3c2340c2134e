"""OpenMP's thread pools, which the C kernels and PyTorch share (one libgomp in the process).

libgomp keeps a pool of worker threads for every thread that has started a parallel region. While it manages
more threads than the machine has CPUs, a worker waiting for the next region spins only about a hundred times
before it sleeps, so every region then pays a wake-up: a decoding pass runs hundreds of regions. The server
loads its models on the main thread (whose pool stays behind, idle) and decodes on an engine thread with a pool
of its own: on 2 cores that is one thread too many, and decoding measured 73 ms a token against 46-52 ms on the
main thread. `release_thread_pool()`, called on the main thread once loading is done, frees its pool.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what can be rebuilt


def loaded_runtimes(maps: Path = Path("/proc/self/maps")) -> list[str]:
    """Paths of the OpenMP runtimes (libgomp) loaded in this process (Linux; elsewhere none are found)."""
    try:
        lines = maps.read_text().splitlines()
    except OSError:
        return []
    paths = {line.split(maxsplit=5)[-1] for line in lines if "libgomp" in line and "/" in line}
    return sorted(path for path in paths if path.startswith("/"))


def release_thread_pool() -> int:
    """Free the OpenMP worker threads the calling thread started (`omp_pause_resource_all`, OpenMP 5.0); returns
    how many runtimes did so. A later parallel region on this thread starts a pool again."""
    released = 0
    for path in loaded_runtimes():
        pause = getattr(ctypes.CDLL(path), "omp_pause_resource_all", None)
        if pause is not None and pause(ctypes.c_int(OMP_PAUSE_SOFT)) == 0:
            released += 1
    return released
