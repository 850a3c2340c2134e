"""`kernels.prebuild`: every native kernel built ahead of use, and the line that names the ones in use."""

from __future__ import annotations

import shutil

import pytest
from typer.testing import CliRunner

from specdraft.kernels import isa, prebuild
from specdraft.kernels.build import cpu_flags
from specdraft.surfaces.cli import app

HAS_AVX2 = isa.CPU_FLAGS["avx2"] <= cpu_flags() and shutil.which("cc") is not None


def test_kernel_modules_are_found():
    names = prebuild.kernel_names()
    assert {"amx_tiles", "avx512_tiles", "avx2_tiles", "avx2_prompt", "vnni_tiles"} <= set(names)
    assert not set(names) & prebuild.NOT_KERNELS and "tiles" not in names and "isa" not in names


@pytest.mark.skipif(not HAS_AVX2, reason="no AVX2 (or no C compiler) here")
def test_build_all_builds_what_this_cpu_runs(monkeypatch):
    monkeypatch.delenv(isa.VARIABLE, raising=False)
    ready = prebuild.build_all()
    assert list(ready) == prebuild.kernel_names() and all(isinstance(runs, bool) for runs in ready.values())
    assert ready["avx2_tiles"] and ready["avx2_prompt"]
    if not isa.allows("avx512"):
        assert not ready["avx512_tiles"] and not ready["vnni_tiles"] and not ready["amx_tiles"]


def test_build_all_under_torch_builds_nothing(monkeypatch):
    monkeypatch.setenv(isa.VARIABLE, "torch")
    ready = prebuild.build_all()
    assert ready and not any(ready.values())
    assert prebuild.in_use() == {"isa": "torch", "tiles": "torch", "int8_activations": "none", "avx_vnni": False,
                                 isa.VARIABLE: "torch"}
    assert prebuild.in_use_text() == "kernels: torch level, torch tiles (forced by SPECDRAFT_ISA=torch)"


def test_in_use_text_names_the_override():
    line = prebuild.in_use_text({"isa": "avx2", "tiles": "avx2", isa.VARIABLE: None})
    assert line == "kernels: avx2 level, avx2 tiles (SPECDRAFT_ISA=torch|avx2|avx512|amx forces a level)"
    line = prebuild.in_use_text({"isa": "avx512", "tiles": "avx512", "int8_activations": "every", isa.VARIABLE: None})
    assert line.startswith("kernels: avx512 level, avx512 tiles, int8 activations on every pass (")


def test_in_use_names_which_passes_run_on_int8_activations(monkeypatch):
    monkeypatch.setenv(isa.VARIABLE, "avx2")  # every x86-64 machine of the project runs it
    for mode, named in (("every", "every"), ("prompt", "prompt"), ("none", "none")):
        monkeypatch.setenv("SPECDRAFT_INT8_ACTIVATIONS", mode)
        assert prebuild.in_use()["int8_activations"] == named
    monkeypatch.delenv("SPECDRAFT_INT8_ACTIVATIONS")
    assert prebuild.in_use()["int8_activations"] == "every"  # the default on the AVX2 kernels
    monkeypatch.setenv(isa.AVX_VNNI_VARIABLE, "0")
    assert prebuild.in_use()["avx_vnni"] is False
    if isa.AVX_VNNI_BUILD[1] <= isa.cpu_flags():  # the AVX2 tiles' int8 products on AVX-VNNI, and the line says so
        monkeypatch.delenv(isa.AVX_VNNI_VARIABLE)
        assert prebuild.in_use()["avx_vnni"] is True
        assert "int8 activations on every pass (AVX-VNNI)" in prebuild.in_use_text()


def test_kernels_command(monkeypatch):
    monkeypatch.setenv(isa.VARIABLE, "torch")
    result = CliRunner().invoke(app, ["kernels"])
    assert result.exit_code == 0, result.output
    assert "avx2_tiles" in result.stdout and "kernels: torch level" in result.stdout
    monkeypatch.setenv(isa.VARIABLE, "mmx")
    result = CliRunner().invoke(app, ["kernels"])
    assert result.exit_code == 2 and "SPECDRAFT_ISA must be one of" in result.output
