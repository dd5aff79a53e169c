"""`dflash-hf bench`: summaries are consistent, the lossless flag can fail, multi-turn feeding, prompt files."""

from __future__ import annotations

import functools
import importlib.util
import json
import weakref

import pytest
import torch
from helpers import FixedLogitsTarget, make_draft, make_target, make_tokenizer

import dflash_hf.benchmark as benchmark
import dflash_hf.cost_model as cost_model
import dflash_hf.evaluation as evaluation
import dflash_hf.generation_dflash as generation_dflash
from dflash_hf.benchmark import load_conversations, read_prompt_file, run_benchmark
from dflash_hf.cli import main
from dflash_hf.cost_model import acceptance_histogram, cost_model_bound
from dflash_hf.evaluation import BenchSettings, TurnRecord, Verdict, compare_outputs, markdown_table, summarize
from dflash_hf.prompts import chat_prompt_ids
from dflash_hf.tokens_dflash import GenerationTokens

STEP_COSTS = {"target_1": 0.010, "target_block": 0.015, "draft": 0.005}
ONE_STOP = GenerationTokens(stop_token_ids=[1], pad_token_id=1, mask_token_id=127)  # the tiny tokenizer's EOS


def record(plain: list[int], dflash: list[int], lengths: list[int], seconds=(2.0, 1.0, 1.5)) -> TurnRecord:
    return TurnRecord(new_tokens={"plain": plain, "dflash": dflash, "prompt_lookup": plain},
                      seconds=dict(zip(("plain", "dflash", "prompt_lookup"), seconds)), acceptance_lengths=lengths)


def test_summary_values_are_consistent():
    records = [record([5, 6, 7, 8], [5, 6, 7, 8], [3, 1]), record([9, 9], [9, 9], [2], seconds=(1.0, 0.5, 1.0))]
    summary = summarize("gsm8k", records, num_prompts=2, block_size=4, step_costs=STEP_COSTS, greedy=True)
    rates = summary["tokens_per_s"]
    assert rates["plain"] == pytest.approx(6 / 3.0) and rates["dflash"] == pytest.approx(6 / 1.5)
    assert summary["speedup"] == pytest.approx(rates["dflash"] / rates["plain"])
    assert summary["speedup_prompt_lookup"] == pytest.approx(rates["prompt_lookup"] / rates["plain"])
    assert summary["acceptance_histogram"] == [1, 1, 1, 0]
    assert sum(summary["acceptance_histogram"]) == 3  # one entry per draft/verify step
    assert summary["tau"] == pytest.approx(6 / 3)
    assert summary["bound"] == pytest.approx(2.0 * 0.010 / (0.015 + 0.005))
    assert summary["lossless"] is True
    json.dumps(summary)  # the --json file can hold it


def test_lossless_flag_turns_false_when_an_output_differs():
    records = [record([5, 6, 7], [5, 6, 7], [3]), record([5, 6, 7], [5, 6, 8], [2, 1])]
    assert summarize("x", records, 2, 4, STEP_COSTS, greedy=True)["lossless"] is False
    # sampling: not an equality check
    assert summarize("x", records, 2, 4, STEP_COSTS, greedy=False)["lossless"] is None
    assert "NO" in markdown_table([summarize("x", records, 2, 4, STEP_COSTS, greedy=True)])


def test_histogram_refuses_impossible_lengths():
    with pytest.raises(ValueError, match="outside 1..4"):
        acceptance_histogram([5], 4)
    assert cost_model_bound(3.0, STEP_COSTS) == pytest.approx(1.5)


def test_prompt_files_and_datasets(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"turns": ["first question", "and a follow-up"]}\n\n{"turns": ["one turn"]}\n')
    assert read_prompt_file(path) == [["first question", "and a follow-up"], ["one turn"]]
    assert read_prompt_file(path, limit=1) == [["first question", "and a follow-up"]]
    path.write_text('{"question": "no turns here"}\n')  # any prompt field, as train reads them
    assert read_prompt_file(path) == [["no turns here"]]
    path.write_text('{"text": "no prompt field"}\n')
    with pytest.raises(ValueError, match="turns/question/prompt/problem/instruction"):
        read_prompt_file(path)
    with pytest.raises(ValueError, match="Unknown dataset 'squad'"):
        load_conversations("squad", tmp_path)
    (tmp_path / "mt_bench.jsonl").write_text('{"question_id": 81, "turns": ["a", "b"]}\n'
                                             '{"question_id": 82, "turns": ["c", "d"]}\n')
    (tmp_path / "gsm8k_test.jsonl").write_text('{"question": "q1", "answer": "x"}\n'
                                               '{"question": "q2", "answer": "y"}\n')
    assert load_conversations("mt-bench", tmp_path, limit=1) == [["a", "b"]]
    assert load_conversations("gsm8k", tmp_path) == [["q1"], ["q2"]]


