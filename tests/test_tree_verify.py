"""Tree verification (`spec_generate(tree_size=N)`): N drafted tokens as a tree in one target pass, exactly the
target's output (greedy) or distribution (sampling)."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    TreeReferenceProposer,
    make_draft,
    make_hybrid_target,
    make_target,
    make_variant_draft,
    plain_greedy,
    random_prompt,
)
from sampling_checks import NUM_NEW, NUM_SAMPLES, assert_follows, chi_square_p_value, exact_joint, sampled_counts
from sampling_checks import SAMPLING_VOCAB as VOCAB

from dflash_hf import speculative_decode
from dflash_hf.cache_dflash import CacheColumns, left_pad
from dflash_hf.masks_dflash import verify_attention_mask
from dflash_hf.proposer_dflash import DFlashProposer, SampledProposal
from dflash_hf.sampling_dflash import sample_from
from dflash_hf.settings_dflash import StepCosts
from dflash_hf.tree_dflash import build_trees, choose_child, tree_sees, walk_greedy, walk_sampled

# --- The tree itself -------------------------------------------------------------------------------------------------


def test_trees_are_the_nodes_of_highest_path_probability_best_first():
    tokens = [[[10, 11, 12], [20, 21, 22], [30, 31, 32]]]  # one row, three positions, three candidates each
    probabilities = [[[0.6, 0.3, 0.1], [0.9, 0.05, 0.05], [0.5, 0.4, 0.1]]]
    trees = build_trees(tokens, probabilities, 5, [3], [99])
    # path probabilities: 10: .6, 10-20: .54, 11: .3, 10-20-30: .27, 11-20: .27 (the earlier-pushed one first), ...
    assert trees.tokens[0] == [10, 20, 11, 30, 20]
    assert trees.parents[0] == [0, 1, 0, 2, 3]
    assert trees.depths[0] == [1, 2, 1, 3, 2]
    assert trees.real[0] == [True] * 5
    assert trees.children(0) == [[1, 3], [2], [4], [5], [], []]


def test_trees_stop_at_the_rows_depth_and_fill_up_with_nodes_never_accepted():
    tokens = [[[10, 11], [20, 21]]] * 2
    probabilities = [[[0.6, 0.4], [0.7, 0.3]]] * 2
    trees = build_trees(tokens, probabilities, 4, [2, 1], [7, 8])
    assert trees.depths[0] == [1, 2, 1, 2] and trees.real[0] == [True] * 4
    assert trees.tokens[1] == [10, 11, 8, 8] and trees.real[1] == [True, True, False, False]
    assert walk_greedy(trees, 1, [8, 0, 0, 0, 0]) == []  # a filler node is never accepted


def test_a_trees_paths_run_from_the_root_to_each_leaf_over_real_nodes_only():
    trees = build_trees([[[10, 11], [20, 21]]] * 2, [[[0.6, 0.4], [0.7, 0.3]]] * 2, 4, [2, 1], [7, 8])
    assert trees.parents[0] == [0, 1, 0, 3]  # 10, 10-20, 11, 11-20
    assert trees.paths(0) == [[0, 1, 2], [0, 3, 4]]
    assert trees.paths(1) == [[0, 1], [0, 2]]  # its filler nodes (columns 3 and 4) are on no path


def test_each_column_sees_its_context_its_ancestors_and_itself():
    trees = build_trees([[[10, 11], [20, 21]]], [[[0.6, 0.4], [0.7, 0.3]]], 4, [2], [0])  # 10, 10-20, 11, 11-20
    columns = CacheColumns(torch.tensor([[True, False, True]]), [2])
    positions = torch.tensor([[2, 3, 4, 3, 4]])  # the root at position 2, then each node at its depth
    mask = verify_attention_mask(columns, tree_sees(trees, torch.device("cpu")), positions, torch.float32)
    sees = (mask[0, 0] == 0).int().tolist()
    assert sees == [[1, 0, 1, 1, 0, 0, 0, 0],
                    [1, 0, 1, 1, 1, 0, 0, 0],
                    [1, 0, 1, 1, 1, 1, 0, 0],
                    [1, 0, 1, 1, 0, 0, 1, 0],
                    [1, 0, 1, 1, 0, 0, 1, 1]]
    assert mask.min() == torch.finfo(torch.float32).min
    # a window of 2 positions, counted in positions (the hole at column 1 is none): each column sees keys 0 or 1
    # positions back, along its own branch only
    windowed = verify_attention_mask(columns, tree_sees(trees, torch.device("cpu")), positions, torch.float32,
                                     window=2, width=10)
    sees = (windowed[0, 0] == 0).int().tolist()
    assert sees == [[0, 0, 1, 1, 0, 0, 0, 0, 0, 0],
                    [0, 0, 0, 1, 1, 0, 0, 0, 0, 0],
                    [0, 0, 0, 0, 1, 1, 0, 0, 0, 0],
                    [0, 0, 0, 1, 0, 0, 1, 0, 0, 0],
                    [0, 0, 0, 0, 0, 0, 1, 1, 0, 0]]


def test_the_sampled_walk_tries_children_against_the_residual():
    trees = build_trees([[[1, 2], [3, 0]]], [[[0.6, 0.4], [0.7, 0.3]]], 2, [1], [0])  # 1, 2 under the root
    p = torch.tensor([[0.25, 0.5, 0.25, 0.0]] * 3)  # [1 + size, V]
    # deterministic candidates: p(1) = 0.5, so 1 is refused at u 0.6; 2 is kept if u < 0.25 / (1 - 0.5) = 0.5
    assert walk_sampled(trees, 0, p, None, [0.6, 0.49], [0.0] * 3)[0] == [2]
    assert walk_sampled(trees, 0, p, None, [0.4, 0.0], [0.0] * 3)[0] == [1]
    path, final = walk_sampled(trees, 0, p, None, [0.6, 0.51], [0.99] * 3)  # both refused: p without 1 and 2
    assert path == [] and final == 0
    # drawn from q = (0, 0.8, 0.2, 0): 1 is kept if u < p(1) / q(1) = 0.625; after its refusal
    # r = norm(max(p - q, 0)) = (5/6, 0, 1/6, 0) and q_2 = (0, 0, 1, 0): 2 is kept if u < 1/6
    q = torch.tensor([[0.0, 0.8, 0.2, 0.0]])
    assert walk_sampled(trees, 0, p, q, [0.62, 0.0], [0.0] * 3)[0] == [1]
    assert walk_sampled(trees, 0, p, q, [0.63, 0.16], [0.0] * 3)[0] == [2]
    assert walk_sampled(trees, 0, p, q, [0.63, 0.17], [0.5] * 3) == ([], 0)


@pytest.mark.parametrize("num_children", [1, 2, 4])
def test_recursive_rejection_at_a_node_keeps_the_target_distribution(num_children):
    """Children drawn from q without replacement, tried by `choose_child`, then the residual: the token that follows
    a node is distributed as p, with q or with one-hot q (a candidate taken as chosen); a refusal that samples p
    itself, not the residual, is not."""
    generator = torch.Generator().manual_seed(7)
    p = torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15])
    q = torch.tensor([0.3, 0.1, 0.35, 0.05, 0.2])
    counts, one_hot, biased = torch.zeros(5), torch.zeros(5), torch.zeros(5)
    num_samples = 6000
    for _ in range(num_samples):
        uniforms = torch.rand(2 * num_children + 1, generator=generator, dtype=torch.float64).tolist()
        remaining, children = q.clone(), []
        for rank in range(num_children):
            token = int(sample_from(remaining, torch.tensor(uniforms[rank], dtype=torch.float64)))
            remaining[token] = 0.0
            children.append(token)
        final = torch.tensor(uniforms[-1], dtype=torch.float64)
        for q_of_children, tally in ((q, counts), (None, one_hot)):
            kept, residual = choose_child(p, children, q_of_children, uniforms[num_children:-1])
            tally[children[kept] if kept is not None else int(sample_from(residual, final))] += 1
        kept, _ = choose_child(p, children, q, uniforms[num_children:-1])
        biased[children[kept] if kept is not None else int(sample_from(p, final))] += 1
    expected = {(token,): float(p[token]) for token in range(5)}
    for tally in (counts, one_hot):
        assert chi_square_p_value({(t,): int(tally[t]) for t in range(5)}, expected, num_samples) > 1e-3
    assert chi_square_p_value({(t,): int(biased[t]) for t in range(5)}, expected, num_samples) < 1e-3


# --- Greedy: the target's own output ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed,length,block_size,tree_size", [
    (0, 1, 4, 3), (1, 9, 8, 8), (2, 30, 16, 16), (3, 5, 8, 24), (4, 40, 2, 2)])
def test_greedy_tree_equals_generate_and_accepts_more_than_the_chain(target, seed, length, block_size, tree_size):
    prompt = random_prompt(seed, length)
    expected = plain_greedy(target, prompt, 40)
    tree = speculative_decode(target, TreeReferenceProposer(expected, 4, seed), prompt, max_new_tokens=40,
                              block_size=block_size,
                              tree_size=tree_size)
    assert torch.equal(tree.output_ids, expected)
    assert set(tree.verified_lengths[0][:-1]) <= {tree_size + 1}
    chain = speculative_decode(target, TreeReferenceProposer(expected, 4, seed), prompt, max_new_tokens=40,
                               block_size=block_size)
    assert torch.equal(chain.output_ids, expected)
    if block_size > 2:
        assert tree.tau > chain.tau, (tree.tau, chain.tau)  # the tree accepted tokens the argmax chain missed


@pytest.mark.parametrize("hybrid_family", [None, "qwen3_5", "qwen3_next"])
def test_a_left_padded_batch_of_trees(target, hybrid_family):
    """Also on hybrid targets, whose recurrent mixers run along each row's paths (tests/test_hybrid_targets.py)."""
    if hybrid_family is not None:
        if not hasattr(__import__("transformers"), "Qwen3_5ForCausalLM"):
            pytest.skip("hybrid targets run on Transformers 5.x only")
        target = make_hybrid_target(hybrid_family, seed=0)
    prompts = [random_prompt(seed, length)[0].tolist() for seed, length in ((1, 5), (2, 17), (3, 11))]
    references = [plain_greedy(target, torch.tensor([prompt]), 30) for prompt in prompts]
    input_ids, attention_mask = left_pad(prompts, 0)
    result = speculative_decode(target, TreeReferenceProposer(references, 3, 4), input_ids, max_new_tokens=30,
                                block_size=6,
                                attention_mask=attention_mask, tree_size=10)
    for row, (prompt, reference) in enumerate(zip(prompts, references)):
        assert result.new_tokens(row) == reference[0, len(prompt):].tolist(), row
    assert len({tuple(lengths[:4]) for lengths in result.acceptance_lengths}) > 1  # rows kept different paths


