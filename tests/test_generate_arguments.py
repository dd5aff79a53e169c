"""`generate`'s own arguments (logits processors and warpers, stopping criteria, scores) give exactly what `generate`
gives with them: each is applied at every verified position with that position's prefix, and a row stops where
`generate` stops, also inside an accepted block."""

from __future__ import annotations

import pytest
import torch
import transformers.generation
from helpers import (
    ReferenceProposer,
    TreeReferenceProposer,
    left_pad_prompts,
    make_char_tokenizer,
    make_draft,
    make_target,
    prompts_of,
    random_prompt,
)
from sampling_checks import NUM_NEW, assert_follows, processed_joint, sampled_counts
from sampling_checks import SAMPLING_VOCAB as VOCAB
from transformers import LogitsProcessor, LogitsProcessorList, StoppingCriteria, StoppingCriteriaList
from transformers.generation import (
    MinPLogitsWarper,
    NoRepeatNGramLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
)

from dflash_hf import speculative_decode, steps_dflash
from dflash_hf.proposer_dflash import DFlashProposer

NEW = 20
BLOCK = 6


@pytest.fixture(scope="module")
def target():
    return make_target("qwen3", seed=3)


def plain_continuation(target, prompt: torch.Tensor) -> list[int]:
    return target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
                           pad_token_id=0)[0, prompt.shape[1]:].tolist()


def processor_settings(name: str, plain: list[int], prompt_length: int) -> dict:
    """One processor's setting, chosen from the plain greedy continuation so that it changes it."""
    early = plain[2]  # a token the plain decode commits early: as an EOS id, a processor must keep it back
    return {
        "repetition_penalty": {"repetition_penalty": 1.6},
        "encoder_repetition_penalty": {"encoder_repetition_penalty": 0.5},
        "no_repeat_ngram_size": {"no_repeat_ngram_size": 2},
        "bad_words_ids": {"bad_words_ids": [[plain[3]], [plain[5], plain[6]]]},
        "sequence_bias": {"sequence_bias": {(plain[1],): -20.0, (plain[4], plain[5]): -20.0}},
        "suppress_tokens": {"suppress_tokens": [plain[0], plain[4]]},
        "begin_suppress_tokens": {"begin_suppress_tokens": [plain[0]]},
        "min_length": {"min_length": prompt_length + 12, "eos_token_id": early},
        "min_new_tokens": {"min_new_tokens": 12, "eos_token_id": early},
        "forced_eos_token_id": {"forced_eos_token_id": 5, "eos_token_id": 5},
        "exponential_decay_length_penalty": {"exponential_decay_length_penalty": (3, 1.8), "eos_token_id": 7},
        "renormalize_logits": {"renormalize_logits": True, "repetition_penalty": 1.3},
        "remove_invalid_values": {"remove_invalid_values": True, "no_repeat_ngram_size": 3},
    }[name]


PROCESSORS = ["repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size", "bad_words_ids",
              "sequence_bias", "suppress_tokens", "begin_suppress_tokens", "min_length", "min_new_tokens",
              "forced_eos_token_id", "exponential_decay_length_penalty", "renormalize_logits",
              "remove_invalid_values"]


class PenaliseLastTokenResidue(LogitsProcessor):
    """A user's processor that depends on the prefix: the token (last token * 7) mod V gains 8."""

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        scores[torch.arange(scores.shape[0]), (input_ids[:, -1] * 7) % scores.shape[1]] += 8.0
        return scores


def decode(target, proposer, input_ids, attention_mask=None, **arguments):
    return speculative_decode(target, proposer, input_ids, attention_mask=attention_mask, max_new_tokens=NEW,
                              block_size=BLOCK, temperature=0.0, pad_token_id=0, **arguments)


def test_min_new_tokens_overrides_min_length_as_in_generate(target):
    """generate lets min_new_tokens replace min_length (prompt width + min_new_tokens): the call's min_length does not
    hold the EOS back."""
    prompt = random_prompt(5, 7)
    plain = plain_continuation(target, prompt)
    settings = {"min_new_tokens": 1, "min_length": prompt.shape[1] + 12, "eos_token_id": plain[2]}
    expected = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
                               pad_token_id=0, **settings)
    assert expected.shape[1] - prompt.shape[1] <= 3  # generate stopped at the EOS, before min_length's 12 tokens
    for proposer in (ReferenceProposer(expected), ReferenceProposer(expected, corrupt_seed=4)):
        assert torch.equal(decode(target, proposer, prompt, **settings).output_ids, expected)