@pytest.fixture(scope="module")
def tiny_models():
    target = make_target("llama", seed=1)
    draft = make_draft(seed=2, block_size=4, mask_token_id=127)
    return target, draft, make_tokenizer()


def test_multi_turn_feeds_back_the_models_own_answer(tiny_models, monkeypatch):
    target, draft, tokenizer = tiny_models
    seen: list[tuple[list[int], TurnRecord]] = []
    measure = evaluation.measure_prompts

    def spy(draft, target, prompts, *args, **kwargs):
        (result,) = measure(draft, target, prompts, *args, **kwargs)
        seen.append((prompts[0], result))
        return [result]

    monkeypatch.setattr(benchmark, "measure_prompts", spy)
    turns = ["w10 w11 w12", "w20 w21"]
    results = run_benchmark(draft, target, tokenizer, {"mt-bench": [turns]}, BenchSettings(max_new_tokens=6),
                            progress=False)
    (first_prompt, first), (second_prompt, _) = seen  # the warm-up runs in evaluation.warm_up, not seen here
    assert first_prompt == chat_prompt_ids(tokenizer, [{"role": "user", "content": turns[0]}])
    answer = tokenizer.decode([t for t in first.new_tokens["plain"] if t != tokenizer.eos_token_id],
                              skip_special_tokens=True)
    assert second_prompt == chat_prompt_ids(tokenizer, [{"role": "user", "content": turns[0]},
                                                        {"role": "assistant", "content": answer},
                                                        {"role": "user", "content": turns[1]}])
    assert results[0]["num_prompts"] == 1 and results[0]["num_turns"] == 2
    assert results[0]["lossless"] is True  # a random draft is still lossless


@pytest.fixture
def saved_models(tiny_models, tmp_path):
    """The tiny target (with its tokenizer) and draft saved as folders, as `--target` / `--draft` take them."""
    target, draft, tokenizer = tiny_models
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    draft.save_pretrained(tmp_path / "draft")
    return ["--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft")]


def test_bench_command_end_to_end(saved_models, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["w5 w6 w7"]}\n{"turns": ["w8 w9", "w30 w31"]}\n')
    out = tmp_path / "bench.json"
    main(["bench", *saved_models, "--prompts", str(prompts),
          "--max-new-tokens", "5", "--block-size", "4", "--json", str(out), "--plot", str(tmp_path / "bench.png")])
    (result,) = json.loads(out.read_text())["results"]
    assert result["dataset"] == "prompts" and result["num_prompts"] == 2 and result["num_turns"] == 3
    assert result["block_size"] == 4 and len(result["acceptance_histogram"]) == 4
    native = importlib.util.find_spec("transformers.models.muse_glimmer_assistant") is not None  # Transformers >= 5.24
    assert set(result["tokens_per_s"]) == ({"plain", "dflash", "prompt_lookup"}
                                           | ({"transformers_dflash"} if native else set()))
    assert result["lossless"] is True and result["bound"] > 0
    # Transformers' own DFlash loop on the same weights, with its own lossless check (absent where unavailable)
    assert result["lossless_transformers_dflash"] is (True if native else None)
    if native:
        assert result["speedup_transformers_dflash"] == pytest.approx(
            result["tokens_per_s"]["transformers_dflash"] / result["tokens_per_s"]["plain"])
    assert (tmp_path / "bench.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_command_needs_a_draft_for_another_target(tmp_path):
    with pytest.raises(SystemExit, match=f"--target {tmp_path} needs its --draft"):
        main(["bench", "--target", str(tmp_path)])


def test_measured_step_costs_are_positive(tiny_models):
    target, draft, _ = tiny_models
    costs = cost_model.measure_step_costs(draft, target, torch.arange(5, 25)[None], block_size=4, mask_token_id=127,
                                          repeats=2)
    assert set(costs) == {"target_1", "target_block", "draft"} and all(v > 0 for v in costs.values())


def test_data_parallel_processes_shard_prompts_and_gather_results(saved_models, tmp_path):
    import os
    import subprocess
    import sys

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(f'{{"turns": ["w{5 + i} w{6 + i}"]}}\n' for i in range(5)))
    out = tmp_path / "bench.json"
    # two CPU processes (torchrun; `accelerate launch` starts the same kind of processes on GPUs)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               "-m", "dflash_hf.cli", "bench",
               *saved_models,
               "--prompts", str(prompts),
               "--max-new-tokens", "4", "--block-size", "3", "--json", str(out), "--plot", ""]
    environment = {**os.environ, "OMP_NUM_THREADS": "1"}
    completed = subprocess.run(command, capture_output=True, text=True, timeout=600, env=environment, check=False)
    assert completed.returncode == 0, completed.stderr[-3000:]
    (result,) = json.loads(out.read_text())["results"]
    assert result["num_prompts"] == 5 and result["num_turns"] == 5  # both shards gathered: 3 + 2 prompts
    assert result["lossless"] is True
    assert completed.stdout.count("| dataset |") == 1  # one process reports


