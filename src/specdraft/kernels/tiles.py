"""The kernels that multiply 4-bit, 5-bit, Q6_K and dense (F16, BF16, F32) tiles: AMX where granted, else AVX-512, else
AVX2 (each within what the `NumericConfig` allows), or None where only PyTorch's kernels run. The dense tiles run on
the same code at every level (`native/shared/dense_tiles.h`).

- `AMX`: AMX's bf16 tiles (`native/avx512/amx_tiles.h`): a flat cost from 1 to 16 tokens.
- `AVX512`: AVX-512 dot products (`native/avx512/tiles.h`), a tile unpacked once per pass of up to 8 tokens; the dot
  product is `vpdpwssd` on each token's bf16 activations put on an int16 grid per 16 inputs (exact for every input
  within 2^7 of the largest of its 16; also on CPUs without AVX-512 BF16 in their dot products) or `vdpbf16ps` on x
  as it is (`NumericConfig.tile_dots`); in an int8 pass (`prompt_pass`), VNNI on int8 activations
  (`native/avx512/int8_tiles.h`).
- `AVX2`: AVX2 integer dot products (`native/avx2/tiles.h`) in their own layout (`int4_layout.QUADS`), the arithmetic
  of the AVX-512 int16 flavour (the same bits); int8 passes on `vpmaddubsw` or AVX-VNNI (`native/avx2/int8_tiles.h`).

Every kernel computes each token alone, so a verify pass agrees bit for bit with one-token decoding.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass, replace

import torch

from specdraft.errors import SpecdraftError
from specdraft.kernels import isa, numerics, prompt_pass
from specdraft.kernels.int4_layout import PAIRS, QUADS, PackedInt4, run_tile_kernel
from specdraft.kernels.numerics import NumericConfig


@dataclass(frozen=True)
class TileKernel:
    """One tile kernel: its name, the level of the library that has it, the tile layout it reads, the library
    functions for 4-bit, 5-bit and Q6_K tiles, and whether its int8 passes run on the library's int8 tiles."""

    name: str  # amx | avx512 | avx2
    level: str
    layout: str
    int4: str
    int5: str
    q6k: str
    int8: bool

    def library(self, config: NumericConfig | None = None) -> ctypes.CDLL | None:
        """The library that runs this kernel under `config` (default: `numerics.current()`), or None."""
        return (config or numerics.current()).library(self.level)

    def available(self, config: NumericConfig | None = None) -> bool:
        """Whether this kernel runs here under `config` (its library builds and loads, and the level is allowed)."""
        return self.library(config) is not None

    def _loaded(self) -> ctypes.CDLL:
        """The library a direct call runs on: the configuration's, whatever level it holds the choice of kernel to
        (`tile_kernel` is what respects the level; a test may call each kernel this CPU has)."""
        config = numerics.current()
        library = self.library(replace(config, isa=isa.detected()) if not config.allows(self.level) else config)
        if library is None:
            raise RuntimeError(f"the {self.name} tile kernels are not available on this machine")
        return library

    def _function(self, name: str):
        """Library function `name`, or in an int8 pass its int8 counterpart with the pass's leading 16-bit rows bound."""
        library, rows = self._loaded(), prompt_pass.precise_rows()
        if self.int8 and rows is not None:
            return prompt_pass.bound(getattr(library, name.replace("_matmul", "_q8_matmul")), rows)
        return getattr(library, name)

    def matmul(self, packed: PackedInt4, x: torch.Tensor) -> torch.Tensor:
        """`x @ W^T` for 4-bit (or 5-bit: `packed.bits`) tiles: x `[tokens, K]` (rounded to bf16) -> float32
        `[tokens, N]`."""
        return run_tile_kernel(self._function(self.int4 if packed.bits == 4 else self.int5), packed, x, self.layout)

    def q6k_matmul(self, tiles: torch.Tensor, d: torch.Tensor, x: torch.Tensor, out_features: int) -> torch.Tensor:
        """`x @ W^T` for Q6_K tiles (`gguf_matmul.pack_q6k`): x `[tokens, K]` (rounded to bf16) -> float32
        `[tokens, N]`."""
        return _run(self._function(self.q6k), (tiles, d), x, out_features)

    def dense_matmul(self, tiles: torch.Tensor, type_name: str, x: torch.Tensor, out_features: int) -> torch.Tensor:
        """`x @ W^T` for dense tiles of `type_name` (F16, BF16, F32: `dense_matmul.pack_dense`): x `[tokens, K]`
        (rounded to bf16) -> float32 `[tokens, N]`, in float32 on every pass (no int8 pass)."""
        return _run(getattr(self._loaded(), f"{type_name.lower()}_matmul"), (tiles,), x, out_features)

    def code_matmul(self, tiles: torch.Tensor, steps: torch.Tensor, type_name: str, x: torch.Tensor,
                    out_features: int) -> torch.Tensor:
        """`x @ W^T` for the code tiles of `type_name` (Q8_0, IQ4_NL, IQ4_XS: `int8_codes.pack_codes`; every
        library's): x `[tokens, K]` (rounded to bf16) -> float32 `[tokens, N]`, on int16 activations on every pass
        (no int8 pass)."""
        kernel = getattr(self._loaded(), "q8_0_matmul" if type_name == "Q8_0" else "iq4_matmul")
        return _run(kernel, (tiles, steps), x, out_features)

    def q4k_matmul(self, codes: torch.Tensor, marks: torch.Tensor, steps: torch.Tensor, x: torch.Tensor,
                   out_features: int, bits: int = 4) -> torch.Tensor:
        """`x @ W^T` for Q4_K tiles (Q5_K's where `bits` is 5: `q4k_tiles.pack_q4k`; every library has them): x
        `[tokens, K]` (rounded to bf16) -> float32 `[tokens, N]`, on int8 activations per 256 inputs inside a pass
        context (`prompt_pass`; its leading precise rows, and every row outside one, against the exact weights)."""
        rows = prompt_pass.precise_rows()
        kernel = self._loaded().q5k_matmul if bits == 5 else self._loaded().q4k_matmul
        return _run(prompt_pass.bound(kernel, x.shape[0] if rows is None else rows),
                    (codes, marks, steps), x, out_features)

    def q4_0_matmul(self, codes: torch.Tensor, steps: torch.Tensor, x: torch.Tensor, out_features: int,
                    bits: int = 4) -> torch.Tensor:
        """`x @ W^T` for Q4_0 tiles (Q5_0's where `bits` is 5: `q4k_tiles.pack_q4_0`; every library has them): x
        `[tokens, K]` (rounded to bf16) -> float32 `[tokens, N]`, on int8 activations per 32 inputs as `q4k_matmul`."""
        rows = prompt_pass.precise_rows()
        kernel = self._loaded().q5_0_matmul if bits == 5 else self._loaded().q4_0_matmul
        return _run(prompt_pass.bound(kernel, x.shape[0] if rows is None else rows),
                    (codes, steps), x, out_features)

    def __reduce__(self):  # a pickled module's kernel comes back as the one below of its name
        return kernel_named, (self.name,)