PREFIX_READERS = ["repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "sequence_bias", "min_new_tokens"]


LAYOUTS = [(name, "chain") for name in PROCESSORS] + [
    (name, layout) for name in PREFIX_READERS for layout in ("chain_with_wrong_drafts", "tree")]


@pytest.mark.parametrize("name, layout", LAYOUTS)
def test_each_processor_gives_generates_output_on_one_prompt(target, name, layout):
    """The proposer drafts generate's own output (with the processor), so whole blocks are accepted and the processor
    runs at every verified column; wrong drafts and trees check rejected and branching positions for the processors
    that read the prefix."""
    prompt = random_prompt(5, 7)
    settings = processor_settings(name, plain_continuation(target, prompt), prompt.shape[1])
    expected = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
                               pad_token_id=0, **settings)
    if name not in ("renormalize_logits", "remove_invalid_values"):  # these two change no argmax
        assert expected[0, prompt.shape[1]:].tolist() != plain_continuation(target, prompt)[: expected.shape[1]
                                                                                             - prompt.shape[1]]
    proposer = (TreeReferenceProposer(expected, k=3, seed=1) if layout == "tree" else
                ReferenceProposer(expected, corrupt_seed=4 if layout == "chain_with_wrong_drafts" else None))
    result = decode(target, proposer, prompt, tree_size=6 if layout == "tree" else None, **settings)
    assert torch.equal(result.output_ids, expected)
    assert result.tau > 1.2  # drafted positions were accepted: the processor judged them, not only column 0


@pytest.mark.parametrize("name, tree_size", [("repetition_penalty", None), ("repetition_penalty", 5),
                                             ("no_repeat_ngram_size", 5), ("min_new_tokens", None),
                                             ("bad_words_ids", 5), ("exponential_decay_length_penalty", None)])
def test_processors_give_generates_output_on_a_left_padded_batch(target, name, tree_size):
    """Each row sees its own prompt with its padding, as in `generate`'s batch (Transformers 5 leaves the padding
    out of the repetition penalty; 4.57 counts it)."""
    prompts = prompts_of([5, 9, 3], seed=2)
    input_ids, mask = left_pad_prompts(prompts)
    settings = processor_settings(name, plain_continuation(target, prompts[0]), input_ids.shape[1])
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                               **settings)
    width = input_ids.shape[1]
    references = [torch.cat((prompt[0], expected[row, width:]))[None] for row, prompt in enumerate(prompts)]
    proposer = (TreeReferenceProposer(references, k=3, seed=2) if tree_size else
                ReferenceProposer(references, corrupt_seed=6))
    result = decode(target, proposer, input_ids, mask, tree_size=tree_size, **settings)
    assert torch.equal(result.output_ids, expected)
    draft = make_draft(5)
    assert torch.equal(draft.spec_generate(target=target, input_ids=input_ids, attention_mask=mask,
                                           max_new_tokens=NEW, temperature=0.0, pad_token_id=0, **settings), expected)


