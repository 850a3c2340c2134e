"""Which kernels run (`kernels.numerics`): the best level the CPU has, or the one `SPECDRAFT_ISA` forces; a forced
level the CPU lacks, or a wrong name or value of any `SPECDRAFT_*` numeric variable, is a clear error."""

import pytest

from specdraft.errors import SpecdraftError
from specdraft.kernels import cache_attention, decoder_layers, isa, layer_ops, numerics, tiles

from conftest import avx2_library

AVX2 = {"avx", "avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni", "avx512_bf16"}


@pytest.fixture
def cpu(monkeypatch):
    """Sets the CPU flags `isa` sees."""
    def set_flags(flags):
        monkeypatch.setattr(isa, "cpu_flags", lambda: set(flags))
        isa.detected.cache_clear()
        numerics._resolved.cache_clear()
    monkeypatch.delenv(numerics.ISA_VARIABLE, raising=False)
    yield set_flags
    isa.detected.cache_clear()
    numerics._resolved.cache_clear()


@pytest.mark.parametrize("flags, want", [(set(), "torch"), ({"avx2", "fma"}, "torch"), (AVX2, "avx2"),
                                         (AVX512 - {"avx512_bf16"}, "avx2"),  # VNNI without BF16 runs the AVX2 library
                                         (AVX512, "avx512"), (AVX512 | {"amx_tile", "amx_bf16"}, "amx")])
def test_the_best_level_the_cpu_has(cpu, flags, want):
    cpu(flags)
    config = numerics.current()
    assert isa.detected() == want and config.isa == want and not config.forced_isa


def test_the_variable_forces_a_lower_level_and_refuses_a_higher_one(cpu, monkeypatch):
    cpu(AVX512)
    monkeypatch.setenv(numerics.ISA_VARIABLE, "AVX2")
    config = numerics.current()
    assert config.isa == "avx2" and config.forced_isa and config.allows("avx2") and config.allows("torch")
    assert not config.allows("avx512")
    monkeypatch.setenv(numerics.ISA_VARIABLE, "torch")
    assert not numerics.current().allows("avx2")
    monkeypatch.setenv(numerics.ISA_VARIABLE, "amx")
    with pytest.raises(SpecdraftError, match=r"SPECDRAFT_ISA=amx needs CPU flags .*amx_tile.*runs up to avx512"):
        numerics.current()
    monkeypatch.setenv(numerics.ISA_VARIABLE, "neon")
    with pytest.raises(SpecdraftError, match="SPECDRAFT_ISA must be one of torch, avx2, avx512, amx"):
        numerics.current()


@pytest.mark.parametrize("variable, bad, says", [
    (numerics.TILE_DOTS_VARIABLE, "fp8", "one of int16, bf16"), (numerics.INT8_VARIABLE, "sometimes", "one of every"),
    (numerics.PREPACK_VARIABLE, "yes", "0 or 1"), (numerics.STATIC_CACHE_VARIABLE, "always", "one of 0, 1, auto"),
    (numerics.FUSED_KERNELS_VARIABLE, "on", "one of 0, 1, auto")])
def test_a_bad_numeric_setting_says_what_to_set(monkeypatch, variable, bad, says):
    monkeypatch.setenv(variable, bad)
    with pytest.raises(SpecdraftError, match=f"{variable} must be {says}"):
        numerics.current()


def test_the_tile_dots_default_by_cpu(monkeypatch):
    """bf16 on AMD CPUs with AVX-512 BF16, int16 elsewhere; the variable wins (any case)."""
    monkeypatch.delenv(numerics.TILE_DOTS_VARIABLE, raising=False)
    monkeypatch.delenv(numerics.ISA_VARIABLE, raising=False)
    for vendor, flags, want in (("AuthenticAMD", {"avx512_bf16"}, "bf16"), ("AuthenticAMD", set(), "int16"),
                                ("GenuineIntel", {"avx512_bf16"}, "int16")):
        monkeypatch.setattr(isa, "cpu_vendor", lambda: vendor)
        monkeypatch.setattr(isa, "cpu_flags", lambda: flags)
        assert isa.preferred_tile_dots() == want, vendor
    numerics._resolved.cache_clear()
    monkeypatch.setenv(numerics.TILE_DOTS_VARIABLE, "BF16")
    assert numerics.current().tile_dots == "bf16"
    numerics._resolved.cache_clear()


@pytest.mark.skipif(avx2_library() is None, reason="no AVX2 tile kernels here")
def test_forcing_avx2_turns_every_avx512_kernel_off(monkeypatch):
    """What `SPECDRAFT_ISA=avx2` runs on any x86-64 CPU with AVX2: the AVX2 library's tiles, layer operations,
    attention and fused decoder, nothing of AVX-512 or AMX; `torch` turns every native kernel off."""
    monkeypatch.setenv(numerics.ISA_VARIABLE, "avx2")
    config = numerics.current()
    assert tiles.tile_kernel() is tiles.AVX2 and decoder_layers.level() == "avx2"
    assert not tiles.AMX.available() and not tiles.AVX512.available()
    assert config.library() is config.library("avx2") is not None
    assert layer_ops._library() is config.library("avx2") and cache_attention._library() is config.library("avx2")
    monkeypatch.setenv(numerics.ISA_VARIABLE, "torch")
    assert tiles.tile_kernel() is None and not tiles.AVX2.available()
    for module in (decoder_layers, layer_ops, cache_attention):
        assert not module.available(), module.__name__


def test_the_avx_vnni_setting_is_checked(cpu, monkeypatch):
    """AVX-VNNI where the CPU has it unless SPECDRAFT_AVX_VNNI=0; =1 on a CPU without it, or another value, is an
    error that says what to set."""
    cpu({"avx2", "fma", "f16c"})
    monkeypatch.setenv(numerics.AVX_VNNI_VARIABLE, "1")
    with pytest.raises(SpecdraftError, match="avx_vnni"):
        numerics.current()
    monkeypatch.setenv(numerics.AVX_VNNI_VARIABLE, "yes")
    with pytest.raises(SpecdraftError, match="0 or 1"):
        numerics.current()
    monkeypatch.delenv(numerics.AVX_VNNI_VARIABLE)
    assert not numerics.current().avx_vnni
    cpu({"avx2", "fma", "f16c", "avx_vnni"})
    assert numerics.current().avx_vnni
    monkeypatch.setenv(numerics.AVX_VNNI_VARIABLE, "0")
    assert not numerics.current().avx_vnni


def test_every_library_fills_every_slot():
    """A library of each instruction set this CPU builds has each function of `bindings.SLOTS` (a port fills the same
    ones); the AMX build adds the AMX tiles."""
    from specdraft.kernels import bindings

    from conftest import avx512_library

    for library in (avx2_library(), avx512_library("int16")):
        if library is not None:
            assert all(hasattr(library, name) for name in bindings.SLOTS)
    amx = bindings.library(bindings.Build("avx512", amx=True))
    if amx is not None:
        assert all(hasattr(amx, name) for name in bindings.AMX_SLOTS)