def test_a_stop_token_inside_the_tree_and_max_new_tokens_mid_tree(target):
    prompt = random_prompt(6, 8)
    free = plain_greedy(target, prompt, 30)[0, 8:].tolist()
    stop = next(token for index, token in enumerate(free) if index >= 5 and token not in free[:index])
    expected = plain_greedy(target, prompt, 30, stop_token_ids=[stop])
    result = speculative_decode(target, TreeReferenceProposer(plain_greedy(target, prompt, 40), 2, 1), prompt,
                                max_new_tokens=30,
                                block_size=8, stop_token_ids=[stop], tree_size=6)
    assert torch.equal(result.output_ids, expected)
    result = speculative_decode(target, TreeReferenceProposer(plain_greedy(target, prompt, 40), 2, 1), prompt,
                                max_new_tokens=13,
                                block_size=8, tree_size=6)
    assert torch.equal(result.output_ids, plain_greedy(target, prompt, 13))


@pytest.mark.parametrize("tree_size", [1, 5, 20])
def test_spec_generate_with_a_tree_equals_generate(target, draft, tree_size):
    for seed, length in ((0, 6), (1, 23)):
        prompt = random_prompt(seed, length)
        output = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=24, tree_size=tree_size)
        assert torch.equal(output, plain_greedy(target, prompt, 24))