def test_batched_measurement_is_per_row_and_shares_the_wall_time(tiny_models):
    target, draft, tokenizer = tiny_models
    prompts = [[3, 10, 11, 4], [3, 20, 4], [3, 30, 31, 32, 33, 4]]
    settings = BenchSettings(max_new_tokens=12, block_size=4, batch_size=3)
    stop = [tokenizer.eos_token_id]
    records = evaluation.measure_prompts(draft, target, prompts, settings, GenerationTokens(stop, stop[0], 127))
    assert len(records) == 3
    for prompt, record in zip(prompts, records):
        alone = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=stop,
                                pad_token_id=0)[0, len(prompt):].tolist()
        assert record.new_tokens["plain"] == record.new_tokens["dflash"] == alone
        assert sum(record.acceptance_lengths) == len(record.new_tokens["dflash"]) - 1
        assert set(record.seconds) == {"plain", "dflash"}  # prompt lookup takes one row: not in batches
    for method in ("plain", "dflash"):  # each row carries an equal share of the batch's wall time
        assert len({record.seconds[method] for record in records}) == 1


def test_bench_command_with_several_batch_sizes(saved_models, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["w5 w6 w7"]}\n{"turns": ["w8 w9", "w30 w31"]}\n{"turns": ["w40"]}\n')
    out = tmp_path / "bench.json"
    main(["bench", *saved_models, "--prompts", str(prompts), "--batch-size", "1", "2",
          "--max-new-tokens", "5", "--block-size", "3", "--json", str(out), "--plot", ""])
    single, batched = json.loads(out.read_text())["results"]
    assert (single["batch_size"], batched["batch_size"]) == (1, 2)
    assert single["num_turns"] == batched["num_turns"] == 4  # the second turn of prompt 2 runs in the batch too
    assert set(batched["tokens_per_s"]) == {"plain", "dflash"}
    assert batched["lossless"] is True and single["lossless"] is True
    assert batched["acceptance_histogram"] and sum(batched["acceptance_histogram"]) > 0


def test_bench_command_with_several_tree_sizes(saved_models, tmp_path, capsys):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["w5 w6 w7"]}\n{"turns": ["w8 w9"]}\n')
    out = tmp_path / "bench.json"
    main(["bench", *saved_models, "--prompts", str(prompts), "--tree-size", "0", "6", "--max-new-tokens", "6",
          "--block-size", "4", "--prompt-lookup-tokens", "2", "--json", str(out)])
    chain, tree = json.loads(out.read_text())["results"]
    assert (chain["tree_size"], tree["tree_size"]) == (0, 6)
    assert tree["lossless"] is True and chain["lossless"] is True
    assert set(tree["tokens_per_s"]) == {"plain", "dflash"} and "prompt_lookup" in chain["tokens_per_s"]
    table = capsys.readouterr().out
    assert "| B | tree | tau |" in table and "| 4 | chain |" in table and "| 4 | 6 |" in table
    with pytest.raises(SystemExit):
        main(["bench", *saved_models, "--prompts", str(prompts), "--tree-size", "-1"])
    assert "tree size must be >= 0 (0: a chain) or 'auto', got '-1'" in capsys.readouterr().err


