"""`specdraft train eagle3` on a tiny random target (8 layers, float32): the folder it writes is a SpecForge
checkpoint (the tensor names and config keys of `eagle3_checkpoints.random_head`'s SpecForge heads, d2t/t2d over
the data's commonest tokens) that the published-head loader reads; its unrolled training steps compute what
drafting computes; greedy `spec` equals `ar` with it; training lowers the loss; and a run stopped after its
second step and run again ends with the very weights and optimizer state of an uninterrupted run."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import TRAINING_LINES, tiny_chat_target
from eagle3_checkpoints import random_head
from specdraft import SpeculativeDecoder
from specdraft.drafters import make_drafter
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.models.eagle3_loading import build_eagle3, from_published, load_eagle3
from specdraft.models.eagle3_saving import specforge_config
from specdraft.training.data import SelfDistillData, build_text_dataset
from specdraft.training.drafters import TRAINING_SUMMARY, drafter_vocab_head, fresh_eagle3_head, train_eagle3
from specdraft.training.loop import TrainConfig, split
from specdraft.training.objectives import Eagle3Objective

QUICK = TrainConfig(steps=20, learning_rate=1e-2, batch_tokens=128, warmup_steps=2, eval_every=10, checkpoint_every=10)


@pytest.fixture(scope="module")
def target() -> CausalLM:
    """Eight layers: EAGLE-3 reads the states entering layers 2, 4 and 5."""
    return tiny_chat_target(layers=8)


@pytest.fixture(scope="module")
def data(target, tmp_path_factory) -> SelfDistillData:
    """45 pieces of 32 tokens of plain text (two held out)."""
    folder = tmp_path_factory.mktemp("texts")
    for i in range(5):
        (folder / f"m{i}.py").write_text("\n".join(TRAINING_LINES[j % 3].format(i=i * 10 + j) for j in range(12)))
    return build_text_dataset(target, [folder], tmp_path_factory.mktemp("data") / "d", max_tokens=10_000,
                              chunk_tokens=32, per_shard=8, top_k=2)


@pytest.fixture(scope="module")
def trained(target, data, tmp_path_factory):
    return train_eagle3(target, data, tmp_path_factory.mktemp("heads") / "head", QUICK, intermediate_size=64,
                        vocab=100, log=lambda line: None)


def test_the_folder_is_a_specforge_checkpoint(target, data, trained):
    """Tensor names and config keys as a SpecForge head has them (the tests' own SpecForge heads, written from the
    published checkpoints, are the reference), d2t/t2d for the data's commonest tokens, the default layers."""
    reference = random_head(target.config, "specforge", hidden=32, heads=4, kv_heads=2, head_dim=8, intermediate=64,
                            draft_ids=list(range(99)) + [200], own_embeddings=False)
    tensors = load_file(str(trained / "model.safetensors"))
    assert set(tensors) == set(reference.tensors)
    assert all(tensors[name].shape == reference.tensors[name].shape for name in tensors if name != "d2t")
    config = json.loads((trained / "config.json").read_text())
    assert set(reference.config) - {"eagle_config"} <= set(config)
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 1
    assert config["draft_vocab_size"] == 100 and config["vocab_size"] == target.vocab_size
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang's ids of (2, 4, 5)
    ids = torch.arange(100) + tensors["d2t"]
    assert torch.equal(ids, ids.sort().values) and torch.equal(tensors["t2d"].nonzero()[:, 0], ids)
    assert ids.tolist() == drafter_vocab_head(target, data, 100).ids.tolist()
    counts = data.token_counts(target.vocab_size)
    assert set(counts.argsort(descending=True)[:50].tolist()) <= set(ids.tolist())  # the commonest tokens are in
    summary = json.loads((trained / TRAINING_SUMMARY).read_text())
    assert summary["steps"] == QUICK.steps and summary["ttt_length"] == 7
    model = load_eagle3(trained, dtype=torch.float32)  # the published-head loader, as for any SpecForge folder
    assert model.config.source == "specforge" and not model.config.own_embeddings
    assert model.config.resolved_aux_layers(8) == (2, 4, 5)
    with pytest.raises(SpecdraftError, match="q/k norms"):  # what SpecForge's config cannot say is refused
        qwen3 = random_head(target.config, "speculators", hidden=32, heads=4, kv_heads=2, head_dim=8,
                            intermediate=64, draft_ids=list(range(100)), layer_type="qwen3")
        specforge_config(build_eagle3(*from_published(qwen3.config, qwen3.tensors), "qwen3"), 8, 256)


