"""Batched spec_generate: every row equals that row decoded alone, whatever the other rows accept."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    VOCAB_SIZE,
    RecordingProposer,
    ReferenceProposer,
    left_pad_prompts,
    make_draft,
    make_target,
    plain_greedy,
    prompts_of,
)

from dflash_hf import cache_dflash, left_pad, speculative_decode
from dflash_hf.cache_dflash import CacheColumns
from dflash_hf.proposer_dflash import DFlashProposer

ARCHS = ["qwen3", "llama"]
LENGTHS = [1, 6, 23, 11]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size", [1, 2, 4, 8])
def test_batched_greedy_equals_each_row_alone(arch, block_size):
    target = make_target(arch, seed=1)
    draft = make_draft(1, block_size=8)
    prompts = prompts_of(LENGTHS, seed=1)
    input_ids, attention_mask = left_pad_prompts(prompts)
    result = draft.spec_generate(target=target, input_ids=input_ids, attention_mask=attention_mask,
                                 max_new_tokens=30, block_size=block_size, return_stats=True)
    assert result.output_ids.shape == (4, 23 + 30)
    assert torch.equal(result.output_ids[:, :23], input_ids)  # the prompts come back as passed
    for row, prompt in enumerate(prompts):
        expected = plain_greedy(target, prompt, max_new_tokens=30)[0, prompt.shape[1]:].tolist()
        assert result.new_tokens(row) == expected, f"row {row}"
        alone = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=30, block_size=block_size,
                                    return_stats=True)
        assert alone.acceptance_lengths[0] == result.acceptance_lengths[row]
    assert result.num_new_tokens == [30] * 4


@pytest.mark.parametrize("arch", ARCHS)
def test_draft_proposes_the_same_for_a_row_in_a_batch_as_alone(arch, monkeypatch):
    """Small vocabulary: random proposals are often accepted, so rows accept different lengths (holes)."""
    vocab = 8
    target = make_target(arch, seed=2, vocab_size=vocab, init_std=1.0)
    draft = make_draft(2, block_size=6, vocab_size=vocab, mask_token_id=vocab - 1, initializer_range=1.0)
    prompts = prompts_of([5, 2, 9], seed=2, vocab_size=vocab)
    input_ids, attention_mask = left_pad_prompts(prompts)
    for budget in (0, cache_dflash.CACHE_HOLE_BUDGET):  # 0: the draft and target caches are compacted at every hole
        monkeypatch.setattr(cache_dflash, "CACHE_HOLE_BUDGET", budget)
        batched = RecordingProposer(draft, target, vocab - 1)
        result = speculative_decode(target, batched, input_ids, max_new_tokens=40, block_size=6,
                                    attention_mask=attention_mask)
        assert len({tuple(lengths) for lengths in result.acceptance_lengths}) == 3  # rows accepted differently
        for row, prompt in enumerate(prompts):
            alone = RecordingProposer(draft, target, vocab - 1)
            single = speculative_decode(target, alone, prompt, max_new_tokens=40, block_size=6)
            assert result.new_tokens(row) == single.new_tokens(0) == \
                plain_greedy(target, prompt, 40)[0, prompt.shape[1]:].tolist()
            # near the end the batch drafts the block its longest row still needs: compare the full-block steps
            full_blocks = [proposals for proposals in alone.proposed[0] if len(proposals) == 5]
            assert batched.proposed[row][: len(full_blocks)] == full_blocks, f"row {row}, budget {budget}"
            assert len(full_blocks) >= len(alone.proposed[0]) - 5 and len({tuple(p) for p in full_blocks}) > 5
        if budget == 0:
            assert max(batched.cache_excess) <= 6  # at most one step's rejected columns stay


@pytest.mark.parametrize("arch", ARCHS)
def test_rows_accepting_full_blocks_and_rows_rejecting(arch):
    """Rows 0 and 2 get perfect proposals, rows 1 and 3 wrong ones: fast rows finish and leave the batch."""
    target = make_target(arch, seed=3)
    prompts = prompts_of(LENGTHS, seed=3)
    references = [plain_greedy(target, prompt, max_new_tokens=60) for prompt in prompts]
    input_ids, attention_mask = left_pad_prompts(prompts)
    proposer = ReferenceProposer(references, target=target, corrupt_seed=3, corrupt_rows={1, 3})
    result = speculative_decode(target, proposer, input_ids, max_new_tokens=60, block_size=8,
                                attention_mask=attention_mask)
    for row, reference in enumerate(references):
        assert result.new_tokens(row) == reference[0, prompts[row].shape[1]:].tolist()
    full_steps, tail = divmod(59, 8)
    for row in (0, 2):
        assert result.acceptance_lengths[row] == [8] * full_steps + [tail]
    for row in (1, 3):
        assert len(result.acceptance_lengths[row]) > full_steps + 1  # slower rows kept going after 0 and 2 left


@pytest.mark.parametrize("arch", ARCHS)
def test_rows_hit_stop_tokens_at_different_steps(arch):
    target = make_target(arch, seed=4)
    draft = make_draft(4, block_size=4)
    prompts = prompts_of([3, 8, 5], seed=4)
    continuations = [plain_greedy(target, prompt, 40)[0, prompt.shape[1]:].tolist() for prompt in prompts]
    stop_tokens = [continuations[0][4], continuations[1][17]]  # rows stop at different steps (or not at all)
    expected = [plain_greedy(target, prompt, 40, stop_token_ids=stop_tokens)[0, prompt.shape[1]:].tolist()
                for prompt in prompts]
    assert len({len(tokens) for tokens in expected}) > 1
    input_ids, attention_mask = left_pad_prompts(prompts)
    perfect = ReferenceProposer([plain_greedy(target, p, 40) for p in prompts], target=target)
    for proposer in (perfect, DFlashProposer(draft, target, VOCAB_SIZE - 1)):
        result = speculative_decode(target, proposer, input_ids, max_new_tokens=40, block_size=4,
                                    attention_mask=attention_mask, stop_token_ids=stop_tokens, pad_token_id=127)
        assert [result.new_tokens(row) for row in range(3)] == expected
        assert result.num_new_tokens == [len(tokens) for tokens in expected]
        width = max(result.num_new_tokens)
        for row, tokens in enumerate(expected):  # rows that ended early are padded on the right
            assert result.new_token_ids[row, len(tokens):].tolist() == [127] * (width - len(tokens))


def test_memory_stays_bounded_while_rows_accept_different_lengths():
    """The target cache never grows past the longest row's positions plus the hole budget."""
    target = make_target("llama", seed=5)
    prompts = prompts_of([4, 9, 2], seed=5)
    references = [plain_greedy(target, prompt, 200) for prompt in prompts]
    input_ids, attention_mask = left_pad_prompts(prompts)
    widths = []

    def record(module, args, kwargs):
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None:
            positions = kwargs.get("position_ids")  # passed only when the cache has holes (else columns = positions)
            longest = cache.get_seq_length() if positions is None else int(positions[:, 0].max())
            widths.append((cache.get_seq_length(), longest))

    handle = target.model.register_forward_pre_hook(record, with_kwargs=True)  # the verify runs the base model
    try:
        proposer = ReferenceProposer(references, corrupt_seed=5, corrupt_rows={1, 2})
        result = speculative_decode(target, proposer, input_ids, max_new_tokens=200, block_size=8,
                                    attention_mask=attention_mask)
    finally:
        handle.remove()
    for row, reference in enumerate(references):
        assert result.new_tokens(row) == reference[0, prompts[row].shape[1]:].tolist()
    assert all(width <= longest + cache_dflash.CACHE_HOLE_BUDGET for width, longest in widths)
    assert max(width - longest for width, longest in widths) > 8  # holes did build up and were compacted
    # without compaction the holes of rows 1 and 2 would have outgrown the bound
    assert sum(8 - a for a in result.acceptance_lengths[1][:25]) > cache_dflash.CACHE_HOLE_BUDGET


