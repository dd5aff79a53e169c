"""What training reports: the gradient norm of every step, and Accelerate's trackers (`--report-to tensorboard`), read
back from TensorBoard's event files (docs/training.md, "Logs")."""

from __future__ import annotations

import pytest
import torch
from helpers import make_draft, make_target

from dflash_hf.training.objective import packed_dflash_loss, target_signals, teacher_rows
from dflash_hf.training.trainer import (
    TRACKER_DIR,
    TRACKER_RUN,
    EpochPlan,
    TrainingSettings,
    anchor_seed,
    check_trackers,
    train_draft,
    training_sequences,
)

SETTINGS = TrainingSettings(epochs=2, learning_rate=2e-3, num_anchors=8, report_to=["tensorboard"])


def rows(count: int = 3) -> list[dict]:
    generator = torch.Generator().manual_seed(5)
    return [{"prompt_ids": torch.randint(0, 127, (5,), generator=generator).tolist(),
             "response_ids": torch.randint(0, 127, (12,), generator=generator).tolist()} for _ in range(count)]


def scalars(folder) -> dict[str, list[tuple[int, float]]]:
    """{tag: [(step, value), ...]} of the TensorBoard event files under `folder`."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_gets_loss_learning_rate_gradient_norm_accuracy_tokens_per_second_and_held_out(tmp_path):
    pytest.importorskip("tensorboard")
    log = train_draft(make_draft(5, block_size=4), make_target("qwen3", seed=4), rows(), SETTINGS, tmp_path,
                      progress=False, evaluate=lambda draft: {"tau": 1.5, "lossless": True}, eval_every=3,
                      held_out_rows=rows(5)[3:], held_out_every=3)
    found = scalars(tmp_path / TRACKER_DIR / TRACKER_RUN)
    steps = list(range(1, log.steps + 1))
    for tag, values in [("train/loss", log.losses), ("train/learning_rate", log.learning_rates),
                        ("train/grad_norm", log.grad_norms)]:
        assert [step for step, _ in found[tag]] == steps, tag
        assert [value for _, value in found[tag]] == pytest.approx(values, rel=1e-6), tag  # stored as float32
    assert all(value > 0 for _, value in found["train/tokens_per_second"])
    assert len(found["train/tokens_per_second"]) == log.steps
    positions = [found[f"train/accuracy_position_{k}"][-1][1] for k in (1, 2, 3)]  # block 4: positions 1..3
    assert positions == pytest.approx(log.position_accuracy, abs=1e-6)  # the last step's: the epoch's accuracy
    assert found["train/block_tau"][-1][1] == pytest.approx(log.block_tau, rel=1e-6)
    assert found["held_out/tau"] == [(0, 1.5), (3, 1.5), (6, 1.5)]  # before training, every 3 steps, the last
    assert [value for _, value in found["held_out/lossless"]] == [1.0, 1.0, 1.0]
    for name in ("loss", "block_tau", "position_accuracy_1"):  # the held-out loss every process computes
        expected = [(entry["step"], entry[name] if name in entry else entry["position_accuracy"][0])
                    for entry in log.held_out_losses]
        assert [step for step, _ in found[f"held_out/{name}"]] == [step for step, _ in expected] == [0, 3, 6]
        assert [value for _, value in found[f"held_out/{name}"]] == pytest.approx([v for _, v in expected], rel=1e-6)


def test_the_logged_gradient_norm_is_the_first_steps_norm_before_clipping(tmp_path):
    target = make_target("qwen3", seed=4)
    settings = TrainingSettings(epochs=1, num_anchors=8, max_grad_norm=1e-3)  # clipping changes the gradients
    log = train_draft(make_draft(5, block_size=4), target, rows(), settings, tmp_path, progress=False, max_steps=1)
    # the same step by hand: the epoch's first row, the anchors of process 0's first micro-batch
    sequences = training_sequences(rows(), settings.max_length)
    input_ids, loss_mask = sequences[EpochPlan(len(sequences), 1, 1, settings.seed).step_items(0)[0]]
    draft = make_draft(5, block_size=4).train()
    signals = target_signals(target, input_ids, draft.target_layer_ids, settings.teacher_top_k,
                             teacher_rows(loss_mask))
    result = packed_dflash_loss(draft, target, [(input_ids, loss_mask)], settings.num_anchors,
                                torch.Generator().manual_seed(anchor_seed(settings.seed, 0, 0)), [signals])
    result.loss.backward()
    norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in draft.parameters() if p.grad is not None]))
    assert log.losses[0] == pytest.approx(float(result.loss.detach()), rel=1e-6)
    assert log.grad_norms == pytest.approx([float(norm)], rel=1e-5) and log.grad_norms[0] > 1e-3


def test_unknown_or_missing_trackers_are_refused_by_name(tmp_path, monkeypatch):
    import dflash_hf.training.command as command
    from dflash_hf.cli import main

    with pytest.raises(ValueError, match="--report-to nope: not one of Accelerate's trackers"):
        check_trackers(["nope"])
    monkeypatch.setattr("accelerate.tracking.get_available_trackers", lambda: [])  # as if nothing were installed
    with pytest.raises(ValueError, match=r"--report-to tensorboard: its package is not installed here \(pip install "
                                         r"tensorboard\)"):
        check_trackers(["tensorboard"])
    monkeypatch.setattr(command, "load_target", lambda *args, **kwargs: pytest.fail("loaded a model before the check"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w5"}\n')
    with pytest.raises(SystemExit, match="--report-to wandb: its package is not installed"):
        main(["train", "--output", str(tmp_path / "run"), "--prompts", str(prompts), "--report-to", "wandb"])
    assert not (tmp_path / "run").exists()
