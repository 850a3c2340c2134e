"""The native kernel libraries in one table: for each instruction set its C source (`native/<isa>/library.c`), compiler
flags and the CPU flags it needs, its build variants, and the functions every library fills (`SLOTS`, with their
ctypes signatures).

Each instruction set's folder under `native/` has the same roles, one header each, and a `library.c` that includes
them: `vectors.h` (bf16 <-> float32, exp), `tiles.h` (4-bit and Q6_K tiles times bf16 activations), `int8_tiles.h`
(the same tiles times int8 activations), `layer_ops.h` (RMSNorm, rotary), `attention.h` (few-query attention over a
bf16 cache), `decoder_ops.h` (the decoder stack's elementwise steps); `native/shared/decoder_layers.h` is the decoder
layer, written once over those slots. A port to another instruction set (ARM NEON, say) fills those headers in a
folder of its own, adds a row to `LIBRARIES` and a level to `isa.LEVELS`, and the Python side is unchanged.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from specdraft.kernels.build import bind, compiled_library

NATIVE = Path(__file__).with_name("native")
_POINTER, _SIZE, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
SLOTS = {  # every library's functions: name -> argument types (none returns a value)
    "int4_matmul": [_POINTER] * 5 + [_SIZE] * 3,  # tiles, scale, zero, x, y, N, K, tokens
    "q6k_matmul": [_POINTER] * 4 + [_SIZE] * 3,  # tiles, d, x, y, N, K, tokens
    "int4_q8_matmul": [_POINTER] * 5 + [_SIZE] * 4,  # ... tokens, leading tokens kept on 16-bit activations
    "q6k_q8_matmul": [_POINTER] * 4 + [_SIZE] * 4,
    "f16_matmul": [_POINTER] * 3 + [_SIZE] * 3,  # tiles, x, y, N, K, tokens
    "bf16_matmul": [_POINTER] * 3 + [_SIZE] * 3,
    "f32_matmul": [_POINTER] * 3 + [_SIZE] * 3,
    "rms_norm_bf16": [_POINTER] * 3 + [_SIZE] * 2 + [_FLOAT],  # x, weight, y, rows, dim, eps
    "rms_norm_gain_bf16": [_POINTER] * 3 + [_SIZE] * 2 + [_FLOAT],  # x, gain, y, rows, dim, eps
    "rotary_bf16": [_POINTER] + [_SIZE] * 4 + [_POINTER] * 2,  # rows, tokens, row stride, heads, dim, cos, sin
    "few_query_attention_bf16": [_POINTER] * 5 + [_SIZE] * 6 + [_FLOAT] * 2,  # q, k, v, mask, out, heads, kv heads,
    #                                                                           T, S, dim, head stride, scaling, softcap
    "silu_mul_bf16": [_POINTER] * 2 + [_SIZE] * 2,  # gate|up, out, rows, inter
    "act_mul_bf16": [_POINTER] * 3 + [_SIZE] * 2,  # gate|up, table, out, rows, inter
    "use_exp": [_POINTER],  # the address of PyTorch's vector exp
    "use_int8_activations": [_SIZE],
    "decoder_layers_forward": [_POINTER, _SIZE, _POINTER] + [_SIZE] * 6 + [_FLOAT] * 3 + [_SIZE] * 2 + [_POINTER] * 2
    + [_POINTER, _SIZE, _POINTER],  # layers, count, hidden, tokens, sizes, eps, scaling, softcap, cache_len,
    #                                 norm_gains, activation, mask, feature layers, their count, features
}
SLOTS |= {  # 5-bit tiles (`int4_layout`, bits 5) take the 4-bit tiles' arguments
    "int5_matmul": SLOTS["int4_matmul"],
    "int5_q8_matmul": SLOTS["int4_q8_matmul"],
    "q4k_matmul": [_POINTER] * 5 + [_SIZE] * 4,  # codes, marks, steps, x, y, N, K, tokens, leading float32 tokens
    "q5k_matmul": [_POINTER] * 5 + [_SIZE] * 4,
    "q4_0_matmul": [_POINTER] * 4 + [_SIZE] * 4,  # codes, steps, x, y, N, K, tokens, leading exact tokens
    "q5_0_matmul": [_POINTER] * 4 + [_SIZE] * 4,
    "q8_0_matmul": [_POINTER] * 4 + [_SIZE] * 3,  # tiles, steps, x, y, N, K, tokens
    "iq4_matmul": [_POINTER] * 4 + [_SIZE] * 3,
}
AMX_SLOTS = {  # the AVX-512 library's build with AMX adds these (and `amx_tiles_init`, which returns 0 when granted)
    "int4_amx_matmul": SLOTS["int4_matmul"],
    "int5_amx_matmul": SLOTS["int4_matmul"],
    "q6k_amx_matmul": SLOTS["q6k_matmul"],
}


@dataclass(frozen=True)
class NativeLibrary:
    """One instruction set's library: its folder under `native/`, compiler flags, the CPU flags it needs, and the
    name of PyTorch's float32 exp of its vector width (what PyTorch's SiLU uses; the library's SiLU takes it)."""

    folder: str
    flags: tuple[str, ...]
    cpu_flags: frozenset[str]
    torch_exp: str


