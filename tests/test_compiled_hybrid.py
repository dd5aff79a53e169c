"""compile=True on hybrid Gated DeltaNet targets (Qwen3.5, Qwen3-Next, OLMo-Hybrid): the compiled backend rolls
each row's convolution and recurrent states back at fixed shapes (static_recurrent_dflash), chains and trees, and
decodes what the target's own greedy decode and the eager loop's sampling give, with no recompilation
after the first call.

Most tests compile with dynamo's `eager` backend (the same capture, guards and recompilations as inductor); one runs
the default (inductor) end to end, checking every state after every step.
"""

from __future__ import annotations

import pytest
import torch
from helpers import (
    ReferenceProposer,
    TreeReferenceProposer,
    make_draft,
    make_hybrid_target,
    plain_greedy,
    random_prompt,
)
from test_compiled import DYNAMO_ONLY, compiled_graphs
from test_hybrid_targets import (
    decode_checking_states,
    hybrid,
    needs_hybrid,
    verify_and_discard,
)
from torch._dynamo.utils import counters

from dflash_hf import speculative_decode
from dflash_hf.cache_dflash import left_pad


@pytest.fixture(scope="module")
def targets() -> dict[str, torch.nn.Module]:
    """One tiny target per hybrid family, seed 0 (built on first use by test_hybrid_targets.hybrid)."""
    return {}

def decode_batch(target: torch.nn.Module, tree_size: int | None, seed: int, block_size: int,
                 lengths: tuple[int, ...], max_new_tokens: int, stop_after: int | None = None):
    """A left-padded batch decoded compiled by a proposer of the target's own continuation that goes wrong at random
    (a chain's, or a tree's candidates with the truth at a random rank); `stop_after`: row 1 stops at that token (a
    stop token), the others run on. Asserts every row equals its own greedy decode; the result."""
    prompts = [random_prompt(seed * 10 + row, length)[0].tolist() for row, length in enumerate(lengths)]
    references = [plain_greedy(target, torch.tensor([prompt]), max_new_tokens) for prompt in prompts]
    stops = [] if stop_after is None else [references[1][0, len(prompts[1]) + stop_after - 1].item()]
    expected = [plain_greedy(target, torch.tensor([prompt]), max_new_tokens, stop_token_ids=stops)
                for prompt in prompts]
    input_ids, attention_mask = left_pad(prompts, pad_token_id=0)
    proposer = (ReferenceProposer(references, corrupt_seed=seed) if tree_size is None
                else TreeReferenceProposer(references, 3, seed))
    result = speculative_decode(target, proposer, input_ids, attention_mask=attention_mask,
                                max_new_tokens=max_new_tokens, block_size=block_size, tree_size=tree_size,
                                stop_token_ids=stops, compile=DYNAMO_ONLY)
    for row, reference in enumerate(expected):
        assert result.new_tokens(row) == reference[0, len(prompts[row]):].tolist(), row
    return result


@needs_hybrid
@pytest.mark.parametrize("family, tree_size, block_size", [
    ("qwen3_5", None, 5), ("qwen3_next", None, 8), ("qwen3_5", 6, 5), ("qwen3_next", 4, 4),
    ("olmo_hybrid", 6, 6)])  # OLMo-Hybrid: Gated DeltaNet with a convolution per query, key and value
def test_compiled_hybrid_decoding_equals_generate_and_compiles_once(targets, family, tree_size, block_size):
    """Greedy, a left-padded batch whose rows accept different counts and stop at different steps (one at a stop
    token): each row is its own greedy decode. Two graphs (the verify and the rollback; these proposers run no draft),
    and none more for a second call of other seeds, prompt lengths and length budget."""
    target = hybrid(targets, family)
    torch._dynamo.reset()
    counters.clear()
    result = decode_batch(target, tree_size, seed=1, block_size=block_size, lengths=(11, 4), max_new_tokens=20,
                          stop_after=6)
    assert len({length for row in result.acceptance_lengths for length in row}) > 2
    assert min(result.num_new_tokens) < max(result.num_new_tokens)
    assert compiled_graphs() == 2, counters["stats"]
    decode_batch(target, tree_size, seed=2, block_size=block_size, lengths=(3, 9), max_new_tokens=17)
    assert compiled_graphs() == 2, counters["stats"]