def test_tree_size_auto_takes_the_fastest_measured_size(saved_models, tmp_path, capsys, monkeypatch):
    from dflash_hf.generation_dflash import DFlashGenerationMixin

    calls, original = [], DFlashGenerationMixin.spec_generate

    def timed(self, *args, **arguments):  # a machine where a tree of 8 decodes fastest
        calls.append(arguments.get("tree_size"))
        output = original(self, *args, **arguments)
        if hasattr(output, "total_time"):
            output.total_time = {None: 4.0, 4: 2.0, 8: 1.0, 16: 3.0, 32: 5.0}[arguments.get("tree_size")]
        return output

    monkeypatch.setattr(DFlashGenerationMixin, "spec_generate", timed)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["w5 w6 w7"]}\n')
    out = tmp_path / "bench.json"
    main(["bench", *saved_models, "--prompts", str(prompts), "--tree-size", "auto", "--max-new-tokens", "6",
          "--block-size", "4", "--prompt-lookup-tokens", "0", "--json", str(out)])
    (result,) = json.loads(out.read_text())["results"]
    assert result["tree_size"] == 8 and result["lossless"] is True
    assert set(result["tree_size_rates"]) == {"0", "4", "8", "16", "32"}
    assert max(result["tree_size_rates"], key=result["tree_size_rates"].get) == "8"
    assert calls.count(8) >= 3  # calibrated (warm-up and timed rounds) and then measured
    assert "| 4 | 8 (auto) |" in capsys.readouterr().out


def test_truncated_tau_and_the_block_size_choice(tiny_models, monkeypatch):
    histogram = [2, 1, 1]  # lengths 1, 1, 2, 3
    assert cost_model.truncated_tau(histogram, 3) == pytest.approx(7 / 4)  # the measured mean
    assert cost_model.truncated_tau(histogram, 2) == pytest.approx(6 / 4)
    assert cost_model.truncated_tau(histogram, 1) == 1.0
    target, draft, _ = tiny_models
    best, predictions = cost_model.choose_block_size(draft, target, torch.arange(5, 25)[None], [0, 0, 0, 10],
                                                    batch_size=2, mask_token_id=127)
    assert set(predictions) == {1, 2, 3, 4} and predictions[1] == 1.0
    assert predictions[best] == max(predictions.values())
    # the choice from given costs (timed costs vary from run to run): a verify of B tokens costs 1 + B / 8 tokens and a
    # draft pass half a token, so a draft always accepted in full gains most from the longest block
    monkeypatch.setattr(cost_model, "measure_step_costs", lambda *args, block_size=None, **kwargs: {
        "target_1": 1.0, "target_block": 1.0 + args[3] / 8, "draft": 0.5})
    best, predictions = cost_model.choose_block_size(draft, target, torch.arange(5, 25)[None], [0, 0, 0, 10],
                                                    batch_size=2, mask_token_id=127)
    assert best == 4 and predictions == pytest.approx({1: 1.0, 2: 2 / 1.75, 3: 3 / 1.875, 4: 4 / 2.0})


def test_bench_command_auto_block_size(saved_models, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["w5 w6 w7"]}\n{"turns": ["w8 w9"]}\n')
    out = tmp_path / "bench.json"
    main(["bench", *saved_models, "--prompts", str(prompts), "--batch-size", "2", "--block-size", "auto",
          "--max-new-tokens", "5", "--json", str(out), "--plot", ""])
    (result,) = json.loads(out.read_text())["results"]
    predictions = {int(block): value for block, value in result["block_size_predictions"].items()}
    assert result["block_size"] == max(predictions, key=predictions.get)
    assert result["lossless"] is True


