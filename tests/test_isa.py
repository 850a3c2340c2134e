"""Which kernels run: the best level the CPU has, or the one `SPECDRAFT_ISA` forces; a forced level the CPU lacks,
or a wrong name, is a clear error."""

import pytest

from specdraft.errors import SpecdraftError
from specdraft.kernels import (amx_tiles, avx2_tiles, avx512_tiles, cache_attention, decoder_layers, isa, layer_ops,
                               tiles, vnni_tiles)

AVX2 = {"avx", "avx2", "fma", "f16c"}
AVX512 = AVX2 | {"avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512_vnni"}


@pytest.fixture
def cpu(monkeypatch):
    """Sets the CPU flags `isa` sees."""
    def set_flags(flags):
        monkeypatch.setattr(isa, "cpu_flags", lambda: set(flags))
        isa.detected.cache_clear()
    monkeypatch.delenv(isa.VARIABLE, raising=False)
    yield set_flags
    isa.detected.cache_clear()


@pytest.mark.parametrize("flags, want", [(set(), "torch"), ({"avx2", "fma"}, "torch"), (AVX2, "avx2"),
                                         (AVX512, "avx512"), (AVX512 | {"avx512_bf16", "amx_tile", "amx_bf16"}, "amx")])
def test_the_best_level_the_cpu_has(cpu, flags, want):
    cpu(flags)
    assert isa.detected() == want and isa.isa() == want


def test_the_variable_forces_a_lower_level_and_refuses_a_higher_one(cpu, monkeypatch):
    cpu(AVX512)
    monkeypatch.setenv(isa.VARIABLE, "AVX2")
    assert isa.isa() == "avx2" and isa.allows("avx2") and isa.allows("torch") and not isa.allows("avx512")
    monkeypatch.setenv(isa.VARIABLE, "torch")
    assert not isa.allows("avx2")
    monkeypatch.setenv(isa.VARIABLE, "amx")
    with pytest.raises(SpecdraftError, match=r"SPECDRAFT_ISA=amx needs CPU flags .*amx_tile.*runs up to avx512"):
        isa.isa()
    monkeypatch.setenv(isa.VARIABLE, "neon")
    with pytest.raises(SpecdraftError, match="SPECDRAFT_ISA must be one of torch, avx2, avx512, amx"):
        isa.isa()


@pytest.mark.skipif(not avx2_tiles.available(), reason="no AVX2 tile kernels here")
def test_forcing_avx2_turns_every_avx512_kernel_off(monkeypatch):
    """What `SPECDRAFT_ISA=avx2` runs on any x86-64 CPU with AVX2: the AVX2 tiles, layer operations, attention and
    fused decoder, nothing of AVX-512 or AMX; `torch` turns every native kernel off."""
    monkeypatch.setenv(isa.VARIABLE, "avx2")
    assert tiles.tile_kernel() is avx2_tiles and decoder_layers.level() == "avx2"
    for module in (amx_tiles, avx512_tiles, vnni_tiles):
        assert not module.available(), module.__name__
    assert layer_ops._library() is layer_ops._built("avx2") and cache_attention._library() is cache_attention._built("avx2")
    monkeypatch.setenv(isa.VARIABLE, "torch")
    assert tiles.tile_kernel() is None and not avx2_tiles.available()
    for module in (decoder_layers, layer_ops, cache_attention):
        assert not module.available(), module.__name__


def test_the_avx_vnni_setting_is_checked(monkeypatch):
    """AVX-VNNI where the CPU has it unless SPECDRAFT_AVX_VNNI=0; =1 on a CPU without it, or another value, is an
    error that says what to set."""
    monkeypatch.setattr(isa, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setenv(isa.AVX_VNNI_VARIABLE, "1")
    with pytest.raises(SpecdraftError, match="avx_vnni"):
        isa.avx_vnni()
    monkeypatch.setenv(isa.AVX_VNNI_VARIABLE, "yes")
    with pytest.raises(SpecdraftError, match="0 or 1"):
        isa.avx_vnni()
    monkeypatch.delenv(isa.AVX_VNNI_VARIABLE)
    assert not isa.avx_vnni()
    monkeypatch.setattr(isa, "cpu_flags", lambda: {"avx2", "fma", "f16c", "avx_vnni"})
    assert isa.avx_vnni()
    monkeypatch.setenv(isa.AVX_VNNI_VARIABLE, "0")
    assert not isa.avx_vnni()
