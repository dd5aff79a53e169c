"""Training throughput on GPUs, checked on the CPU: activation checkpointing of the draft's layers, bf16 FSDP, and
the token-budget sampler (docs/training.md, "Batches" and "FSDP")."""

from __future__ import annotations

import copy
import math
from types import SimpleNamespace

import pytest
import torch
from distributed_worker import budget_rows
from helpers import VOCAB_SIZE, make_draft, make_target

from dflash_hf.training.objective import dflash_loss, target_signals, teacher_rows
from dflash_hf.training.processes import check_token_budget, fsdp_precision, token_budget_steps
from dflash_hf.training.trainer import (
    TokenBudgetPlan,
    TrainingSettings,
    activation_checkpointing,
    train_draft,
    training_plan,
    training_sequences,
)


def sequence_and_mask(length: int, prompt: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    input_ids = torch.randint(0, VOCAB_SIZE - 1, (length,), generator=torch.Generator().manual_seed(seed))
    return input_ids, torch.cat((torch.zeros(prompt), torch.ones(length - prompt)))


def loss_gradients_and_saved_bytes(draft, target, input_ids, loss_mask, signals):
    """The loss, every trained parameter's gradient, and the bytes autograd keeps for the backward (what its outer
    saved-tensor hooks see, the weights left out)."""
    weights = {p.untyped_storage().data_ptr() for p in [*draft.parameters(), *target.parameters()]}
    saved: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    draft.zero_grad()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        result = dflash_loss(draft, target, input_ids, loss_mask, 12, torch.Generator().manual_seed(5), signals)
    result.loss.backward()
    return result.loss.detach(), {n: p.grad.clone() for n, p in draft.named_parameters()}, sum(saved.values())


@pytest.mark.parametrize("tile_rows", [None, 16])
def test_activation_checkpointing_gives_the_same_loss_and_gradients_and_keeps_less(tile_rows):
    target = make_target("qwen3", seed=2)
    draft = make_draft(3, block_size=4, num_hidden_layers=3).train()
    input_ids, loss_mask = sequence_and_mask(48, 6, seed=1)
    signals = target_signals(target, input_ids, draft.target_layer_ids, 8, teacher_rows(loss_mask))
    plain = loss_gradients_and_saved_bytes(draft, target, input_ids, loss_mask, signals)
    checkpointed_draft = copy.deepcopy(draft)
    activation_checkpointing(checkpointed_draft, True)
    assert all(layer.gradient_checkpointing for layer in checkpointed_draft.layers)
    checkpointed = loss_gradients_and_saved_bytes(checkpointed_draft, target, input_ids, loss_mask, signals)

    assert torch.allclose(checkpointed[0], plain[0], rtol=0, atol=1e-6)
    for name, gradient in plain[1].items():
        assert torch.allclose(checkpointed[1][name], gradient, rtol=1e-5, atol=1e-7), name
    # each layer keeps only its inputs: the rest is recomputed in the backward
    assert checkpointed[2] < 0.5 * plain[2], (checkpointed[2], plain[2])

    activation_checkpointing(checkpointed_draft, False)
    assert not any(layer.gradient_checkpointing for layer in checkpointed_draft.layers)
    assert loss_gradients_and_saved_bytes(checkpointed_draft, target, input_ids, loss_mask, signals)[2] == plain[2]


def test_training_with_gradient_checkpointing_gives_the_same_run(tmp_path):
    target = make_target("qwen3", seed=4)
    generator = torch.Generator().manual_seed(3)
    rows = [{"prompt_ids": torch.randint(0, VOCAB_SIZE - 1, (5,), generator=generator).tolist(),
             "response_ids": torch.randint(0, VOCAB_SIZE - 1, (16,), generator=generator).tolist()}
            for _ in range(4)]
    settings = TrainingSettings(epochs=1, learning_rate=2e-3, num_anchors=8, batch_size=2, mixed_precision="no")
    logs, drafts = [], []
    for checkpointing in (False, True):
        draft = make_draft(5, block_size=4)
        logs.append(train_draft(draft, target, rows, TrainingSettings(**{**settings.__dict__,
                                                                         "gradient_checkpointing": checkpointing}),
                                tmp_path / str(checkpointing), progress=False))
        drafts.append(draft)
        assert not any(layer.gradient_checkpointing for layer in draft.layers)  # switched off again after training
    assert logs[0].steps == logs[1].steps == 2
    assert logs[1].losses == pytest.approx(logs[0].losses, rel=1e-6, abs=1e-7)
    assert logs[1].grad_norms == pytest.approx(logs[0].grad_norms, rel=1e-5)
    for (name, plain), checkpointed in zip(drafts[0].state_dict().items(), drafts[1].state_dict().values()):
        assert torch.allclose(checkpointed, plain, rtol=1e-5, atol=1e-6), name


def test_fsdp_precision_keeps_float32_shards_and_gathers_in_the_autocast_dtype():
    for dtype, reduce_dtype in ((torch.bfloat16, torch.float32), (None, None)):
        accelerator = SimpleNamespace(mixed_precision="no", state=SimpleNamespace(fsdp_plugin=SimpleNamespace()))
        fsdp_precision(accelerator, dtype)
        policy = accelerator.state.fsdp_plugin.mixed_precision_policy
        assert (policy.param_dtype, policy.reduce_dtype) == (dtype, reduce_dtype)
    with pytest.raises(ValueError, match=r"mixed_precision 'bf16'.*--mixed-precision.*mixed_precision: 'no'"):
        fsdp_precision(SimpleNamespace(mixed_precision="bf16"), torch.bfloat16)


def varied_lengths(count: int, seed: int = 0) -> list[int]:
    return torch.randint(8, 200, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("processes, accumulation", [(1, 1), (2, 1), (2, 3), (4, 2)])
def test_token_budget_steps_fill_the_budget_balance_the_bins_and_cover_the_epoch(processes, accumulation):
    lengths = varied_lengths(300)
    bins, budget = processes * accumulation, 2000 * processes
    check_token_budget(budget, max(lengths), processes, accumulation)
    steps = token_budget_steps(lengths, epoch=0, seed=7, bins=bins, budget=budget)
    for step in steps:
        tokens = [sum(lengths[i] for i in batch) for batch in step]
        assert len(step) == bins and all(step)  # every process's every micro-batch has a sequence
        assert sum(tokens) <= budget  # the budget holds
        assert max(tokens) - min(tokens) <= max(lengths[i] for batch in step for i in batch)  # ranks finish together
    items = [i for step in steps for batch in step for i in batch]
    # every sequence once an epoch, plus the last step's wrap; within a step, no sequence is on two processes
    assert set(items) == set(range(len(lengths))) and len(items) - len(lengths) < bins
    for step in steps:
        step_items = [i for batch in step for i in batch]
        assert len(step_items) == len(set(step_items))
    # most steps are full: no more than one step beyond the tokens over the budget, rounded up, plus slack for the
    # sequences that did not fit (each step leaves less than its next sequence)
    assert len(steps) <= math.ceil(sum(lengths) / (budget - max(lengths))) + 1


def test_token_budget_steps_group_lengths_and_are_a_pure_function_of_seed_and_epoch():
    lengths = varied_lengths(120)
    steps = token_budget_steps(lengths, epoch=0, seed=3, bins=2, budget=1200)
    assert steps == token_budget_steps(list(lengths), epoch=0, seed=3, bins=2, budget=1200)  # every process's
    assert steps != token_budget_steps(lengths, epoch=1, seed=3, bins=2, budget=1200)  # a fresh one each epoch
    assert steps != token_budget_steps(lengths, epoch=0, seed=4, bins=2, budget=1200)
    # one window (120 <= LENGTH_GROUP_WINDOW): the steps cut the epoch sorted by length, so their lengths do not
    # interleave (but for the last step's wrap), and they come shuffled, not longest first
    spans = [(min(lengths[i] for b in step for i in b), max(lengths[i] for b in step for i in b)) for step in steps]
    items = [i for step in steps for b in step for i in b]
    repeated = {i for i in items if items.count(i) > 1}  # the wrap of the step cut last
    full = sorted((span for span, step in zip(spans, steps) if not repeated & {i for b in step for i in b}),
                  key=lambda span: -span[1])
    assert len(full) >= len(spans) - 1
    assert all(longer[0] >= shorter[1] for longer, shorter in zip(full, full[1:]))
    assert [span[1] for span in spans] != sorted((span[1] for span in spans), reverse=True)
    # against no grouping: the sequences of a step differ in length far less
    spread = sum(high - low for low, high in spans) / len(spans)
    assert spread < 0.25 * (max(lengths) - min(lengths))


def test_a_token_budget_too_small_for_a_sequence_per_micro_batch_is_refused():
    with pytest.raises(ValueError, match=r"--tokens-per-step 500: .*2 process\(es\) 2 micro-batch.*300 tokens: pass "
                                         r"at least 1200"):
        check_token_budget(500, 300, 2, 2)
    with pytest.raises(ValueError, match="leave --train-batch-size at 1"):
        TrainingSettings(tokens_per_step=4096, batch_size=2)


def test_token_budget_training_resumes_exactly_mid_epoch(tmp_path):
    target, rows = make_target("qwen3", seed=4), budget_rows(12)
    settings = TrainingSettings(epochs=2, learning_rate=2e-3, num_anchors=8, tokens_per_step=80,
                                gradient_accumulation_steps=2, checkpoint_every=1, mixed_precision="no")
    plan = training_plan(training_sequences(rows, settings.max_length), 1, settings)
    total = plan.total_steps(2)
    assert isinstance(plan, TokenBudgetPlan) and total > 4
    assert plan.epoch_of(total - 1) == 1 and plan.epoch_of(0) == 0
    draft = make_draft(5, block_size=4)
    log = train_draft(draft, target, rows, settings, tmp_path / "whole", progress=False)
    assert log.steps == total
    lengths = [len(row["prompt_ids"]) + len(row["response_ids"]) for row in rows]
    assert log.tokens == sum(lengths[i] for step in range(total) for i in plan.step_items(step))
    assert all(sum(lengths[i] for i in plan.step_items(step)) <= 80 for step in range(total))
    # stopped in the middle of the first epoch, then resumed: the same losses, bit for bit, and the same weights
    stop = plan.total_steps(1) // 2
    train_draft(make_draft(5, block_size=4), target, rows, settings, tmp_path / "resumed", progress=False,
                max_steps=stop)
    resumed_draft = make_draft(6, block_size=4)  # other initial weights: the checkpoint's replace them
    resumed = train_draft(resumed_draft, target, rows, settings, tmp_path / "resumed", progress=False)
    assert resumed.losses == log.losses and resumed.tokens == log.tokens
    for (name, weight), resumed_weight in zip(draft.state_dict().items(), resumed_draft.state_dict().values()):
        assert torch.equal(weight, resumed_weight), name