def test_unrolled_steps_compute_what_drafting_computes(target, data):
    """Step j, row t of the training-time test equals the head drafting j tokens after the target's pair t through
    its cache (the target's tokens standing in for the drafted ones), float32, 1e-5."""
    vocab_head = drafter_vocab_head(target, data, 100)
    model = fresh_eagle3_head(target, vocab_head, 64, torch.Generator().manual_seed(3)).eval()
    objective = Eagle3Objective(model, target, ttt_length=3)
    tokens = next(data.sequences()).tokens[:20]
    with torch.no_grad():
        steps = objective._unroll(tokens)
        assert [logits.shape[0] for logits, _, _ in steps] == [19, 18, 17]
        features = target.prefill(tokens.unsqueeze(0), hidden=True)  # [20, 3H]: the layers the objective claimed
        target.reset()
        embed = target.model.get_input_embeddings()
        for t in (0, 7, 16):
            model.reset_cache()
            out = model(model.project(features[:t + 1]), model.embed(tokens[1:t + 2], embed), torch.arange(t + 1))
            out = out[-1:]  # the target's pair t: predicts x_{t+2}
            for j in range(3):
                if j:  # the output fed back with the next token, one position on
                    token = tokens[t + 1 + j:t + 2 + j]
                    out = model(model.fed_back(out), model.embed(token, embed), torch.tensor([t + j]))
                expected = model.lm_head.scores(model.head_input(out))[0]
                torch.testing.assert_close(steps[j][0][t], expected, rtol=1e-5, atol=1e-5)


def test_kept_target_states_give_the_same_loss_without_the_target(target, data, monkeypatch):
    """With memory to keep them, a sequence's target states are computed once: its loss the second time equals the
    first (bit for bit) and the target does not run again; past the budget they are computed every time."""
    from specdraft.training import objectives

    vocab_head = drafter_vocab_head(target, data, 100)
    model = fresh_eagle3_head(target, vocab_head, 64, torch.Generator().manual_seed(3))
    sequence = next(data.sequences())
    passes = []
    real = objectives.target_layer_states
    monkeypatch.setattr(objectives, "target_layer_states", lambda *a: passes.append(1) or real(*a))
    for keep, want in ((2**30, 1), (0, 2)):
        passes.clear()
        objective = Eagle3Objective(model, target, ttt_length=2, keep_bytes=keep)
        with torch.no_grad():
            first, second = (objective.loss(sequence, None)[0] for _ in range(2))
        assert torch.equal(first, second)
        assert len(passes) == want


def test_training_lowers_the_loss(target, data, trained):
    train_set, _ = split(data)
    vocab_head = drafter_vocab_head(target, data, 100)
    fresh = fresh_eagle3_head(target, vocab_head, 64, torch.Generator().manual_seed(QUICK.seed))
    learned = load_eagle3(trained, dtype=torch.float32)
    losses = []
    for model in (fresh, learned):
        objective = Eagle3Objective(model, target)
        with torch.no_grad():
            losses.append(sum(objective.loss(s, None)[0].item() for s in train_set[:10]))
    assert losses[1] < 0.7 * losses[0], losses


@pytest.mark.parametrize("tree", [0, 6])
def test_greedy_spec_equals_ar_with_the_trained_head(target, trained, tree):
    prompts = [[5, 17, 42, 8, 59, 3, 5, 17], [7], list(range(40, 70))]
    expected = [SpeculativeDecoder(target).generate(p, max_new_tokens=24).token_ids for p in prompts]
    drafter = make_drafter("eagle3", {"trained": str(trained), "draft-confidence": 0.0}, target_model=target)
    spec = SpeculativeDecoder(target, drafter, k=4, tree_budget=tree, tree_branch=3)
    outs = [spec.generate(p, max_new_tokens=24) for p in prompts]
    assert [out.token_ids for out in outs] == expected
    assert sum(out.stats.drafted for out in outs) > 0


class Stopped(Exception):
    """A run killed mid-training."""


