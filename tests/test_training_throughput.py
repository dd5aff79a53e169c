"""Training throughput on GPUs, checked on the CPU: activation checkpointing of the draft's layers, bf16 FSDP, and
the token-budget sampler (docs/training.md, "Batches" and "FSDP")."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from helpers import VOCAB_SIZE, make_draft, make_target

from dflash_hf.training.objective import dflash_loss, target_signals, teacher_rows
from dflash_hf.training.processes import fsdp_precision
from dflash_hf.training.trainer import TrainingSettings, activation_checkpointing, train_draft


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