def test_custom_generate_passes_tree_size_through(target, draft, tmp_path):
    draft.save_pretrained(tmp_path / "draft")
    prompt = random_prompt(2, 7)
    output = target.generate(prompt, custom_generate=str(tmp_path / "draft"), trust_remote_code=True,
                             max_new_tokens=16, do_sample=False, tree_size=6)
    assert torch.equal(output, plain_greedy(target, prompt, 16))


# --- Sampling: the target's distribution -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def small_vocabulary(sampling_setup):
    target, input_ids = sampling_setup
    return target, make_draft(12, block_size=4, vocab_size=VOCAB, mask_token_id=VOCAB - 1), input_ids


@pytest.mark.parametrize("tree_size,temperature,top_k,sampled_candidates", [(3, 1.0, None, True), (10, 0.8, 3, True),
                                                                          (5, 1.0, None, False)])
def test_sampled_trees_keep_the_target_distribution(small_vocabulary, tree_size, temperature, top_k,
                                                    sampled_candidates):
    """Candidates drawn from q (rejection) or the draft's most probable ones (equality: sample_proposals False)."""
    target, draft, input_ids = small_vocabulary
    counts, accepted = sampled_counts(
        target, DFlashProposer(draft, target, VOCAB - 1, sample_proposals=sampled_candidates), input_ids,
        torch.Generator().manual_seed(4321), max_new_tokens=NUM_NEW, block_size=4, temperature=temperature,
        top_k=top_k, tree_size=tree_size, cpu_kernels=False)
    assert accepted > NUM_SAMPLES // 5  # drafted tokens were accepted, and some refused: both paths ran
    # power: the same counts reject a nearby wrong distribution
    assert_follows(counts, exact_joint(target, input_ids, temperature, top_k, None),
                   exact_joint(target, input_ids, temperature * 1.5, top_k, None))