@pytest.mark.parametrize("tree_size", [None, 6])
def test_a_users_processor_that_reads_the_prefix_gives_generates_output(target, tree_size):
    prompts = prompts_of([6, 4], seed=8)
    input_ids, mask = left_pad_prompts(prompts)
    processors = LogitsProcessorList([PenaliseLastTokenResidue()])
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                               logits_processor=processors)
    plain = target.generate(input_ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert not torch.equal(expected, plain)
    width = input_ids.shape[1]
    references = [torch.cat((prompt[0], expected[row, width:]))[None] for row, prompt in enumerate(prompts)]
    proposer = TreeReferenceProposer(references, k=3, seed=3) if tree_size else ReferenceProposer(references)
    result = decode(target, proposer, input_ids, mask, tree_size=tree_size, logits_processor=processors)
    assert torch.equal(result.output_ids, expected)
    assert result.tau > 1.2


class RecordPositions(LogitsProcessor):
    """A user's processor that records, per call, how many tokens of its row's prefix follow the prompts' width."""

    def __init__(self, width: int) -> None:
        self.width, self.new_before = width, []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        self.new_before.append(input_ids.shape[1] - self.width)
        return scores


@pytest.mark.parametrize("tree_size", [None, 6])
def test_a_processor_is_asked_only_about_positions_a_row_can_commit(target, tree_size):
    """A row whose proposals are all accepted reaches max_new_tokens while a slower row still verifies whole blocks:
    the verify stays as wide as the slower row needs, but no processor is asked about the first row's positions past
    max_new_tokens, which `generate` never reaches (a compiled verify, always as wide, asks as often as eager)."""
    prompts = prompts_of([6, 4], seed=8)
    input_ids, mask = left_pad_prompts(prompts)
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    width = input_ids.shape[1]
    references = [torch.cat((prompt[0], expected[row, width:]))[None] for row, prompt in enumerate(prompts)]
    proposer = TreeReferenceProposer(references, k=3, seed=3) if tree_size else \
        ReferenceProposer(references, corrupt_seed=2, corrupt_rows={1})
    recorder = RecordPositions(width)
    result = decode(target, proposer, input_ids, mask, tree_size=tree_size,
                    logits_processor=LogitsProcessorList([recorder]))
    assert torch.equal(result.output_ids, expected)
    assert max(recorder.new_before) == NEW - 1  # the last position generate reaches, and none after it
    if tree_size is None:  # row 0 took whole blocks (its last one cut by max_new_tokens), row 1 more steps
        assert len(result.acceptance_lengths[0]) < len(result.acceptance_lengths[1])


def test_prefix_allowed_tokens_fn_is_given_each_rows_own_index(target):
    prompts = prompts_of([5, 7], seed=9)
    input_ids, mask = left_pad_prompts(prompts)

    def allowed(batch_id: int, sequence: torch.Tensor) -> list[int]:  # row 0: even ids; row 1: ids near its last one
        return list(range(0, 40, 2)) if batch_id == 0 else [(int(sequence[-1]) + k) % 128 for k in (1, 5, 9)]

    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                               prefix_allowed_tokens_fn=allowed)
    width = input_ids.shape[1]
    references = [torch.cat((prompt[0], expected[row, width:]))[None] for row, prompt in enumerate(prompts)]
    result = decode(target, ReferenceProposer(references, corrupt_seed=2), input_ids, mask,
                    prefix_allowed_tokens_fn=allowed)
    assert torch.equal(result.output_ids, expected)
    assert all(token % 2 == 0 for token in result.new_tokens(0))


# --- Stopping --------------------------------------------------------------------------------------------------------


def test_a_stop_string_ending_inside_an_accepted_block_stops_there(target):
    """The proposer drafts the whole plain continuation, so every block is accepted whole; the stop string ends
    inside the second block and the row stops right there, as `generate` stops."""
    tokenizer, prompt = make_char_tokenizer(), random_prompt(5, 7)
    plain = plain_continuation(target, prompt)
    end = next(index for index in range(BLOCK + 1, NEW) if index % BLOCK not in (0, 1))  # not at a block's edge
    stop = tokenizer.decode(plain[end - 1 : end + 1])
    assert stop not in tokenizer.decode(plain[:end])  # it first ends at token `end`
    expected = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
                               pad_token_id=0, stop_strings=[stop], tokenizer=tokenizer)
    assert expected.shape[1] == prompt.shape[1] + end + 1
    result = decode(target, ReferenceProposer(torch.tensor([prompt[0].tolist() + plain])), prompt,
                    stop_strings=stop, tokenizer=tokenizer)
    assert torch.equal(result.output_ids, expected)
    assert result.acceptance_lengths[0][-1] < BLOCK  # the last block was cut after the stop string


