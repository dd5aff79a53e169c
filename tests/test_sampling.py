"""At temperature > 0, spec_generate samples exactly the target's own distribution."""

from __future__ import annotations

import pytest
import torch
from helpers import make_draft
from sampling_checks import NUM_NEW, NUM_SAMPLES, assert_follows, chi_square_p_value, exact_joint, sampled_counts
from sampling_checks import SAMPLING_VOCAB as VOCAB

from dflash_hf import DraftStep, speculative_decode
from dflash_hf.proposer_dflash import DFlashProposer, Proposal, SampledProposal
from dflash_hf.sampling_dflash import speculative_sample
from dflash_hf.settings_dflash import StepCosts


class TargetGreedyProposer:
    """Proposes the target's greedy continuation of the current prefix: often accepted at low entropy."""

    target_layer_ids = None

    def __init__(self, target):
        self.target = target

    def propose(self, step: DraftStep) -> torch.Tensor:
        rows = []
        for sequence in step.sequences:
            ids = torch.tensor([sequence])
            for _ in range(step.block_size - 1):
                ids = torch.cat((ids, self.target(ids).logits[:, -1:].argmax(-1)), dim=1)
            rows.append(ids[0, -(step.block_size - 1):])
        return torch.stack(rows)


@pytest.mark.parametrize("proposer_kind,temperature,top_k,top_p", [
    ("dflash", 1.0, None, None),  # speculative (rejection) sampling of the draft's q
    ("dflash", 0.8, 3, None),
    ("dflash", 1.2, None, 0.8),
    ("dflash_equality", 1.0, None, None),  # the draft's argmax, kept when the target samples it
    ("dflash_equality", 0.8, 3, None),
    ("target_greedy", 1.0, None, None),
])
def test_sampled_sequences_follow_the_target_distribution(sampling_setup, proposer_kind, temperature, top_k, top_p):
    target, input_ids = sampling_setup
    draft = make_draft(12, block_size=4, vocab_size=VOCAB, mask_token_id=VOCAB - 1)
    proposer = TargetGreedyProposer(target) if proposer_kind == "target_greedy" else \
        DFlashProposer(draft, target, VOCAB - 1, sample_proposals=proposer_kind == "dflash")
    counts, accepted_drafts = sampled_counts(target, proposer, input_ids, torch.Generator().manual_seed(1234),
                                             max_new_tokens=NUM_NEW, block_size=4, temperature=temperature,
                                             top_k=top_k, top_p=top_p)
    assert accepted_drafts > NUM_SAMPLES // 10  # proposals were accepted: the acceptance path was tested
    print(proposer_kind, temperature, top_k, top_p, "accepted", accepted_drafts)
    # the same statistic has power: it rejects a nearby wrong distribution
    assert_follows(counts, exact_joint(target, input_ids, temperature, top_k, top_p),
                   exact_joint(target, input_ids, temperature * 1.5, top_k, top_p))


class TokenDependentConfidence(DFlashProposer):
    """The wrong confidence: q of the token it sampled. The width then depends on the sampled token, which biases the
    proposals that get verified (the test below must catch it)."""

    def propose(self, step: DraftStep) -> Proposal:
        proposal = super().propose(step)
        sampled_q = proposal.draft_probabilities.gather(-1, proposal.tokens[..., None])[..., 0]
        return SampledProposal(proposal.tokens, draft_probabilities=proposal.draft_probabilities,
                               confidences=sampled_q)


@pytest.mark.parametrize("sample_proposals", [True, False, "token_dependent"])
def test_shortened_steps_keep_the_target_distribution(sampling_setup, sample_proposals):
    """Adaptive verify length: each step verifies the prefix its draft confidences choose; still the target's law."""
    target, input_ids = sampling_setup
    proposer_class = TokenDependentConfidence if sample_proposals == "token_dependent" else DFlashProposer
    draft = make_draft(12, block_size=4, vocab_size=VOCAB, mask_token_id=VOCAB - 1)
    costs = StepCosts(draft=0.0, verify=(1.0, 1.7, 2.0, 2.3))  # a second token pays when the draft is > 70 % sure
    generator = torch.Generator().manual_seed(4321)
    counts: dict[tuple[int, ...], int] = {}
    widths: set[int] = set()
    accepted_drafts = 0
    with torch.no_grad():
        for _ in range(NUM_SAMPLES):
            proposer = proposer_class(draft, target, VOCAB - 1, sample_proposals=bool(sample_proposals))
            result = speculative_decode(target, proposer, input_ids, max_new_tokens=NUM_NEW, block_size=4,
                                        temperature=1.0, generator=generator, step_costs=costs)
            cell = tuple(result.new_token_ids[0].tolist())
            counts[cell] = counts.get(cell, 0) + 1
            widths.add(result.verified_lengths[0][0])
            accepted_drafts += sum(a - 1 for a in result.acceptance_lengths[0])
    assert widths == {1, 2}  # the first step (two tokens left) was shortened in some runs, not in others
    assert accepted_drafts > NUM_SAMPLES // 10
    p_value = chi_square_p_value(counts, exact_joint(target, input_ids, 1.0, None, None), NUM_SAMPLES)
    p_value_wrong = chi_square_p_value(counts, exact_joint(target, input_ids, 1.5, None, None), NUM_SAMPLES)
    print("sample_proposals", sample_proposals, "accepted", accepted_drafts, "p", p_value, "p_wrong", p_value_wrong)
    if sample_proposals == "token_dependent":
        assert p_value < 1e-3  # the statistic sees the bias of a token-dependent width
        return
    assert p_value > 1e-3
    assert p_value_wrong < 1e-3


