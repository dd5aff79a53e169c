"""The training objective: the sparse block mask, labels, and a few dozen steps that teach the draft."""

from __future__ import annotations

import pytest
import torch
from helpers import VOCAB_SIZE, draft_config, make_draft, make_target, plain_greedy

from dflash_hf import DFlashDraftModel
from dflash_hf.target_dflash import select_features
from dflash_hf.training import build_blocks, dflash_loss, position_weights, sample_anchors

MASK = VOCAB_SIZE - 1


def test_block_mask_sees_exactly_the_context_before_the_anchor_and_its_own_block():
    length, block_size = 20, 4
    anchors = torch.tensor([0, 3, 10, 18])  # the first block has no context; the last runs past the end
    blocks = build_blocks(torch.arange(length), torch.ones(length), anchors, block_size, MASK)
    assert blocks.attention_mask.shape == (4 * block_size, length + 4 * block_size)
    for row in range(4 * block_size):
        block = row // block_size
        for column in range(length + 4 * block_size):
            if column < length:
                expected = column < int(anchors[block])
            else:
                expected = (column - length) // block_size == block
            assert bool(blocks.attention_mask[row, column]) == expected, (row, column)


def test_block_inputs_and_labels():
    input_ids = torch.arange(100, 120)
    loss_mask = torch.zeros(20)
    loss_mask[6:] = 1  # prompt is positions 0..5
    blocks = build_blocks(input_ids, loss_mask, torch.tensor([4, 17]), 4, MASK)
    assert blocks.block_ids.tolist() == [104, MASK, MASK, MASK, 117, MASK, MASK, MASK]
    assert blocks.block_position_ids.tolist() == [4, 5, 6, 7, 17, 18, 19, 20]
    assert blocks.labels.tolist() == [[105, 106, 107], [118, 119, 0]]
    assert blocks.label_mask.tolist() == [[False, True, True], [True, True, False]]


def test_anchors_are_distinct_and_precede_a_label():
    loss_mask = torch.zeros(30)
    loss_mask[10:25] = 1
    anchors = sample_anchors(loss_mask, 100, torch.Generator().manual_seed(0))
    assert anchors.tolist() == list(range(9, 24))
    assert len(sample_anchors(loss_mask, 5, torch.Generator().manual_seed(0))) == 5


def test_position_weights_decay():
    weights = position_weights(16)
    assert weights[0] == 1.0 and torch.allclose(weights[7], torch.exp(torch.tensor(-1.0)))


def test_all_blocks_in_one_pass_equal_one_block_at_a_time():
    target, draft = make_target("qwen3", seed=0), make_draft(0, block_size=4)
    input_ids = torch.randint(0, MASK, (24,), generator=torch.Generator().manual_seed(0))
    anchors = torch.tensor([2, 9, 20])
    blocks = build_blocks(input_ids, torch.ones(24), anchors, 4, MASK)
    with torch.no_grad():
        features = select_features(target(input_ids[None], output_hidden_states=True).hidden_states,
                                   draft.target_layer_ids)
        embeddings = target.get_input_embeddings()(blocks.block_ids)[None]
        together = draft(embeddings, features, blocks.block_position_ids[None], torch.arange(24)[None],
                         attention_mask=blocks.attention_mask[None, None])
        for k, anchor in enumerate(anchors.tolist()):
            rows = slice(4 * k, 4 * k + 4)
            alone = draft(embeddings[:, rows], features[:, :anchor], blocks.block_position_ids[None, rows],
                          torch.arange(anchor)[None])
            torch.testing.assert_close(together[:, rows], alone, rtol=1e-5, atol=1e-5)