@needs_hybrid
def test_after_every_compiled_tree_step_each_state_equals_a_plain_forwards(targets):
    """The fixed-shape rollback of a tree's accepted paths leaves every tensor of every recurrent layer (states and
    token counts) as a plain forward over the committed tokens does, row by row."""
    assert decode_checking_states(hybrid(targets, "qwen3_5"), True, 9, DYNAMO_ONLY) >= 3


@needs_hybrid
def test_the_default_compiled_path_keeps_every_state_exact_on_a_hybrid_target():
    """compile=True (inductor on a CPU), a chain: every state checked after every step of a batch (under inductor, a
    copy of the cache's state into a buffer in the verify that writes the state once read the written one, off by
    about the states' size, 1e-2). Inductor's fused kernels round differently from the plain forward: 1.2e-5 apart on
    an AVX2 machine, so 1e-4 here."""
    assert decode_checking_states(make_hybrid_target("qwen3_5", seed=0), True, None, True, atol=1e-4) >= 3


@needs_hybrid
@pytest.mark.parametrize("family, tree_size", [("qwen3_5", None), ("qwen3_next", 6)])
def test_compiled_hybrid_sampling_draws_what_the_eager_loop_draws(targets, family, tree_size):
    """Sampling with a DFlash draft, chain and tree: the compiled backend draws the eager one's tokens (same seed), up
    to the eager loop's last, narrower block; other seeds draw other tokens."""
    target, draft = hybrid(targets, family), make_draft(18)
    prompt = random_prompt(19, 9)
    arguments = dict(target=target, input_ids=prompt, max_new_tokens=24, temperature=1.0, tree_size=tree_size)
    outputs = set()
    for seed in (0, 1):
        eager = draft.spec_generate(**arguments, seed=seed)[0, prompt.shape[1]:][:24 - draft.block_size]
        compiled = draft.spec_generate(**arguments, seed=seed, compile=DYNAMO_ONLY)[0, prompt.shape[1]:]
        assert compiled[:24 - draft.block_size].tolist() == eager.tolist(), seed
        outputs.add(tuple(eager.tolist()))
    assert len(outputs) == 2


@needs_hybrid
def test_a_discarded_compiled_verify_leaves_every_state_as_it_was(targets):
    """A compiled verify, then `discard_verify`: every tensor of every recurrent layer as before it. A keep replaces
    the states in place, so discarding after it is refused by name."""
    session = verify_and_discard(hybrid(targets, "qwen3_5"), compile=DYNAMO_ONLY)
    with session.running():
        step = session.plan()
        session.verify(step, session.propose(step))
        session.state.backend.keep([[0, 1]], torch.ones(1, 2, dtype=torch.bool))
        with pytest.raises(RuntimeError, match="a keep cannot be discarded"):
            session.discard_verify()


@needs_hybrid
@pytest.mark.parametrize("family", ["lfm2", "nemotron_h"])
def test_compile_is_refused_for_recurrent_layers_that_are_not_gated_deltanet(family):
    """Other recurrent families run eagerly (test_hybrid_targets); compile=True names why not, and the alternative,
    before any forward."""
    target = make_hybrid_target(family)
    with pytest.raises(ValueError, match=r"rolls back Gated DeltaNet layers .* pass compile=False"):
        make_draft(0).spec_generate(target=target, input_ids=random_prompt(0, 5), max_new_tokens=4, compile=True)


@needs_hybrid
def test_compile_gives_a_refused_recurrent_family_the_eager_loops_reason():
    target = make_hybrid_target("jamba")
    with pytest.raises(ValueError, match=r"JambaForCausalLM \(jamba\) is not supported"):
        make_draft(0).spec_generate(target=target, input_ids=random_prompt(0, 5), max_new_tokens=4, compile=True)


@needs_hybrid
def test_a_compiled_verify_of_one_column_is_refused_on_a_hybrid_target(targets):
    """A one-column verify runs the token-by-token rule, which the rollback does not record: refused before any
    forward, naming the fix."""
    target = hybrid(targets, "qwen3_5")
    prompt = random_prompt(0, 5)
    with pytest.raises(ValueError, match=r"at least 2 columns.*block_size >= 2"):
        speculative_decode(target, ReferenceProposer(plain_greedy(target, prompt, 4)), prompt, max_new_tokens=4,
                           block_size=1, compile=DYNAMO_ONLY)
