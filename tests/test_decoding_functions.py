"""The loop's small pure functions."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from dflash_hf import left_pad
from dflash_hf.sampling_dflash import commit_block, count_accepted, first_stop_index, process_logits


@pytest.mark.parametrize("proposals,target_tokens,expected", [
    ([1, 2, 3], [1, 2, 4, 9], 2),
    ([1, 2, 3], [1, 2, 3, 9], 3),
    ([7, 2], [1, 2, 3], 0),
    ([], [5], 0),
])
def test_count_accepted_counts_the_leading_matches(proposals, target_tokens, expected):
    assert count_accepted(proposals, target_tokens) == expected


def test_first_stop_index():
    assert first_stop_index([4, 5, 6, 5], {5}) == 1
    assert first_stop_index([4, 6], {5}) is None
    assert first_stop_index([4, 6], set()) is None


@pytest.mark.parametrize("proposed,target_tokens,limit,stops,expected", [
    ([1, 2, 3], [1, 2, 4, 9], 4, set(), (2, [1, 2, 4], False)),  # two accepted, then the target's own token
    ([1, 2, 3], [1, 2, 3, 9], 4, set(), (3, [1, 2, 3, 9], False)),  # all accepted plus the bonus token
    ([1, 2, 3], [1, 2, 3, 9], 2, set(), (1, [1, 2], False)),  # max_new_tokens leaves room for two
    ([1, 2, 3], [1, 2, 3, 9], 4, {2}, (3, [1, 2], True)),  # a stop token cuts the committed tokens
    ([5, 2], [1, 2, 3], 3, {1}, (0, [1], True)),
])
def test_commit_block(proposed, target_tokens, limit, stops, expected):
    assert commit_block(proposed, target_tokens, limit, stops) == expected


def test_left_pad():
    input_ids, attention_mask = left_pad([[5, 6, 7], [8]], pad_token_id=0)
    assert input_ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]


@pytest.mark.parametrize("temperature,top_k,top_p",
                         [(1.0, None, None), (0.7, 5, None), (1.3, None, 0.9), (0.9, 20, 0.5)])
def test_process_logits_matches_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    chain = [TemperatureLogitsWarper(temperature)]
    chain += [TopKLogitsWarper(top_k)] if top_k else []
    chain += [TopPLogitsWarper(top_p)] if top_p else []
    expected = LogitsProcessorList(chain)(torch.zeros(3, 1, dtype=torch.long), logits.clone())
    actual = process_logits(logits, temperature, top_k, top_p)
    assert torch.equal(torch.isinf(actual), torch.isinf(expected))
    torch.testing.assert_close(actual.softmax(-1), expected.softmax(-1))


def test_pick_block_greedy_is_argmax_and_sampling_respects_top_k():
    """The target's tokens from its scores (`target_scores`: without processors, the logits when greedy, temperature
    and top-k at once when sampling)."""
    from dataclasses import replace

    from dflash_hf.settings_dflash import DecodingSettings
    from dflash_hf.steps_dflash import pick_block, target_scores

    logits = torch.randn(4, 3, 30, generator=torch.Generator().manual_seed(1))  # [n, b, V]
    rows = [0, 1, 2, 3]
    greedy = DecodingSettings(max_new_tokens=4, block_size=3, generators=(None,) * 4)
    assert torch.equal(pick_block(target_scores(logits, list, rows, greedy), rows, greedy), logits.argmax(-1))
    sampled = replace(greedy, temperature=2.0, top_k=3, generators=(torch.Generator().manual_seed(2),) * 4)
    allowed = logits.topk(3, dim=-1).indices
    for _ in range(50):
        picked = pick_block(target_scores(logits, list, rows, sampled), rows, sampled)
        assert bool((allowed == picked[..., None]).any(-1).all())


def test_the_proposals_type_decides_how_it_is_accepted():
    """A `SampledProposal` is accepted by speculative sampling (with q = p every proposal is kept); a `Proposal` of
    the same tokens is judged by equality (the target's own samples, whatever was proposed). The q of a sampled
    proposal cannot be passed where a plain one's fields go."""
    from dflash_hf.proposer_dflash import Proposal, SampledProposal
    from dflash_hf.settings_dflash import DecodingSettings
    from dflash_hf.steps_dflash import StepPlan, pick_block, target_tokens

    logits = torch.randn(2, 4, 12, generator=torch.Generator().manual_seed(3))  # [n, b, V]
    proposals = logits[:, :3].argmin(dim=-1)  # [n, b - 1]: the target's least likely tokens
    p = logits.softmax(dim=-1)
    step = StepPlan(4, [4, 4], torch.arange(4).repeat(2, 1), torch.zeros(2, 1, dtype=torch.long))

    def settings() -> DecodingSettings:
        return DecodingSettings(max_new_tokens=8, block_size=4, temperature=1.0,
                                generators=tuple(torch.Generator().manual_seed(row) for row in range(2)))

    sampled = target_tokens(logits, SampledProposal(proposals, draft_probabilities=p[:, :3]), [0, 1], step,
                            settings())
    assert torch.equal(sampled[:, :3], proposals)  # q = p: min(1, p / q) = 1 keeps all of them
    plain = target_tokens(logits, Proposal(proposals), [0, 1], step, settings())
    assert torch.equal(plain, pick_block(logits, [0, 1], settings()))
    assert not torch.equal(plain[:, :3], proposals)
    with pytest.raises(TypeError):
        Proposal(proposals, p[:, :3])  # q is named, and only a SampledProposal has it