# --- DFlash2: the candidate selector ranks each node's children after the node's own token ---------------------------


def test_dflash2_trees_rank_a_nodes_children_by_the_selectors_transitions():
    tokens, probabilities = [[[10, 11], [20, 21]]], [[[0.6, 0.4], [0.9, 0.1]]]
    transitions = [[[[0.6, 0.4], [0.6, 0.4]], [[0.9, 0.1], [0.2, 0.8]]]]  # position 1: after 10, after 11
    independent = build_trees(tokens, probabilities, 4, [2], [0])
    selected = build_trees(tokens, probabilities, 4, [2], [0], transitions)
    assert independent.tokens[0] == [10, 20, 11, 20]  # 11-20: .4 * .9
    assert selected.tokens[0] == [10, 20, 11, 21] and selected.parents[0] == [0, 1, 0, 3]  # 11-21: .4 * .8


@pytest.mark.parametrize("seed,length,tree_size", [(0, 3, 4), (1, 12, 8), (2, 25, 16)])
def test_dflash2_greedy_trees_equal_generate(target, seed, length, tree_size):
    draft = make_variant_draft("dflash2", seed=seed)
    with torch.no_grad():
        for codebook in (draft.candidate_selector.predecessor_codebook, draft.candidate_selector.successor_codebook):
            codebook.mul_(10.0)  # the selector's pair scores matter: children are ranked differently per parent
    prompt = random_prompt(seed, length)
    result = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=24, tree_size=tree_size,
                                 return_stats=True)
    assert torch.equal(result.output_ids, plain_greedy(target, prompt, 24))
    assert set(result.verified_lengths[0][:-1]) <= {tree_size + 1}


def test_dflash2_tree_candidates_are_the_selectors_transitions(target):
    from dflash_hf.proposer_dflash import DraftStep

    draft = make_variant_draft("dflash2", seed=3)
    sequence = random_prompt(3, 9)[0].tolist()
    with torch.no_grad():
        outputs = target(torch.tensor([sequence]), output_hidden_states=True)
        features = torch.cat([outputs.hidden_states[layer + 1] for layer in draft.target_layer_ids], dim=-1)
        step = DraftStep(prompts=[sequence[:8]], generated=[sequence[8:]], target_hidden=features[:, :8],
                         context_position_ids=torch.arange(8)[None], context_valid=None, block_size=5, row_ids=[0],
                         num_candidates=4)
        proposal = DFlashProposer(draft, target, draft.mask_token_id).propose(step)
    transitions = proposal.candidates.transitions[0]  # [4, K, K]
    assert transitions.shape == (4, 4, 4) and not isinstance(proposal, SampledProposal)  # chosen: one-hot q
    torch.testing.assert_close(transitions.sum(-1), torch.ones(4, 4))
    assert torch.equal(proposal.candidates.probabilities[0], transitions[:, 0])
    assert not torch.allclose(transitions[1, 0], transitions[1, 1])  # a child's rank depends on its parent


def test_the_loop_plants_dflash2_trees_by_the_selectors_transitions(target, monkeypatch):
    """A DFlash2 draft's trees in the loop rank a node's children by the selector's transitions after their parent
    (the proposal's `candidate_transitions` reach `build_trees`), and the output is still the target's own."""
    from dflash_hf import steps_dflash

    draft = make_variant_draft("dflash2", seed=3)
    given = []
    build = steps_dflash.build_trees
    monkeypatch.setattr(steps_dflash, "build_trees",
                        lambda *args: given.append(args[5]) or build(*args))  # args[5]: the transitions
    prompt = random_prompt(3, 9)
    output = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=24, tree_size=6)
    assert torch.equal(output, plain_greedy(target, prompt, 24))
    assert given and all(transitions is not None for transitions in given)


