"""Training at scale in one process: sequences packed into one row, the block-sparse mask, gradient accumulation,
the feature cache's bound."""

from __future__ import annotations

import pytest
import torch
from helpers import VOCAB_SIZE, make_draft, make_target, make_variant_draft

from dflash_hf.training.objective import (
    build_blocks,
    dflash_loss,
    pack_blocks,
    packed_dflash_loss,
    sample_anchors,
    target_signals,
    tiled_block_mask,
)

MASK = VOCAB_SIZE - 1


def sequences_of(lengths: list[int], prompt: int = 4, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random sequences [T_i] with their loss masks (the first `prompt` tokens of each are not labels)."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, MASK, (length,), generator=generator),
             torch.cat((torch.zeros(prompt), torch.ones(length - prompt)))) for length in lengths]


def loss_and_grads(draft, compute) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The loss `compute()` returns and the draft's gradients after its backward."""
    draft.zero_grad()
    result = compute()
    result.loss.backward()
    return result.loss.detach(), {name: p.grad.clone() for name, p in draft.named_parameters() if p.grad is not None}


def assert_same_grads(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys() and expected
    for name, grad in expected.items():
        torch.testing.assert_close(actual[name], grad, rtol=1e-4, atol=1e-6, msg=name)


def test_packed_blocks_see_only_their_own_sequence():
    first = build_blocks(torch.arange(10), torch.ones(10), torch.tensor([2, 7]), 3, MASK)
    second = build_blocks(torch.arange(6), torch.ones(6), torch.tensor([0, 4]), 3, MASK)
    packed = pack_blocks([first, second])
    assert packed.context_length == 16
    assert packed.context_start.tolist() == [0, 0, 10, 10] and packed.context_end.tolist() == [2, 7, 10, 14]
    assert packed.sequence_index.tolist() == [0, 0, 1, 1]
    assert packed.block_position_ids.tolist() == [2, 3, 4, 7, 8, 9, 0, 1, 2, 4, 5, 6]  # within each sequence
    mask = packed.attention_mask  # [12, 16 + 12]
    assert mask[9, :16].nonzero().flatten().tolist() == [10, 11, 12, 13]  # second sequence, anchor 4
    assert mask[6, :16].sum() == 0  # anchor 0: no context at all
    assert mask[0, 16:].nonzero().flatten().tolist() == [0, 1, 2]  # its own block only


@pytest.mark.parametrize("tile_rows", [1, 8, 40])
def test_tiles_cover_exactly_the_dense_mask(tile_rows):
    input_ids, loss_mask = sequences_of([30], seed=1)[0]
    blocks = build_blocks(input_ids, loss_mask, sample_anchors(loss_mask, 9, torch.Generator().manual_seed(1)), 4,
                          MASK)
    blocks = pack_blocks([blocks, build_blocks(input_ids[:12], loss_mask[:12], torch.tensor([3, 8]), 4, MASK)])
    tiled, dense = tiled_block_mask(blocks, tile_rows), blocks.attention_mask
    rebuilt = torch.zeros_like(dense)
    for rows_start, rows_end, context_start, context_end, mask in tiled.tiles:
        width = context_end - context_start
        rebuilt[rows_start:rows_end, context_start:context_end] = mask[0, 0, :, :width]
        rebuilt[rows_start:rows_end, 42 + rows_start:42 + rows_end] = mask[0, 0, :, width:]
    assert torch.equal(rebuilt, dense)
    assert len(tiled.tiles) == (11 if tile_rows < 8 else 6 if tile_rows == 8 else 2)


@pytest.mark.parametrize("variant", [None, "sliding_mixed", "all_causal", "sliding_bidirectional"])
@pytest.mark.parametrize("distill", [False, True])
def test_the_sparse_mask_gives_the_dense_loss_and_gradients(variant, distill):
    """Tiles skip the masked blocks: the same loss and gradients as the dense [K*B, T + K*B] mask."""
    target = make_target("qwen3", seed=2)
    draft = (make_draft(2, block_size=4) if variant is None else make_variant_draft(variant, 2, block_size=4)).train()
    sequences = sequences_of([40, 18], seed=2)
    signals = [target_signals(target, ids, draft.target_layer_ids, 4 if distill else None) for ids, _ in sequences]
    losses, grads = {}, {}
    for tile_rows in (8, None):  # tiles of two blocks (several tiles per sequence), or the dense mask
        losses[tile_rows], grads[tile_rows] = loss_and_grads(draft, lambda tile_rows=tile_rows: packed_dflash_loss(
            draft, target, sequences, 12, torch.Generator().manual_seed(0), signals, tile_rows=tile_rows))
    torch.testing.assert_close(losses[8], losses[None])
    assert_same_grads(grads[8], grads[None])


@pytest.mark.parametrize("tile_rows", [12, None])
def test_packed_loss_and_gradients_are_the_mean_of_per_sequence_ones(tile_rows):
    target, draft = make_target("llama", seed=3), make_draft(3, block_size=4).train()
    sequences = sequences_of([26, 9, 17], seed=3)
    signals = [target_signals(target, ids, draft.target_layer_ids, 4) for ids, _ in sequences]
    packed_loss, packed_grads = loss_and_grads(draft, lambda: packed_dflash_loss(
        draft, target, sequences, 6, torch.Generator().manual_seed(5), signals, tile_rows=tile_rows))

    generator = torch.Generator().manual_seed(5)  # the same anchor draws, one sequence after the other
    draft.zero_grad()
    one_by_one = []
    for (input_ids, loss_mask), one in zip(sequences, signals):
        loss = dflash_loss(draft, target, input_ids, loss_mask, 6, generator, one, tile_rows=tile_rows).loss
        (loss / len(sequences)).backward()  # gradients of the mean
        one_by_one.append(loss.detach())
    mean_grads = {name: p.grad.clone() for name, p in draft.named_parameters() if p.grad is not None}
    torch.testing.assert_close(packed_loss, torch.stack(one_by_one).mean())
    assert_same_grads(packed_grads, mean_grads)


def tiny_rows(count: int, seed: int) -> list[dict]:
    """`count` seeded rows: a 5-token prompt and a 12-token response."""
    generator = torch.Generator().manual_seed(seed)
    return [{"prompt_ids": torch.randint(0, MASK, (5,), generator=generator).tolist(),
             "response_ids": torch.randint(0, MASK, (12,), generator=generator).tolist()} for _ in range(count)]


@pytest.mark.parametrize("batch_size, accumulation", [(2, 2), (1, 4)])
def test_accumulated_micro_batches_make_the_big_batch_step(tmp_path, batch_size, accumulation):
    """Four sequences per optimiser step, as one packed batch or accumulated over micro-batches: the same steps.

    Anchors cover every response position (more anchors than labels), so the split cannot change them; 6 rows make
    two steps of 4 (the epoch wraps round to whole steps)."""
    from dflash_hf.training.trainer import TrainingSettings, train_draft

    target, rows = make_target("qwen3", seed=8), tiny_rows(6, seed=8)
    drafts, logs = {}, {}
    for split in ((4, 1), (batch_size, accumulation)):
        drafts[split] = make_draft(8, block_size=4)
        settings = TrainingSettings(epochs=2, learning_rate=3e-3, num_anchors=64, batch_size=split[0],
                                    gradient_accumulation_steps=split[1], warmup_ratio=0.0)
        logs[split] = train_draft(drafts[split], target, rows, settings, tmp_path / f"{split}", progress=False)
    big, accumulated = logs[(4, 1)], logs[(batch_size, accumulation)]
    assert big.steps == accumulated.steps == 4 and len(accumulated.losses) == 4
    assert accumulated.losses == pytest.approx(big.losses, rel=1e-5)
    assert accumulated.learning_rates == big.learning_rates
    assert accumulated.block_tau == pytest.approx(big.block_tau)
    # each step moves every weight by about the learning rate (Adam); float rounding of a near-zero gradient entry
    # can move one entry differently, by far less than a step
    start = make_draft(8, block_size=4).state_dict()
    for name, value in drafts[(4, 1)].state_dict().items():
        assert (value - start[name]).abs().max() > 1e-3, name
        torch.testing.assert_close(drafts[(batch_size, accumulation)].state_dict()[name], value, rtol=0, atol=1e-4,
                                   msg=name)


def test_a_feature_cache_over_its_limit_is_refused_before_the_target_runs(tmp_path, monkeypatch):
    import dflash_hf.training.trainer as trainer

    target, rows = make_target("qwen3", seed=9), tiny_rows(3, seed=9)
    draft = make_draft(9, block_size=4)  # two target features of hidden size 64, float32; a top-32 teacher
    sequences = trainer.training_sequences(rows, 3072)
    assert trainer.feature_cache_bytes(target, sequences, 2, 32) == 3 * 17 * (2 * 64 * 4 + 32 * 12)
    monkeypatch.setattr(trainer, "target_signals", lambda *args: pytest.fail("the target ran before the check"))
    settings = trainer.TrainingSettings(epochs=1, num_anchors=4, cache_target=True, cache_limit_gib=1e-6)
    with pytest.raises(ValueError, match=r"feature cache would take 0\.00 GiB .* over --cache-limit-gib .* drop "
                                         r"--cache-target-features"):
        trainer.train_draft(draft, target, rows, settings, tmp_path, progress=False)
