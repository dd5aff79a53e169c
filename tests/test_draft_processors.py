"""The draft's proposals go through `generate`'s processors (`processors_dflash.DraftRules`), each block position
with the prefix its verify gives it: greedy output stays `generate`'s for each processor with the DFlash draft (chain
and tree, a left-padded batch), a token a processor forbids is never proposed (nor verified in a greedy tree), and a
user's own processor shapes the draft only with draft_processors="all"."""

from __future__ import annotations

import pytest
import torch
from helpers import left_pad_prompts, make_draft, make_target, make_variant_draft, prompts_of
from transformers import LogitsProcessor, LogitsProcessorList

from dflash_hf import steps_dflash
from dflash_hf.generation_dflash import dflash_proposer, speculative_decode
from dflash_hf.settings_dflash import resolve_settings

NEW = 20
PAD = 0


@pytest.fixture(scope="module")
def models():
    return make_target("qwen3", seed=3), make_draft(5)


@pytest.fixture(scope="module")
def batch():
    return left_pad_prompts(prompts_of([5, 9, 3], seed=2))


def greedy(target, input_ids, mask, **settings) -> torch.Tensor:
    return target.generate(input_ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=PAD,
                           **settings)


class Forbid(LogitsProcessor):
    """A user's processor: `token` never follows `after`."""

    def __init__(self, after: int, token: int) -> None:
        self.after, self.token = after, token

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        scores[input_ids[:, -1] == self.after, self.token] = float("-inf")
        return scores


def processor_settings(name: str, plain: torch.Tensor, width: int) -> dict:
    """One processor's setting, chosen from row 0's plain greedy continuation (plain [N, width + NEW]) so that it
    changes what the draft would propose."""
    row = plain[0, width:].tolist()
    early = row[2]  # as an EOS id, a length rule must keep it back
    return {
        "repetition_penalty": {"repetition_penalty": 1.6},
        "no_repeat_ngram_size": {"no_repeat_ngram_size": 2},
        "bad_words_ids": {"bad_words_ids": [[row[3]], [row[5], row[6]]]},
        "sequence_bias": {"sequence_bias": {(row[1],): -20.0, (row[4], row[5]): -20.0}},
        "suppress_tokens": {"suppress_tokens": [row[0], row[4]]},
        "begin_suppress_tokens": {"begin_suppress_tokens": [row[0]]},
        "min_new_tokens": {"min_new_tokens": 12, "eos_token_id": early},
        "forced_eos_token_id": {"forced_eos_token_id": 5, "eos_token_id": 5},
        "prefix_allowed_tokens_fn": {"prefix_allowed_tokens_fn":
                                     lambda batch_id, ids: [token for token in range(40) if token != int(ids[-1])]},
        "a user's processor": {"logits_processor": LogitsProcessorList([Forbid(row[1], row[2])]),
                               "draft_processors": "all"},
    }[name]


NAMES = ["repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "suppress_tokens",
         "begin_suppress_tokens", "min_new_tokens", "forced_eos_token_id", "prefix_allowed_tokens_fn",
         "a user's processor"]


@pytest.mark.parametrize("tree_size", [None, 6])
@pytest.mark.parametrize("name", NAMES)
def test_greedy_output_is_generates_with_the_draft_seeing_each_processor(models, batch, name, tree_size):
    target, draft = models
    input_ids, mask = batch
    settings = processor_settings(name, greedy(target, input_ids, mask), input_ids.shape[1])
    generate_settings = {key: value for key, value in settings.items() if key != "draft_processors"}
    expected = greedy(target, input_ids, mask, **generate_settings)
    assert not torch.equal(expected, greedy(target, input_ids, mask))  # the processor changes the output
    result = draft.spec_generate(target=target, input_ids=input_ids, attention_mask=mask, max_new_tokens=NEW,
                                 temperature=0.0, pad_token_id=PAD, tree_size=tree_size, block_size=6, **settings)
    assert torch.equal(result, expected)


