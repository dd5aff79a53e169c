"""Training memory: target signals on the host, hooked features without the LM head, chunked checkpointed logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from device_costs import peak_cpu_bytes
from helpers import TARGET_LAYERS, VOCAB_SIZE, make_draft, make_target

from dflash_hf.target_dflash import select_features
from dflash_hf.training.objective import (
    LOSS_CHUNK_ROWS,
    TargetSignals,
    build_blocks,
    dflash_loss,
    position_weights,
    sample_anchors,
    target_features,
    target_signals,
    teacher_rows,
)
from dflash_hf.training.trainer import TrainingSettings, on_host, train_draft

MASK = VOCAB_SIZE - 1


def reference_loss(draft, target, input_ids, loss_mask, num_anchors, generator, signals):
    """The loss as first written: full-vocabulary logits for every block row, then masked ([K, B-1, V] at once)."""
    block_size = draft.block_size
    anchors = sample_anchors(loss_mask, num_anchors, generator)
    blocks = build_blocks(input_ids, loss_mask, anchors, block_size, draft.mask_token_id)
    with torch.no_grad():
        embeddings = draft.embed_block(blocks.block_ids, target.get_input_embeddings().weight)[None]
    hidden = draft(embeddings, signals.hidden[None], blocks.block_position_ids[None],
                   torch.arange(len(input_ids))[None], attention_mask=blocks.attention_mask[None, None],
                   block_length=block_size)
    hidden = hidden.view(len(anchors), block_size, -1)[:, 1:]
    logits = draft.scale_logits(target.get_output_embeddings()(hidden.reshape(-1, hidden.shape[-1]))).float()
    logits = logits.view(len(anchors), block_size - 1, -1)  # [K, B-1, V]
    if signals.teacher_probs is not None:
        positions = blocks.block_position_ids.view(len(anchors), block_size)[:, :-1].clamp(max=len(input_ids) - 1)
        log_probs = logits.log_softmax(-1).gather(-1, signals.teacher_ids[positions])
        token_loss = -(signals.teacher_probs[positions] * log_probs).sum(-1)
    else:
        token_loss = F.cross_entropy(logits.flatten(0, 1), blocks.labels.flatten(), reduction="none")
        token_loss = token_loss.view_as(blocks.labels)
    weights = position_weights(block_size)[None, :] * blocks.label_mask
    hits = (logits.argmax(-1) == blocks.labels) & blocks.label_mask
    return (token_loss * weights).sum() / weights.sum(), hits.sum(0), hits.long().cumprod(1).sum(1)


def sequence_and_mask(length: int, prompt: int, vocab: int = VOCAB_SIZE, seed: int = 0):
    input_ids = torch.randint(0, vocab - 1, (length,), generator=torch.Generator().manual_seed(seed))
    return input_ids, torch.cat((torch.zeros(prompt), torch.ones(length - prompt)))


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_hooked_features_equal_output_hidden_states_and_skip_the_lm_head(arch):
    target = make_target(arch, seed=1)
    input_ids, _ = sequence_and_mask(15, 4, seed=1)
    layer_ids = [2, 0, TARGET_LAYERS - 1]  # the last layer is reported after the final norm, as Transformers does
    with torch.no_grad():
        old = select_features(target(input_ids[None], output_hidden_states=True).hidden_states, layer_ids)[0]
    decoder_outputs = []  # (a hook on the head itself would make it an unknown, hooked head)
    hooks = [target.get_decoder().register_forward_hook(lambda module, inputs, output: decoder_outputs.append(output))]
    try:
        features, final, logits = target_features(target, input_ids, layer_ids)
        signals = target_signals(target, input_ids, layer_ids)
    finally:
        for hook in hooks:
            hook.remove()
    assert torch.equal(features, old) and torch.equal(signals.hidden, old)
    assert logits is None and signals.teacher_probs is None  # only the base model ran: no LM head, no [T, V] logits
    assert all(output.hidden_states is None for output in decoder_outputs)  # not every layer's hidden states
    assert torch.equal(final, old[:, -final.shape[-1]:])


@pytest.mark.parametrize("plain_head", [True, False])
def test_teacher_top_k_only_for_the_rows_the_loss_reads(plain_head):
    target = make_target("qwen3", seed=2)
    input_ids, loss_mask = sequence_and_mask(20, 7, seed=2)
    with torch.no_grad():
        full = target(input_ids[None]).logits[0].float().topk(5, dim=-1)
    hook = None if plain_head else target.get_output_embeddings().register_forward_hook(lambda *args: None)
    try:  # a hooked head is not provably plain: the target's own forward gives the logits
        needed = teacher_rows(loss_mask)
        signals = target_signals(target, input_ids, [1, 3], teacher_top_k=5, needed_rows=needed, chunk_rows=3)
        every_row = target_signals(target, input_ids, [1, 3], teacher_top_k=5)
    finally:
        if hook is not None:
            hook.remove()
    assert needed.tolist() == [False] * 6 + [True] * 13 + [False]  # p whose next token p + 1 is a label
    torch.testing.assert_close(signals.teacher_probs[needed], full.values.softmax(-1)[needed])
    assert torch.equal(signals.teacher_ids[needed], full.indices[needed])
    assert not signals.teacher_probs[~needed].any() and not signals.teacher_ids[~needed].any()
    torch.testing.assert_close(every_row.teacher_probs, full.values.softmax(-1))


@pytest.mark.parametrize("distill", [False, True])
@pytest.mark.parametrize("chunk_rows", [1, 7, LOSS_CHUNK_ROWS])
def test_chunked_loss_and_gradients_equal_the_full_logits_loss(distill, chunk_rows):
    target, draft = make_target("qwen3", seed=3), make_draft(3, block_size=4).train()
    input_ids, loss_mask = sequence_and_mask(30, 6, seed=3)
    signals = target_signals(target, input_ids, draft.target_layer_ids, 4 if distill else None)
    expected, expected_correct, expected_leading = reference_loss(
        draft, target, input_ids, loss_mask, 9, torch.Generator().manual_seed(0), signals)
    expected.backward()
    expected_grads = {name: p.grad.clone() for name, p in draft.named_parameters()}
    draft.zero_grad()
    result = dflash_loss(draft, target, input_ids, loss_mask, 9, torch.Generator().manual_seed(0), signals, chunk_rows)
    result.loss.backward()
    torch.testing.assert_close(result.loss, expected)
    assert torch.equal(result.correct, expected_correct) and torch.equal(result.leading_correct, expected_leading)
    for name, parameter in draft.named_parameters():
        torch.testing.assert_close(parameter.grad, expected_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_peak_loss_memory_is_bounded_by_the_chunk_not_the_rows():
    vocab, chunk_rows = 65_536, 16
    target = make_target("qwen3", seed=4, vocab_size=vocab).requires_grad_(False)  # frozen, as train_draft has it
    draft = make_draft(4, block_size=4, vocab_size=vocab).train()
    input_ids, loss_mask = sequence_and_mask(64, 4, vocab=vocab, seed=4)
    signals = target_signals(target, input_ids, draft.target_layer_ids)
    chunk_bytes = chunk_rows * vocab * 4  # one chunk's float32 logits: 4 MiB

    def chunked():
        dflash_loss(draft, target, input_ids, loss_mask, 48, torch.Generator().manual_seed(0), signals,
                    chunk_rows).loss.backward()

    def full():
        reference_loss(draft, target, input_ids, loss_mask, 48, torch.Generator().manual_seed(0),
                       signals)[0].backward()

    rows = int(build_blocks(input_ids, loss_mask, sample_anchors(loss_mask, 48, torch.Generator().manual_seed(0)),
                            4, vocab - 1).label_mask.sum())
    assert rows > 8 * chunk_rows  # 141 supervised rows: 9 chunks
    full_peak, chunked_peak = peak_cpu_bytes(full), peak_cpu_bytes(chunked)
    assert full_peak >= rows * vocab * 4  # the measure sees the [rows, V] logits the old loss kept
    print("peak / chunk logits bytes: full", full_peak / chunk_bytes, "chunked", chunked_peak / chunk_bytes)
    assert chunked_peak <= 5 * chunk_bytes, (chunked_peak / chunk_bytes, full_peak / chunk_bytes)


def test_cached_signals_live_on_the_host_and_leave_training_unchanged(tmp_path):
    target = make_target("qwen3", seed=5)
    generator = torch.Generator().manual_seed(5)
    rows = [{"prompt_ids": torch.randint(0, MASK, (5,), generator=generator).tolist(),
             "response_ids": torch.randint(0, MASK, (14,), generator=generator).tolist()} for _ in range(3)]
    input_ids = torch.tensor(rows[0]["prompt_ids"] + rows[0]["response_ids"])
    signals = target_signals(target, input_ids, [1, 3], teacher_top_k=4)
    host = on_host(signals)
    for name in ("hidden", "teacher_probs", "teacher_ids"):
        tensor = getattr(host, name)
        assert tensor.device.type == "cpu" and tensor.is_pinned() == torch.cuda.is_available(), name
        assert torch.equal(tensor, getattr(signals, name).cpu()), name

    logs = {}
    for cache in (True, False):
        settings = TrainingSettings(epochs=2, learning_rate=2e-3, num_anchors=6, distill=True, cache_target=cache)
        logs[cache] = train_draft(make_draft(5, block_size=4), target, rows, settings, tmp_path / str(cache),
                                  progress=False)
    assert logs[True].losses == pytest.approx(logs[False].losses, rel=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_the_feature_cache_is_pinned_host_memory(tmp_path, monkeypatch):
    import dflash_hf.training.trainer as trainer

    target = make_target("qwen3", seed=6).cuda()
    generator = torch.Generator().manual_seed(6)
    rows = [{"prompt_ids": torch.randint(0, MASK, (5,), generator=generator).tolist(),
             "response_ids": torch.randint(0, MASK, (14,), generator=generator).tolist()} for _ in range(2)]
    cached, used = [], []
    monkeypatch.setattr(trainer, "on_host", lambda signals: cached.append(on_host(signals)) or cached[-1])
    real_loss = trainer.packed_dflash_loss
    monkeypatch.setattr(trainer, "packed_dflash_loss", lambda *args: used.extend(args[-1]) or real_loss(*args))
    settings = TrainingSettings(epochs=1, num_anchors=6, distill=True, cache_target=True)
    train_draft(make_draft(6, block_size=4), target, rows, settings, tmp_path, progress=False)
    assert len(cached) == 2 and all(s.hidden.device.type == "cpu" and s.hidden.is_pinned() for s in cached)
    assert all(s.teacher_probs.is_pinned() and s.teacher_ids.is_pinned() for s in cached)
    assert len(used) == 2 and all(s.hidden.device.type == "cuda" for s in used)
    assert isinstance(used[0], TargetSignals)
