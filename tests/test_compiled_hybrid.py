"""compile=True on hybrid Gated DeltaNet targets (Qwen3.5, Qwen3-Next, OLMo-Hybrid): the compiled backend rolls
each row's convolution and recurrent states back at fixed shapes (recurrent_dflash.StaticRecurrentStates), chains and
trees, and decodes what the target's own greedy decode and the eager loop's sampling give, with no recompilation
after the first call.

Most tests compile with dynamo's `eager` backend (the same capture, guards and recompilations as inductor); one runs
the default (inductor) end to end, checking every state after every step.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import (
    ReferenceProposer,
    TreeReferenceProposer,
    make_draft,
    make_hybrid_target,
    plain_greedy,
    random_prompt,
)
from test_hybrid_targets import assert_states_equal_plain_forwards, layer_tensors
from torch._dynamo.utils import counters

from dflash_hf import speculative_decode
from dflash_hf.cache_dflash import left_pad, recurrent_cache_layers
from dflash_hf.generation_dflash import DecodeSession
from dflash_hf.settings_dflash import resolve_settings

DYNAMO_ONLY = {"backend": "eager"}
HAS_HYBRID_CACHE = hasattr(transformers, "Qwen3_5ForCausalLM")  # Transformers 5.x
needs_hybrid = pytest.mark.skipif(not HAS_HYBRID_CACHE, reason="Qwen3.5 and the linear-attention cache: 5.x only")


@pytest.fixture(scope="module")
def targets() -> dict[str, torch.nn.Module]:
    """One tiny target per hybrid family, seed 0 (built on first use)."""
    return {}


def target_of(targets: dict[str, torch.nn.Module], family: str) -> torch.nn.Module:
    if family not in targets:
        targets[family] = make_hybrid_target(family, seed=0)
    return targets[family]


def compiled_graphs() -> int:
    """Graphs dynamo has compiled since the counters were last cleared (a recompilation adds one)."""
    return counters["stats"]["unique_graphs"]


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
    target = target_of(targets, family)
    torch._dynamo.reset()
    counters.clear()
    result = decode_batch(target, tree_size, seed=1, block_size=block_size, lengths=(11, 4), max_new_tokens=20,
                          stop_after=6)
    assert len({length for row in result.acceptance_lengths for length in row}) > 2
    assert min(result.num_new_tokens) < max(result.num_new_tokens)
    assert compiled_graphs() == 2, counters["stats"]
    decode_batch(target, tree_size, seed=2, block_size=block_size, lengths=(3, 9), max_new_tokens=17)
    assert compiled_graphs() == 2, counters["stats"]


def decode_checking_states(target: torch.nn.Module, tree_size: int | None, compile: dict | bool) -> int:
    """A compiled batch (a chain's rows keep different prefixes, a tree's rows different root-to-leaf paths); after the
    prefill and every step each recurrent cache layer's tensors equal a plain forward's over the row's committed
    tokens. The number of steps."""
    prompts = [random_prompt(7, 9)[0].tolist(), random_prompt(8, 3)[0].tolist()]
    references = [plain_greedy(target, torch.tensor([prompt]), 24) for prompt in prompts]
    input_ids, attention_mask = left_pad(prompts, 0)
    settings = resolve_settings(target, input_ids, None, attention_mask=attention_mask, max_new_tokens=24,
                                block_size=7, tree_size=tree_size, compile=compile)
    proposer = (ReferenceProposer(references, corrupt_seed=7) if tree_size is None
                else TreeReferenceProposer(references, 3, 7))
    session = DecodeSession(target, proposer, settings)
    steps = 0
    with session.running():
        session.prefill(input_ids, attention_mask)
        assert_states_equal_plain_forwards(target, session)
        while session.step():
            steps += 1
            assert_states_equal_plain_forwards(target, session)
    return steps


@needs_hybrid
def test_after_every_compiled_tree_step_each_state_equals_a_plain_forwards(targets):
    """The fixed-shape rollback of a tree's accepted paths leaves every tensor of every recurrent layer (states and
    token counts) as a plain forward over the committed tokens does, row by row."""
    assert decode_checking_states(target_of(targets, "qwen3_5"), 9, DYNAMO_ONLY) >= 3


@needs_hybrid
def test_the_default_compiled_path_keeps_every_state_exact_on_a_hybrid_target():
    """compile=True (inductor on a CPU), a chain: every state checked after every step of a batch (under inductor, a
    copy of the cache's state into a buffer in the verify that writes the state once read the written one)."""
    assert decode_checking_states(make_hybrid_target("qwen3_5", seed=0), None, True) >= 3


@needs_hybrid
@pytest.mark.parametrize("family, tree_size", [("qwen3_5", None), ("qwen3_next", 6)])
def test_compiled_hybrid_sampling_draws_what_the_eager_loop_draws(targets, family, tree_size):
    """Sampling with a DFlash draft, chain and tree: the compiled backend draws the eager one's tokens (same seed), up
    to the eager loop's last, narrower block; other seeds draw other tokens."""
    target, draft = target_of(targets, family), make_draft(18)
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
    target = target_of(targets, "qwen3_5")
    prompt = random_prompt(9, 6)
    settings = resolve_settings(target, prompt, None, max_new_tokens=8, block_size=4, compile=DYNAMO_ONLY)
    session = DecodeSession(target, ReferenceProposer(plain_greedy(target, prompt, 12)), settings)
    with session.running():
        session.prefill(prompt)
        cache = session.state.backend.cache
        layers = recurrent_cache_layers(cache)
        before = {layer: {name: tensor.clone() for name, tensor in layer_tensors(cache.layers[layer]).items()}
                  for layer in layers}
        step = session.plan()
        session.verify(step, session.propose(step))
        assert not torch.equal(cache.get_recurrent_state(layers[0]), before[layers[0]]["recurrent_states.0"])
        session.discard_verify()
        for layer in layers:
            for name, tensor in layer_tensors(cache.layers[layer]).items():
                assert torch.equal(tensor, before[layer][name]), (layer, name)
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


@pytest.mark.skipif(HAS_HYBRID_CACHE, reason="Transformers 4.x only: its Qwen3-Next cache")
def test_compiled_qwen3_next_on_transformers_4_is_refused_with_the_version_to_install():
    """4.57 keeps Qwen3-Next's states in a model-specific cache (no static layout to roll back): refused by name,
    before any forward, as the eager loop refuses it."""
    torch.manual_seed(0)
    config = transformers.Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32)
    target = transformers.Qwen3NextForCausalLM(config).eval()
    with pytest.raises(ValueError, match=r"Qwen3NextForCausalLM \(qwen3_next\) is not supported: "
                                         r".*model-specific cache.*install transformers 5\.25"):
        make_draft(0).spec_generate(target=target, input_ids=random_prompt(0, 5), max_new_tokens=4, compile=True)


@needs_hybrid
def test_a_compiled_verify_of_one_column_is_refused_on_a_hybrid_target(targets):
    """A one-column verify runs the token-by-token rule, which the rollback does not record: refused before any
    forward, naming the fix."""
    target = target_of(targets, "qwen3_5")
    prompt = random_prompt(0, 5)
    with pytest.raises(ValueError, match=r"at least 2 columns.*block_size >= 2"):
        speculative_decode(target, ReferenceProposer(plain_greedy(target, prompt, 4)), prompt, max_new_tokens=4,
                           block_size=1, compile=DYNAMO_ONLY)