def test_seed_makes_sampling_reproducible(sampling_setup):
    target, input_ids = sampling_setup
    draft = make_draft(12, block_size=4, vocab_size=VOCAB, mask_token_id=VOCAB - 1)
    runs = [draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=12, temperature=1.0, seed=s)
            for s in (7, 7, 8)]
    assert torch.equal(runs[0], runs[1])
    assert not torch.equal(runs[0], runs[2])


@pytest.mark.parametrize("per_row_generators, sample_proposals", [(False, True), (True, True), (True, False)])
def test_batched_sampling_follows_each_rows_distribution(sampling_setup, per_row_generators, sample_proposals):
    """Rows of one left-padded batch alternate two prompts (the second shorter): each row samples its own
    prompt's distribution, with a generator per row or one shared by all."""
    target, prompt = sampling_setup
    other = torch.tensor([[3, 2]])
    repeats = 600  # of the pattern (prompt, other, prompt)
    input_ids = torch.cat((prompt, torch.cat((torch.zeros(1, 2, dtype=torch.long), other), dim=1), prompt))
    attention_mask = torch.tensor([[1, 1, 1, 1], [0, 0, 1, 1], [1, 1, 1, 1]])
    draft = make_draft(12, block_size=4, vocab_size=VOCAB, mask_token_id=VOCAB - 1)
    generator = [torch.Generator().manual_seed(10_000 + row) for row in range(3 * repeats)] \
        if per_row_generators else torch.Generator().manual_seed(99)
    proposer = DFlashProposer(draft, target, VOCAB - 1, sample_proposals=sample_proposals)
    with torch.no_grad():
        result = speculative_decode(target, proposer, input_ids.repeat(repeats, 1),
                                    attention_mask=attention_mask.repeat(repeats, 1), max_new_tokens=NUM_NEW,
                                    block_size=4, temperature=1.0, generator=generator)
    counts: list[dict[tuple[int, ...], int]] = [{}, {}]  # per prompt
    for row in range(3 * repeats):
        cell, which = tuple(result.new_tokens(row)), int(row % 3 == 1)
        counts[which][cell] = counts[which].get(cell, 0) + 1
    assert sum(length - 1 for lengths in result.acceptance_lengths for length in lengths) > repeats // 10
    for which, (row_prompt, num_samples) in enumerate(((prompt, 2 * repeats), (other, repeats))):
        assert_follows(counts[which], exact_joint(target, row_prompt, 1.0, None, None),
                       exact_joint(target, row_prompt, 1.5, None, None), num_samples)


def test_per_row_generators_reproduce_each_row_alone(sampling_setup):
    """With the equality rule (argmax proposals) a row's random stream is the same in a batch and alone. Speculative
    sampling draws a row's proposals from a block as wide as the batch's step, so there it is exact, not replayable."""
    target, prompt = sampling_setup
    draft = make_draft(12, block_size=4, vocab_size=VOCAB, mask_token_id=VOCAB - 1)
    other = torch.tensor([[0, 3, 2, 2]])
    batch = draft.spec_generate(target=target, input_ids=torch.cat((prompt, other)), max_new_tokens=12,
                                temperature=1.0, generator=[torch.Generator().manual_seed(s) for s in (5, 6)],
                                acceptance="equality", return_stats=True)
    for row, (row_prompt, seed) in enumerate(((prompt, 5), (other, 6))):
        alone = draft.spec_generate(target=target, input_ids=row_prompt, max_new_tokens=12, temperature=1.0,
                                    generator=torch.Generator().manual_seed(seed), acceptance="equality",
                                    return_stats=True)
        assert batch.new_tokens(row) == alone.new_tokens(0)
    assert batch.new_tokens(0) != batch.new_tokens(1)