@pytest.mark.parametrize("cheapest", ["lm_head", False, True])
def test_bench_auto_kernels_run_each_dataset_in_the_mode_timed_cheapest(tiny_models, cheapest, monkeypatch):
    """`--cpu-kernels auto` (None): each dataset times the modes on its first prompt at the trained block, then again
    at the block `--block-size auto` picks where that differs, and runs in the mode cheapest there; a block given as a
    number is timed once, at that block; a mode given is kept."""
    target, draft, tokenizer = tiny_models
    timed, ran = [], []
    other = False if cheapest == "lm_head" else "lm_head"  # the cheapest at the trained block
    monkeypatch.setattr(benchmark, "choose_cpu_kernels", lambda draft, target, prompt_ids, block_size, *args:
                        timed.append(block_size) or (other if block_size == draft.block_size else cheapest, {}))
    monkeypatch.setattr(cost_model, "choose_block_size", lambda *args: (2, {1: 1.0, 2: 1.5}))
    spec_generate, step_costs = type(draft).spec_generate, benchmark.measure_step_costs
    monkeypatch.setattr(type(draft), "spec_generate", lambda self, **kwargs: ran.append(kwargs["cpu_kernels"])
                        or spec_generate(self, **kwargs))
    costed = []  # the cost model's bound is timed in the mode the dataset runs in
    monkeypatch.setattr(benchmark, "measure_step_costs", lambda *args, **kwargs: costed.append(kwargs["cpu_kernels"])
                        or step_costs(*args, **kwargs))
    conversations = {"a": [["w5 w6 w7"], ["w8 w9"]], "b": [["w3 w4"]]}
    results = run_benchmark(draft, target, tokenizer, conversations,
                            BenchSettings(max_new_tokens=6, block_size="auto"), progress=False)
    assert timed == [draft.block_size, 2] * 2  # per dataset: the trained block, then the chosen one
    assert [result["cpu_kernels"] for result in results] == [cheapest, cheapest]
    # per dataset the calibration at the trained block (in the mode cheapest there), then each prompt's timed run
    assert ran[-5:] == [other, cheapest, cheapest, other, cheapest]
    assert costed == [cheapest, cheapest]
    assert all(result["lossless"] for result in results)
    timed.clear()
    results = run_benchmark(draft, target, tokenizer, {"a": [["w5 w6"]]},
                            BenchSettings(max_new_tokens=6, block_size=3), progress=False)
    assert timed == [3] and results[0]["cpu_kernels"] == cheapest
    timed.clear()
    results = run_benchmark(draft, target, tokenizer, {"a": [["w5 w6"]]},
                            BenchSettings(max_new_tokens=6, block_size=3, cpu_kernels="lm_head"), progress=False)
    assert timed == [] and results[0]["cpu_kernels"] == "lm_head"


def test_bench_command_adaptive_verify_length(saved_models, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["w5 w6 w7"]}\n{"turns": ["w8 w9"]}\n')
    out = tmp_path / "bench.json"
    main(["bench", *saved_models, "--prompts", str(prompts), "--block-size", "adaptive", "--max-new-tokens", "12",
          "--json", str(out), "--plot", ""])
    (result,) = json.loads(out.read_text())["results"]
    assert result["adaptive_verify"] is True and result["block_size"] == 4 and result["lossless"] is True
    assert len(result["verify_costs_ms"]["verify"]) == 4 and result["bound"] is None
    assert 1.0 <= result["mean_verified_length"] <= 4.0
    assert "4 (adaptive, verified" in markdown_table([result])


def test_bench_block_size_values_are_checked():
    with pytest.raises(SystemExit):
        main(["bench", "--block-size", "adaptiv"])
    with pytest.raises(SystemExit, match="--synthetic times given block sizes"):
        main(["bench", "--synthetic", "Qwen3-8B", "--block-size", "adaptive"])


def test_bench_refuses_a_block_longer_than_the_drafts_before_running(saved_models, tmp_path, monkeypatch):
    monkeypatch.setattr(benchmark, "run_benchmark", lambda *args, **kwargs: pytest.fail("ran before the check"))
    with pytest.raises(SystemExit, match="--block-size 16: the draft was trained with blocks of 4; pass 1 to 4"):
        main(["bench", *saved_models, "--block-size", "auto", "16", "--max-new-tokens", "5", "--plot", ""])


def test_markdown_table_shows_the_batch_size_only_for_batches():
    single = summarize("gsm8k", [record([5, 6], [5, 6], [2])], 1, 4, STEP_COSTS, greedy=True)
    batched = summarize("gsm8k", [record([5, 6], [5, 6], [2])], 1, 4, STEP_COSTS, greedy=True, batch_size=4)
    assert markdown_table([single]).splitlines()[0].startswith("| dataset | prompts | B |")
    table = markdown_table([single, batched]).splitlines()
    assert table[0].startswith("| dataset | prompts | N | B |")
    assert table[2].startswith("| gsm8k | 1 | 1 | 4 |") and table[3].startswith("| gsm8k | 1 | 4 | 4 |")
    assert all(line.count("|") == table[0].count("|") for line in table)


