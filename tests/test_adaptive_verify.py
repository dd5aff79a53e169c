"""Adaptive verify length: with step costs, each step verifies only the worthwhile prefix of the drafted block.

The width depends on the draft alone, never on the target, so the output must stay the target's own.
"""

from __future__ import annotations

import pytest
import torch
from helpers import VOCAB_SIZE, ReferenceProposer, make_draft, make_target, plain_greedy, random_prompt

from dflash_hf import DraftStep, left_pad, speculative_decode
from dflash_hf.cost_model import measure_verify_costs
from dflash_hf.proposer_dflash import Proposal
from dflash_hf.settings_dflash import StepCosts
from dflash_hf.steps_dflash import worthwhile_width

STEEP = StepCosts(draft=0.002, verify=(0.010, 0.013, 0.016, 0.030, 0.034, 0.038, 0.042, 0.046))  # the CPU's shape
FLAT = StepCosts(draft=0.002, verify=(0.010,) * 8)  # a GPU's: any width costs one step



# --- The choice --------------------------------------------------------------------------------------------------


def test_sure_proposals_are_all_verified_and_hopeless_ones_are_not():
    assert worthwhile_width(torch.ones(1, 7), [8], FLAT) == 8
    assert worthwhile_width(torch.zeros(1, 7), [8], FLAT) == 1
    assert worthwhile_width(torch.ones(1, 7), [8], STEEP) == 8  # 8 tokens for 48 ms beats 3 for 18 ms


def test_the_width_maximises_expected_tokens_per_second():
    confidences = torch.tensor([[0.9, 0.5, 0.1]])
    costs = StepCosts(draft=1.0, verify=(4.0, 5.0, 6.0, 9.0))
    survival = [1.0, 0.9, 0.45, 0.045]  # P(proposal k and all before it accepted); 1.0: the pending token's
    rates = [sum(survival[:width]) / (1.0 + costs.verify[width - 1]) for width in range(1, 5)]
    assert worthwhile_width(confidences, [4], costs) == rates.index(max(rates)) + 1 == 3


def test_rows_that_can_keep_fewer_tokens_expect_fewer():
    confidences = torch.tensor([[0.95, 0.95, 0.95]])
    costs = StepCosts(draft=0.0, verify=(1.0, 1.2, 1.4, 1.6))
    assert worthwhile_width(confidences, [4], costs) == 4
    assert worthwhile_width(confidences, [2], costs) == 2  # max_new_tokens lets it keep two: more costs only time


def test_a_batch_chooses_one_width_for_the_sum_of_its_rows():
    costs = StepCosts(draft=0.0, verify=(1.0, 1.5, 1.8))
    sure, unsure = [1.0, 1.0], [0.0, 0.0]
    assert worthwhile_width(torch.tensor([sure]), [3], costs) == 3
    assert worthwhile_width(torch.tensor([unsure]), [3], costs) == 1
    assert worthwhile_width(torch.tensor([sure, unsure]), [3, 3], costs) == 3  # 4 tokens / 1.8 > 2 / 1.0


def test_step_costs_are_checked(target, draft):
    with pytest.raises(ValueError, match="positive verify seconds"):
        StepCosts(draft=0.001, verify=(0.01, 0.0))
    with pytest.raises(ValueError, match="verify widths 1 .. 4 but block_size is 8.*measure_verify_costs"):
        draft.spec_generate(target=target, input_ids=random_prompt(0, 5), max_new_tokens=10,
                            step_costs=StepCosts(0.001, (0.01,) * 4))


# --- In the loop ---------------------------------------------------------------------------------------------------


