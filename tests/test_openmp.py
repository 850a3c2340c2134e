"""Releasing the main thread's OpenMP pool before the server's engine thread starts (kernels/openmp.py)."""

from __future__ import annotations

import threading

import torch

from specdraft.kernels import openmp


def test_the_runtimes_are_read_from_the_process_maps(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0\n"
        "7f01-7f02 r--p 00001000 08:01 1 /usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /site-packages/torch/lib/libgomp.so.1\n"
        "7f03-7f04 r-xp 00000000 08:01 3 /usr/lib/libc.so.6\n"
        "7f04-7f05 rw-p 00000000 00:00 0 [heap]\n")
    assert openmp.loaded_runtimes(maps) == ["/site-packages/torch/lib/libgomp.so.1",
                                            "/usr/lib/x86_64-linux-gnu/libgomp.so.1.0.0"]
    assert openmp.loaded_runtimes(tmp_path / "absent") == []


def test_a_thread_releases_its_pool_and_parallel_work_still_runs_after():
    """Each loaded libgomp frees the calling thread's workers; a later parallel region starts them again."""
    x = torch.randn(512, 512)
    expected = x @ x
    results = {}

    def work():
        torch.mm(x, x)  # a parallel region: this thread now has a pool
        results["released"] = openmp.release_thread_pool()
        results["after"] = torch.mm(x, x)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    with_pause = [path for path in openmp.loaded_runtimes() if hasattr(openmp.ctypes.CDLL(path),
                                                                         "omp_pause_resource_all")]
    assert results["released"] == len(with_pause)
    torch.testing.assert_close(results["after"], expected)