def test_transformers_dflash_is_timed_only_at_the_drafts_own_block_size(tiny_models):
    """Transformers' loop always drafts the draft's trained block: at another block size the column is left out."""
    pytest.importorskip("transformers.models.muse_glimmer_assistant", reason="Transformers < 5.24: no native DFlash")
    from dflash_hf.conversion import to_native

    target, draft, _ = tiny_models
    native = to_native(draft)
    for block_size, timed in ((None, True), (4, True), (3, False)):
        (record,) = evaluation.measure_prompts(draft, target, [[5, 6, 7]], BenchSettings(
            max_new_tokens=4, block_size=block_size, prompt_lookup_tokens=None), ONE_STOP, native_draft=native)
        assert ("transformers_dflash" in record.new_tokens) is timed


def test_compare_outputs_reads_exact_near_tie_and_no():
    tied = FixedLogitsTarget([0.0] * 5 + [3.0, 3.0] + [0.0] * 3)  # tokens 5 and 6 tie exactly for the best logit
    assert compare_outputs(tied, [1, 2], [7, 5, 9], [7, 5, 9]) == Verdict("exact")
    assert tied.prefixes == []  # equal outputs need no forward
    verdict = compare_outputs(tied, [1, 2], [7, 5, 9], [7, 6, 2])
    assert (verdict.verdict, verdict.first_divergence, verdict.logit_gap) == ("near-tie", 1, 0.0)
    assert tied.prefixes == [[1, 2, 7]]  # the target's own logits after the prompt and the common prefix
    assert compare_outputs(tied, [1], [5], [8]).verdict == "NO"  # token 8 is far below the tied pair
    apart = FixedLogitsTarget([0.0] * 5 + [10.0, 0.0] + [0.0] * 3)
    verdict = compare_outputs(apart, [1], [5, 5], [6, 5])
    assert (verdict.verdict, verdict.first_divergence, verdict.logit_gap) == ("NO", 0, 10.0)
    assert compare_outputs(apart, [1], [5, 5], [5]).verdict == "NO"  # stopping earlier is no tie
    close = FixedLogitsTarget([0.0] * 5 + [10.0, 9.9] + [0.0] * 3)  # 0.1 apart: a few bf16 ulps, many float32 ones
    assert compare_outputs(close, [1], [5], [6], dtype=torch.bfloat16).verdict == "near-tie"
    assert compare_outputs(close, [1], [5], [6], dtype=torch.float32).verdict == "NO"
    assert compare_outputs(close, [1], [5], [6]).verdict == "NO"  # the target's own dtype: float32


def test_summary_counts_verdicts_and_a_near_tie_stays_lossless():
    tie = Verdict("near-tie", 2, 0.0, 0.1)
    records = [record([5, 6, 7], [5, 6, 7], [3]),
               TurnRecord(new_tokens={"plain": [5, 6, 7], "dflash": [5, 6, 8], "prompt_lookup": [5, 6, 7]},
                          seconds={"plain": 1.0, "dflash": 1.0, "prompt_lookup": 1.0}, acceptance_lengths=[2, 1],
                          verdicts={"dflash": tie, "prompt_lookup": Verdict("exact")})]
    summary = summarize("x", records, 2, 4, STEP_COSTS, greedy=True)
    assert summary["lossless"] is True and summary["lossless_prompt_lookup"] is True
    assert summary["verdicts"]["dflash"] == {"exact": 1, "near-tie": 1, "NO": 0}
    assert summary["divergences"] == [{"turn": 1, "method": "dflash", "verdict": "near-tie", "first_divergence": 2,
                                       "logit_gap": 0.0, "tolerance": 0.1}]
    assert "| yes (1 near-tie) |" in markdown_table([summary])
    json.dumps(summary)
    records[1].verdicts["dflash"] = Verdict("NO", 2, 5.0, 0.1)
    summary = summarize("x", records, 2, 4, STEP_COSTS, greedy=True)
    assert summary["lossless"] is False and summary["verdicts"]["dflash"]["NO"] == 1
    assert "| NO (1 of 2) |" in markdown_table([summary])
    sampled = summarize("x", records, 2, 4, STEP_COSTS, greedy=False)
    assert sampled["verdicts"] is None and "n/a (sampling)" in markdown_table([sampled])


