"""Token counts for a draft's partial head: counting text, the file and its tokenizer check, `train vocab`."""

import copy
import json

import pytest
import torch
from typer.testing import CliRunner

from specdraft.errors import SpecdraftError
from specdraft.models.token_counts import (load_token_counts, made_counts_path, save_token_counts, token_counts_for,
                                           tokenizer_fingerprint)
from specdraft.surfaces.cli import app
from specdraft.training.data import count_tokens, text_files


def run(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


@pytest.fixture()
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDRAFT_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _texts(folder):
    folder.mkdir()
    (folder / "a.py").write_text("def add(a, b):\n    return a + b\n" * 20)
    (folder / "b.md").write_text("# Notes\n\nThe cache holds the keys and the values.\n" * 10)
    (folder / "skip.bin").write_bytes(b"\x00\x01")
    return folder


def test_count_tokens_counts_what_the_tokenizer_encodes(tiny_tokenizer, tmp_path):
    files = text_files([_texts(tmp_path / "texts")])
    assert [f.name for f in files] == ["a.py", "b.md"]
    vocab = len(tiny_tokenizer)
    counts, total = count_tokens(files, tiny_tokenizer, vocab)
    encoded = [tiny_tokenizer.encode(f.read_text(), add_special_tokens=False) for f in files]
    assert total == sum(map(len, encoded))
    assert torch.equal(counts, torch.bincount(torch.tensor(sum(encoded, [])), minlength=vocab))
    first, some = count_tokens(files, tiny_tokenizer, vocab, max_tokens=1)  # stops after the file reaching it
    assert some in map(len, encoded) and int(first.sum()) == some


def test_counts_file_keeps_to_its_tokenizer(tiny_tokenizer, tmp_path, own_cache):
    counts = torch.arange(len(tiny_tokenizer))
    assert token_counts_for(tiny_tokenizer) is None  # none made, none shipped for this tokenizer
    save_token_counts(made_counts_path(tiny_tokenizer), counts, tiny_tokenizer, {"texts": ["x"]})
    found, path = token_counts_for(tiny_tokenizer)
    assert torch.equal(found, counts) and path.parent == own_cache / "vocab"
    other = copy.deepcopy(tiny_tokenizer)
    other.add_tokens(["<|extra|>"])
    assert tokenizer_fingerprint(other) != tokenizer_fingerprint(tiny_tokenizer)
    assert token_counts_for(other) is None
    assert torch.equal(load_token_counts(path, tiny_tokenizer), counts)
    with pytest.raises(SpecdraftError, match="another tokenizer"):
        load_token_counts(path, other)
    with pytest.raises(SpecdraftError, match="train vocab"):
        load_token_counts(tmp_path / "none.safetensors")


def test_train_vocab_then_draft_vocab_uses_the_counts(tiny_model_dirs, tiny_tokenizer, tmp_path, own_cache):
    target = ["--target", tiny_model_dirs["target"]]
    made = run("train", "vocab", "--texts", _texts(tmp_path / "texts"), *target)
    assert made.exit_code == 0, made.output
    assert "tokens from 2 files" in made.output
    counts, path = token_counts_for(tiny_tokenizer)
    assert path == made_counts_path(tiny_tokenizer) and int(counts.sum()) > 0
    generate = ["generate", "def add", *target, "--draft", tiny_model_dirs["draft"], "--dtype", "float32",
                "--max-new-tokens", 16, "--json"]
    narrowed = run(*generate, "--draft-vocab", 32, "--k", 3)
    assert narrowed.exit_code == 0, narrowed.output
    assert f"by {path.name}, then lowest ids" in narrowed.stderr
    plain = run(*generate, "--method", "ar")
    assert (json.loads(narrowed.stdout)["completions"][0]["token_ids"]
            == json.loads(plain.stdout)["completions"][0]["token_ids"])
    missing = run("train", "vocab", "--texts", tmp_path / "nowhere", *target)
    assert missing.exit_code == 2 and "no such file or folder" in missing.output
