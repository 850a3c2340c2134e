"""The kernel that multiplies 4-bit and Q6_K tiles on this machine: AMX where granted, else AVX-512, else
AVX2 (each within what `SPECDRAFT_ISA` allows), or None where only PyTorch's kernels run."""

from __future__ import annotations

from types import ModuleType

from specdraft.kernels import amx_tiles, avx2_tiles, avx512_tiles

KERNELS = (amx_tiles, avx512_tiles, avx2_tiles)  # fastest first; each has matmul (4-bit) and q6k_matmul


def tile_kernel() -> ModuleType | None:
    """The fastest tile kernel module that runs here, or None."""
    return next((kernel for kernel in KERNELS if kernel.available()), None)


def kernel_name(kernel: ModuleType | None) -> str:
    """A kernel module's short name (`amx`, `avx512`, `avx2`), `torch` for None."""
    return "torch" if kernel is None else kernel.__name__.rsplit(".", 1)[-1].removesuffix("_tiles")