@pytest.mark.parametrize("tree_size", [None, 5])
def test_stopping_criteria_and_stop_strings_stop_each_row_of_a_batch_on_its_own(target, tree_size):
    """Each row stops where `generate` stops that row's prompt alone (Transformers 5.25's batched stop-string check
    can miss a row's stop string that the same row alone meets)."""
    tokenizer = make_char_tokenizer()
    prompts = prompts_of([5, 8, 4], seed=12)
    input_ids, mask = left_pad_prompts(prompts)
    plain = [plain_continuation(target, prompt) for prompt in prompts]
    stop = tokenizer.decode(plain[0][1:3])

    class StopAfterToken(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return input_ids[:, -1] == plain[1][6]

    arguments = {"stop_strings": [stop], "tokenizer": tokenizer, "stopping_criteria": StoppingCriteriaList(
        [StopAfterToken()])}
    expected = [target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
                                pad_token_id=0, **arguments)[0, prompt.shape[1]:].tolist() for prompt in prompts]
    assert len(expected[0]) < NEW and len(expected[1]) < NEW and len(expected[2]) == NEW  # two rows stop early
    references = [torch.tensor([prompt[0].tolist() + tokens]) for prompt, tokens in zip(prompts, plain)]
    proposer = TreeReferenceProposer(references, k=3, seed=4) if tree_size else ReferenceProposer(references)
    result = decode(target, proposer, input_ids, mask, tree_size=tree_size, **arguments)
    assert [result.new_tokens(row) for row in range(3)] == expected


def test_max_time_stops_after_the_token_at_which_time_ran_out(target):
    prompt = random_prompt(5, 7)
    expected = target.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
                               pad_token_id=0, max_time=0.0)
    result = decode(target, ReferenceProposer(expected), prompt, max_time=0.0)
    assert torch.equal(result.output_ids, expected) and result.num_new_tokens == [1]


# --- What the call returns -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tree_size", [None, 5])
def test_scores_and_logits_are_generates(target, tree_size):
    """Processed scores and raw logits of each new token, in generate's layout: one [N, V] per new-token index;
    a row's entries after it ended are -inf."""
    prompts = prompts_of([6, 4], seed=13)
    input_ids, mask = left_pad_prompts(prompts)
    arguments = {"repetition_penalty": 1.4, "output_scores": True, "output_logits": True,
                 "return_dict_in_generate": True, "eos_token_id": 9}
    expected = target.generate(input_ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, pad_token_id=0,
                               **arguments)
    width = input_ids.shape[1]
    references = [torch.cat((prompt[0], expected.sequences[row, width:]))[None] for row, prompt in enumerate(prompts)]
    proposer = TreeReferenceProposer(references, k=3, seed=5) if tree_size else ReferenceProposer(references)
    result = decode(target, proposer, input_ids, mask, tree_size=tree_size, **arguments)
    assert torch.equal(result.sequences, expected.sequences[:, : result.sequences.shape[1]])
    assert len(result.scores) == len(result.logits) == max(result.num_new_tokens)
    for row, count in enumerate(result.num_new_tokens):
        for index in range(count):
            torch.testing.assert_close(result.scores[index][row], expected.scores[index][row], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(result.logits[index][row], expected.logits[index][row], rtol=1e-5, atol=1e-5)
        assert all(bool(torch.isinf(result.scores[index][row]).all()) for index in range(count, len(result.scores)))
    assert not torch.allclose(result.scores[3][0], result.logits[3][0])  # the penalty is in the scores only


def test_spec_generate_returns_its_output_for_return_dict_in_generate(target):
    prompt = random_prompt(5, 7)
    draft = make_draft(5)
    ids = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=8, temperature=0.0)
    output = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=8, temperature=0.0,
                                 return_dict_in_generate=True, output_scores=True)
    assert torch.equal(output.sequences, ids) and len(output.scores) == 8 and output.logits is None
    plain = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=8, temperature=0.0,
                                output_scores=True)  # generate returns scores only inside its output object
    assert torch.equal(plain, ids)


# --- Sampling --------------------------------------------------------------------------------------------------------


WARPERS = {"min_p": 0.1, "typical_p": 0.8, "epsilon_cutoff": 0.02, "eta_cutoff": 0.02}
if hasattr(transformers.generation, "TopHLogitsWarper"):  # Transformers 5 adds top_h
    WARPERS["top_h"] = 0.6


