"""The core installs lean: the library and the CLI import no optional dependency, and a command that needs a
missing extra says which, in one line, before any work."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from specdraft.extras import MissingExtra, require
from specdraft.errors import SpecdraftError

OPTIONAL = ("fastapi", "uvicorn", "starlette", "pydantic", "matplotlib", "openai", "ray")


def test_the_library_and_the_cli_import_no_extra():
    code = ("import sys, specdraft, specdraft.surfaces.cli, specdraft.bench; "
            f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(OPTIONAL)!r}))")
    imported = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert imported.strip() == "[]"


def test_require_names_the_extra(monkeypatch):
    require("bench", "anything", "sys")  # present: nothing happens
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(MissingExtra, match=r"^specdraft bench needs matplotlib, .*pip install 'specdraft\[bench\]'"):
        require("bench", "specdraft bench", "matplotlib")
    assert issubclass(MissingExtra, SpecdraftError) and issubclass(MissingExtra, ImportError)


@pytest.mark.parametrize("command, module, extra", [
    (["serve"], "fastapi", "server"),
    (["serve", "--ray"], "uvicorn", "server"),
    (["bench", "--max-prompts", "1"], "matplotlib", "bench"),
    (["loadtest"], "openai", "loadtest"),
    (["theory", "--out", "chart.png"], "matplotlib", "bench"),
])
def test_a_command_without_its_extra_fails_in_one_line(command, module, extra, monkeypatch, tmp_path):
    from specdraft.surfaces.cli import app

    monkeypatch.chdir(tmp_path)
    monkeypatch.setitem(sys.modules, module, None)
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and f"pip install 'specdraft[{extra}]'" in lines[0] and module in lines[0], result.output
    assert not (tmp_path / "chart.png").exists() and not (tmp_path / "bench_out").exists()
