"""Trained drafters on a tiny target: self-distillation data, Medusa and EAGLE training (loss
falls, checkpoints resume), weight files, and greedy equivalence of the trained drafters."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import build_tokenizer, tiny_config, tiny_model
from specdraft import SpeculativeDecoder
from specdraft.drafters import make_drafter
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.models.draft_head import common_token_ids, head_rows
from specdraft.models.trained import load_trained
from specdraft.training.data import SelfDistillData, build_dataset, training_prompts
from specdraft.models.loading import load_model
from specdraft.models.quantize import Int4Linear, int4_kernel_available
from specdraft.training.distill import SUMMARY, train_distill
from specdraft.training.drafters import drafter_vocab_head, train_eagle, train_medusa
from specdraft.training.loop import TrainConfig, split
from specdraft.training.objectives import DistillObjective, EagleObjective, MedusaObjective

PROMPT_TEMPLATES = ["def add{i}(a, b):\n    return a + b", "for i in range({i}):\n    print(i * i)",
                    "The quick brown fox {i} jumps over the lazy dog."]
QUICK = TrainConfig(steps=30, learning_rate=2e-2, batch_tokens=128, warmup_steps=3, eval_every=15, checkpoint_every=15)


@pytest.fixture(scope="module")
def target() -> CausalLM:
    tokenizer = build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return CausalLM(tiny_model(tiny_config(vocab_size=len(tokenizer), eos=eos, max_positions=256), seed=1),
                    tokenizer, name="tiny")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "train.jsonl"
    lines = [{"question_id": i, "category": f"c{i % 3}", "turns": [PROMPT_TEMPLATES[i % 3].format(i=i)]}
             for i in range(66)]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    return path


@pytest.fixture(scope="module")
def data(target, prompts_file, tmp_path_factory) -> SelfDistillData:
    prompts = training_prompts([prompts_file], holdout=2)
    return build_dataset(target, prompts, tmp_path_factory.mktemp("data") / "d", max_new_tokens=24, batch_size=8,
                         top_k=4)


def test_held_out_prompts_are_the_first_of_each_category(prompts_file):
    kept = training_prompts([prompts_file], holdout=2)
    ids = {p.question_id for p in kept}
    assert len(kept) == 66 - 3 * 2
    assert not ids & {"train:0", "train:1", "train:2", "train:3", "train:4", "train:5"}
    assert "train:6" in ids
    with pytest.raises(SpecdraftError, match="No training prompts"):
        training_prompts([prompts_file], holdout=100)


def test_data_holds_the_targets_greedy_continuations_and_features(target, data):
    assert data.num_sequences == 60
    sequence = next(data.sequences())
    ar = SpeculativeDecoder(target).generate(sequence.tokens[: sequence.prompt_length].tolist(), max_new_tokens=24)
    assert sequence.tokens[sequence.prompt_length:].tolist() == ar.token_ids  # the target's own greedy output
    with torch.no_grad():  # hidden states and top log-probabilities of one teacher-forced pass
        out = target.model(sequence.tokens.unsqueeze(0), output_hidden_states=True)
    torch.testing.assert_close(sequence.hidden.float(), out.hidden_states[-1][0].float(), atol=2e-2, rtol=2e-2)
    top = out.logits[0].float().log_softmax(-1).topk(4)
    assert torch.equal(sequence.top_ids[:, 0], top.indices[:, 0])
    torch.testing.assert_close(sequence.top_logprobs, top.values, atol=1e-2, rtol=1e-2)


def test_build_resumes_and_refuses_other_settings(target, prompts_file, tmp_path):
    prompts = training_prompts([prompts_file], holdout=2)
    out = tmp_path / "d"
    first = build_dataset(target, prompts[:8], out, max_new_tokens=8, batch_size=4, top_k=2)
    assert first.num_sequences == 8 and len(first.manifest["shards"]) == 2
    (out / "shard-00002.safetensors.tmp").write_bytes(b"half a shard")  # an interrupted write is never read
    calls = []
    again = build_dataset(target, prompts[:12], out, max_new_tokens=8, batch_size=4, top_k=2,
                          progress=lambda done, total: calls.append((done, total)))
    assert again.num_sequences == 12 and calls == [(12, 12)]  # only the 4 new prompts ran
    assert len({qid for shard in again.manifest["shards"] for qid in shard["prompts"]}) == 12
    with pytest.raises(SpecdraftError, match="other settings"):
        build_dataset(target, prompts[:12], out, max_new_tokens=9, batch_size=4, top_k=2)


def test_partial_head_rows_and_vocabulary(target):
    head = target.model.lm_head
    ids = torch.tensor([0, 5, 17, 300])
    torch.testing.assert_close(head_rows(head, ids, target.config.hidden_size), head.weight[ids].float())
    counts = torch.zeros(10, dtype=torch.long)
    counts[[7, 8]] = torch.tensor([5, 9])
    assert common_token_ids(counts, 4, always={9}).tolist() == [0, 7, 8, 9]


def _loss_on(objective, sequences) -> float:
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        parts = [objective.loss(s, generator) for s in sequences]
    return sum(float(loss) for loss, _ in parts) / sum(count for _, count in parts)


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_training_lowers_the_loss_and_writes_a_drafter(target, data, tmp_path, kind):
    train_set, _ = split(data)
    vocab_head = drafter_vocab_head(target, data, 200)
    logs = []
    if kind == "medusa":
        from specdraft.models.medusa import MedusaConfig, MedusaHeads

        torch.manual_seed(0)
        module = MedusaHeads(MedusaConfig(target.config.hidden_size, num_heads=3, rank=16))
        objective = MedusaObjective(module, vocab_head)
        before = _loss_on(objective, train_set[:10])
        path = train_medusa(target, data, tmp_path / "m.safetensors", QUICK, num_heads=3, rank=16, vocab=200,
                            log=logs.append)
    else:
        from specdraft.models.eagle import EagleConfig, EagleDrafterModel

        torch.manual_seed(0)
        module = EagleDrafterModel(EagleConfig(target.config.hidden_size, width=128, num_heads=1, num_kv_heads=1,
                                               intermediate_size=64))
        objective = EagleObjective(module, vocab_head, target.model.get_input_embeddings())
        before = _loss_on(objective, train_set[:10])
        path = train_eagle(target, data, tmp_path / "e.safetensors", QUICK, width=128, intermediate_size=64,
                           vocab=200, log=logs.append)
    trained = load_trained(path, kind, "tiny", target.config.hidden_size, dtype=torch.float32)
    objective.module.load_state_dict(trained.module.state_dict())
    after = _loss_on(objective, train_set[:10])
    assert after < 0.9 * before, (before, after)
    assert any("held-out" in line for line in logs)
    assert trained.training["steps"] == QUICK.steps and trained.target == "tiny"
    assert trained.vocab_ids.tolist() == vocab_head.ids.tolist()


def test_training_resumes_from_its_checkpoint(target, data, tmp_path):
    out = tmp_path / "m.safetensors"
    short = TrainConfig(steps=6, learning_rate=3e-3, batch_tokens=64, warmup_steps=2, eval_every=3, checkpoint_every=3)
    train_medusa(target, data, out, short, num_heads=2, rank=8, vocab=200, log=lambda line: None)
    logs = []
    longer = TrainConfig(steps=9, learning_rate=3e-3, batch_tokens=64, warmup_steps=2, eval_every=3, checkpoint_every=3)
    train_medusa(target, data, out, longer, num_heads=2, rank=8, vocab=200, log=logs.append)
    assert logs[0].startswith("resumed") and "step 6" in logs[0]
    assert load_trained(out, "medusa", "tiny", target.config.hidden_size).training["steps"] == 9
    other = TrainConfig(steps=12, learning_rate=1e-2, batch_tokens=64, warmup_steps=2, eval_every=3, checkpoint_every=3)
    with pytest.raises(SpecdraftError, match="learning_rate"):
        train_medusa(target, data, out, other, num_heads=2, rank=8, vocab=200, log=lambda line: None)


@pytest.fixture(scope="module")
def trained_files(target, data, tmp_path_factory):
    folder = tmp_path_factory.mktemp("trained")
    config = TrainConfig(steps=60, learning_rate=3e-3, batch_tokens=256, warmup_steps=5, eval_every=60,
                         checkpoint_every=60)
    quiet = lambda line: None  # noqa: E731
    return {"medusa": train_medusa(target, data, folder / "m.safetensors", config, num_heads=3, rank=16, vocab=200,
                                   log=quiet),
            "eagle": train_eagle(target, data, folder / "e.safetensors", config, width=128, intermediate_size=64,
                                 vocab=200, log=quiet)}


@pytest.mark.parametrize("name,budget", [("medusa", 0), ("medusa", 6), ("eagle", 0), ("eagle", 6), ("ngram+eagle", 0)])
def test_trained_drafters_are_greedy_exact(target, trained_files, prompts_file, name, budget):
    """Held-out prompts (never trained on): output identical to plain decoding, and drafts accepted."""
    held_out = [json.loads(line)["turns"][0] for line in prompts_file.read_text().splitlines()[:6]]
    kind = name.split("+")[-1]
    drafter = make_drafter(name, {"trained": str(trained_files[kind])}, target_model=target)
    if kind == "eagle":  # on the CPU its linears run on int4 kernels (a cheaper, lossy draft: still exact)
        layer = drafter.fallback.model if hasattr(drafter, "fallback") else drafter.model
        assert isinstance(layer.fc, Int4Linear) == int4_kernel_available()
    spec = SpeculativeDecoder(target, drafter, k=3, tree_budget=budget, tree_branch=3)
    ar = SpeculativeDecoder(target)
    accepted = 0
    for prompt in held_out:
        out = spec.generate(prompt, max_new_tokens=32)
        assert out.token_ids == ar.generate(prompt, max_new_tokens=32).token_ids
        accepted += out.stats.accepted
    if kind == "eagle":  # the EAGLE layer learns the tiny target's continuations well enough to be accepted
        assert accepted > 0


def test_trained_weights_are_checked_when_loaded(target, trained_files, tmp_path):
    hidden = target.config.hidden_size
    with pytest.raises(SpecdraftError, match="holds a medusa drafter, not eagle"):
        load_trained(trained_files["medusa"], "eagle", "tiny", hidden)
    with pytest.raises(SpecdraftError, match="hidden size"):
        load_trained(trained_files["medusa"], "medusa", "tiny", hidden + 1)
    with pytest.raises(SpecdraftError, match="no such file"):
        load_trained(tmp_path / "missing.safetensors", "medusa", "tiny", hidden)
    with pytest.raises(SpecdraftError, match="No medusa drafter is shipped for 'tiny'"):
        load_trained("", "medusa", "tiny", hidden)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a safetensors file")
    with pytest.raises(SpecdraftError, match="not a safetensors file"):
        load_trained(junk, "medusa", "tiny", hidden)
    assert load_file(str(trained_files["eagle"]))["fc.weight"].dtype == torch.bfloat16  # shipped compactly


def test_distillation_objective_is_zero_for_the_target_itself(target, data):
    """KL over (top-k, rest) vanishes and agreement is total when the draft is the target."""
    _, held_out = split(data)
    metrics = DistillObjective(target.model, target.model, target.device).evaluate(held_out)
    assert metrics["agree"] == 1.0 and metrics["kl"] < 2e-3
    mass = torch.cat([s.top_logprobs[s.prompt_length - 1:].float().exp().sum(-1) for s in held_out])
    assert metrics["alpha_top_k"] == pytest.approx(float(mass.mean()), abs=2e-3)  # min(p, p) = p on the top-k


def test_distillation_moves_a_draft_towards_the_target(target, data, tmp_path):
    """A draft of another seed learns the target's continuations: held-out KL falls and agreement rises;
    the written folder loads as a draft and speculative output stays exact."""
    tokenizer = target.tokenizer
    draft = CausalLM(tiny_model(tiny_config(vocab_size=len(tokenizer), eos=target.config.eos_token_id,
                                            max_positions=256), seed=7), tokenizer, name="tiny-draft")
    logs = []
    config = TrainConfig(steps=40, learning_rate=1e-2, batch_tokens=128, warmup_steps=3, eval_every=40,
                         checkpoint_every=40)
    out = train_distill(draft, data, tmp_path / "distilled", config, layers=1, log=logs.append)
    summary = json.loads((out / SUMMARY).read_text())
    before, after = summary["held_out_before"], summary["held_out"]
    assert after["kl"] < 0.7 * before["kl"] and after["agree"] > before["agree"], (before, after)
    assert summary["layers"] == 1 and summary["steps"] == 40
    assert any(line.startswith("before training") for line in logs)
    distilled = load_model(str(out), dtype="float32", device="cpu", verbose=False)
    frozen = draft.model.model.layers[0].mlp.up_proj.weight
    torch.testing.assert_close(distilled.model.model.layers[0].mlp.up_proj.weight, frozen)  # only the last layer moved
    assert not torch.equal(distilled.model.model.layers[1].mlp.up_proj.weight, tiny_model(
        tiny_config(vocab_size=len(tokenizer), eos=target.config.eos_token_id, max_positions=256),
        seed=7).model.layers[1].mlp.up_proj.weight)
    spec = SpeculativeDecoder(target, make_drafter("model", draft_model=distilled), k=3)
    prompt = PROMPT_TEMPLATES[1].format(i=0)
    assert spec.generate(prompt, max_new_tokens=24).token_ids == SpeculativeDecoder(target).generate(
        prompt, max_new_tokens=24).token_ids
    with pytest.raises(SpecdraftError, match="--layers must be between 1 and"):
        train_distill(draft, data, tmp_path / "again", config, layers=9)
