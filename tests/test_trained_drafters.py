"""Trained drafters on a tiny target: self-distillation data, Medusa and EAGLE training (loss
falls, checkpoints resume), weight files, and greedy equivalence of the trained drafters."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import TRAINING_LINES, tiny_chat_target, tiny_config, tiny_model
from specdraft import SpeculativeDecoder
from specdraft.drafters import make_drafter
from specdraft.errors import SpecdraftError
from specdraft.models.causal_lm import CausalLM
from specdraft.models.draft_head import common_token_ids, head_rows
from specdraft.models.trained import load_trained
from specdraft.training.data import SelfDistillData, build_dataset, build_text_dataset, text_files, training_prompts
from specdraft.models.loading import load_model
from specdraft.models.quantize import Int4Linear, int4_kernel_available
from specdraft.training.distill import SUMMARY, train_distill
from specdraft.training.drafters import drafter_vocab_head, train_eagle, train_medusa
from specdraft.training.loop import TrainConfig, split
from specdraft.training.objectives import DistillObjective, EagleObjective, MedusaObjective

QUICK = TrainConfig(steps=30, learning_rate=2e-2, batch_tokens=128, warmup_steps=3, eval_every=15, checkpoint_every=15)


@pytest.fixture(scope="module")
def target() -> CausalLM:
    return tiny_chat_target()


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("prompts") / "train.jsonl"
    lines = [{"question_id": i, "category": f"c{i % 3}", "turns": [TRAINING_LINES[i % 3].format(i=i)]}
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


@pytest.fixture(scope="module")
def texts(tmp_path_factory):
    """A folder of plain text files (and a file of another kind, which is not read)."""
    folder = tmp_path_factory.mktemp("texts")
    (folder / "lib").mkdir()
    for i in range(5):
        (folder / "lib" / f"m{i}.py").write_text("\n".join(TRAINING_LINES[j % 3].format(i=i * 10 + j)
                                                            for j in range(12)))
    (folder / "README.md").write_text(" ".join(f"The quick brown fox {i} jumps." for i in range(60)))
    (folder / "image.png").write_bytes(b"\x89PNG not text")
    return folder


def test_text_data_holds_the_targets_features_over_the_files(target, texts, tmp_path):
    files = text_files([texts])
    assert [f.name for f in files] == ["README.md", "m0.py", "m1.py", "m2.py", "m3.py", "m4.py"]
    built = build_text_dataset(target, [texts], tmp_path / "t", max_tokens=10_000, chunk_tokens=48, per_shard=4,
                               top_k=3)
    all_tokens = sum(len(target.tokenizer.encode(f.read_text(), add_special_tokens=False)) for f in files)
    sequences = list(built.sequences())
    assert all(s.prompt_length == 0 and 12 <= len(s.tokens) <= 48 for s in sequences)  # every position trains
    assert all_tokens - 12 * len(files) < built.num_tokens <= all_tokens  # only tails under a quarter are dropped
    names = [name for shard in built.manifest["shards"] for name in shard["prompts"]]
    assert len(names) == len(set(names)) == len(sequences)
    sequence = sequences[0]
    with torch.no_grad():  # one teacher-forced pass over the piece, as for generated data
        out = target.model(sequence.tokens.unsqueeze(0), output_hidden_states=True)
    torch.testing.assert_close(sequence.hidden.float(), out.hidden_states[-1][0].float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(sequence.top_ids[:, 0], out.logits[0].argmax(-1))


def test_text_data_stops_at_its_budget_resumes_and_refuses_bad_input(target, texts, tmp_path):
    out = tmp_path / "t"
    first = build_text_dataset(target, [texts], out, max_tokens=100, chunk_tokens=48, per_shard=2, top_k=3)
    assert 100 <= first.num_tokens < 100 + 48
    done = [name for shard in first.manifest["shards"] for name in shard["prompts"]]
    calls = []
    more = build_text_dataset(target, [texts], out, max_tokens=300, chunk_tokens=48, per_shard=2, top_k=3,
                              progress=lambda built, total: calls.append(built))
    names = [name for shard in more.manifest["shards"] for name in shard["prompts"]]
    assert names[:len(done)] == done and len(names) == len(set(names))  # earlier pieces were not built again
    assert 300 <= more.num_tokens < 300 + 48 and calls[0] > first.num_tokens and calls[-1] == 300
    with pytest.raises(SpecdraftError, match="other settings"):
        build_text_dataset(target, [texts], out, max_tokens=300, chunk_tokens=40, top_k=3)
    with pytest.raises(SpecdraftError, match="no such file or folder"):
        text_files([tmp_path / "missing"])
    with pytest.raises(SpecdraftError, match="no .py/.md/.rst/.txt files"):
        text_files([out])
    with pytest.raises(SpecdraftError, match="--chunk-tokens must be >= 16"):
        build_text_dataset(target, [texts], tmp_path / "u", max_tokens=300, chunk_tokens=8)


def test_several_data_folders_train_as_one(target, data, texts, tmp_path):
    text_data = build_text_dataset(target, [texts], tmp_path / "t", max_tokens=200, chunk_tokens=48, top_k=4)
    both = SelfDistillData(data.folders[0], text_data.folders[0])
    assert both.num_sequences == data.num_sequences + text_data.num_sequences
    assert both.num_tokens == data.num_tokens + text_data.num_tokens
    assert [len(s.tokens) for s in both.sequences()] == [len(s.tokens) for s in data.sequences()] + [
        len(s.tokens) for s in text_data.sequences()]
    other = tmp_path / "other"
    other.mkdir()
    manifest = dict(text_data.manifest, target="another", shards=[])
    (other / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(SpecdraftError, match="another target"):
        SelfDistillData(data.folders[0], other)


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
    drafts = []
    propose = drafter.propose
    drafter.propose = lambda ctx, k: drafts.append(propose(ctx, k)) or drafts[-1]
    spec = SpeculativeDecoder(target, drafter, k=3, tree_budget=budget, tree_branch=3)
    ar = SpeculativeDecoder(target)
    accepted = 0
    for prompt in held_out:
        out = spec.generate(prompt, max_new_tokens=32)
        assert out.token_ids == ar.generate(prompt, max_new_tokens=32).token_ids
        accepted += out.stats.accepted
    if kind == "eagle":  # the EAGLE layer learns the tiny target's continuations well enough to be accepted
        assert accepted > 0
    trees = [draft for draft in drafts if draft.layout is not None]
    assert bool(trees) == (budget > 0)
    for tree in trees:  # path probabilities for `AutoK.trim`: one per node, never above the parent's
        assert len(tree.scores) == tree.k
        assert all(tree.scores[i] <= tree.scores[p] + 1e-6 for i, p in enumerate(tree.parents.tolist()) if p >= 0)


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_training_goes_on_from_a_trained_drafter(target, data, trained_files, tmp_path, kind):
    """--init: the trained file's shape, vocabulary and weights are the start (not the options' fresh module)."""
    logs = []
    tiny_steps = TrainConfig(steps=2, learning_rate=1e-7, batch_tokens=64, warmup_steps=0, eval_every=2,
                             checkpoint_every=2)
    train = train_medusa if kind == "medusa" else train_eagle
    shape = {"rank": 64, "vocab": 50} if kind == "medusa" else {"width": 256, "vocab": 50}
    path = train(target, data, tmp_path / f"{kind}.safetensors", tiny_steps, log=logs.append,
                 init=trained_files[kind], **shape)
    start = load_trained(trained_files[kind], kind, "tiny", target.config.hidden_size, dtype=torch.float32)
    went_on = load_trained(path, kind, "tiny", target.config.hidden_size, dtype=torch.float32)
    assert logs[0].startswith(f"starting from {trained_files[kind]}")
    assert went_on.module.config == start.module.config and torch.equal(went_on.vocab_ids, start.vocab_ids)
    assert went_on.training["init"] == str(trained_files[kind])  # the file says what it grew from
    for name, weight in start.module.state_dict().items():  # two steps at a tiny rate barely move it
        torch.testing.assert_close(went_on.module.state_dict()[name], weight, atol=1e-2, rtol=1e-2)
    with pytest.raises(SpecdraftError, match="holds a medusa drafter, not eagle"):
        train_eagle(target, data, tmp_path / "x.safetensors", tiny_steps, log=logs.append, init=trained_files["medusa"])


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
    prompt = TRAINING_LINES[1].format(i=0)
    assert spec.generate(prompt, max_new_tokens=24).token_ids == SpeculativeDecoder(target).generate(
        prompt, max_new_tokens=24).token_ids
    with pytest.raises(SpecdraftError, match="--layers must be between 1 and"):
        train_distill(draft, data, tmp_path / "again", config, layers=9)


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_a_batchs_trained_drafters_share_the_weights_and_draft_as_alone_side_by_side(target, trained_files,
                                                                                      prompts_file, kind):
    """The drafters a batch builds with one `shared` dict: the weights loaded once, each sequence's drafter a
    sibling over them with a state of its own, so two drafting in turns propose what each proposes alone."""
    prompts = [json.loads(line)["turns"][0] for line in prompts_file.read_text().splitlines()[:2]]
    options, shared = {"trained": str(trained_files[kind])}, {}
    siblings = [make_drafter(kind, options, target_model=target, shared=shared) for _ in prompts]
    weights = (lambda drafter: drafter.model.fc) if kind == "eagle" else (lambda drafter: drafter.heads)
    assert len(shared) == 1 and weights(siblings[0]) is weights(siblings[1]) is weights(next(iter(shared.values())))
    assert siblings[0].vocab_head is siblings[1].vocab_head

    def stream(drafter, prompt):  # a generation's steps, and the draft tokens its drafter proposes at each
        drafts, propose = [], drafter.propose
        drafter.propose = lambda ctx, k: drafts.append(propose(ctx, k)) or drafts[-1]
        decoder = SpeculativeDecoder(CausalLM(target.model, target.tokenizer, name=target.name), drafter, k=3)
        return decoder.stream(prompt, max_new_tokens=24), drafts

    alone = []
    for prompt in prompts:
        steps, drafts = stream(make_drafter(kind, options, target_model=target), prompt)
        list(steps)
        alone.append([draft.tokens.tolist() for draft in drafts])
    running = [stream(drafter, prompt) for drafter, prompt in zip(siblings, prompts)]
    steps = [steps for steps, _ in running]
    while steps:  # a step of each in turn
        for each in list(steps):
            if next(each, None) is None:
                steps.remove(each)
    assert [[draft.tokens.tolist() for draft in drafts] for _, drafts in running] == alone
    assert sum(len(drafts) for drafts in alone) > 4