def test_a_dflash2_drafts_proposals_see_the_processors(batch):
    """DFlash2's selector chooses among candidates of the processed logits: output equal, none forbidden proposed."""
    target, draft = make_target("qwen3", seed=3), make_variant_draft("dflash2", seed=4)
    input_ids, mask = batch
    settings = forbidding_settings(target, draft, input_ids, mask)
    for tree_size in (None, 5):
        recorder, output = record_proposals(target, draft, input_ids, mask, tree_size, **settings)
        assert torch.equal(output.output_ids, greedy(target, input_ids, mask, **settings))
        assert recorder.checked > 20 and recorder.forbidden == []
        assert len(record_proposals(target, draft, input_ids, mask, tree_size, "none", **settings)[0].forbidden) > 0


class ProposalRecorder:
    """Records every proposed chain and every verified tree node with the prefix its verify gives it, and which of
    them the call's processors forbid there."""

    def __init__(self, settings) -> None:
        self.settings, self.forbidden, self.checked = settings, [], 0

    def check(self, row: int, prefix: torch.Tensor, token: int) -> None:
        """Every processor of the call (a user's too) on zero logits: -inf at `token` forbids it after `prefix`."""
        self.checked += 1
        rules = self.settings.rules.draft
        scores = rules.row_processors[row](prefix[None], torch.zeros(1, rules.vocabulary_size))
        if scores[0, token] == float("-inf"):
            self.forbidden.append((row, prefix.tolist(), token))


def record_proposals(target, draft, input_ids, mask, tree_size, draft_processors="built", temperature=0.0,
                     **arguments):
    """Decode with a proposer and tree builder that report to a `ProposalRecorder`; (recorder, output)."""
    settings = resolve_settings(target, input_ids, draft, attention_mask=mask, max_new_tokens=NEW, block_size=6,
                                pad_token_id=PAD, tree_size=tree_size, do_sample=temperature > 0,
                                temperature=temperature, seed=7, draft_processors=draft_processors, **arguments)
    # the check uses every processor of the call, also when the draft was told not to see them
    checking = resolve_settings(target, input_ids, draft, attention_mask=mask, max_new_tokens=NEW, block_size=6,
                                pad_token_id=PAD, tree_size=tree_size, draft_processors="all", **arguments)
    recorder = ProposalRecorder(checking)
    proposer = dflash_proposer(draft, target, settings, input_ids.shape[1], input_ids.shape[0])
    base_propose, base_arrange = proposer.propose, steps_dflash.TreeStep.arrange

    def propose(step):
        proposal = base_propose(step)
        tokens = getattr(proposal, "tokens", proposal)  # [n, B-1]
        if tree_size is None:
            for index, row in enumerate(step.row_ids):
                committed = torch.cat((input_ids[row], torch.tensor(step.generated[index])))
                for position, token in enumerate(tokens[index].tolist()):
                    recorder.check(row, torch.cat((committed, tokens[index, :position])), token)
        return proposal

    def arrange(self, state, step, proposal, call_settings):
        tree_step, arranged = base_arrange(self, state, step, proposal, call_settings)
        trees = tree_step.tree
        for index, row in enumerate(state.active):
            committed = torch.cat((input_ids[row], torch.tensor(state.generated[row])))
            paths: list[list[int]] = [[]]
            for token, parent, real in zip(trees.tokens[index], trees.parents[index], trees.real[index]):
                paths.append(paths[parent] + [token])
                if real:
                    recorder.check(row, torch.cat((committed, torch.tensor(paths[parent], dtype=torch.long))),
                                   token)
        return tree_step, arranged

    proposer.propose = propose
    steps_dflash.TreeStep.arrange = arrange
    try:
        output = speculative_decode(target, proposer, input_ids, attention_mask=mask, settings=settings)
    finally:
        steps_dflash.TreeStep.arrange = base_arrange
    return recorder, output