_COMMON_FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
LIBRARIES = {
    "avx512": NativeLibrary("avx512", ("-mavx512f", "-mavx512bw", "-mavx512dq", "-mavx512vl", "-mavx512bf16",
                                       "-mavx512vnni", "-mfma", "-mf16c", *_COMMON_FLAGS),
                            frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni",
                                       "fma", "f16c"}), "Sleef_expf16_u10"),
    "avx2": NativeLibrary("avx2", ("-mavx2", "-mfma", "-mf16c", *_COMMON_FLAGS), frozenset({"avx2", "fma", "f16c"}),
                          "Sleef_expf8_u10"),
}
VARIANTS = {  # a build option -> (compiler flags, CPU flags it needs)
    "tile_dots_bf16": (("-DTILE_DOTS_BF16",), frozenset()),  # the AVX-512 tiles on `vdpbf16ps` (else `vpdpwssd`)
    "amx": (("-DWITH_AMX", "-mamx-tile", "-mamx-bf16"), frozenset({"amx_tile", "amx_bf16"})),
    "avx_vnni": (("-mavxvnni",), frozenset({"avx_vnni"})),  # the AVX2 int8 products on `vpdpbusd`
}


@dataclass(frozen=True)
class Build:
    """One build of a library: its instruction set and options (the AVX-512 tiles' dot product, AMX, AVX-VNNI)."""

    level: str  # a key of LIBRARIES
    tile_dots: str = "int16"
    amx: bool = False
    avx_vnni: bool = False

    def options(self) -> list[str]:
        """The VARIANTS this build takes."""
        chosen = {"tile_dots_bf16": self.level == "avx512" and self.tile_dots == "bf16", "amx": self.amx,
                  "avx_vnni": self.avx_vnni}
        return [option for option, wanted in chosen.items() if wanted]

    def name(self) -> str:
        """How the build is named in messages and in the cache folder, e.g. `avx512-tile_dots_bf16`."""
        return "-".join([self.level, *self.options()])


@lru_cache(maxsize=None)
def library(build: Build) -> ctypes.CDLL | None:
    """`build` compiled on first use (kept in the cache folder), its slots bound; None where this CPU lacks its flags,
    it does not build, or (AMX) the OS does not grant the tile state."""
    spec = LIBRARIES[build.level]
    flags, required = list(spec.flags), set(spec.cpu_flags)
    for option in build.options():
        flags += VARIANTS[option][0]
        required |= VARIANTS[option][1]
    loaded = compiled_library(NATIVE / spec.folder / "library.c", flags, required, f"the {build.name()} kernels",
                              name=build.name())
    if loaded is None or (build.amx and loaded.amx_tiles_init() != 0):
        return None
    bind(loaded, SLOTS | (AMX_SLOTS if build.amx else {}))
    exp = _torch_exp(spec.torch_exp)
    if exp is not None:
        loaded.use_exp(exp)
    return loaded


def same_exp_as_torch(build: Build) -> bool:
    """Whether `build`'s SiLU uses PyTorch's own exp (so it gives PyTorch's bits)."""
    return _torch_exp(LIBRARIES[build.level].torch_exp) is not None


@lru_cache(maxsize=None)
def _torch_exp(name: str) -> int | None:
    """The address of SLEEF's float32 exp `name` in PyTorch's CPU library, or None."""
    try:
        function = getattr(ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so")), name)
        return ctypes.cast(function, ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None