def test_a_few_dozen_steps_lower_the_loss_and_raise_acceptance():
    target = make_target("llama", seed=1)
    for parameter in target.parameters():
        parameter.requires_grad_(False)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, MASK, (1, 6), generator=generator) for _ in range(6)]
    sequences = [plain_greedy(target, p, max_new_tokens=40)[0] for p in prompts]  # the target's own answers
    loss_masks = [torch.cat((torch.zeros(6), torch.ones(40))) for _ in sequences]
    draft = make_draft(1, block_size=4)

    def mean_tau(model):
        taus = [model.spec_generate(target=target, input_ids=p, max_new_tokens=40, return_stats=True).tau
                for p in prompts[:3]]
        return sum(taus) / len(taus)

    untrained_tau = mean_tau(draft.eval())
    draft.train()
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    anchor_generator = torch.Generator().manual_seed(2)
    losses = []
    for step in range(48):
        index = step % len(sequences)
        result = dflash_loss(draft, target, sequences[index], loss_masks[index], num_anchors=16,
                             generator=anchor_generator)
        optimizer.zero_grad()
        result.loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optimizer.step()
        losses.append(float(result.loss.detach()))
    trained_tau = mean_tau(draft.eval())
    assert sum(losses[-6:]) / 6 < 0.7 * sum(losses[:6]) / 6
    print("tau untrained", untrained_tau, "trained", trained_tau, "loss", losses[:3], losses[-3:])
    assert trained_tau > untrained_tau + 0.3, (untrained_tau, trained_tau)

    # leading_correct of a training block is what greedy verification accepts at that anchor while decoding
    with torch.no_grad():
        for prompt, sequence, loss_mask in zip(prompts[:3], sequences, loss_masks, strict=False):
            result = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=40, return_stats=True)
            blocks = dflash_loss(draft, target, sequence, loss_mask, num_anchors=len(sequence))  # every anchor
            anchors = sample_anchors(loss_mask, len(sequence))
            leading = dict(zip(anchors.tolist(), blocks.leading_correct.tolist(), strict=True))
            start = prompt.shape[1]  # the pending token of the first step sits right after the prompt
            for accepted in result.acceptance_lengths[0][:-1]:  # the last step may be cut by max_new_tokens
                assert leading[start] == accepted - 1, (start, leading[start], accepted)
                start += accepted


def _tiny_rows(target, count=4, seed=3):
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(count):
        prompt_ids = torch.randint(0, MASK, (1, 5), generator=generator)
        response = plain_greedy(target, prompt_ids, max_new_tokens=24)[0, 5:]
        rows.append({"prompt_ids": prompt_ids[0].tolist(), "response_ids": response.tolist()})
    return rows


