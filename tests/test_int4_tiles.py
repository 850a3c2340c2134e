"""The int4 tile kernels (AMX; AVX-512 on int16 or bf16 dot products): x · (s·q − m) to float32 rounding,
the same per token at any pass width, and Int4Linear's choice among them and PyTorch's kernel."""


import contextlib
import itertools

import numpy as np
import pytest
import torch

from conftest import activations_as_multiplied, avx2_library, avx512_library
from test_gguf_native import random_q6k
from specdraft.kernels import bindings, gguf_matmul, int4_layout, numerics, prompt_pass, tiles
from specdraft.models.quantize import Int4Linear, five_bit_tiles_run


def affine_matrix(n: int, k: int, seed: int = 0):
    """Random codes, scale and minimum per group of 32, and the weight they stand for with the scale and
    zero = 8·scale − minimum rounded to bf16."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.1 + 1e-3
    minimum = (torch.rand(n, k // 32, generator=g) - 0.3) * 0.5
    s = scale.bfloat16().float().repeat_interleave(32, 1)
    zero = (8 * scale - minimum).bfloat16().float().repeat_interleave(32, 1)
    weight = s * (codes.float() - 8) + zero  # [N, K]: what the kernels hold (bf16 scale and zero)
    return codes, scale, minimum, weight


def five_bit_packs(codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> dict:
    """5-bit codes `[N, K]` (0..31) as tiles in each layout, by layout."""
    rows = int4_layout.affine_rows(codes, scale, minimum)
    return {layout: int4_layout.pack_rows(rows, *codes.shape, 32, layout, bits=5)
            for layout in (int4_layout.PAIRS, int4_layout.QUADS)}


def test_fifth_bits_sit_where_each_layouts_unpacking_reads_them():
    """The 5-bit tiles' fifth-bit bytes, built a byte at a time from the layouts' definitions (module doc): `PAIRS`,
    bit m of chunk c's mask v the fifth bit of the pair vector byte m = 16·L + 2u + e that `tile_unpack.h` makes of
    row 4·L + u % 4, input 8·c + 4·v + 2·(u // 4) + e; `QUADS`, bit 4·(j % 2) + 2h + e of byte 32p + 4c + b that of row
    8h + c, input 16p + 8·(j % 2) + 4e + b."""
    high = torch.randint(0, 2, (32, 64), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)  # [rows, K]
    pairs = torch.zeros(2, 2, 64, dtype=torch.uint8)  # [row block, group, byte]
    quads = torch.zeros_like(pairs)
    for nb in range(2):
        for g in range(2):
            for chunk in range(4):
                for vector in range(2):
                    for m in range(64):
                        lane, u, e = m // 16, (m % 16) // 2, m % 2
                        bit = high[16 * nb + 4 * lane + u % 4, 32 * g + 8 * chunk + 4 * vector + 2 * (u // 4) + e]
                        pairs[nb, g, 8 * (2 * chunk + vector) + m // 8] |= bit << (m % 8)
            for p, c, b in itertools.product(range(2), range(8), range(4)):
                for j, h, e in itertools.product(range(2), range(2), range(2)):
                    bit = high[16 * nb + 8 * h + c, 32 * g + 16 * p + 8 * j + 4 * e + b]
                    quads[nb, g, 32 * p + 4 * c + b] |= bit << (4 * j + 2 * h + e)
    assert torch.equal(int4_layout._fifth_bit_masks(high), pairs)
    assert torch.equal(int4_layout._fifth_bit_quads(high), quads)


@pytest.mark.parametrize("tokens", [1, 2, 5, 8, 9, 16, 17, 40])
@pytest.mark.parametrize("inputs", [64, 192, 256])  # groups of 32: 2, 6, 8 (the AMX kernel unrolls by 4, then 2)
def test_matches_the_dequantized_weight(tile_kernel, tokens, inputs):
    kernel = tile_kernel
    codes, scale, minimum, weight = affine_matrix(96, inputs)
    x = torch.randn(tokens, inputs, generator=torch.Generator().manual_seed(tokens)).bfloat16()  # [T, K]
    out = kernel.matmul(int4_layout.pack(codes, scale, minimum, kernel.layout), x)  # [T, N]
    expected = activations_as_multiplied(x, kernel) @ weight.double().T
    assert out.dtype == torch.float32 and out.shape == (tokens, 96)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


def test_each_token_is_computed_alone(tile_kernel):
    """A token's output is bit-identical whether it runs alone or among 19 (verify pass == decode step)."""
    kernel = tile_kernel
    codes, scale, minimum, _ = affine_matrix(64, 128, seed=1)
    packed = int4_layout.pack(codes, scale, minimum, kernel.layout)
    x = torch.randn(19, 128, generator=torch.Generator().manual_seed(3)).bfloat16()
    together = kernel.matmul(packed, x)
    for i in range(19):
        assert torch.equal(kernel.matmul(packed, x[i:i + 1])[0], together[i])
    with pytest.raises(ValueError, match=r"\[tokens, 128\]"):
        kernel.matmul(packed, x[:, :64])
    other = int4_layout.QUADS if kernel.layout == int4_layout.PAIRS else int4_layout.PAIRS
    with pytest.raises(ValueError, match=f"reads {kernel.layout} tiles; the matrix was packed as {other}"):
        kernel.matmul(int4_layout.pack(codes, scale, minimum, other), x)


def test_pack_layout_and_shape_errors():
    codes, scale, minimum, _ = affine_matrix(32, 64)
    packed = int4_layout.pack(codes, scale, minimum)
    assert packed.tiles.numel() == 32 * 64 // 2 and packed.scale.shape == (2, 2, 16)
    # tile (block 0, group 0), row r = 0: pair c (codes[c, 0] low nibble, codes[c, 1] high) at 16·(c / 4) + c % 4
    first_row = packed.tiles[torch.tensor([16 * (c // 4) + c % 4 for c in range(16)])]
    assert torch.equal(first_row & 0x0F, codes[:16, 0]) and torch.equal(first_row >> 4, codes[:16, 1])
    assert not int4_layout.fits(24, 64, 32) and not int4_layout.fits(32, 96, 32) and not int4_layout.fits(32, 64, 64)
    with pytest.raises(ValueError, match="N % 16"):
        int4_layout.pack(codes[:24], scale[:24], minimum[:24])
    with pytest.raises(ValueError, match="unknown 4-bit tile layout 'rows'"):
        int4_layout.pack(codes, scale, minimum, "rows")


def test_quads_layout_puts_four_inputs_of_a_row_in_a_dword():
    """`QUADS`: byte 64·j + 32·h + 4·c + b of a tile holds inputs 8j + b (low nibble) and 8j + 4 + b (high) of row
    8h + c, so the low nibbles of a dword are four consecutive inputs of one row (the `vpmaddubsw` operand)."""
    codes, scale, minimum, _ = affine_matrix(32, 64, seed=2)
    packed = int4_layout.pack(codes, scale, minimum, int4_layout.QUADS)
    tiles_ = packed.tiles.view(2, 2, 256)  # [row blocks, groups, bytes]
    for block, group, j, h, c, b in itertools.product(range(2), range(2), range(4), range(2), range(8), range(4)):
        byte = tiles_[block, group, 64 * j + 32 * h + 4 * c + b]
        row, column = 16 * block + 8 * h + c, 32 * group + 8 * j + b
        assert byte & 0x0F == codes[row, column] and byte >> 4 == codes[row, column + 4]
    pairs = int4_layout.pack(codes, scale, minimum)
    assert torch.equal(packed.scale, pairs.scale) and torch.equal(packed.zero, pairs.zero)
    assert sorted(packed.tiles.tolist()) != sorted(pairs.tiles.tolist())  # other bytes: nibbles paired differently


def test_quads_packing_takes_codes_that_start_inside_a_word():
    """The QUADS layouts move codes four bytes a word (`int4_layout.byte_words`): codes viewed from an odd byte of a
    larger buffer pack as a copy of them does."""
    buffer = torch.randint(0, 16, (16 * 64 + 1,), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    codes = buffer[1:].view(16, 64)  # contiguous, one byte past a word's start
    assert torch.equal(int4_layout.quad_tiles(codes), int4_layout.quad_tiles(codes.clone()))
    bits = (buffer & 1)[1:].view(16, 64)
    assert torch.equal(int4_layout._fifth_bit_quads(bits), int4_layout._fifth_bit_quads(bits.clone()))


@pytest.mark.parametrize("tokens", [7, 40])  # a verify pass, a prefill
def test_int4_linear_runs_on_the_tile_kernel_and_agrees_with_pytorchs(monkeypatch, tile_kernel, tokens):
    kernel = tile_kernel
    codes, scale, minimum, weight = affine_matrix(64, 128, seed=4)
    bias = torch.randn(64)
    monkeypatch.setattr(tiles, "tile_kernel", lambda config=None: kernel)
    on_tiles = Int4Linear.from_affine(codes, scale, minimum, bias)
    monkeypatch.setattr(tiles, "tile_kernel", lambda config=None: None)
    on_torch = Int4Linear.from_affine(codes, scale, minimum, bias)
    assert on_tiles.tiles is not None and on_tiles.tile_matmul == kernel.matmul and on_torch.tiles is None
    x = torch.randn(1, tokens, 128, generator=torch.Generator().manual_seed(5)).bfloat16()  # [1, T, K]
    expected = (x.float() @ weight.T + bias.bfloat16().float()).bfloat16().float()
    for module in (on_tiles, on_torch):
        out = module(x)
        assert out.shape == (1, tokens, 64) and out.dtype == torch.bfloat16
        # bf16 output (and, for a prefill, bf16 weights): a few units in the last place of the largest
        torch.testing.assert_close(out.float(), expected, rtol=2e-2, atol=1e-2 * expected.abs().max().item())
    torch.testing.assert_close(on_tiles.dequantized_weight(), on_torch.dequantized_weight(), rtol=1e-2, atol=1e-2)


def test_int4_linear_prefers_amx_then_avx512_then_avx2_then_pytorch(monkeypatch):
    runs = {kernel.name: True for kernel in tiles.KERNELS}
    monkeypatch.setattr(tiles.TileKernel, "available", lambda self, config=None: runs[self.name])
    for kernel in tiles.KERNELS:
        assert tiles.tile_kernel() is kernel and tiles.kernel_name(kernel) in ("amx", "avx512", "avx2")
        runs[kernel.name] = False
    assert tiles.tile_kernel() is None and tiles.kernel_name(None) == "torch"
    codes, scale, minimum, _ = affine_matrix(32, 64, seed=7)
    assert Int4Linear.from_affine(codes, scale, minimum).tiles is None  # PyTorch's layout instead


def test_a_tile_kernel_pickles_as_itself():
    """A kept packed model's linears name their kernel: unpickled, it is the same object (the fused decoder finds
    its projections by it)."""
    import pickle

    for kernel in tiles.KERNELS:
        assert pickle.loads(pickle.dumps(kernel)) is kernel
        assert pickle.loads(pickle.dumps(kernel.matmul)) == kernel.matmul


def test_packing_in_row_slices_changes_nothing(monkeypatch):
    codes, scale, minimum, _ = affine_matrix(96, 128, seed=6)
    for layout in (int4_layout.PAIRS, int4_layout.QUADS):
        whole = int4_layout.pack(codes, scale, minimum, layout)
        monkeypatch.setattr(int4_layout, "_PACK_ROWS", 32)
        sliced = int4_layout.pack(codes, scale, minimum, layout)
        monkeypatch.undo()
        for name in ("tiles", "scale", "zero"):
            assert torch.equal(getattr(whole, name), getattr(sliced, name))


@pytest.mark.parametrize("kernel_runs", [True, False])  # our tiles, PyTorch's int4 layout
def test_a_matrix_made_a_slice_of_rows_at_a_time_packs_as_the_whole_one(monkeypatch, kernel_runs):
    """A file's big matrix (a 262k-row head) is asked of its blocks a slice at a time, never whole: the same packing."""
    if not kernel_runs:
        monkeypatch.setattr(tiles, "tile_kernel", lambda config=None: None)
    elif tiles.tile_kernel() is None:
        pytest.skip("no tile kernel runs here")
    codes, scale, minimum, _ = affine_matrix(192, 128, seed=8)
    whole = Int4Linear.from_affine(codes, scale, minimum)
    asked = []

    def rows(start, stop):
        asked.append(stop - start)
        return codes[start:stop], scale[start:stop], minimum[start:stop]

    monkeypatch.setattr(int4_layout, "_PACK_ROWS", 64)  # PyTorch's packing: a multiple of its 64-row blocks
    monkeypatch.setattr("specdraft.models.quantize._PACK_ROWS", 64)
    sliced = Int4Linear(rows, 192, 128, 32)
    assert asked == [64, 64, 64]
    assert (sliced.tiles is None) != kernel_runs
    for name, tensor in whole.state_dict().items():
        assert torch.equal(tensor, sliced.state_dict()[name]), name


@pytest.mark.parametrize("int8", [False, True], ids=["16-bit", "int8"])
def test_five_bit_tiles_hold_each_code_and_compute_each_token_alone(tile_kernel, int8):
    """5-bit tiles (`pack_rows(bits=5)`) in each kernel's layout (AMX; AVX-512 in both dot flavours; AVX2; the last
    two also on int8 activations, AVX2's widening its int16 sums twice a group): x · W within the kernel's rounding,
    W = s·(q − 16) + z with s and z rounded to bf16; a pass of 16 tokens gives each token's bits alone; one flipped
    fifth bit moves that row's outputs alone, by 16 s x."""
    if int8 and not tile_kernel.int8:
        pytest.skip(f"the {tile_kernel.name} tile kernels take no int8 activations")
    g = torch.Generator().manual_seed(11)
    n, k = 64, 256
    codes = torch.randint(0, 32, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(n, k // 32, generator=g) * 0.1 + 1e-3
    minimum = (torch.rand(n, k // 32, generator=g) - 0.3) * 0.5
    layout = tile_kernel.layout
    packed = int4_layout.pack_rows(int4_layout.affine_rows(codes, scale, minimum), n, k, 32, layout, bits=5)
    assert packed.bits == 5 and packed.tiles.numel() == n * k * 5 // 8  # 320 bytes a tile
    s = scale.bfloat16().float().repeat_interleave(32, 1)
    weight = s * (codes.float() - 16) + (16 * scale - minimum).bfloat16().float().repeat_interleave(32, 1)
    x = torch.randn(16, k, generator=g).bfloat16()
    with prompt_pass.prompt_pass() if int8 else contextlib.nullcontext():
        got = tile_kernel.matmul(packed, x)  # [16, N] float32
        alone = [tile_kernel.matmul(packed, x[t:t + 1])[0] for t in range(16)]
        flipped = codes.clone()
        flipped[5, 70] ^= 16
        moved = tile_kernel.matmul(int4_layout.pack_rows(int4_layout.affine_rows(flipped, scale, minimum), n, k, 32,
                                                         layout, bits=5), x) - got
    want = x.double() @ weight.double().T
    bound = 2e-2 if int8 else 1e-4  # int8: activations on about 8 bits per group of 32
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < bound
    assert all(torch.equal(a, got[t]) for t, a in enumerate(alone))
    sign = 1 if flipped[5, 70] > codes[5, 70] else -1
    expected = sign * 16 * s[5, 70] * x[:, 70].float()  # [16]
    torch.testing.assert_close(moved[:, 5], expected, rtol=bound, atol=bound * expected.abs().max().item())
    assert moved[:, [i for i in range(n) if i != 5]].abs().max() <= 1e-5 * want.abs().max()
    # the largest integer sums: every code 31 against equal activations (int8: 127 each, eight words of 2 * 31 * 127 a
    # group, past an int16), still x · W
    top = torch.full((n, k), 31, dtype=torch.uint8)
    full = int4_layout.pack_rows(int4_layout.affine_rows(top, scale, minimum), n, k, 32, layout, bits=5)
    ones = torch.ones(3, k, dtype=torch.bfloat16)
    with prompt_pass.prompt_pass() if int8 else contextlib.nullcontext():
        got = tile_kernel.matmul(full, ones)
    want = ones.double() @ (s * 15 + (16 * scale - minimum).bfloat16().float().repeat_interleave(32, 1)).double().T
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < bound


def test_five_bit_codes_need_a_tile_kernel(monkeypatch):
    """Where no tile kernel runs (PyTorch's int4 kernel), asking for 5-bit codes is an error, not a silent 4-bit
    matrix; the loader splits such codes into 4-bit halves there instead. Tiles hold 4- or 5-bit codes only."""
    codes, scale, minimum, _ = affine_matrix(32, 64, seed=3)
    with pytest.raises(ValueError, match="4- or 5-bit codes, not 6-bit"):
        int4_layout.pack_rows(int4_layout.affine_rows(codes, scale, minimum), 32, 64, 32, int4_layout.QUADS, bits=6)
    monkeypatch.setattr(tiles, "tile_kernel", lambda config=None: None)
    assert not five_bit_tiles_run(32, 64)
    with pytest.raises(ValueError, match="5-bit codes need a tile kernel"):
        Int4Linear.from_affine(codes, scale, minimum, bits=5)


def test_the_bf16_dots_are_a_build_option_of_the_avx512_library():
    """The bf16 build asks for its define (the AVX-512 library needs BF16 anyway); the int16 build for nothing more."""
    assert bindings.Build("avx512", "int16").options() == [] and bindings.Build("avx2", "bf16").options() == []
    assert bindings.Build("avx512", "bf16").options() == ["tile_dots_bf16"]
    assert bindings.VARIANTS["tile_dots_bf16"][0] == ("-DTILE_DOTS_BF16",)
    assert "avx512_bf16" in bindings.LIBRARIES["avx512"].cpu_flags


@pytest.mark.skipif(avx512_library("int16") is None or avx512_library("bf16") is None,
                    reason="needs both AVX-512 flavours")
def test_the_two_flavours_are_two_builds_of_one_function():
    """Both flavours compute x · W^T to float32 rounding of what they multiply, but not with the same bits: the
    variable really switches the kernel (a build that ignored it would give identical outputs)."""
    codes, scale, minimum, weight = affine_matrix(64, 256, seed=8)
    packed = int4_layout.pack(codes, scale, minimum)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(9)).bfloat16()
    out = {flavour: int4_layout.run_tile_kernel(avx512_library(flavour).int4_matmul, packed, x, int4_layout.PAIRS)
           for flavour in ("int16", "bf16")}
    assert not torch.equal(out["int16"], out["bf16"])
    torch.testing.assert_close(out["int16"], out["bf16"], rtol=1e-4, atol=1e-4 * out["bf16"].abs().max().item())


@pytest.mark.skipif(avx2_library() is None or avx512_library("int16") is None,
                    reason="needs the AVX2 and the AVX-512 int16 tile kernels on one CPU")
@pytest.mark.parametrize("tokens", [1, 3, 6, 11])
def test_avx2_gives_the_avx512_int16_bits(tokens):
    """The AVX2 kernels do the AVX-512 int16 flavour's arithmetic in the same order: the same bits, 4-bit and 5-bit
    (each kernel on its own tile layout) and Q6_K."""
    codes, scale, minimum, _ = affine_matrix(64, 256, seed=10)
    x = torch.randn(tokens, 256, generator=torch.Generator().manual_seed(11)).bfloat16()
    x[0, :16] *= 300.0  # a huge activation (an attention sink's) coarsens its 16's grid alone
    wide = int4_layout.run_tile_kernel(avx512_library("int16").int4_matmul,
                                       int4_layout.pack(codes, scale, minimum), x, int4_layout.PAIRS)
    assert torch.equal(tiles.AVX2.matmul(int4_layout.pack(codes, scale, minimum, int4_layout.QUADS), x), wide)
    five = five_bit_packs(codes * 2 + (codes > 7), scale, minimum)
    wide = int4_layout.run_tile_kernel(avx512_library("int16").int5_matmul, five[int4_layout.PAIRS], x, int4_layout.PAIRS)
    assert torch.equal(tiles.AVX2.matmul(five[int4_layout.QUADS], x), wide)
    raw = torch.from_numpy(random_q6k(32, 1, np.random.default_rng(tokens)))  # [32, 210]: K = 256
    q6_pairs, q6_quads = (gguf_matmul.pack_q6k(raw, layout) for layout in (int4_layout.PAIRS, int4_layout.QUADS))
    wide = torch.empty(tokens, 32)
    avx512_library("int16").q6k_matmul(q6_pairs.tiles.data_ptr(), q6_pairs.d.data_ptr(), x.data_ptr(),
                                            wide.data_ptr(), 32, 256, tokens)
    assert torch.equal(tiles.AVX2.q6k_matmul(q6_quads.tiles, q6_quads.d, x, 32), wide)


@pytest.mark.skipif(not tiles.AVX512.available() or avx512_library("int16") is None or avx2_library() is None,
                    reason="needs the AVX-512 VNNI and the AVX2 prompt kernels on one CPU")
@pytest.mark.parametrize("tokens", [1, 5, 19])
def test_avx2_prompt_kernels_give_the_vnni_bits(monkeypatch, tokens):
    """The AVX2 prompt kernels compute the AVX-512 library's `int8_tiles.h` function in its order: the same bits (int16 tiles for the
    leading precise row on both), 4-bit, 5-bit and Q6_K, each kernel on its own tile layout."""
    codes, scale, minimum, _ = affine_matrix(96, 512, seed=tokens)
    x = torch.randn(tokens, 512, generator=torch.Generator().manual_seed(tokens)).bfloat16()
    monkeypatch.setenv("SPECDRAFT_TILE_DOTS", "int16")
    raw = torch.from_numpy(random_q6k(32, 2, np.random.default_rng(tokens)))  # [32, 420]: K = 512
    q6_pairs, q6_quads = (gguf_matmul.pack_q6k(raw, layout) for layout in (int4_layout.PAIRS, int4_layout.QUADS))
    five = five_bit_packs(31 - codes * 2, scale, minimum)  # high codes: the int16 sums of AVX2's 5-bit words
    with prompt_pass.prompt_pass(starts_sequence=True):
        wide = tiles.AVX512.matmul(int4_layout.pack(codes, scale, minimum), x)
        wide_five = tiles.AVX512.matmul(five[int4_layout.PAIRS], x)
        wide_q6 = tiles.AVX512.q6k_matmul(q6_pairs.tiles, q6_pairs.d, x, 32)
        monkeypatch.setenv(numerics.ISA_VARIABLE, "avx2")
        assert torch.equal(tiles.AVX2.matmul(int4_layout.pack(codes, scale, minimum, int4_layout.QUADS), x), wide)
        assert torch.equal(tiles.AVX2.matmul(five[int4_layout.QUADS], x), wide_five)
        assert torch.equal(tiles.AVX2.q6k_matmul(q6_quads.tiles, q6_quads.d, x, 32), wide_q6)