def test_compaction_keeps_each_rows_positions_in_order(monkeypatch):
    valid = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 1, 1, 0, 0], [0, 0, 1, 0, 0, 1]], dtype=torch.bool)
    columns = CacheColumns(valid, [3, 4, 2])
    assert columns.compaction() is None  # 2 unused columns: within the budget
    monkeypatch.setattr(cache_dflash, "CACHE_HOLE_BUDGET", 1)
    index = columns.compaction()
    states = torch.arange(6.0)[None, None, :, None].repeat(3, 2, 1, 1)  # [N, heads, W, 1]: value = column
    compacted = cache_dflash.gather_columns(states, index)[:, 0, :, 0]
    assert compacted.shape == (3, 4)  # the longest row's 4 positions
    assert compacted[0, 1:].tolist() == [1, 2, 4] and compacted[1].tolist() == [0, 1, 2, 3]
    assert compacted[2, 2:].tolist() == [2, 5]
    assert columns.valid.tolist() == [[False, True, True, True], [True] * 4, [False, False, True, True]]


def test_left_padded_single_row_equals_unpadded():
    target = make_target("qwen3", seed=6)
    draft = make_draft(6)
    prompt = prompts_of([7], seed=6)[0]
    padded = torch.cat((torch.zeros(1, 3, dtype=torch.long), prompt), dim=1)
    mask = torch.tensor([[0, 0, 0] + [1] * 7])
    out = draft.spec_generate(target=target, input_ids=padded, attention_mask=mask, max_new_tokens=20)
    assert out[0, 10:].tolist() == plain_greedy(target, prompt, 20)[0, 7:].tolist()