def test_training_resumes_from_its_checkpoint_exactly(tmp_path):
    from dflash_hf.training.trainer import TrainingSettings, train_draft

    target = make_target("qwen3", seed=4)
    rows = _tiny_rows(target)
    settings = TrainingSettings(epochs=2, learning_rate=2e-3, num_anchors=8, checkpoint_every=3, distill=True)
    straight = make_draft(5, block_size=4)
    log = train_draft(straight, target, rows, settings, tmp_path / "straight", progress=False)
    assert log.steps == 8 and len(log.losses) == 8 and len(log.position_accuracy) == 3

    interrupted = make_draft(5, block_size=4)
    train_draft(interrupted, target, rows, settings, tmp_path / "resumed", progress=False, max_steps=5)
    resumed = make_draft(6, block_size=4)  # a fresh process: the weights come from the checkpoint
    resumed_log = train_draft(resumed, target, rows, settings, tmp_path / "resumed", progress=False)
    assert resumed_log.steps == 8
    assert resumed_log.losses == pytest.approx(log.losses, rel=1e-5)
    for name, value in straight.state_dict().items():
        torch.testing.assert_close(resumed.state_dict()[name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("own_vocabulary", [False, True])
def test_top1_teacher_on_greedy_data_equals_the_hard_label_loss(own_vocabulary):
    """Distillation reads the target's distribution at p for the token at p + 1: with a top-1 teacher
    on the target's own greedy continuation it must give exactly the hard-label loss. With a draft vocabulary of its
    own, the teacher's ids map to the head's rows as the labels do (outside ones get probability 0)."""
    from dflash_hf.training.objective import target_signals

    target = make_target("qwen3", seed=7)
    draft = own_head_draft(7, list(range(1, VOCAB_SIZE, 2))) if own_vocabulary else make_draft(7, block_size=4)
    sequence = plain_greedy(target, torch.tensor([[5, 6, 7, 8]]), max_new_tokens=20)[0]
    loss_mask = torch.cat((torch.zeros(4), torch.ones(20)))
    hard = dflash_loss(draft, target, sequence, loss_mask, 12, torch.Generator().manual_seed(0))
    signals = target_signals(target, sequence, draft.target_layer_ids, teacher_top_k=1)
    soft = dflash_loss(draft, target, sequence, loss_mask, 12, torch.Generator().manual_seed(0), signals)
    torch.testing.assert_close(soft.loss, hard.loss)
    assert torch.equal(soft.correct, hard.correct)
    if own_vocabulary:
        assert int(hard.outside) > 0
        soft.loss.backward()
        assert draft.lm_head.weight.grad is not None and draft.lm_head.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_training_blocks_predict_what_the_decoding_loop_accepts(arch):
    """At the loop's own anchors, the training forward's leading-correct count equals each step's accepted count.

    This ties the objective to decoding: same context (features strictly before the anchor), same block, same
    positions. A small vocabulary makes the random draft right often, so the counts vary step by step.
    """
    vocab = 8
    target = make_target(arch, seed=2, vocab_size=vocab, init_std=1.0)
    draft = make_draft(4, block_size=6, vocab_size=vocab, mask_token_id=vocab - 1, initializer_range=1.0)
    prompt = torch.randint(0, vocab - 1, (1, 7), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        result = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=60, return_stats=True)
        sequence, lengths = result.output_ids[0], result.acceptance_lengths[0]
        # [S]: the first token comes from the prefill
        committed_before = 1 + torch.tensor([0, *lengths[:-1]]).cumsum(0)
        full_blocks = int((60 - committed_before >= 6).sum())  # the last steps shrink the block to what is left
        accepted = [length - 1 for length in lengths[:full_blocks]]
        anchors = prompt.shape[1] + committed_before[:full_blocks] - 1  # [S]: position of each step's pending token
        blocks = build_blocks(sequence, torch.ones_like(sequence), anchors, 6, vocab - 1)
        features = select_features(target(sequence[None], output_hidden_states=True).hidden_states,
                                   draft.target_layer_ids)
        hidden = draft(target.get_input_embeddings()(blocks.block_ids)[None], features,
                       blocks.block_position_ids[None], torch.arange(len(sequence))[None],
                       attention_mask=blocks.attention_mask[None, None])
        predictions = target.get_output_embeddings()(hidden.view(len(anchors), 6, -1)[:, 1:]).argmax(-1)  # [S, 5]
    leading_correct = ((predictions == blocks.labels) & blocks.label_mask).long().cumprod(1).sum(1)
    assert leading_correct.tolist() == accepted
    assert len(set(accepted)) >= 3  # the check saw short and long acceptances


def test_a_flash_attention_draft_trains_like_sdpa(monkeypatch):
    """Training's 4-D block mask never reaches a flash-attention backend: masked calls run on sdpa, same loss."""
    from dflash_hf import modeling_dflash

    received = []

    def flash_attention(module, query, key, value, attention_mask, **kwargs):
        received.append(attention_mask)
        return modeling_dflash.ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(modeling_dflash, "ALL_ATTENTION_FUNCTIONS",
                        {**modeling_dflash.ALL_ATTENTION_FUNCTIONS, "flash_attention_2": flash_attention})
    target = make_target("qwen3", seed=4)
    sequence = torch.randint(0, VOCAB_SIZE - 1, (24,), generator=torch.Generator().manual_seed(4))
    losses = {}
    for backend in ("sdpa", "flash_attention_2"):
        draft = make_draft(5, block_size=4)
        draft.config._attn_implementation = backend
        losses[backend] = dflash_loss(draft, target, sequence, torch.ones(24), 4,
                                      torch.Generator().manual_seed(0)).loss
    assert received == []  # every training call is masked
    torch.testing.assert_close(losses["flash_attention_2"], losses["sdpa"], rtol=0, atol=0)


def own_head_draft(seed: int, vocabulary: list[int]) -> torch.nn.Module:
    """A block-4 draft with its own LM head over `vocabulary` (rows at random)."""
    torch.manual_seed(seed)
    draft = DFlashDraftModel(draft_config(block_size=4, draft_vocab_size=len(vocabulary)))
    draft.set_draft_vocabulary(vocabulary)
    return draft


def test_the_loss_over_an_own_vocabulary_is_cross_entropy_over_its_k_logits_with_outside_labels_left_out():
    """The loss of a draft with its own head equals the position-decayed cross-entropy over its K logits of each label
    mapped to its row, with labels outside the vocabulary out of the loss (counted in `outside`) and counted as
    misses in the accuracy, whose hits compare target ids."""
    from dflash_hf.training.objective import sample_anchors

    vocabulary = list(range(0, VOCAB_SIZE, 2)) + [MASK]  # the even ids: about half the labels fall outside
    target, draft = make_target("qwen3", seed=8), own_head_draft(8, vocabulary)
    input_ids = torch.randint(0, MASK, (30,), generator=torch.Generator().manual_seed(8))
    loss_mask = torch.cat((torch.zeros(6), torch.ones(24)))
    result = dflash_loss(draft, target, input_ids, loss_mask, 7, torch.Generator().manual_seed(1), tile_rows=None)
    anchors = sample_anchors(loss_mask, 7, torch.Generator().manual_seed(1))
    blocks = build_blocks(input_ids, loss_mask, anchors, 4, MASK)
    with torch.no_grad():
        features = select_features(target(input_ids[None], output_hidden_states=True).hidden_states,
                                   draft.target_layer_ids)
        hidden = draft(target.get_input_embeddings().weight[blocks.block_ids][None], features,
                       blocks.block_position_ids[None], torch.arange(30)[None],
                       attention_mask=blocks.attention_mask[None, None], block_length=4)
        logits = draft.lm_head(hidden.view(len(anchors), 4, -1)[:, 1:])  # [A, 3, K]: over the draft's vocabulary
    rows = {token: row for row, token in enumerate(sorted(vocabulary))}
    total = weight_sum = 0.0
    outside = correct = 0
    for block, position in blocks.label_mask.nonzero().tolist():
        label = int(blocks.labels[block, position])
        prediction = sorted(vocabulary)[int(logits[block, position].argmax())]  # back to a target id
        correct += prediction == label
        if label not in rows:
            outside += 1
            continue
        weight = float(position_weights(4)[position])
        total += weight * float(torch.nn.functional.cross_entropy(logits[block, position], torch.tensor(rows[label])))
        weight_sum += weight
    assert 0 < outside < int(blocks.label_mask.sum())
    assert float(result.loss.detach()) == pytest.approx(total / weight_sum, rel=1e-5)
    assert int(result.outside) == outside and int(result.correct.sum()) == correct
    assert torch.equal(result.counted, blocks.label_mask.sum(0))  # every label counts in the accuracy


def test_a_row_whose_teacher_ids_are_all_outside_the_own_vocabulary_is_left_out_of_the_loss():
    from dflash_hf.training.objective import IGNORED_LABEL, draft_vocabulary_targets

    draft = own_head_draft(3, [2, 4, 6, 8])
    labels = torch.tensor([4, 4, 5])  # inside, inside, outside
    teacher_ids = torch.tensor([[4, 5], [5, 7], [6, 5]])  # row 1: no teacher id inside
    teacher_probs = torch.tensor([[0.6, 0.4], [0.7, 0.3], [0.5, 0.5]])
    rows, probs, ids = draft_vocabulary_targets(draft, labels, teacher_probs, teacher_ids)
    assert rows.tolist() == [1, IGNORED_LABEL, IGNORED_LABEL]  # 4 is row 1 of (2, 4, 6, 8)
    assert probs[0].tolist() == [1.0, 0.0] and ids[0].tolist() == [1, 0]  # renormalised over the ids inside


def _row_loss_inputs(seed: int = 5, rows: int = 6, k: int = 4):
    """A draft, a head, rows [n, H], labels [n] and a top-k teacher (probabilities, ids, raw logits)."""
    draft = make_draft(seed, block_size=4)
    head = torch.nn.Linear(draft.config.hidden_size, VOCAB_SIZE, bias=False)
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, draft.config.hidden_size, generator=generator)
    teacher_full = 3 * torch.randn(rows, VOCAB_SIZE, generator=generator)  # [n, V]
    top = teacher_full.topk(k, dim=-1)
    return draft, head, hidden, top.indices[:, 0], top.values.softmax(-1), top.indices, top.values


def test_the_l1_term_is_the_distance_between_the_draft_and_the_teachers_distributions():
    """With l1 = 1 a row's loss is sum |q - p| over the whole vocabulary, p the teacher's top-k distribution (0
    elsewhere), or the label's one-hot without a teacher; a share W mixes it with cross-entropy: (1 - W) CE + W L1."""
    from dflash_hf.training.objective import LossWeights, chunked_row_losses

    draft, head, hidden, labels, probs, ids, _ = _row_loss_inputs()
    with torch.no_grad():
        q = draft.scale_logits(head(hidden)).float().softmax(-1)  # [n, V]
        p = torch.zeros_like(q).scatter(-1, ids, probs)
        one_hot = torch.nn.functional.one_hot(labels, VOCAB_SIZE).float()
        soft_ce, _, acceptance = chunked_row_losses(draft, head, hidden, labels, probs, ids)
        hard_ce, _, _ = chunked_row_losses(draft, head, hidden, labels)
        soft_l1, _, _ = chunked_row_losses(draft, head, hidden, labels, probs, ids, weights=LossWeights(l1=1.0))
        hard_l1, _, _ = chunked_row_losses(draft, head, hidden, labels, weights=LossWeights(l1=1.0))
        mixed, _, _ = chunked_row_losses(draft, head, hidden, labels, probs, ids, weights=LossWeights(l1=0.9))
    torch.testing.assert_close(soft_l1, (q - p).abs().sum(-1))
    torch.testing.assert_close(hard_l1, (q - one_hot).abs().sum(-1))
    torch.testing.assert_close(mixed, 0.1 * soft_ce + 0.9 * soft_l1)
    assert not torch.allclose(soft_ce, hard_ce)  # the teacher is not the label's one-hot here
    assert bool(((soft_l1 >= 0) & (soft_l1 <= 2)).all())
    # a token sampled from q is accepted against p with probability 1 - L1 / 2 (whatever the weights)
    torch.testing.assert_close(acceptance, 1 - soft_l1 / 2)
    torch.testing.assert_close(acceptance, torch.minimum(q, p).sum(-1))


def test_the_raw_logit_term_is_the_squared_error_on_the_teachers_ids_and_pulls_the_draft_to_the_targets_level():
    from dflash_hf.training.objective import LossWeights, chunked_row_losses

    draft, head, hidden, labels, probs, ids, values = _row_loss_inputs()
    with torch.no_grad():
        logits = draft.scale_logits(head(hidden)).float()
        plain = chunked_row_losses(draft, head, hidden, labels, probs, ids)[0]
        with_term = chunked_row_losses(draft, head, hidden, labels, probs, ids, teacher_logits=values,
                                       weights=LossWeights(logits=0.5))[0]
    expected = (logits.gather(-1, ids) - values).square().mean(-1)
    torch.testing.assert_close(with_term, plain + 0.5 * expected)
    # minimising the term alone moves the draft's logits on the teacher's ids to the target's values
    head.weight.requires_grad_(True)
    optimizer = torch.optim.Adam(head.parameters(), lr=0.05)
    for _ in range(200):
        with_term = chunked_row_losses(draft, head, hidden, labels, probs, ids, teacher_logits=values,
                                       weights=LossWeights(logits=1.0))[0]
        without = chunked_row_losses(draft, head, hidden, labels, probs, ids)[0]
        optimizer.zero_grad()
        (with_term - without).mean().backward()  # the term alone
        optimizer.step()
    with torch.no_grad():
        gap = (draft.scale_logits(head(hidden)).float().gather(-1, ids) - values).abs().mean()
    assert float(gap) < 0.1 * float((logits.gather(-1, ids) - values).abs().mean())


def test_the_loss_terms_reach_training_and_are_refused_out_of_range():
    from dflash_hf.training.objective import LossWeights, target_signals, teacher_rows
    from dflash_hf.training.trainer import TrainingSettings

    target, draft = make_target("qwen3", seed=4), make_draft(4, block_size=4)
    input_ids = torch.randint(0, MASK, (24,), generator=torch.Generator().manual_seed(4))
    loss_mask = torch.cat((torch.zeros(6), torch.ones(18)))
    signals = target_signals(target, input_ids, draft.target_layer_ids, 8, teacher_rows(loss_mask), keep_logits=True)
    assert signals.teacher_logits is not None and torch.allclose(signals.teacher_logits.softmax(-1)[6:-1],
                                                                 signals.teacher_probs[6:-1])
    losses = [float(dflash_loss(draft, target, input_ids, loss_mask, 6, torch.Generator().manual_seed(0), signals,
                                loss_weights=weights).loss.detach())
              for weights in (LossWeights(), LossWeights(l1=0.9), LossWeights(logits=0.1))]
    assert len(set(losses)) == 3
    result = dflash_loss(draft, target, input_ids, loss_mask, 6, torch.Generator().manual_seed(0), signals)
    assert bool(((result.expected_accepted >= 0) & (result.expected_accepted <= 3)).all())  # B - 1 drafts at most
    with pytest.raises(ValueError, match="teacher's logits"):
        dflash_loss(draft, target, input_ids, loss_mask, 6, signals=target_signals(
            target, input_ids, draft.target_layer_ids, 8), loss_weights=LossWeights(logits=0.1))
    with pytest.raises(ValueError, match="--l1-weight"):
        TrainingSettings(l1_weight=1.5)
    with pytest.raises(ValueError, match="--no-distill"):
        TrainingSettings(logit_weight=0.1, distill=False)