def unshaped_proposals(target, draft, input_ids, mask) -> list[tuple[int, int]]:
    """(token before, token) of every chain proposal of a plain greedy call."""
    settings = resolve_settings(target, input_ids, draft, attention_mask=mask, max_new_tokens=NEW, block_size=6,
                                pad_token_id=PAD, temperature=0.0)
    proposer = dflash_proposer(draft, target, settings, input_ids.shape[1], input_ids.shape[0])
    base, pairs = proposer.propose, []

    def propose(step):
        proposal = base(step)
        for generated, tokens in zip(step.generated, getattr(proposal, "tokens", proposal).tolist()):
            pairs.extend(zip([generated[-1]] + tokens[:-1], tokens))
        return proposal

    proposer.propose = propose
    speculative_decode(target, proposer, input_ids, attention_mask=mask, settings=settings)
    return pairs


def forbidding_settings(target, draft, input_ids, mask) -> dict:
    """Processors that forbid tokens the unshaped draft proposes: no repeated bigram, and its most frequent
    proposals as bad words (one alone, one after another)."""
    counts: dict[int, int] = {}
    for _, token in unshaped_proposals(target, draft, input_ids, mask):
        counts[token] = counts.get(token, 0) + 1
    common = sorted(counts, key=counts.get, reverse=True)
    return {"no_repeat_ngram_size": 2, "bad_words_ids": [[common[0]], [common[2], common[1]]]}


@pytest.mark.parametrize("tree_size, temperature", [(None, 0.0), (5, 0.0), (None, 1.0), (5, 1.0)])
def test_a_token_a_processor_forbids_is_never_proposed(models, batch, tree_size, temperature):
    """Every proposal of a chain and every verified node of a tree (greedy or sampled) is allowed after its prefix;
    the same check finds forbidden proposals when the draft does not see the processors (draft_processors="none")."""
    target, draft = models
    input_ids, mask = batch
    settings = forbidding_settings(target, draft, input_ids, mask)
    shaped, output = record_proposals(target, draft, input_ids, mask, tree_size, temperature=temperature, **settings)
    unshaped, unshaped_output = record_proposals(target, draft, input_ids, mask, tree_size, "none",
                                                 temperature=temperature, **settings)
    assert shaped.checked > 20 and shaped.forbidden == []
    assert len(unshaped.forbidden) > 0  # the check can fail
    if temperature == 0.0:
        expected = greedy(target, input_ids, mask, **settings)
        assert torch.equal(output.output_ids, expected) and torch.equal(unshaped_output.output_ids, expected)


def test_a_users_processor_shapes_the_draft_only_when_asked(models, batch):
    """draft_processors="built" (the default) leaves a user's processor to the verify: the draft may propose what it
    forbids; "all" gives it to the draft too. The output is generate's either way."""
    target, draft = models
    input_ids, mask = batch
    pairs = unshaped_proposals(target, draft, input_ids, mask)
    forbid = LogitsProcessorList([Forbid(*max(set(pairs), key=pairs.count))])  # its most frequent proposed pair
    checking = {"logits_processor": forbid}
    built, built_output = record_proposals(target, draft, input_ids, mask, None, "built", **checking)
    everything, all_output = record_proposals(target, draft, input_ids, mask, None, "all", **checking)
    expected = greedy(target, input_ids, mask, logits_processor=forbid)
    assert torch.equal(built_output.output_ids, expected) and torch.equal(all_output.output_ids, expected)
    assert everything.forbidden == [] and everything.checked > 20
    assert len(built.forbidden) > 0


def test_an_unknown_draft_processors_choice_is_refused(models, batch):
    target, draft = models
    with pytest.raises(ValueError, match=r"draft_processors must be one of \('built', 'all', 'none'\)"):
        draft.spec_generate(target=target, input_ids=batch[0], attention_mask=batch[1], max_new_tokens=4,
                            repetition_penalty=1.2, draft_processors="yes")
