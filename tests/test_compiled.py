"""The compiled path (`compile=True`, static_dflash): exact against `generate` (greedy) and drawing what the eager loop
draws (sampling), with no recompilation once the first verify has compiled, and refused up front where it cannot run.

Most tests compile with dynamo's `eager` backend: the same graph capture, guards and recompilations as inductor,
without inductor's C++ build; one test runs the default (inductor) end to end.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    ReferenceProposer,
    make_draft,
    make_hybrid_target,
    make_target,
    make_variant_draft,
    plain_greedy,
    random_prompt,
)
from torch._dynamo.utils import counters

from dflash_hf import speculative_decode
from dflash_hf.cache_dflash import left_pad
from dflash_hf.proposer_dflash import DFlashProposer

DYNAMO_ONLY = {"backend": "eager"}


def compiled_graphs() -> int:
    """Graphs dynamo has compiled since the counters were last cleared (a recompilation adds one)."""
    return counters["stats"]["unique_graphs"]


class GuidedDFlashProposer(DFlashProposer):
    """Runs the draft at every step (its context cache follows the loop) and records what it drafted, but proposes
    the target's own continuation, wrong from a random offset: accepted lengths vary as a trained draft's do."""

    def __init__(self, draft, target, reference: torch.Tensor, seed: int, compile: dict | None = None,
                 context_columns: int | None = None) -> None:
        super().__init__(draft, target, draft.mask_token_id, compile=compile, context_columns=context_columns)
        self.reference = ReferenceProposer(reference, corrupt_seed=seed)
        self.drafted: list[list[list[int]]] = []

    def propose(self, step):
        self.drafted.append(super().propose(step).tolist())
        return self.reference.propose(step)


def guided_decode(target, draft, prompt: torch.Tensor, max_new_tokens: int, seed: int, compile: bool):
    """`speculative_decode` with a GuidedDFlashProposer, eager or compiled (target and draft): (result, proposer)."""
    reference = plain_greedy(target, prompt, max_new_tokens)
    options = DYNAMO_ONLY if compile else None
    proposer = GuidedDFlashProposer(draft, target, reference, seed, compile=options,
                                    context_columns=prompt.shape[1] + max_new_tokens + draft.block_size)
    result = speculative_decode(target, proposer, prompt, max_new_tokens=max_new_tokens, block_size=draft.block_size,
                                compile=options or False)
    assert result.output_ids.tolist() == reference.tolist()
    return result, proposer


@pytest.mark.parametrize("seed, block_size, prompt_length, max_new_tokens", [
    (0, 4, 5, 24), (1, 8, 11, 40), (2, 16, 3, 33)])
def test_compiled_greedy_equals_generate_while_acceptance_varies(seed, block_size, prompt_length, max_new_tokens):
    """The target's own greedy tokens, with features equal to its hidden states at every kept position
    (ReferenceProposer checks them), while each step accepts a different number of proposals."""
    target = make_target(seed=seed)
    prompt = random_prompt(seed, prompt_length)
    expected = plain_greedy(target, prompt, max_new_tokens)
    proposer = ReferenceProposer(expected, target, corrupt_seed=seed)
    result = speculative_decode(target, proposer, prompt, max_new_tokens=max_new_tokens, block_size=block_size,
                                compile=DYNAMO_ONLY)
    assert result.output_ids.tolist() == expected.tolist()
    assert len(set(result.acceptance_lengths[0])) > 2


def test_a_compiled_batch_keeps_rows_that_stopped_and_commits_nothing_for_them():
    """A left-padded batch whose rows stop (stop token, max_new_tokens) at different steps: each row equals its own
    greedy decode, though finished rows stay in the compiled batch."""
    target = make_target(seed=3)
    prompts = [random_prompt(seed, length)[0].tolist() for seed, length in ((4, 7), (5, 3), (6, 12))]
    references = [plain_greedy(target, torch.tensor([prompt]), 30) for prompt in prompts]
    stop = references[1][0, len(prompts[1]) + 6].item()  # row 1 stops at its 7th token (others may too)
    expected = [plain_greedy(target, torch.tensor([prompt]), 30, stop_token_ids=[stop]) for prompt in prompts]
    input_ids, attention_mask = left_pad(prompts, pad_token_id=0)
    proposer = ReferenceProposer(references, target, corrupt_seed=1)
    result = speculative_decode(target, proposer, input_ids, attention_mask=attention_mask, max_new_tokens=30,
                                block_size=6, stop_token_ids=[stop], compile=DYNAMO_ONLY)
    for row, reference in enumerate(expected):
        assert result.new_tokens(row) == reference[0, len(prompts[row]):].tolist()
    assert min(result.num_new_tokens) < max(result.num_new_tokens)


@pytest.mark.parametrize("acceptance", ["rejection", "equality"])
def test_compiled_sampling_draws_the_tokens_the_eager_loop_draws(acceptance):
    """Same seed, same tokens: the compiled verify changes no draw, so the target's distribution (tested for the
    eager loop by chi-square, test_sampling) is kept. Compared up to the last block: there the eager loop verifies
    fewer tokens per step, so it draws fewer uniforms. Power: other seeds draw other tokens."""
    target, draft = make_target(seed=4), make_draft(4)
    prompt = random_prompt(7, 6)
    new_tokens, compared = 40, 40 - draft.block_size
    arguments = dict(target=target, input_ids=prompt, max_new_tokens=new_tokens, temperature=1.0,
                     acceptance=acceptance)
    outputs = {}
    for seed in (0, 1, 2):
        eager = draft.spec_generate(**arguments, seed=seed)[0, prompt.shape[1]:][:compared]
        compiled = draft.spec_generate(**arguments, seed=seed, compile=DYNAMO_ONLY)[0, prompt.shape[1]:][:compared]
        assert compiled.tolist() == eager.tolist(), seed
        outputs[seed] = tuple(eager.tolist())
    assert len(set(outputs.values())) == 3


@pytest.mark.parametrize("variant", ["dflash", "sliding_mixed", "dflash2"])
def test_the_compiled_draft_drafts_what_the_eager_draft_drafts(variant):
    """Step by step the same proposals from the static context cache (block-wide contexts, masked padding) as from
    the eager one, while the kept context grows by 1 to B columns a step (compared until the eager loop shortens
    its last blocks)."""
    target = make_target(seed=7)
    draft = make_draft(7) if variant == "dflash" else make_variant_draft(variant, seed=7)
    prompt = random_prompt(9, 10)
    eager, eager_proposer = guided_decode(target, draft, prompt, 40, seed=3, compile=False)
    compiled, compiled_proposer = guided_decode(target, draft, prompt, 40, seed=3, compile=True)
    full_width = [len(tokens[0]) == draft.block_size - 1 for tokens in eager_proposer.drafted]
    steps = full_width.index(False) if False in full_width else len(full_width)  # the eager loop's last blocks shrink
    assert steps > 5
    assert compiled_proposer.drafted[:steps] == eager_proposer.drafted[:steps]
    assert len(set(compiled.acceptance_lengths[0][:steps])) > 2


def test_no_recompilation_after_the_first_step():
    """Two graphs (the target's verify, the draft's forward) for the whole call while accepted lengths vary, and none
    for a second call of another prompt length and length budget (the caches' capacities are rounded up, so they are
    the same). Power: another batch size compiles a new verify graph, and the counter sees it."""
    target, draft = make_target(seed=5), make_draft(5)
    torch._dynamo.reset()
    counters.clear()
    for seed, prompt_length, max_new_tokens in ((0, 9, 40), (1, 14, 31)):
        result, _ = guided_decode(target, draft, random_prompt(seed, prompt_length), max_new_tokens, seed,
                                  compile=True)
        assert len(set(result.acceptance_lengths[0])) > 2
        assert compiled_graphs() == 2, counters["stats"]
    prompts = [random_prompt(seed, 9)[0].tolist() for seed in (2, 3)]
    input_ids, attention_mask = left_pad(prompts, pad_token_id=0)
    references = [plain_greedy(target, torch.tensor([prompt]), 12) for prompt in prompts]
    speculative_decode(target, ReferenceProposer(references, target), input_ids, attention_mask=attention_mask,
                       max_new_tokens=12, block_size=8, compile=DYNAMO_ONLY)
    assert compiled_graphs() == 3


def test_the_default_compiled_path_equals_generate():
    """`compile=True`: inductor on a CPU, exact on a tiny target with a DFlash draft."""
    target, draft = make_target(seed=6), make_draft(6)
    prompt = random_prompt(8, 7)
    expected = plain_greedy(target, prompt, 20)
    assert draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=20, compile=True).tolist() == \
        expected.tolist()


@pytest.mark.parametrize("arguments, message", [
    (dict(tree_size=4), "fixed-width chain"),
    (dict(cpu_kernels=True), "cpu_kernels=False"),
])
def test_compile_is_refused_with_what_it_cannot_run(arguments, message):
    target, draft = make_target(seed=0), make_draft(0)
    with pytest.raises(ValueError, match=message):
        draft.spec_generate(target=target, input_ids=random_prompt(0, 5), max_new_tokens=4, compile=True,
                            **arguments)


def test_compile_is_refused_for_a_target_with_recurrent_layers():
    target, draft = make_hybrid_target("qwen3_next"), make_draft(0)
    with pytest.raises(ValueError, match="recurrent layers"):
        draft.spec_generate(target=target, input_ids=random_prompt(0, 5), max_new_tokens=4, compile=True)


def test_a_compiled_call_keeps_neither_model_alive():
    """The verifier and the compiled draft forward are kept for later calls, but hold the models weakly: once the
    caller drops them, they are freed."""
    import gc
    import weakref

    target, draft = make_target(seed=8), make_draft(8)
    draft.spec_generate(target=target, input_ids=random_prompt(10, 6), max_new_tokens=10, compile=DYNAMO_ONLY)
    references = weakref.ref(target), weakref.ref(draft)
    del target, draft
    gc.collect()
    assert [reference() for reference in references] == [None, None]