@pytest.mark.parametrize("block_size", [2, 5])
def test_without_a_mask_a_batch_is_masked_as_generate_infers_it(block_size):
    """No attention_mask: where pad_token_id occurs in the prompts and is no stop id the pads are padding, as
    generate infers them to be; where it is a stop id every token attends, as in generate; a pad id after a prompt
    token, which generate would hide and a left-padded batch cannot, is refused by name."""
    target, draft = make_target("qwen3", seed=2), make_draft(2, block_size=8)
    pad = VOCAB_SIZE - 1  # prompts_of never draws it
    input_ids, attention_mask = left_pad([prompt[0].tolist() for prompt in prompts_of([3, 9, 6], seed=2)], pad)
    for stops in (None, [pad]):  # a pad id that is a stop id is no padding to generate
        arguments = dict(max_new_tokens=12, pad_token_id=pad, eos_token_id=stops)
        expected = target.generate(input_ids, do_sample=False, **arguments)
        got = draft.spec_generate(target=target, input_ids=input_ids, block_size=block_size, **arguments)
        assert torch.equal(got, expected), stops
        masked = draft.spec_generate(target=target, input_ids=input_ids, attention_mask=attention_mask,
                                     block_size=block_size, **arguments)
        assert torch.equal(got, masked) == (stops is None)  # the pads attended to only where pad is a stop id
    inside = input_ids[1:2].clone()
    inside[0, 4] = pad
    with pytest.raises(ValueError, match=f"holds pad_token_id {pad} after a prompt token, and no attention_mask"):
        draft.spec_generate(target=target, input_ids=inside, max_new_tokens=4, pad_token_id=pad)
    # an EOS id is never padding to generate, even where the call stops on other ids (stop_token_ids)
    unmasked = draft.spec_generate(target=target, input_ids=inside, max_new_tokens=4, pad_token_id=pad,
                                   eos_token_id=pad, stop_token_ids=[])
    assert torch.equal(unmasked, draft.spec_generate(target=target, input_ids=inside, max_new_tokens=4,
                                                     attention_mask=torch.ones_like(inside), stop_token_ids=[]))


def test_batch_of_identical_prompts_matches_batched_generate_shape():
    """The output layout is generate's: prompts as passed, then new tokens; a full batch needs no padding."""
    target = make_target("qwen3", seed=7)
    draft = make_draft(7)
    prompt = prompts_of([5], seed=7)[0]
    out = draft.spec_generate(target=target, input_ids=prompt.repeat(3, 1), max_new_tokens=12)
    assert torch.equal(out, plain_greedy(target, prompt, 12).repeat(3, 1))


def test_a_single_streamer_with_a_batch_is_refused():
    target = make_target("qwen3", seed=8)
    draft = make_draft(8)
    input_ids, attention_mask = left_pad_prompts(prompts_of([2, 3], seed=8))

    class Sink:
        def put(self, value):
            pass

        def end(self):
            pass

    with pytest.raises(ValueError, match="1 streamer\\(s\\) for a batch of 2"):
        draft.spec_generate(target=target, input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=4,
                            streamer=Sink())
