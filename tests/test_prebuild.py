"""`kernels.prebuild`: every native kernel built ahead of use, and the line that names the ones in use."""

from __future__ import annotations

import shutil

import pytest
from typer.testing import CliRunner

from specdraft.kernels import isa, numerics, prebuild
from specdraft.kernels.build import cpu_flags
from specdraft.surfaces.cli import app

HAS_AVX2 = isa.CPU_FLAGS["avx2"] <= cpu_flags() and shutil.which("cc") is not None


@pytest.mark.skipif(not HAS_AVX2, reason="no AVX2 (or no C compiler) here")
def test_build_all_builds_what_this_cpu_runs(monkeypatch):
    monkeypatch.delenv(numerics.ISA_VARIABLE, raising=False)
    ready = prebuild.build_all()
    assert list(ready) == list(prebuild.LIBRARY_LEVELS) and all(isinstance(runs, bool) for runs in ready.values())
    assert ready["avx2"]
    if not numerics.current().allows("avx512"):
        assert not ready["avx512"] and not ready["amx"]


def test_build_all_under_torch_builds_nothing(monkeypatch):
    monkeypatch.setenv(numerics.ISA_VARIABLE, "torch")
    ready = prebuild.build_all()
    assert ready and not any(ready.values())
    assert prebuild.in_use() == {"isa": "torch", "tiles": "torch", "tile_dots": None, "int8_activations": "none",
                                 "avx_vnni": False, numerics.ISA_VARIABLE: "torch"}
    assert prebuild.in_use_text() == "kernels: torch level, torch tiles (forced by SPECDRAFT_ISA=torch)"


def test_in_use_text_names_the_override():
    line = prebuild.in_use_text({"isa": "avx2", "tiles": "avx2", numerics.ISA_VARIABLE: None})
    assert line == "kernels: avx2 level, avx2 tiles (SPECDRAFT_ISA=torch|avx2|avx512|amx forces a level)"
    line = prebuild.in_use_text({"isa": "avx512", "tiles": "avx512", "tile_dots": "bf16", "int8_activations": "every",
                                 numerics.ISA_VARIABLE: None})
    assert line.startswith("kernels: avx512 level, avx512 tiles (bf16 dots), int8 activations on every pass (")


def test_in_use_names_which_passes_run_on_int8_activations(monkeypatch):
    monkeypatch.setenv(numerics.ISA_VARIABLE, "avx2")  # every x86-64 machine of the project runs it
    for mode, named in (("every", "every"), ("prompt", "prompt"), ("none", "none")):
        monkeypatch.setenv("SPECDRAFT_INT8_ACTIVATIONS", mode)
        assert prebuild.in_use()["int8_activations"] == named
    monkeypatch.delenv("SPECDRAFT_INT8_ACTIVATIONS")
    assert prebuild.in_use()["int8_activations"] == "every"  # the default on the AVX2 kernels
    monkeypatch.setenv(numerics.AVX_VNNI_VARIABLE, "0")
    assert prebuild.in_use()["avx_vnni"] is False
    if isa.AVX_VNNI_CPU_FLAGS <= isa.cpu_flags():  # the AVX2 tiles' int8 products on AVX-VNNI, and the line says so
        monkeypatch.delenv(numerics.AVX_VNNI_VARIABLE)
        assert prebuild.in_use()["avx_vnni"] is True
        assert "int8 activations on every pass (AVX-VNNI)" in prebuild.in_use_text()


def test_kernels_command(monkeypatch):
    monkeypatch.setenv(numerics.ISA_VARIABLE, "torch")
    result = CliRunner().invoke(app, ["kernels"])
    assert result.exit_code == 0, result.output
    assert "avx2 library" in result.stdout and "kernels: torch level" in result.stdout
    monkeypatch.setenv(numerics.ISA_VARIABLE, "mmx")
    result = CliRunner().invoke(app, ["kernels"])
    assert result.exit_code == 2 and "SPECDRAFT_ISA must be one of" in result.output