@pytest.mark.parametrize("name", sorted(WARPERS))
def test_sampling_warpers_give_generates_scores_at_each_committed_position(target, name):
    """The distribution each token is drawn from: our processed scores at every committed position equal what
    `generate` samples from after the same prefix."""
    prompt = random_prompt(6, 7)
    arguments = {"do_sample": True, "temperature": 0.7, name: WARPERS[name], "output_scores": True,
                 "return_dict_in_generate": True}
    result = make_draft(6).spec_generate(target=target, input_ids=prompt, max_new_tokens=10, pad_token_id=0,
                                         seed=3, **arguments)
    for index in range(result.num_new_tokens[0]):
        prefix = result.sequences[:, : prompt.shape[1] + index]
        reference = target.generate(prefix, attention_mask=torch.ones_like(prefix), max_new_tokens=1,
                                    pad_token_id=0, **arguments)
        torch.testing.assert_close(result.scores[index][0], reference.scores[0][0], rtol=1e-5, atol=1e-5)
        assert torch.isfinite(result.scores[index][0, result.sequences[0, prompt.shape[1] + index]])  # drawn in it


@pytest.mark.parametrize("sample_proposals, tree_size", [(True, None), (False, None), (True, 3)])
@pytest.mark.parametrize("settings", [{"repetition_penalty": 2.5}, {"min_p": 0.3}])
def test_sampling_with_a_processor_follows_the_processed_distribution(sample_proposals, tree_size, settings):
    """Chi-square against the processed law (Transformers' own processors, each prefix as their input), with a
    power check against the unprocessed law; the draft's q (a chain's, or a tree's candidates') went through the
    repetition penalty too."""
    target, prompt = make_target("llama", seed=11, vocab_size=VOCAB, init_std=0.4), torch.tensor([[1, 4, 2, 5]])
    draft = make_draft(12, block_size=4, vocab_size=VOCAB, mask_token_id=VOCAB - 1)
    proposer = DFlashProposer(draft, target, VOCAB - 1, sample_proposals=sample_proposals)
    counts, accepted = sampled_counts(target, proposer, prompt, torch.Generator().manual_seed(77),
                                      max_new_tokens=NUM_NEW, block_size=4, temperature=1.0, top_k=None,
                                      tree_size=tree_size, **settings)
    assert accepted > 100  # drafted tokens were accepted: the processed p judged them
    processors = ([RepetitionPenaltyLogitsProcessor(settings["repetition_penalty"])]
                  if "repetition_penalty" in settings else [MinPLogitsWarper(settings["min_p"])])
    assert_follows(counts, processed_joint(target, prompt, LogitsProcessorList(processors)),
                   processed_joint(target, prompt, LogitsProcessorList([TopKLogitsWarper(VOCAB)])))



def test_a_sampled_trees_refused_nodes_keep_the_processed_distribution(monkeypatch):
    """No repeated bigram in a sampled tree: nodes the processor forbids after their path are not verified but tried
    in their place (refused for certain). Chi-square against the processed law, with a power check against the
    unprocessed one; refusals did happen."""
    refused = []
    build = steps_dflash.build_trees
    monkeypatch.setattr(steps_dflash, "build_trees",
                        lambda *args: (lambda trees: refused.extend(sum(trees.refused, [])) or trees)(build(*args)))
    target, prompt = make_target("llama", seed=11, vocab_size=VOCAB, init_std=0.4), torch.tensor([[1, 2, 3, 4, 0, 1]])
    draft = make_draft(12, block_size=4, vocab_size=VOCAB, mask_token_id=VOCAB - 1)
    proposer = DFlashProposer(draft, target, VOCAB - 1)
    counts, accepted = sampled_counts(target, proposer, prompt, torch.Generator().manual_seed(78),
                                      max_new_tokens=4, block_size=4, temperature=1.0, top_k=None, tree_size=10,
                                      no_repeat_ngram_size=2)  # 4 tokens: a tree two deep after the first
    assert accepted > 100 and len(refused) > 500
    assert_follows(counts, processed_joint(target, prompt, LogitsProcessorList([NoRepeatNGramLogitsProcessor(2)]), 4),
                   processed_joint(target, prompt, LogitsProcessorList([TopKLogitsWarper(VOCAB)]), 4))
