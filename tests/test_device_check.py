"""The GPU check's dry run: every part at tiny shapes on the CPU, so the script a GPU machine runs cannot rot."""

from __future__ import annotations

import json

from specdraft.bench import device_check


def test_dry_run_measures_every_part_and_finds_the_cuda_path_exact(tmp_path):
    out = tmp_path / "check.json"
    results = device_check.main(["--dry-run", "--out", str(out)])
    assert json.loads(out.read_text())["dry_run"] is True
    errors = {key: row["error"] for key, row in results.items() if isinstance(row, dict) and "error" in row}
    assert not errors, errors
    assert set(results["target_pass_ms"]) == set(device_check.PASS_WIDTHS)
    assert results["c"] > 0 and results["ar"]["tok_s"] > 0 and results["hf_generate_eager"]["tok_s"] > 0
    for alpha in device_check.ALPHAS:
        row = results[f"oracle_{alpha}"]
        assert row["same_tokens_as_ar"] and row["speedup"] > 0 and row["alpha"] is not None
    for row in results["greedy_spec_equals_ar"].values():
        assert row["identical"] == row["runs"] > 0
    batch = results["batch"]
    drafted = [f"oracle_{alpha}" for alpha in device_check.ALPHAS] + ["draft_model"]
    for size in device_check.BATCH_SIZES:  # every request joins at once; on the CPU each answers as alone
        for method in ["ar"] + drafted:
            row = batch[f"{method}_{size}"]
            assert row["largest_batch"] == size and row["same_as_alone"] == size and row["tok_s"] > 0
            steps = row["steps"]
            assert steps["full_steps"] > 0 and steps["eager_steps"] == 0  # no graphs on the CPU: none is eager
    for method in drafted:
        assert batch[f"{method}_16"]["vs_ar"] > 0
    drafting = {method: sum(batch[f"{method}_{size}"]["steps"]["drafting_steps"] for size in device_check.BATCH_SIZES)
                for method in ["ar"] + drafted}
    assert drafting["ar"] == 0 and all(drafting[f"oracle_{alpha}"] > 0 for alpha in device_check.ALPHAS)
    assert any((batch[f"oracle_0.95_{size}"]["alpha"] or 0) > 0 for size in device_check.BATCH_SIZES)
    chain = results["draft_chain"]
    assert [k for k in chain if k != "target_one_token_ms"] == list(range(1, 9))
    assert all(chain[k]["ms_per_token"] > 0 and chain[k]["c"] > 0 for k in range(1, 9))
    assert [name for name in results["batch_plain"] if name.startswith("oracle")] == []
    assert results["batch_plain"]["ar_16"]["same_as_alone"] == 16
    assert results["greedy_spec_equals_ar"]["batch_float32"]["drafted"] > 0
    first, grown = results["greedy_spec_equals_ar"]["cache_grows"]["capacity"]
    assert grown > first
    assert all(row["p_value"] > 1e-3 for row in results["chi_square"].values())
    for row in results["constrained"].values():
        assert row["identical"] == row["valid"] == row["runs"] > 0