def test_dflash2_sampled_trees_keep_the_target_distribution(small_vocabulary):
    target, _, input_ids = small_vocabulary
    draft = make_variant_draft("dflash2", seed=12, block_size=4, vocab_size=VOCAB, mask_token_id=VOCAB - 1)
    counts, accepted = sampled_counts(target, DFlashProposer(draft, target, VOCAB - 1), input_ids,
                                      torch.Generator().manual_seed(77), max_new_tokens=NUM_NEW, block_size=4,
                                      temperature=1.0, tree_size=5, cpu_kernels=False)
    assert accepted > NUM_SAMPLES // 5
    assert_follows(counts, exact_joint(target, input_ids, 1.0, None, None),
                   exact_joint(target, input_ids, 1.5, None, None))


# --- Refusals --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tree_size,message", [(0, "positive int"), (2.5, "positive int"), (True, "positive int"),
                                               ("auto", "choose_tree_size")])
def test_bad_tree_sizes_are_refused(target, draft, tree_size, message):
    with pytest.raises(ValueError, match=message):
        draft.spec_generate(target=target, input_ids=random_prompt(0, 4), max_new_tokens=4, tree_size=tree_size)


def test_trees_are_refused_where_they_cannot_be_verified_exactly(target, draft):
    prompt = random_prompt(0, 4)
    with pytest.raises(ValueError, match="step_costs"):
        draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=4, tree_size=4,
                            step_costs=StepCosts(0.01, tuple([0.01] * 8)))


def flex_attention_target() -> torch.nn.Module:
    """A target whose attention does not take a 4-D additive mask as given (flex attention)."""
    target = make_target(seed=0)
    target.config._attn_implementation = "flex_attention"
    return target


def test_a_target_whose_attention_takes_no_given_mask_is_refused_with_trees():
    with pytest.raises(ValueError, match="4-D mask"):
        make_draft(0).spec_generate(target=flex_attention_target(), input_ids=random_prompt(0, 4), max_new_tokens=4,
                                    tree_size=4)


def test_tree_size_auto_gives_the_chain_where_trees_are_refused():
    from dflash_hf.cost_model import choose_tree_size

    refused = flex_attention_target()
    draft = make_draft(0)
    tree_size, rates = choose_tree_size(draft, refused, random_prompt(0, 6)[0].tolist(), 4, 8, 1, [],
                                        draft.mask_token_id)
    assert tree_size is None and list(rates) == [0] and rates[0] > 0


def test_forbidden_nodes_leave_the_tree_with_their_subtrees_and_keep_their_place_among_the_children_tried():
    """Candidates [10, 11] then [20, 21] plant 10, 20 (under 10), 11, 20 (under 11), 21 (under 10). Forbidding 10
    after the root drops it and both nodes under it; no other node takes their place (the planted shape stays), and
    a sampled walk tries 10 first at the root, refused for certain, then 11 with q without 10."""
    tokens, probabilities = [[10, 11], [20, 21]], [[0.6, 0.4], [0.7, 0.3]]
    asked = []

    def forbidden(row, paths, node_tokens):
        asked.append((row, paths, node_tokens))
        return [path == [] and token == 10 for path, token in zip(paths, node_tokens)]

    trees = build_trees([tokens], [probabilities], 5, [2], [0], forbidden=forbidden)
    assert asked == [(0, [[], [10], [], [11], [10]], [10, 20, 11, 20, 21])]  # once a row: each node's parent path
    assert (trees.tokens, trees.parents, trees.depths, trees.real) == (
        [[11, 20, 0, 0, 0]], [[0, 1, 0, 0, 0]], [[1, 2, 1, 1, 1]], [[True, True, False, False, False]])
    assert trees.refused == [[(0, 0, 10)]]
    assert trees.tried_children(0)[0] == [-10, 1]
    p = torch.zeros(1 + trees.size, 30, dtype=torch.float64)  # the target's p: 10 is forbidden at the root
    p[:, 11], p[:, 12] = 0.5, 0.5
    q = torch.zeros(2, 30, dtype=torch.float64)
    q[0, 10], q[0, 11], q[1, 20], q[1, 21] = 0.6, 0.4, 0.7, 0.3
    # refusing 10 leaves r = norm(max(p - q, 0)) = {11: 1/6, 12: 5/6}; 11's q is then 1 (q without 10), so 11 is
    # kept when its uniform is below 1/6 (were 10 skipped instead, r would stay p and 11 be kept below 1/2)
    kept = sum(walk_sampled(trees, 0, p, q, [u / 100] * trees.size, [0.5] * (1 + trees.size))[0] == [1]
               for u in range(100))
    assert kept == 17
