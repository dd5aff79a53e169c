"""Held-out evidence while training (`train_draft(evaluate=..., eval_every=N)`, `dflash-hf train --eval-every N`), the
held-out loss every process computes (`--held-out-rows K --held-out-every N`) and the progress the trainer reports
(tokens, tokens/s, time left)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import make_draft, make_target

from dflash_hf.tokens_dflash import GenerationTokens
from dflash_hf.training.command import held_out_evaluation
from dflash_hf.training.objective import packed_dflash_loss, target_signals, teacher_rows
from dflash_hf.training.trainer import (
    CHECKPOINT_DIR,
    STATE_FILE,
    TrainingSettings,
    anchor_seed,
    train_draft,
    training_sequences,
)


def repeating_target() -> torch.nn.Module:
    """A tiny Llama whose greedy continuation repeats its last token (mostly: one of 8 responses switches token after
    5): its layers are near zero (init std 0.02), so the last hidden state is about the token's own embedding, and
    its LM head is that embedding, scaled so that the distribution is sharp."""
    target = make_target("llama", seed=3, init_std=0.02)
    with torch.no_grad():
        target.get_output_embeddings().weight.copy_(target.get_input_embeddings().weight * 10)
    return target


def greedy_rows(target: torch.nn.Module, prompts: list[list[int]], length: int) -> list[dict]:
    """The target's own greedy responses to `prompts`, as `dflash-hf train` regenerates them."""
    rows = []
    for prompt in prompts:
        output = target.generate(torch.tensor([prompt]), max_new_tokens=length, do_sample=False, pad_token_id=0)
        rows.append({"prompt_ids": prompt, "response_ids": output[0, len(prompt):].tolist()})
    return rows


def test_held_out_tau_rises_on_prompts_the_draft_never_saw(tmp_path):
    target = repeating_target()
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, 120, (6,), generator=generator).tolist() for _ in range(8)]
    rows = greedy_rows(target, prompts, 32)
    assert all(row["response_ids"][:4] == row["prompt_ids"][-1:] * 4 for row in rows)  # the target repeats
    # held out: new prompts (other tokens before the last one), never trained on
    held_out = [torch.randint(1, 120, (5,), generator=generator).tolist() + [prompt[-1]] for prompt in prompts[:3]]
    assert not {tuple(prompt) for prompt in held_out} & {tuple(prompt) for prompt in prompts}
    tokens = GenerationTokens(stop_token_ids=[], pad_token_id=0, mask_token_id=None)
    settings = TrainingSettings(epochs=5, learning_rate=1e-2, num_anchors=32, warmup_ratio=0.1)

    log = train_draft(make_draft(5, block_size=4), target, rows, settings, tmp_path, progress=False,
                      evaluate=lambda draft: held_out_evaluation(draft, target, held_out, 24, tokens), eval_every=10)

    assert [evaluation["step"] for evaluation in log.evaluations] == [0, 10, 20, 30, 40]  # before, every 10, last
    assert all(evaluation["lossless"] for evaluation in log.evaluations)
    taus = [evaluation["tau"] for evaluation in log.evaluations]
    assert taus[0] < 1.2 and taus[-1] > 1.6, taus  # measured: 1.03 before training, 1.92 after 40 steps
    assert json.loads((tmp_path / "training_log.json").read_text())["evaluations"] == log.evaluations
    # the checkpoint keeps the curve: a resumed run continues it
    assert json.loads((tmp_path / CHECKPOINT_DIR / STATE_FILE).read_text())["evaluations"] == log.evaluations


def test_the_progress_bar_shows_tokens_per_second_and_time_left(tmp_path, capsys):
    rows = [{"prompt_ids": [5, 6, 7], "response_ids": list(range(10, 10 + length))} for length in (8, 12, 16)]
    log = train_draft(make_draft(5, block_size=4), make_target("qwen3", seed=4), rows,
                      TrainingSettings(epochs=2, num_anchors=8), tmp_path)
    assert log.tokens == 2 * sum(3 + length for length in (8, 12, 16))  # every sequence's tokens, each epoch
    states = re.split(r"[\r\n]", capsys.readouterr().err)  # every state the bar was drawn in
    last = next(state for state in reversed(states) if "training:" in state)  # the one it closed with
    assert re.search(r"6/6 \[\d\d:\d\d<00:00,\s+[\d.]+(step/s|s/step)", last), last  # steps, elapsed < remaining, rate
    rate = re.search(r"([\d,]+) tok/s", last)
    assert rate is not None and int(rate.group(1).replace(",", "")) > 0, last


def test_eval_every_without_held_out_prompts_is_refused_before_anything_loads(tmp_path):
    from dflash_hf.cli import main

    for flags, message in [(["--eval-every", "5", "--num-eval", "0"], "--num-eval >= 1, got 0"),
                           (["--eval-every", "-1"], "--eval-every -1: expected optimiser steps (500), a share of "
                                                             "the run (5%) or a time of training (30m, 2h, 90s)")]:
        with pytest.raises(SystemExit, match=re.escape(message)):
            main(["train", "--target", str(tmp_path / "no-such-target"), "--output", str(tmp_path / "run"), *flags])
    assert not (tmp_path / "run").exists()


def held_out_reference(draft: torch.nn.Module, target: torch.nn.Module, rows: list[dict],
                       settings: TrainingSettings) -> float:
    """The mean training loss of `draft` on held-out `rows`, one at a time, each with the anchors the trainer draws
    for it (process -1, its index)."""
    losses = []
    with torch.no_grad():
        for index, (input_ids, loss_mask) in enumerate(training_sequences(rows, settings.max_length)):
            signals = target_signals(target, input_ids, draft.target_layer_ids, settings.teacher_top_k,
                                     teacher_rows(loss_mask))
            generator = torch.Generator().manual_seed(anchor_seed(settings.seed, -1, index))
            losses.append(float(packed_dflash_loss(draft, target, [(input_ids, loss_mask)], settings.num_anchors,
                                                   generator, [signals]).loss))
    return sum(losses) / len(losses)


def test_the_held_out_loss_is_measured_on_rows_never_trained_on(tmp_path):
    target = repeating_target()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 120, (6,), generator=generator).tolist() for _ in range(7)]
    rows = greedy_rows(target, prompts, 16)
    settings = TrainingSettings(epochs=2, learning_rate=1e-2, num_anchors=16, warmup_ratio=0.1, report_to=[])
    log = train_draft(make_draft(5, block_size=4), target, rows[:4], settings, tmp_path, progress=False,
                      held_out_rows=rows[4:], held_out_every=3)
    assert [entry["step"] for entry in log.held_out_losses] == [0, 3, 6, 8]  # before, every 3 steps, the last
    assert log.tokens == 8 * (6 + 16)  # the 4 training rows twice: the held-out ones were not trained on
    first, last = log.held_out_losses[0], log.held_out_losses[-1]
    assert first["loss"] == pytest.approx(held_out_reference(make_draft(5, block_size=4), target, rows[4:], settings),
                                          rel=1e-6)  # the untrained draft, the same anchors
    assert len(first["position_accuracy"]) == 3 and first["block_tau"] >= 1.0
    assert last["loss"] < 0.9 * first["loss"]  # it learns the repetition (measured: 6.55 before, 5.59 after 8 steps)
    assert json.loads((tmp_path / "training_log.json").read_text())["held_out_losses"] == log.held_out_losses
    with pytest.raises(ValueError, match="held_out_every 0: held-out rows are measured every N >= 1"):
        train_draft(make_draft(5, block_size=4), target, rows[:4], settings, tmp_path / "other", progress=False,
                    held_out_rows=rows[4:])