class ConfidentReference(ReferenceProposer):
    """The target's own continuation (wrong after a random offset), with a fixed confidence per position."""

    def __init__(self, *args, confidences: list[float], **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.confidences = confidences
        self.widths: list[int] = []  # the width chosen at each step
        self.full_block_widths: list[int] = []  # the same at steps that drafted the whole block

    def propose(self, step: DraftStep) -> Proposal:
        tokens = super().propose(step)
        confidences = torch.tensor([self.confidences[: step.block_size - 1]] * tokens.shape[0])
        assert step.score_proposals
        self.widths.append(worthwhile_width(confidences, [step.block_size] * tokens.shape[0], STEEP))
        if step.block_size == len(self.confidences) + 1:
            self.full_block_widths.append(self.widths[-1])
        return Proposal(tokens, confidences=confidences)


@pytest.mark.parametrize("confidences, expected_width", [([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3], None),
                                                        ([0.05] * 7, 1), ([1.0] * 7, 8)])
def test_each_step_verifies_the_width_its_confidences_choose(confidences, expected_width):
    target = make_target("qwen3", seed=4)
    input_ids = random_prompt(4, 6)
    reference = plain_greedy(target, input_ids, 40)
    proposer = ConfidentReference(reference, target, corrupt_seed=4, confidences=confidences)
    result = speculative_decode(target, proposer, input_ids, max_new_tokens=40, block_size=8, step_costs=STEEP)
    assert torch.equal(result.output_ids, reference)
    verified = result.verified_lengths[0]
    assert verified[: len(proposer.widths)] == proposer.widths  # every drafted step verified the chosen width
    if expected_width is not None:
        assert set(proposer.full_block_widths) == {expected_width}
    else:
        assert 1 < proposer.full_block_widths[0] < 8  # a prefix: neither everything nor nothing
    assert all(accepted <= width for accepted, width in zip(result.acceptance_lengths[0], verified))


@pytest.mark.parametrize("arch, seed, length, block_size, costs", [
    ("qwen3", 0, 9, 8, STEEP), ("llama", 1, 1, 4, STEEP), ("qwen3", 2, 23, 8, FLAT), ("llama", 3, 5, 6, STEEP),
])
def test_greedy_with_step_costs_equals_plain_greedy(arch, seed, length, block_size, costs):
    target, draft = make_target(arch, seed=seed), make_draft(seed)
    input_ids = random_prompt(seed, length)
    result = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=40, block_size=block_size,
                                 step_costs=costs, return_stats=True)
    assert torch.equal(result.output_ids, plain_greedy(target, input_ids, 40))
    assert len(result.verified_lengths[0]) == len(result.acceptance_lengths[0])
    assert all(1 <= width <= block_size for width in result.verified_lengths[0])


def test_greedy_with_step_costs_stops_where_plain_greedy_stops():
    target, draft = make_target("qwen3", seed=5), make_draft(5)
    input_ids = random_prompt(5, 7)
    free = plain_greedy(target, input_ids, 30)[0, 7:].tolist()
    stop = free[11]  # a token the target produces: generation must end at its first occurrence
    expected = plain_greedy(target, input_ids, 30, stop_token_ids=[stop])
    output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=30, stop_token_ids=[stop],
                                 step_costs=STEEP)
    assert torch.equal(output, expected)


def test_a_left_padded_batch_with_step_costs_equals_each_rows_greedy():
    target, draft = make_target("llama", seed=6), make_draft(6)
    prompts = [random_prompt(60 + row, length)[0].tolist() for row, length in enumerate((3, 11, 6))]
    input_ids, attention_mask = left_pad(prompts, 0, torch.device("cpu"))
    result = draft.spec_generate(target=target, input_ids=input_ids, attention_mask=attention_mask,
                                 max_new_tokens=25, step_costs=STEEP, return_stats=True)
    for row, row_prompt in enumerate(prompts):
        expected = plain_greedy(target, torch.tensor([row_prompt]), 25)[0, len(row_prompt):].tolist()
        assert result.new_tokens(row) == expected


def test_the_draft_scores_its_proposals_only_when_asked():
    target, draft = make_target("qwen3", seed=7), make_draft(7)
    proposals: list[Proposal] = []
    from dflash_hf.proposer_dflash import DFlashProposer

    class Recording:
        def __init__(self):
            self.inner = DFlashProposer(draft, target, VOCAB_SIZE - 1)
            self.target_layer_ids = self.inner.target_layer_ids

        def propose(self, step):
            proposals.append(self.inner.propose(step))
            return proposals[-1]

    speculative_decode(target, Recording(), random_prompt(7, 5), max_new_tokens=12, block_size=8)
    assert proposals and all(isinstance(p, torch.Tensor) for p in proposals)  # unscored: the tokens as before
    proposals.clear()
    speculative_decode(target, Recording(), random_prompt(7, 5), max_new_tokens=12, block_size=8, step_costs=FLAT)
    confidences = proposals[0].confidences  # [1, 7]: the draft's probability of its own argmax
    assert confidences.shape == (1, 7) and bool(((confidences > 0) & (confidences <= 1)).all())


def test_measured_verify_costs_cover_every_width():
    target, draft = make_target("llama", seed=8), make_draft(8, block_size=4)
    costs = measure_verify_costs(draft, target, torch.arange(5, 25)[None], VOCAB_SIZE - 1, repeats=2)
    assert len(costs.verify) == 4 and min(costs.verify) > 0 and costs.draft > 0
    output = draft.spec_generate(target=target, input_ids=random_prompt(8, 4), max_new_tokens=15, step_costs=costs)
    assert torch.equal(output, plain_greedy(target, random_prompt(8, 4), 15))


def test_measured_verify_times_are_made_non_decreasing():
    from dflash_hf.cost_model import nondecreasing

    assert nondecreasing([1.0, 2.0, 3.0]) == [1.0, 2.0, 3.0]  # already in order: unchanged
    assert nondecreasing([3.0, 2.0, 1.0]) == [2.0, 2.0, 2.0]  # one pool, its mean
    assert nondecreasing([49.6, 61.0, 57.0, 68.5]) == [49.6, 59.0, 59.0, 68.5]  # a noisy pair is averaged
