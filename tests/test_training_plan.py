"""`dflash-hf train --plan` and the run's schedule: the cost model's arithmetic against numbers computed by hand, the
intervals by steps, share of the run or time, and the decode evaluation sharded over two processes."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest
import torch
from helpers import make_draft, save_tiny_target_and_prompts

from dflash_hf.cli import build_parser, main
from dflash_hf.configuration_dflash import DFlashConfig
from dflash_hf.loading import PUBLISHED_CONFIGS
from dflash_hf.training.plan import (
    GPUS,
    Interval,
    RunInputs,
    events,
    interval_steps,
    parse_hardware,
    parse_interval,
    plan_run,
    planned,
    resolve_schedule,
    step_flops,
    target_config,
)

QWEN3_8B_PARAMETERS = 8_190_735_360  # Qwen3-8B: 2 x 151,936 x 4,096 + 36 x 192,946,432 + norms
DRAFT_PARAMETERS = 1.05e9  # the 5-layer draft's trained parameters (docs/training.md)


def qwen3_8b_run(**changes) -> RunInputs:
    """docs/training.md's 8xH100 example as the plan reads it: 800K sequences of 3,072 tokens, 6 epochs, one sequence
    per GPU per step, a checkpoint every 200 steps, 2,000 held-out rows every 500, 20 prompts every 5,000."""
    run = RunInputs(sequences=800_000, tokens=3072, epochs=6, processes=8, gpu=GPUS["h100"], anchors=512,
                    per_process=1, per_micro_batch=1, gradient_checkpointing=False,
                    checkpoint_every=Interval(200, ""), held_out_rows=2000, held_out_every=Interval(500, ""),
                    num_eval=20, eval_every=Interval(5000, ""), eval_max_new_tokens=256)
    return replace(run, **changes)


def qwen3_8b_shapes():
    draft = DFlashConfig.from_json_file(str(PUBLISHED_CONFIGS / "Qwen3-8B-DFlash-b16.json"))
    return target_config("Qwen/Qwen3-8B"), draft


def test_the_step_flops_are_the_documented_sum_of_their_parts():
    _, draft = qwen3_8b_shapes()
    rows, context, hidden, supervised = 512 * 16, 3072, 4096, 512 * 15
    fc = 2 * context * 5 * hidden * hidden  # five target layers' features in, forward
    projections = 2 * rows * hidden * 4096 * 2 + 2 * (rows + context) * hidden * 1024 * 2  # q, o; k, v of both
    attention = 2 * 2 * rows * (context + rows) * 4096  # scores and values under the dense mask
    mlp = 2 * rows * 3 * hidden * 12288
    head = 2 * supervised * hidden * 151936
    expected = 2 * fc + 3 * 5 * (projections + attention + mlp) + 3 * head
    assert step_flops(draft, 5, 512, 3072) == expected
    assert 1.00e14 < expected < 1.01e14  # docs/training.md: 1.0e14 a sequence


def test_the_plan_of_the_docs_8xh100_run_matches_the_hand_computed_numbers():
    target, draft = qwen3_8b_shapes()
    plan = plan_run(qwen3_8b_run(), target, QWEN3_8B_PARAMETERS, draft, DRAFT_PARAMETERS)
    assert plan.steps == 800_000 * 6 // 8 == 600_000
    assert plan.tokens == 800_000 * 6 * 3072
    sequence = step_flops(draft, 5, 512, 3072) + 2 * QWEN3_8B_PARAMETERS * 3072  # draft step + online target
    assert plan.step_seconds == pytest.approx(sequence / (0.4 * 989e12))  # one sequence per GPU: 0.38 s
    assert plan.training_seconds / 3600 == pytest.approx(63.6, abs=0.05)  # docs: 63 hours
    # the example's costs as the issue counted them
    assert plan.checkpoints == 3000 and plan.checkpoint_bytes == 12 * 1.05e9  # 12.6 GB: weights, two moments
    assert plan.checkpoints * plan.checkpoint_bytes == pytest.approx(37.8e12)  # 38 TB written
    assert plan.held_out_measurements == 600_000 // 500 + 1  # and before the first step
    held_out = 1201 * 250 * (2 * QWEN3_8B_PARAMETERS * 3072 + step_flops(draft, 5, 512, 3072) / 3) / (0.4 * 989e12)
    assert plan.held_out_seconds == pytest.approx(held_out)  # 250 rows per process, forwards only
    assert 0.25 <= plan.held_out_seconds / plan.training_seconds <= 0.30  # "about 25-30 %"
    assert plan.evaluations == 121 and plan.overhead > 0.4
    fsdp, data_parallel = (sum(parts.values()) for parts in plan.memory.values())
    target_bytes, state = 2 * QWEN3_8B_PARAMETERS, 16 * 1.05e9
    activations = 5 * 4 * 4096 * (8192 * 7.3e6 / (16 * 4096 * 4) + 3072 * 44e6 / (256 * 4096 * 4))  # 5 x (3.74 +
    assert activations == pytest.approx(5 * (512 * 7.3e6 + 12 * 44e6))  # 0.53) GB: as measured per anchor / token
    other = 4 * 1024 * 151936 + 2 * 5 * 4096 * 3072  # logits of 1,024 rows, the features
    assert fsdp == pytest.approx(target_bytes + state / 8 + 4 * 1.05e9 / 5 + activations + other)  # 41.4 GB
    assert data_parallel == pytest.approx(target_bytes + state + activations + other)  # 55.2 GB
    assert 40e9 < fsdp < 43e9 and data_parallel < 80e9  # docs: about 42 GB; both fit an 80 GB H100


def test_the_docs_run_with_the_new_settings_spends_under_5_percent_and_writes_under_1_tb():
    target, draft = qwen3_8b_shapes()
    run = qwen3_8b_run(checkpoint_every=Interval(2, "%"), held_out_every=Interval(2, "%"),
                       eval_every=Interval(10, "%"))
    plan = plan_run(run, target, QWEN3_8B_PARAMETERS, draft, DRAFT_PARAMETERS)
    assert (plan.checkpoint_every, plan.held_out_every, plan.eval_every) == (12_000, 12_000, 60_000)
    written = plan.checkpoints * plan.checkpoint_bytes
    assert plan.checkpoints == 50 and written == pytest.approx(0.63e12) and written < 1e12
    assert plan.held_out_measurements == 51 and plan.evaluations == 11
    assert plan.overhead <= 0.05
    # the decode evaluation is sharded: 3 of the 20 prompts per process, not 20 on one while 7 wait
    sharded = plan.evaluation_seconds
    alone = plan_run(replace(run, processes=1), target, QWEN3_8B_PARAMETERS, draft, DRAFT_PARAMETERS)
    assert sharded == pytest.approx((11 * 3 + 20) / (11 * 20 + 20) * alone.evaluation_seconds)


def test_intervals_are_steps_shares_of_the_run_or_times():
    assert parse_interval("200", "--x") == Interval(200, "")
    assert parse_interval("2.5%", "--x") == Interval(2.5, "%") and parse_interval("30m", "--x") == Interval(30, "m")
    assert interval_steps(parse_interval("200", "--x"), 1000, None, "--x") == 200
    assert interval_steps(parse_interval("5%", "--x"), 1000, None, "--x") == 50
    assert interval_steps(parse_interval("5%", "--x"), 10, None, "--x") == 1  # at least every step
    assert interval_steps(parse_interval("30m", "--x"), 1000, 0.5, "--x") == 3600  # 1,800 s of 0.5 s steps
    assert interval_steps(parse_interval("1.5h", "--x"), 1000, 2.0, "--x") == 2700
    assert interval_steps(parse_interval("0", "--x"), 1000, None, "--x") == 0  # never
    for text in ("5x", "2.5", "-1", "150%"):
        with pytest.raises(ValueError, match=r"--x"):
            parse_interval(text, "--x")
    with pytest.raises(ValueError, match=r"--x 30m: a time needs the step time of a GPU the cost model knows .*"
                                         r"give optimiser steps or a share of the run"):
        interval_steps(parse_interval("30m", "--x"), 1000, None, "--x")
    assert events(200, 1000, False) == 5 and events(300, 1000, False) == 4  # and the last step
    assert events(500, 1000, True) == 3 and events(0, 1000, True) == 0
    assert parse_hardware("8xh100") == (8, "h100") and parse_hardware("h200")[1] == "h200"
    with pytest.raises(ValueError, match=r"--plan 8xv100: expected GPUs as NxKIND or KIND"):
        parse_hardware("8xv100")


def test_the_schedule_flags_resolve_to_steps_and_bad_ones_are_refused_before_anything_loads(tmp_path, monkeypatch):
    import dflash_hf.training.command as command

    args = build_parser().parse_args(["train", "--output", "run", "--eval-every", "10%", "--held-out-every", "25",
                                      "--held-out-rows", "4"])
    resolved = resolve_schedule(args, 400, None)
    assert (resolved.checkpoint_every, resolved.eval_every, resolved.held_out_every) == (8, 40, 25)
    assert args.checkpoint_every == "2%"  # the arguments themselves are left as given
    prompts = save_tiny_target_and_prompts(tmp_path, 2)
    monkeypatch.setattr(command, "load_target", lambda *args, **kwargs: pytest.fail("loaded a model before the check"))
    common = ["train", "--target", str(tmp_path / "target"), "--output", str(tmp_path / "run"), "--prompts",
              str(prompts)]
    for flags, message in [(["--checkpoint-every", "30m"], "--checkpoint-every 30m: a time needs the step time of a "
                                                            "GPU the cost model knows (h100, h200, a100)"),
                           (["--checkpoint-every", "0"], "--checkpoint-every 0: a run checkpoints"),
                           (["--held-out-every", "1h"], "--held-out-every 1h: a time needs")]:
        with pytest.raises(SystemExit, match=re.escape(message)):
            main([*common, *flags])
    assert not (tmp_path / "run").exists()


def test_the_plan_flag_prints_the_cost_before_any_model_loads(tmp_path, monkeypatch, capsys):
    import dflash_hf.training.command as command

    prompts = save_tiny_target_and_prompts(tmp_path, 6)
    monkeypatch.setattr(command, "load_target", lambda *args, **kwargs: pytest.fail("loaded a model"))
    monkeypatch.setattr(command, "process_state", lambda *args, **kwargs: pytest.fail("started the processes"))
    main(["train", "--target", str(tmp_path / "target"), "--output", str(tmp_path / "run"), "--prompts",
          str(prompts), "--epochs", "3", "--max-length", "64", "--draft-layers", "1", "--draft-block-size", "4",
          "--mask-token", "w127", "--held-out-rows", "2", "--held-out-every", "1", "--checkpoint-every", "1",
          "--plan", "2xh200"])
    printed = capsys.readouterr().out
    # 6 prompts, 2 held out: 4 sequences over 2 GPUs, one each per step: 2 steps an epoch
    assert "on 2 x H200 SXM 141GB" in printed and "sequences: 4 x 3 epochs" in printed
    assert "optimiser steps: 6 (2 sequences each)" in printed
    assert "checkpoints: every 1 steps (--checkpoint-every 1), 6 of" in printed
    assert "held-out loss: 2 rows every 1 steps (--held-out-every 1), 7 times" in printed
    assert re.search(r"memory per GPU, fsdp: [\d.]+ GB of 141\.0 GB", printed)
    assert re.search(r"checkpoints and held-out measurements would take \d+% of the training time", printed)
    assert not (tmp_path / "run").exists()  # nothing written
    draft = make_draft(7, num_hidden_layers=2)  # --init-from: the trained draft's shape, read from its config alone
    draft.save_pretrained(tmp_path / "draft")
    args = build_parser().parse_args(["train", "--target", str(tmp_path / "target"), "--output", "run",
                                      "--init-from", str(tmp_path / "draft")])
    _, _, _, trained = planned(args, 4, 1, "h100")
    assert trained == sum(parameter.numel() for parameter in draft.parameters() if parameter.requires_grad)
    _, _, _, new = planned(build_parser().parse_args(["train", "--target", str(tmp_path / "target"), "--output",
                                                      "run", "--draft-layers", "1"]), 4, 1, "h100")
    assert new < trained  # a new one-layer draft against the two-layer one


@pytest.fixture(scope="module")
def evaluated_run(tmp_path_factory):
    """`dflash-hf train` on two processes with a decode evaluation every step: 3 held-out prompts, 3 steps."""
    from test_training_distributed import run_two_processes

    folder = tmp_path_factory.mktemp("sharded-evaluation")
    prompts = save_tiny_target_and_prompts(folder, 4)
    output, records = run_two_processes(
        ["cli"], folder, "train", "--target", str(folder / "target"), "--output", str(folder / "cli" / "run"),
        "--prompts", str(prompts), "--gen-max-new-tokens", "8", "--draft-block-size", "4", "--draft-layers", "1",
        "--mask-token", "w127", "--epochs", "1", "--num-anchors", "6", "--eval-prompts", str(prompts),
        "--num-eval", "3", "--eval-max-new-tokens", "6", "--eval-dtype", "float32", "--eval-every", "1",
        "--process-group-timeout", "45")["cli"]
    return output, records, folder, prompts


def test_the_decode_evaluation_is_sharded_over_the_processes(evaluated_run):
    """Each process measures its share of the held-out prompts at every evaluation (process 0: prompts 0 and 2,
    process 1: prompt 1) instead of one measuring all while the other waits; the combined point is what one process
    measuring the three prompts gives."""
    from dflash_hf.loading import load_target
    from dflash_hf.modeling_dflash import DFlashDraftModel
    from dflash_hf.prompts import user_prompt_ids
    from dflash_hf.tokens_dflash import generation_tokens
    from dflash_hf.training.command import held_out_evaluation
    from dflash_hf.training.data import read_prompts

    output, records, folder, prompt_file = evaluated_run
    log = json.loads((output / "training_log.json").read_text())
    steps = log["steps"]
    assert steps == 2 and [point["step"] for point in log["evaluations"]] == [0, 1, 2]
    # evaluate_draft calls: one per evaluation on each process; process 0 also measures the final draft alone
    assert [record["evaluations"] for record in records] == [3 + 1, 3]
    assert all(point["lossless"] for point in log["evaluations"])
    target, tokenizer = load_target(str(folder / "target"), torch.float32)
    draft = DFlashDraftModel.from_pretrained(output / "draft", dtype=torch.float32).eval()
    prompts = [user_prompt_ids(tokenizer, text) for text in read_prompts([prompt_file], 3)]
    alone = held_out_evaluation(draft, target, prompts, 6, generation_tokens(target, tokenizer))
    assert log["evaluations"][-1]["tau"] == pytest.approx(alone["tau"])  # the trained draft, all prompts at once
    assert alone["lossless"]