def test_greedy_records_carry_a_verdict_per_method(tiny_models):
    target, draft, _ = tiny_models
    settings = BenchSettings(max_new_tokens=5, block_size=4, prompt_lookup_tokens=2)
    (greedy,) = evaluation.measure_prompts(draft, target, [[5, 6, 7, 5, 6]], settings, ONE_STOP)
    assert greedy.verdicts == {"dflash": Verdict("exact"), "prompt_lookup": Verdict("exact")}
    (sampled,) = evaluation.measure_prompts(draft, target, [[5, 6, 7]], BenchSettings(
        max_new_tokens=3, block_size=4, temperature=1.0, prompt_lookup_tokens=None), ONE_STOP)
    assert sampled.verdicts == {}


def test_the_method_that_runs_first_rotates(tiny_models, monkeypatch):
    target, draft, _ = tiny_models
    calls: list[str] = []
    generate, spec_generate = target.generate, draft.spec_generate

    def plain_or_lookup(*args, **kwargs):
        calls.append("prompt_lookup" if "prompt_lookup_num_tokens" in kwargs else "plain")
        return generate(*args, **kwargs)

    def dflash(*args, **kwargs):
        calls.append("dflash")
        return spec_generate(*args, **kwargs)

    monkeypatch.setattr(target, "generate", plain_or_lookup)
    monkeypatch.setattr(draft, "spec_generate", dflash)
    orders = []
    for turn in range(4):
        calls.clear()
        (record,) = evaluation.measure_prompts(draft, target, [[5, 6, 7]], BenchSettings(
            max_new_tokens=3, block_size=4, prompt_lookup_tokens=2), ONE_STOP, turn=turn)
        orders.append(list(calls))
        assert list(record.new_tokens) == ["plain", "dflash", "prompt_lookup"]  # records keep the usual order
    assert orders == [["plain", "dflash", "prompt_lookup"], ["dflash", "prompt_lookup", "plain"],
                      ["prompt_lookup", "plain", "dflash"], ["plain", "dflash", "prompt_lookup"]]


@pytest.fixture(scope="module")
def block_8_draft():
    return make_draft(seed=3, block_size=8, mask_token_id=127)


def test_warm_up_covers_full_blocks_and_turns_rotate(tiny_models, block_8_draft, monkeypatch):
    """The warm-up verifies full blocks in the timed batch's shape; each later call gets the next turn."""
    target, _, tokenizer = tiny_models
    seen: list[tuple[int, int, int]] = []  # (rows, max_new_tokens, turn) per call
    measure = evaluation.measure_prompts

    def spy(draft, target, prompts, settings, *args, turn=0, **kwargs):
        seen.append((len(prompts), settings.max_new_tokens, turn))
        return measure(draft, target, prompts, settings, *args, turn=turn, **kwargs)

    monkeypatch.setattr(benchmark, "measure_prompts", spy)
    monkeypatch.setattr(evaluation, "measure_prompts", spy)  # the warm-up's (evaluation.warm_up)
    conversations = [["w10 w11"], ["w20 w21"], ["w30"]]
    run_benchmark(block_8_draft, target, tokenizer, {"x": conversations},
                  BenchSettings(max_new_tokens=4, batch_size=2, prompt_lookup_tokens=None), progress=False)
    (rows, warm_up_tokens, _), *timed = seen
    assert rows == 2 and warm_up_tokens >= 8 + 1  # a full block of 8 after the prefill's token, two rows
    assert timed == [(2, 4, 0), (1, 4, 1)]
    seen.clear()
    evaluation.evaluate_draft(block_8_draft, target, [[5, 6], [7, 8]], max_new_tokens=3, tokens=ONE_STOP)
    assert seen[0][1] >= 8 + 1 and [turn for _, _, turn in seen[1:]] == [0, 1]


def test_step_costs_keep_no_logits_or_hidden_states_between_repetitions(tiny_models, monkeypatch):
    target, draft, _ = tiny_models
    earlier: list[weakref.ref] = []  # logits, hidden states and prompt features of earlier target calls
    calls: list[tuple[str, dict]] = []

    def record(name: str, module: torch.nn.Module) -> None:
        forward = module.forward

        @functools.wraps(forward)  # keeps the signature: `logits_to_keep` is seen
        def recording(*args, **kwargs):
            assert all(ref() is None for ref in earlier), "an earlier call's logits or hidden states are still held"
            outputs = forward(*args, **kwargs)
            calls.append((name, kwargs))
            kept = (getattr(outputs, "logits", None), getattr(outputs, "last_hidden_state", None),
                    *(outputs.hidden_states or ()))
            earlier.extend(weakref.ref(tensor) for tensor in kept if tensor is not None)
            return outputs

        monkeypatch.setattr(module, "forward", recording)

    record("target", target)  # a patched forward: every verify runs the target's own forward
    prefill = generation_dflash.prefill

    def keeping_features(*args, **kwargs):
        state = prefill(*args, **kwargs)
        earlier.append(weakref.ref(state.context.hidden))  # handed to the draft, then no longer needed
        return state

    monkeypatch.setattr(generation_dflash, "prefill", keeping_features)
    cost_model.measure_step_costs(draft, target, torch.arange(5, 25)[None], block_size=4, mask_token_id=127, repeats=3)
    plain_steps = [kwargs for name, kwargs in calls if name == "target" and kwargs["input_ids"].shape[1] == 1]
    assert len(plain_steps) == 4 and all(kwargs.get("logits_to_keep") == 1 for kwargs in plain_steps)  # warm-up + 3
    assert sum(name == "target" and kwargs["input_ids"].shape[1] == 4 for name, kwargs in calls) == 4  # the verifies


