"""The kernel that multiplies 4-bit and Q6_K tiles on this machine: AMX where granted, else AVX-512, else
AVX2 (each within what `SPECDRAFT_ISA` allows), or None where only PyTorch's kernels run."""

from __future__ import annotations

from types import ModuleType

from specdraft.errors import SpecdraftError
from specdraft.kernels import amx_tiles, avx2_prompt, avx2_tiles, avx512_tiles, isa, prompt_pass, vnni_tiles

KERNELS = (amx_tiles, avx512_tiles, avx2_tiles)  # fastest first; each has matmul (4-bit) and q6k_matmul


def tile_kernel() -> ModuleType | None:
    """The fastest tile kernel module that runs here, or None."""
    return next((kernel for kernel in KERNELS if kernel.available()), None)


def kernel_name(kernel: ModuleType | None) -> str:
    """A kernel module's short name (`amx`, `avx512`, `avx2`), `torch` for None."""
    return "torch" if kernel is None else kernel.__name__.rsplit(".", 1)[-1].removesuffix("_tiles")


def int8_every_pass() -> bool:
    """Whether every pass runs on int8 activations (`prompt_pass`'s `every`): the default where the AVX2 or the
    AVX-512 tile kernels run (with their int8 kernels: `avx2_prompt`, `vnni_tiles`), or as
    `SPECDRAFT_INT8_ACTIVATIONS` says (`every` where neither runs, e.g. on AMX, is an error)."""
    chosen = prompt_pass.configured()
    kernel = tile_kernel()
    runs_int8 = ((kernel is avx2_tiles and avx2_prompt.available())
                 or (kernel is avx512_tiles and vnni_tiles.available()))
    if chosen == "every" and not runs_int8:
        raise SpecdraftError(f"{prompt_pass.VARIABLE}=every runs on the AVX2 and AVX-512 VNNI kernels only (this "
                             f"machine runs {kernel_name(kernel)}): use prompt or none, or force {isa.VARIABLE}=avx2.")
    return runs_int8 if chosen is None else chosen == "every"