@pytest.mark.parametrize("broken", [False, True])
def test_speculative_sample_keeps_the_target_distribution(broken):
    """One position: accept with min(1, p/q), else the residual. Sampling p instead of the residual is caught."""
    p = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]])  # [k + 1, V], k = 1
    q = torch.tensor([[0.1, 0.6, 0.1, 0.2]])  # [k, V]
    generator, num_samples = torch.Generator().manual_seed(3), 20000
    proposals = torch.multinomial(q[0], num_samples, replacement=True, generator=generator)[:, None]  # [n, 1]
    uniforms = torch.rand(num_samples, 2, generator=generator, dtype=torch.float64)
    accepted, tokens = speculative_sample(proposals, q.expand(num_samples, -1, -1), p.expand(num_samples, -1, -1),
                                          uniforms)
    if broken:  # the wrong rule: resample from p after a rejection
        tokens = torch.where(accepted == 0,
                             torch.multinomial(p[0], num_samples, replacement=True, generator=generator), tokens)
    first_tokens = torch.where(accepted == 1, proposals[:, 0], tokens)
    counts = dict(enumerate(torch.bincount(first_tokens, minlength=4).tolist()))
    p_value = chi_square_p_value(counts, dict(enumerate(p[0].double().tolist())), num_samples)
    assert (p_value < 1e-3) if broken else (p_value > 1e-3)


def test_speculative_sample_rows_follow_their_limits_and_p():
    """Rows of one call keep at most `limits` proposals; after k kept proposals the bonus token follows p at k."""
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])  # [k + 1, V], k = 2: p keeps token 1 twice
    q = torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]])
    proposals = torch.tensor([[1, 1], [1, 1], [1, 1]])  # [n, k]
    uniforms = torch.full((3, 3), 0.5, dtype=torch.float64)
    accepted, tokens = speculative_sample(proposals, q.expand(3, -1, -1), p.expand(3, -1, -1), uniforms,
                                          limits=torch.tensor([2, 1, 0]))
    assert accepted.tolist() == [2, 1, 0]
    assert tokens.tolist() == [2, 1, 1]  # p at position 2, 1 and 0: the bonus from p, never a proposal of q


def test_rejection_sampling_accepts_more_than_the_equality_rule_for_a_close_draft(sampling_setup):
    """A draft whose q equals p: every proposal is kept by speculative sampling, far fewer by the equality rule."""
    target, input_ids = sampling_setup
    tau = {}
    for sample_proposals in (True, False):
        proposer = TargetSampleProposer(target, sample_proposals)
        lengths = []
        for seed in range(40):
            result = speculative_decode(target, proposer, input_ids, max_new_tokens=4, block_size=4, temperature=1.0,
                                        generator=torch.Generator().manual_seed(seed))
            lengths += result.acceptance_lengths[0]
        tau[sample_proposals] = sum(lengths) / len(lengths)
    assert tau[True] == 3.0  # every block of 3 proposals kept (4 tokens: 1 prefill token + 3 in one step)
    assert tau[False] < 2.5


class TargetSampleProposer:
    """Proposes by sampling the target itself (q = p): with q, speculative sampling must keep every proposal."""

    target_layer_ids = None

    def __init__(self, target, with_probabilities: bool):
        self.target, self.with_probabilities = target, with_probabilities

    def propose(self, step: DraftStep):
        ids, generator = torch.tensor([step.sequences[0]]), torch.Generator().manual_seed(len(step.sequences[0]))
        tokens, distributions = [], []
        for _ in range(step.block_size - 1):
            probabilities = self.target(ids).logits[0, -1].float().softmax(-1)
            token = int(torch.multinomial(probabilities, 1, generator=generator)) if self.with_probabilities \
                else int(probabilities.argmax())
            tokens.append(token)
            distributions.append(probabilities)
            ids = torch.cat((ids, torch.tensor([[token]])), dim=1)
        if not self.with_probabilities:
            return torch.tensor([tokens])
        return SampledProposal(torch.tensor([tokens]), draft_probabilities=torch.stack(distributions)[None])


def test_speculative_sample_never_commits_the_proposal_it_rejected():
    """p slightly below q everywhere (rounding): a rejection finds no residual and keeps the proposal instead."""
    q = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]])
    p = torch.cat((q[:1] * 0.999, q[1:]))  # [k + 1, V], k = 1: p < q at every token of position 0
    generator, num_samples = torch.Generator().manual_seed(0), 3000
    proposals = torch.multinomial(q[0], num_samples, replacement=True, generator=generator)[:, None]
    uniforms = torch.rand(num_samples, 2, generator=generator, dtype=torch.float64)
    accepted, tokens = speculative_sample(proposals, q[:1].expand(num_samples, -1, -1), p.expand(num_samples, -1, -1),
                                          uniforms)
    assert bool(((accepted == 1) | (tokens != proposals[:, 0])).all())