def test_prompts_render_with_thinking_off_unless_asked():
    """Qwen3's template adds an empty think block when `enable_thinking` is false (as the paper measures); bench
    renders that way by default and `--thinking` turns it on."""
    from helpers import make_tokenizer

    from dflash_hf.cli import build_parser
    from dflash_hf.prompts import user_prompt_ids

    tokenizer = make_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}w3 {{ m['content'] }} w1 {% endfor %}w4 "
                               "{% if enable_thinking is defined and enable_thinking is false %}w5 w6{% endif %}")
    assert user_prompt_ids(tokenizer, "w9") == [3, 9, 1, 4, 5, 6]
    assert user_prompt_ids(tokenizer, "w9", thinking=True) == [3, 9, 1, 4]
    assert build_parser().parse_args(["bench", "--thinking"]).thinking is True
    assert build_parser().parse_args(["bench"]).thinking is False


def test_bench_compile_runs_the_compiled_path_end_to_end(saved_models, tmp_path, capsys, monkeypatch):
    """`bench --compile` reaches `spec_generate(compile=True)` on every DFlash call (warm-up included) and the output
    stays the target's own. Dynamo's eager backend stands in for inductor, whose C++ build would take a minute."""
    from dflash_hf.generation_dflash import DFlashGenerationMixin

    calls, original = [], DFlashGenerationMixin.spec_generate

    def dynamo_only(self, *args, compile=False, **arguments):
        calls.append(compile)
        return original(self, *args, compile={"backend": "eager"} if compile is True else compile, **arguments)

    monkeypatch.setattr(DFlashGenerationMixin, "spec_generate", dynamo_only)
    compile_with = torch.compile  # the compiled `generate` baseline: dynamo's eager backend too
    monkeypatch.setattr(torch, "compile", lambda *args, **options: compile_with(
        *args, **{**options, "backend": "eager", "mode": None}))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"turns": ["w5 w6 w7"]}\n{"turns": ["w8 w9"]}\n')
    out = tmp_path / "bench.json"
    main(["bench", *saved_models, "--prompts", str(prompts), "--compile", "--max-new-tokens", "6", "--block-size", "4",
          "--prompt-lookup-tokens", "0", "--json", str(out), "--plot", ""])
    (result,) = json.loads(out.read_text())["results"]
    assert result["lossless"] is True and len(calls) >= 3 and all(compile is True for compile in calls)
    # the compiled baseline ran, gave generate's own tokens, and the speedup is also read against it
    assert result["lossless_plain_compiled"] is True and result["tokens_per_s"]["plain_compiled"] > 0
    assert result["speedup_vs_compiled"] == result["tokens_per_s"]["dflash"] / result["tokens_per_s"]["plain_compiled"]
    printed = capsys.readouterr().out
    assert "compiled: the warm-up took" in printed and "| compiled plain tok/s |" in printed


def test_demo_compile_reaches_the_demo(monkeypatch):
    import dflash_hf.demo as demo

    seen = {}
    monkeypatch.setattr(demo, "run_demo", lambda *args, **kwargs: seen.update(args=args, kwargs=kwargs))
    main(["demo", "--compile", "--max-new-tokens", "8"])
    assert seen["kwargs"]["compile"] is True and seen["args"][5] is None  # auto times eager trees: the chain
    main(["demo", "--compile", "--tree-size", "8"])
    assert seen["kwargs"]["compile"] is True and seen["args"][5] == 8  # a compiled tree, when asked for
