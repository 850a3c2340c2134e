"""The bench under prompts' JSON schemas: which methods follow them, what the records and the summary say."""

from __future__ import annotations

import json

import pytest

from specdraft.bench.methods import parse_method
from specdraft.bench.runner import _check_schemas, prompt_constraint
from specdraft.bench.summary import constrained_figures, find_mismatches, summarize
from specdraft.errors import SpecdraftError
from specdraft.prompts import Prompt, load_prompts

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_a_prompt_file_may_carry_a_schema(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["hi"], "schema": SCHEMA}) + "\n"
                    + json.dumps({"question_id": 2, "category": "x", "turns": ["hi"]}) + "\n")
    first, second = load_prompts(path)
    assert json.loads(first.schema) == SCHEMA and second.schema is None
    path.write_text(json.dumps({"question_id": 1, "category": "x", "turns": ["hi"], "schema": [1]}) + "\n")
    with pytest.raises(SpecdraftError, match="schema must be a JSON schema"):
        load_prompts(path)


def test_ar_and_spec_follow_a_schema_unless_told_not_to():
    prompt = Prompt(1, "x", ("hi",), json.dumps(SCHEMA))
    assert prompt_constraint(prompt, parse_method("ar")).kind == "json_schema"
    assert prompt_constraint(prompt, parse_method("spec:k=3")) is not None
    assert prompt_constraint(prompt, parse_method("spec:schema=0")) is None
    assert prompt_constraint(Prompt(2, "x", ("hi",)), parse_method("spec")) is None
    with pytest.raises(SpecdraftError, match="'hf-ar' cannot answer under a JSON schema"):
        _check_schemas([prompt], [parse_method("ar"), parse_method("hf-ar")])
    with pytest.raises(SpecdraftError, match="Question 3.*JSON schema is not valid"):
        _check_schemas([Prompt(3, "x", ("hi",), json.dumps({"type": "objekt"}))], [parse_method("ar")])


def record(method, tokens, constrained, valid=None, forced=0, mask=0.0, qid=1):
    base = {"question_id": qid, "category": "x", "method": method, "token_ids": tokens, "new_tokens": len(tokens),
            "wall_seconds": 1.0, "prefill_seconds": 0.2, "temperature": 0.0, "steps": 2, "drafted": None,
            "accepted": None}
    return base | ({"constrained": True, "valid": valid, "forced_tokens": forced, "mask_seconds": mask}
                   if constrained else {})


def test_exactness_is_judged_only_under_the_same_constraint():
    records = [record("ar", [1, 2, 3], True, True, forced=1, mask=0.08),
               record("spec", [1, 2, 3], True, True, forced=0, mask=0.02),
               record("spec:schema=0", [9, 9], False)]
    assert find_mismatches(records, "ar") == []  # the unconstrained answer differs, and is not held to ar's
    assert find_mismatches(records[:1] + [record("spec", [1, 2, 4], True, False)], "ar") == [(1, "spec")]
    summary = summarize(records, "ar")
    assert summary["spec"]["greedy_exact"] == 1.0 and summary["spec:schema=0"]["greedy_exact"] is None
    assert summary["spec:schema=0"]["valid"] is None
    figures = constrained_figures(records[:1])
    assert figures == {"valid": 1.0, "forced_share": pytest.approx(1 / 3), "mask_share": pytest.approx(0.1)}
