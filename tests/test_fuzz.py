"""The differential fuzzer (tests/fuzz_cases.py, scripts/fuzz_generate.py): a CI-sized slice of its cases gives
`generate`'s output, and the fuzzer does report a difference, a crash and a refusal when there is one."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from fuzz_cases import (
    CRASHED,
    EQUAL,
    MISMATCH,
    REFUSED,
    available_draft_families,
    ci_slice,
    draw_case,
    run_cases,
    summary,
)

from dflash_hf import DFlashDraftModel

SLICE = ci_slice()


@pytest.fixture(scope="module")
def slice_results():
    return run_cases(SLICE)


def test_the_ci_slice_gives_generates_output(slice_results):
    counts = summary(slice_results)
    failures = [f"case {r.index} ({r.case['target']}, {r.case['draft']}): {r.outcome}: {r.detail[:500]}\n  replay: "
                f"python scripts/fuzz_generate.py --seed 0 --case {r.index}" for r in slice_results
                if r.outcome in (MISMATCH, CRASHED)]
    assert not failures, "\n".join(failures)
    assert counts[EQUAL] >= 0.75 * len(SLICE), counts  # most cases ran and were compared, not refused
    assert sum(r.tau is not None and r.tau >= 1.5 for r in slice_results) >= 3  # drafted blocks were accepted too


def test_the_ci_slice_draws_every_draft_family_chains_trees_batches_stops_and_processors():
    cases = [draw_case(index) for index in SLICE]
    assert {case["draft"] for case in cases} == set(available_draft_families())
    assert any(case["tree_size"] for case in cases) and any(not case["tree_size"] for case in cases)
    assert any(len(case["prompt_lengths"]) > 1 and case["mask"] for case in cases)
    assert any(not case["mask"] for case in cases)
    assert {case["stop"]["via"] for case in cases if case["stop"]} >= {"call", "stop_token_ids", "config",
                                                                       "stop_strings"}
    assert len({spec["name"] for case in cases for spec in case["processors"]}) >= 8
    assert {case["length_via"] for case in cases} == {"max_new_tokens", "max_length"}
    assert {case["draft_processors"] for case in cases} >= {"built", "all", "none"}
    assert len({case["target"] for case in cases}) >= 10


def test_a_case_is_drawn_from_its_own_seed():
    assert draw_case(7, base_seed=3) == draw_case(7, base_seed=3) == {**draw_case(10, base_seed=0), "index": 7,
                                                                      "base_seed": 3}


def first_equal_case(results, batch: bool) -> int:
    return next(r.index for r in results if r.outcome == EQUAL
                and (r.arguments["compared_with"] == "generate on the batch") == batch)


@pytest.mark.parametrize("batch", [True, False])
def test_a_changed_token_is_reported_as_a_mismatch_with_its_replay_command(slice_results, monkeypatch, tmp_path,
                                                                          batch):
    """spec_generate's last token of row 0 changed: the runner (compared with the batch, or with each row alone) and
    the script report that case as a mismatch, and the script exits 1."""
    index = first_equal_case(slice_results, batch)
    original = DFlashDraftModel.spec_generate

    def one_token_off(self, *args, **kwargs):
        output = original(self, *args, **kwargs)
        last = output.num_prompt_tokens + output.num_new_tokens[0] - 1
        output.output_ids[0, last] = (output.output_ids[0, last] + 1) % self.config.vocab_size
        return output

    monkeypatch.setattr(DFlashDraftModel, "spec_generate", one_token_off)
    [result] = run_cases([index])
    assert result.outcome == MISMATCH and result.index == index
    assert ("!= generate [[" in result.detail) if batch else result.detail.startswith("row 0: spec_generate")
    script = load_script()
    report = tmp_path / "report.json"
    assert script.main(["--case", str(index), "--report", str(report)]) == 1
    written = json.loads(report.read_text())
    assert written["counts"] == {EQUAL: 0, MISMATCH: 1, REFUSED: 0, CRASHED: 0}
    assert written["failures"][0]["replay"] == f"python scripts/fuzz_generate.py --seed 0 --case {index}"


@pytest.mark.parametrize("error, outcome", [(RuntimeError("index out of range"), CRASHED),
                                            (ValueError("something undocumented"), CRASHED),
                                            (ValueError("tree_size does not run over this draft"), REFUSED)])
def test_errors_are_crashes_unless_a_documented_refusal(slice_results, monkeypatch, error, outcome):
    index = first_equal_case(slice_results, batch=False)

    def raising(self, *args, **kwargs):
        raise error

    monkeypatch.setattr(DFlashDraftModel, "spec_generate", raising)
    [result] = run_cases([index])
    assert result.outcome == outcome and str(error) in result.detail


def load_script():
    path = Path(__file__).resolve().parent.parent / "scripts" / "fuzz_generate.py"
    spec = importlib.util.spec_from_file_location("fuzz_generate", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module