def test_a_resumed_run_ends_where_an_uninterrupted_one_does(target, data, tmp_path):
    """Four steps in one run, against a run killed during its third step (its checkpoint holds step 2) and run
    again: the same weights, optimizer state and batch generator, bit for bit, and the same folder."""
    config = TrainConfig(steps=4, learning_rate=1e-2, batch_tokens=96, warmup_steps=1, eval_every=1,
                         checkpoint_every=1)
    train_eagle3(target, data, tmp_path / "whole", config, intermediate_size=64, vocab=100, log=lambda line: None)

    def killed_in_step_three(line: str) -> None:
        if line.startswith("step 3 "):  # step 3's held-out line comes before its checkpoint
            raise Stopped

    with pytest.raises(Stopped):
        train_eagle3(target, data, tmp_path / "split", config, intermediate_size=64, vocab=100,
                     log=killed_in_step_three)
    assert torch.load(tmp_path / "split.checkpoint.pt", weights_only=False)["step"] == 2
    assert not (tmp_path / "split").exists()  # the folder comes at the end
    logs = []
    train_eagle3(target, data, tmp_path / "split", config, intermediate_size=64, vocab=100, log=logs.append)
    assert logs[0].startswith("resumed") and logs[0].endswith("at step 2")
    whole, split_run = (torch.load(tmp_path / f"{name}.checkpoint.pt", weights_only=False)
                        for name in ("whole", "split"))
    assert whole["step"] == split_run["step"] == 4
    assert whole["module"].keys() == split_run["module"].keys()
    assert all(torch.equal(whole["module"][name], split_run["module"][name]) for name in whole["module"])
    assert torch.equal(whole["generator"], split_run["generator"])
    moments = [(w, s) for w, s in zip(whole["optimizer"]["state"].values(), split_run["optimizer"]["state"].values())]
    assert moments and all(torch.equal(w[key], s[key]) for w, s in moments for key in w)
    assert not torch.equal(whole["module"]["fc.weight"], fresh_eagle3_head(
        target, drafter_vocab_head(target, data, 100), 64, torch.Generator().manual_seed(0)).fc.weight)  # it trained
    folders = [load_file(str(tmp_path / name / "model.safetensors")) for name in ("whole", "split")]
    assert all(torch.equal(folders[0][name], folders[1][name]) for name in folders[0])
    with pytest.raises(SpecdraftError, match="learning_rate"):  # another setting: not silently mixed
        train_eagle3(target, data, tmp_path / "split", TrainConfig(steps=6, learning_rate=3e-3, batch_tokens=96,
                                                                    warmup_steps=1), vocab=100, log=lambda line: None)


def test_the_command_trains_and_generate_reads_its_folder(target, tiny_model_dirs, tmp_path):
    """`specdraft train data --texts` then `train eagle3` on the saved tiny target, then `generate --drafter eagle3
    --trained` equals `--method ar`; a second `train eagle3` with more steps goes on from the checkpoint; a target
    of two layers is refused."""
    from typer.testing import CliRunner

    from specdraft.surfaces.cli import app

    target.model.save_pretrained(tmp_path / "target")
    target.tokenizer.save_pretrained(tmp_path / "target")
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(4):
        (texts / f"m{i}.py").write_text("\n".join(TRAINING_LINES[j % 3].format(i=i * 10 + j) for j in range(12)))
    runner = CliRunner()

    def run(*args):
        result = runner.invoke(app, [str(a) for a in args])
        assert result.exit_code == 0, result.output
        return result

    target = ["--target", tmp_path / "target"]
    run("train", "data", "--out", tmp_path / "data", "--texts", texts, "--chunk-tokens", 32, *target)
    train = ["train", "eagle3", "--data", tmp_path / "data", "--out", tmp_path / "head", *target, "--vocab", 64,
             "--intermediate", 48, "--ttt-length", 2, "--batch-tokens", 64, "--eval-every", 2, "--threads", 1]
    run(*train, "--steps", 2)
    assert "resumed" in run(*train, "--steps", 3).output
    assert json.loads((tmp_path / "head" / TRAINING_SUMMARY).read_text())["steps"] == 3
    dtype = ["--dtype", "float32"]
    spec = json.loads(run("generate", "def add", *target, *dtype, "--drafter", "eagle3", "--trained",
                          tmp_path / "head", "--k", 3, "--max-new-tokens", 16, "--json").stdout)
    ar = json.loads(run("generate", "def add", *target, *dtype, "--method", "ar", "--max-new-tokens", 16,
                        "--json").stdout)
    assert spec["completions"][0]["token_ids"] == ar["completions"][0]["token_ids"]
    result = runner.invoke(app, ["train", "eagle3", "--data", str(tmp_path / "data"), "--out", str(tmp_path / "x"),
                                 *map(str, target), "--steps", "0"])
    assert result.exit_code == 2 and "--steps must be >= 1" in result.output
    run("train", "data", "--out", tmp_path / "data2", "--texts", texts, "--chunk-tokens", 32, "--target",
        tiny_model_dirs["target"])
    result = runner.invoke(app, ["train", "eagle3", "--data", str(tmp_path / "data2"), "--out", str(tmp_path / "x"),
                                 "--target", tiny_model_dirs["target"], "--steps", "1"])
    assert result.exit_code == 2 and "has 2 layers, too few" in result.output