def _run(kernel, weights: tuple[torch.Tensor, ...], x: torch.Tensor, out_features: int) -> torch.Tensor:
    """`kernel(*weights, x, y, N, K, tokens)` (the slots that take a packed matrix's buffers, then the activations):
    x `[tokens, K]` rounded to bf16 -> y float32 `[tokens, N]`."""
    x = x.to(torch.bfloat16).contiguous()
    out = torch.empty((x.shape[0], out_features), dtype=torch.float32)
    kernel(*(weight.data_ptr() for weight in weights), x.data_ptr(), out.data_ptr(), out_features, x.shape[1],
           x.shape[0])
    return out


AMX = TileKernel("amx", "amx", PAIRS, "int4_amx_matmul", "int5_amx_matmul", "q6k_amx_matmul", int8=False)
AVX512 = TileKernel("avx512", "avx512", PAIRS, "int4_matmul", "int5_matmul", "q6k_matmul", int8=True)
AVX2 = TileKernel("avx2", "avx2", QUADS, "int4_matmul", "int5_matmul", "q6k_matmul", int8=True)
KERNELS = (AMX, AVX512, AVX2)  # fastest first
STORED_KERNELS = (AVX512, AVX2)  # the tile kernels that also run weights as the file stores them (Q4_K, Q5_K,
#                                  Q4_0, Q5_0, Q8_0, IQ4, F16 / BF16 / F32: `q4k_tiles`, `int8_codes`,
#                                  `dense_matmul`); AMX keeps its bf16 tiles


def kernel_named(name: str) -> TileKernel:
    """The tile kernel called `name`."""
    return next(kernel for kernel in KERNELS if kernel.name == name)


def tile_kernel(config: NumericConfig | None = None) -> TileKernel | None:
    """The fastest tile kernel that runs here under `config` (default: `numerics.current()`), or None."""
    config = config or numerics.current()
    return next((kernel for kernel in KERNELS if kernel.available(config)), None)


def runs_stored_weights(config: NumericConfig | None = None) -> bool:
    """Whether the tile kernel that runs here (under `config`) multiplies weights as the file stores them
    (`STORED_KERNELS`): where the loader packs Q4_K, Q8_0, IQ4 and F16 / BF16 / F32 linears for it."""
    return tile_kernel(config) in STORED_KERNELS


def kernel_name(kernel: TileKernel | None) -> str:
    """A kernel's short name (`amx`, `avx512`, `avx2`), `torch` for None."""
    return "torch" if kernel is None else kernel.name


def int8_every_pass(config: NumericConfig | None = None) -> bool:
    """Whether every pass runs on int8 activations (`prompt_pass`'s `every`): the default where the AVX2 or the
    AVX-512 tile kernels run, or as `config.int8_activations` says (`every` where neither runs, e.g. on AMX, is an
    error)."""
    config = config or numerics.current()
    kernel = tile_kernel(config)
    runs_int8 = kernel is not None and kernel.int8
    if config.int8_activations == "every" and not runs_int8:
        raise SpecdraftError(f"{numerics.INT8_VARIABLE}=every runs on the AVX2 and AVX-512 VNNI kernels only (this "
                             f"machine runs {kernel_name(kernel)}): use prompt or none, or force "
                             f"{numerics.ISA_VARIABLE}=avx2.")
    return runs_int8 if config.int8_activations is None else config.int8_activations == "every"
