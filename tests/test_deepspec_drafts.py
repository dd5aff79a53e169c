"""DeepSeek DeepSpec drafts (`Qwen3DSparkModel`: DFlash with shifted labels, DSpark's Markov and confidence heads).

They load unchanged through `DFlashDraftModel.from_pretrained` as a configuration of the DFlash draft, and the
proposer's Markov stage drafts each position after the token drafted before it. Checked against DeepSpec's own
inference code (a recorded golden fixture: proposals, outputs, acceptance per step), against the target's greedy
decode on several families and batch layouts, and against the target's distribution when sampling.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from deepspec_fixture import GOLDEN, golden_prompts, golden_target, write_deepspec_folder
from helpers import (
    VOCAB_SIZE,
    RecordingProposer,
    build_target,
    draft_config,
    plain_greedy,
    prompts_of,
    random_prompt,
)
from sampling_checks import NUM_NEW, NUM_SAMPLES, assert_follows, exact_joint, sampled_counts
from sampling_checks import SAMPLING_VOCAB as VOCAB
from test_compiled import COMPILES, DYNAMO_ONLY, compiled_graphs
from torch._dynamo.utils import counters

import dflash_hf.proposer_dflash as proposer_module
from dflash_hf import DFlashConfig, DFlashDraftModel, DraftStep, left_pad, speculative_decode
from dflash_hf.loading import PUBLISHED_CONFIGS
from dflash_hf.proposer_dflash import DFlashProposer
from dflash_hf.target_dflash import select_features

GOLDEN_RECORD = json.loads(GOLDEN.read_text(encoding="utf-8"))
MARKOV = {"dflash": {}, **{kind: dict(markov_rank=8, markov_head_type=kind, enable_confidence_head=True,
                                      confidence_head_with_markov=kind != "rnn")
                           for kind in ("vanilla", "gated", "rnn")}}
PUBLISHED = {"dflash_qwen3_4b_block7": 0, "dflash_qwen3_8b_block7": 0, "dflash_qwen3_14b_block7": 0,
             "dspark_qwen3_4b_block7": 256, "dspark_qwen3_8b_block7": 256, "dspark_qwen3_14b_block7": 256}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def deepspec_draft(kind: str, seed: int = 0, block_size: int = 7, vocab_size: int = VOCAB_SIZE,
                   **overrides) -> DFlashDraftModel:
    """A tiny random DeepSpec draft (`kind`: a MARKOV key) from a config in DeepSpec's layout (its `block_size` counts
    the drafted rows); its Markov head scaled up so that its bias moves the argmax."""
    config = draft_config(architectures=["Qwen3DSparkModel"], block_size=block_size, vocab_size=vocab_size,
                          **{**MARKOV[kind], **overrides})
    torch.manual_seed(seed)
    draft = DFlashDraftModel(config).eval()
    if draft.markov_head is not None:
        with torch.no_grad():
            draft.markov_head.markov_w2.weight.mul_(20.0)
    return draft


# --- Loading: DeepSpec's config keys and weight names ----------------------------------------------------------------


@pytest.mark.parametrize("name", PUBLISHED)
def test_published_configs_read_as_deepspec_drafts(name):
    config = DFlashConfig.from_json_file(str(PUBLISHED_CONFIGS / "deepspec" / f"{name}.json"))
    assert config.architectures == ["DFlashDraftModel"] and config.shifted_labels
    assert config.block_size == 8  # DeepSpec's block 7: seven proposals, verified with the pending token
    assert config.markov_rank == PUBLISHED[name]
    assert config.markov_head_type == ("vanilla" if PUBLISHED[name] else None)
    assert config.enable_confidence_head == bool(PUBLISHED[name])
    assert config.dflash_config["mask_token_id"] == 151669
    with torch.device("meta"):
        draft = DFlashDraftModel(config)
    names = {name for name, _ in draft.named_parameters()}
    if PUBLISHED[name]:
        assert draft.markov_head.markov_w1.weight.shape == (config.vocab_size, 256)
        assert draft.confidence_head.proj.weight.shape == (1, config.hidden_size + 256)
        assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
                "confidence_head.proj.bias"} <= names
    else:
        assert not any(name.startswith(("markov_head", "confidence_head")) for name in names)


def test_deepspec_config_keys_are_normalised_once():
    config = draft_config(architectures=["Qwen3DSparkModel"], block_size=7, **MARKOV["gated"])
    again = DFlashConfig(**config.to_dict())  # what a saved config reads as
    assert (config.block_size, again.block_size) == (8, 8)
    assert again.shifted_labels and again.markov_head_type == "gated" and again.confidence_head_with_markov


@pytest.mark.parametrize("overrides, message", [
    (dict(architectures=["Gemma4DSparkModel"]), "Gemma-4 decoder layers"),
    (dict(architectures=["Qwen3DSparkModel"], markov_rank=4), "markov_head_type"),
    (dict(architectures=["Qwen3DSparkModel"], markov_rank=4, markov_head_type="lstm"), "markov_head_type"),
    (dict(architectures=["Qwen3DSparkModel"], enable_confidence_head=True, confidence_head_with_markov=True),
     "confidence_head_with_markov"),
    (dict(markov_rank=4, markov_head_type="vanilla"), "shifted_labels"),
])
def test_bad_deepspec_configs_are_refused_by_name(overrides, message):
    with pytest.raises(ValueError, match=message):
        draft_config(**overrides)


def test_a_deepspec_folder_loads_unchanged_and_saves_in_dflash_hf_layout(tmp_path):
    """DeepSpec's config.json and weight names as its own code wrote them (the golden fixture's); its copies of the
    target's embedding and LM head are left unread; a save and reload gives the same tokens."""
    variant = GOLDEN_RECORD["variants"]["dspark_rnn"]
    target = golden_target()
    folder = write_deepspec_folder(tmp_path / "deepspec", variant["config"], variant["shapes"], target,
                                   variant["seed"])
    draft = DFlashDraftModel.from_pretrained(folder)
    assert draft.shifted_labels and draft.markov_head.kind == "rnn" and draft.block_size == 5
    prompt = golden_prompts()[1]
    expected = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=16)
    draft.save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["shifted_labels"] and saved["block_size"] == 5 and saved["markov_head_type"] == "rnn"
    reloaded = DFlashDraftModel.from_pretrained(tmp_path / "saved")
    assert torch.equal(reloaded.spec_generate(target=target, input_ids=prompt, max_new_tokens=16), expected)
    assert torch.equal(expected, plain_greedy(target, prompt, max_new_tokens=16))


# --- Golden: DeepSpec's own inference code -------------------------------------------------------------------------


class CutRecordingProposer(RecordingProposer):
    """Records each step's proposals and the length the confidence cut left (None: no cut)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.lengths: list[int | None] = []

    def propose(self, step):
        proposal = super().propose(step)
        lengths = getattr(proposal, "lengths", None)
        self.lengths.append(None if lengths is None else int(lengths[0]))
        return proposal


@pytest.mark.parametrize("variant", list(GOLDEN_RECORD["variants"]))
def test_golden_runs_of_deepspec_are_reproduced(tmp_path, variant):
    """Greedy, batch 1, every prompt and threshold recorded: the same new tokens, the same B drafted tokens at every
    step (B = DeepSpec's block), the same cut and acceptance per step. DeepSpec never shortens its last block (it
    trims afterwards); dflash-hf narrows the blocks that reach max_new_tokens, so those steps are left out."""
    record = GOLDEN_RECORD["variants"][variant]
    target = golden_target()
    draft = DFlashDraftModel.from_pretrained(write_deepspec_folder(
        tmp_path / variant, record["config"], record["shapes"], target, record["seed"]))
    assert draft.block_size == GOLDEN_RECORD["block_size"] + 1
    prompts = golden_prompts()
    for run in record["greedy"]:
        proposer = CutRecordingProposer(draft, target, draft.mask_token_id,
                                        confidence_threshold=run["threshold"] or None)
        result = speculative_decode(target, proposer, prompts[run["prompt"]],
                                    max_new_tokens=GOLDEN_RECORD["max_new_tokens"], block_size=draft.block_size,
                                    stop_token_ids=[])
        where = f"prompt {run['prompt']} threshold {run['threshold']}"
        assert result.new_tokens(0) == run["new_tokens"], where
        # the steps before our loop narrows its block to what max_new_tokens leaves
        steps = sum(tokens.shape[1] == GOLDEN_RECORD["block_size"] for tokens in proposer.steps)
        assert steps >= len(run["acceptance_lengths"]) // 2
        assert result.acceptance_lengths[0][:steps] == run["acceptance_lengths"][:steps], where
        for index in range(steps):
            count = run["proposal_lengths"][index]
            assert proposer.lengths[index] in ((None, count) if count == GOLDEN_RECORD["block_size"] else (count,))
            assert proposer.steps[index][0, :count].tolist() == run["drafted"][index], f"{where} step {index}"


@pytest.mark.parametrize("variant", list(GOLDEN_RECORD["variants"]))
def test_sampled_q_is_deepspecs_for_the_same_draws(tmp_path, monkeypatch, variant):
    """At temperature 1, after the prompt (the pending token: the target's greedy first one) and with DeepSpec's own
    draws forced on the walk, q at every position is the distribution DeepSpec drew that token from: the LM head's
    logits plus the Markov bias of the token drawn before it."""
    record = GOLDEN_RECORD["variants"][variant]
    sampled = record["sampled_first_step"]
    target = golden_target()
    draft = DFlashDraftModel.from_pretrained(write_deepspec_folder(
        tmp_path / variant, record["config"], record["shapes"], target, record["seed"]))
    prompt = golden_prompts()[sampled["prompt"]][0].tolist()
    drawn = iter(sampled["drafted"])

    def forced(probabilities: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        if probabilities.dim() == 3:  # no Markov head: all positions at once
            return torch.tensor([sampled["drafted"]])
        return torch.full(probabilities.shape[:-1], next(drawn), dtype=torch.long)  # the walk: one position

    monkeypatch.setattr(proposer_module, "sample_from", forced)
    with torch.no_grad():
        hidden_states = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        step = DraftStep(prompts=[prompt], generated=[[sampled["anchor"]]],
                         target_hidden=select_features(hidden_states, draft.target_layer_ids),
                         context_position_ids=torch.arange(len(prompt))[None], context_valid=None,
                         block_size=draft.block_size, row_ids=[0], temperature=1.0,
                         generators=(torch.Generator().manual_seed(0),))
        proposal = DFlashProposer(draft, target, draft.mask_token_id).propose(step)
    assert proposal.tokens[0].tolist() == sampled["drafted"]
    torch.testing.assert_close(proposal.draft_probabilities[0], torch.tensor(sampled["q"]), rtol=1e-4, atol=1e-6)


# --- Lossless: greedy chains equal generate -------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3", "llama", "gemma3"])
@pytest.mark.parametrize("kind", list(MARKOV))
def test_greedy_chains_equal_generate(family, kind):
    target = build_target(family)
    for seed, length in ((0, 5), (1, 11)):
        input_ids = random_prompt(700 + seed, length)
        expected = plain_greedy(target, input_ids, max_new_tokens=20)
        draft = deepspec_draft(kind, seed=seed)
        for block_size in (2, 5, 8):
            output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=20,
                                         block_size=block_size)
            assert torch.equal(output, expected), f"seed {seed} block_size {block_size}"
        if draft.confidence_head is not None:
            for threshold in (0.3, 0.6, 1.0):
                output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=20,
                                             confidence_threshold=threshold)
                assert torch.equal(output, expected), f"seed {seed} threshold {threshold}"


@pytest.mark.parametrize("kind", list(MARKOV))
def test_left_padded_batches_equal_each_row_alone(kind):
    target = build_target("qwen3")
    prompts = prompts_of([3, 9, 6], seed=40)
    input_ids, attention_mask = left_pad([ids[0].tolist() for ids in prompts], pad_token_id=0)
    draft = deepspec_draft(kind, seed=3)
    for threshold in ((None, 0.5) if draft.confidence_head is not None else (None,)):
        result = draft.spec_generate(target=target, input_ids=input_ids, attention_mask=attention_mask,
                                     max_new_tokens=18, block_size=6, return_stats=True,
                                     confidence_threshold=threshold)
        for row, ids in enumerate(prompts):
            expected = plain_greedy(target, ids, max_new_tokens=18)[0, ids.shape[1]:].tolist()
            assert result.new_tokens(row) == expected, f"row {row} threshold {threshold}"


def test_the_markov_walk_follows_the_tokens_it_drafts():
    """A vanilla Markov head planted with a chain a -> a+1 and no other signal proposes a, a+1, a+2, ... from anchor
    a - 1: each position's bias comes from the token drafted just before it (not from the anchor)."""
    target = build_target("qwen3")
    draft = deepspec_draft("vanilla", seed=0, markov_rank=VOCAB_SIZE)
    with torch.no_grad():
        draft.markov_head.markov_w1.weight.copy_(torch.eye(VOCAB_SIZE))
        following = torch.roll(torch.eye(VOCAB_SIZE), 1, dims=0)  # column v: one-hot of v + 1
        draft.markov_head.markov_w2.weight.copy_(1e4 * following)
    proposer = RecordingProposer(draft, target, draft.mask_token_id)
    input_ids = torch.tensor([[5, 9, 20]])
    speculative_decode(target, proposer, input_ids, max_new_tokens=12, block_size=draft.block_size)
    first = plain_greedy(target, input_ids, max_new_tokens=1)[0, -1].item()
    assert proposer.steps[0][0].tolist() == [(first + k) % VOCAB_SIZE for k in range(1, 8)]


def test_a_cut_at_zero_verifies_the_pending_token_alone():
    target = build_target("qwen3")
    draft = deepspec_draft("gated", seed=1)
    input_ids = random_prompt(77, 6)
    result = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=10, confidence_threshold=1.0,
                                 return_stats=True)
    assert result.acceptance_lengths[0] == [1] * 9  # sigmoid < 1 everywhere: only the anchor is sent
    assert torch.equal(result.output_ids, plain_greedy(target, input_ids, max_new_tokens=10))


def test_confidence_thresholds_and_unbuilt_combinations_are_refused_up_front():
    target, input_ids = build_target("qwen3"), random_prompt(3, 4)
    with pytest.raises(ValueError, match="confidence head"):
        deepspec_draft("dflash").spec_generate(target=target, input_ids=input_ids, max_new_tokens=8,
                                               confidence_threshold=0.5)
    with pytest.raises(ValueError, match="from 0 to 1"):
        deepspec_draft("vanilla").spec_generate(target=target, input_ids=input_ids, max_new_tokens=8,
                                                confidence_threshold=1.5)
    with pytest.raises(ValueError, match="tree_size .*confidence cut"):
        deepspec_draft("gated").spec_generate(target=target, input_ids=input_ids, max_new_tokens=8, tree_size=4,
                                              confidence_threshold=0.5)


def test_a_deepspec_dflash_tree_equals_generate():
    """Rank 0 (DeepSpec's DFlash) has no Markov head: its shifted block feeds the best-first tree unchanged."""
    target = build_target("llama")
    input_ids = random_prompt(31, 7)
    output = deepspec_draft("dflash", seed=4).spec_generate(target=target, input_ids=input_ids, max_new_tokens=16,
                                                            tree_size=6)
    assert torch.equal(output, plain_greedy(target, input_ids, max_new_tokens=16))


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_trees_over_a_markov_draft_equal_generate(kind):
    """Each node's children ranked by q after its own token (rnn: after its whole path); greedy trees stay exact."""
    for family in ("qwen3", "llama"):
        target = build_target(family)
        input_ids = random_prompt(41, 6)
        draft = deepspec_draft(kind, seed=5)
        for tree_size in (3, 8):
            output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=16, tree_size=tree_size)
            assert torch.equal(output, plain_greedy(target, input_ids, max_new_tokens=16)), (family, tree_size)


def test_a_markov_tree_ranks_children_after_their_parent():
    """No LM-head signal (a zero final norm) and a planted chain v -> v+1: each position's candidates are v+1 after
    the greedy path, then ties; a node's children are ranked by q after its own token, so the successor of every
    candidate of position 0 that is also a candidate of position 1 comes first under it."""
    target = build_target("qwen3")
    draft = deepspec_draft("vanilla", seed=0, markov_rank=VOCAB_SIZE)
    with torch.no_grad():
        draft.norm.weight.zero_()
        draft.markov_head.markov_w1.weight.copy_(torch.eye(VOCAB_SIZE))
        draft.markov_head.markov_w2.weight.copy_(2.0 * torch.roll(torch.eye(VOCAB_SIZE), 1, dims=0))
    seen = []

    class Keep(DFlashProposer):
        def propose(self, step):
            proposal = super().propose(step)
            seen.append(proposal.candidates)
            return proposal

    speculative_decode(target, Keep(draft, target, draft.mask_token_id), torch.tensor([[5, 9, 20]]),
                       max_new_tokens=12, block_size=draft.block_size, tree_size=6)
    tokens, transitions = seen[0].tokens[0].tolist(), seen[0].transitions[0]  # [P][k], [P, k, k]
    checked = 0
    for parent, token in enumerate(tokens[0]):
        successor = (token + 1) % VOCAB_SIZE
        if successor in tokens[1]:
            assert tokens[1][int(transitions[1, parent].argmax())] == successor, (token, tokens[1])
            checked += 1
    assert checked >= 3


def test_an_rnn_tree_steps_each_nodes_state_from_its_parents():
    """An rnn head's state follows the whole path: the q a tree ranks a node's children by is the q a chain walk
    along that node's path gives (each node's state stepped from its parent's, not a sibling's), for every path of
    up to three candidates. Power: two nodes with the same token after different parents rank their children
    differently."""
    target = build_target("qwen3")
    draft = deepspec_draft("rnn", seed=2)
    seen = []

    class Keep(DFlashProposer):
        def propose(self, step):
            proposal = super().propose(step)
            seen.append(proposal.candidates)
            return proposal

    speculative_decode(target, Keep(draft, target, draft.mask_token_id), random_prompt(5, 6), max_new_tokens=6,
                       block_size=draft.block_size, tree_size=3)
    candidates = seen[0]
    assert candidates.transitions is None and candidates.after_path is not None
    markov = candidates.after_path.__self__.markov  # the step's MarkovStage: LM-head logits, hidden states, anchor
    tokens = candidates.tokens[0]  # [P, k]
    count = tokens.shape[1]
    paths = [(a,) for a in range(count)] + [(a, b) for a in range(count) for b in range(count)]
    paths += [(a, b, c) for a in range(count) for b in range(count) for c in range(count)]
    for path in paths:
        with torch.no_grad():  # the step's tensors were made in inference mode
            walk = proposer_module.MarkovStage(draft, markov.base, markov.hidden_states, markov.anchors, False)
            walked = torch.zeros(1, len(path) + 1, dtype=torch.long)
            for position, rank in enumerate(path):
                walk.logits(position, walked)
                walked[0, position] = tokens[position, rank]
            q = walk.logits(len(path), walked)[0].float().softmax(dim=-1)  # [V]: after the path
            torch.testing.assert_close(torch.tensor(candidates.after_path(0, path)), q[tokens[len(path)]])
    differs = [candidates.after_path(0, (a, b)) != candidates.after_path(0, (0, b))
               for a in range(1, count) for b in range(count)]
    assert any(differs)


# --- Sampling keeps the target's distribution ------------------------------------------------------------------------


@pytest.mark.parametrize("kind, threshold, tree_size", [("rnn", None, None), ("vanilla", 0.25, None),
                                                      ("gated", None, 3), ("rnn", None, 3)])
def test_sampled_markov_chains_follow_the_target_distribution(kind, threshold, tree_size):
    """Chi-square over 6^3 continuations, with the power check, for chains (rnn; vanilla with a confidence cut that
    falls on about half the rows) and trees (gated; rnn, each node's children ranked by q after its path); the
    draft's Markov head planted with the target's most likely token after each one-token prompt, so that proposals
    get accepted (and a wrong q would show)."""
    from sampling_checks import sampling_target

    target, input_ids = sampling_target()
    draft = deepspec_draft(kind, seed=12, block_size=3, vocab_size=VOCAB, markov_rank=VOCAB)
    with torch.no_grad():
        following = target(torch.arange(VOCAB)[:, None]).logits[:, -1].argmax(-1)  # [V]
        draft.norm.weight.mul_(0.05)  # small LM-head logits: the bias counts
        draft.confidence_head.proj.weight.mul_(10.0)  # at 0.25, about half the first proposals are cut (by anchor)
        draft.markov_head.markov_w1.weight.copy_(torch.eye(VOCAB))
        draft.markov_head.markov_w2.weight.copy_(torch.eye(VOCAB)[following].T)
        if kind == "rnn":  # its output reads the token before only
            draft.markov_head.joint_proj.weight[2 * VOCAB :] = 0.0
            draft.markov_head.joint_proj.bias[2 * VOCAB :] = 0.0
            draft.markov_head.joint_proj.weight[2 * VOCAB :, VOCAB : 2 * VOCAB] = 3.0 * torch.eye(VOCAB)
    proposer = DFlashProposer(draft, target, VOCAB - 1, confidence_threshold=threshold)
    temperature, top_k, top_p = 0.9, None, None
    counts, accepted = sampled_counts(target, proposer, input_ids, torch.Generator().manual_seed(5),
                                      max_new_tokens=NUM_NEW, block_size=4, temperature=temperature,
                                      tree_size=tree_size)
    assert accepted > NUM_SAMPLES // 10
    assert_follows(counts, exact_joint(target, input_ids, temperature, top_k, top_p),
                   exact_joint(target, input_ids, temperature * 1.5, top_k, top_p))


# --- compile=True ------------------------------------------------------------------------------------------------


@COMPILES
def test_compiled_golden_runs_keep_deepspecs_tokens_and_acceptance(tmp_path):
    """compile=True on the golden runs (every variant, with and without the confidence cut): DeepSpec's new tokens,
    and its acceptance at every step before the eager loop would narrow its block; a step that accepts the whole
    shifted block keeps one context column more than the draft's block has rows. After each draft's first call, its
    other prompts and thresholds compile nothing new."""
    target = golden_target()
    prompts = golden_prompts()
    torch._dynamo.reset()
    counters.clear()
    full_blocks = 0
    for variant, record in GOLDEN_RECORD["variants"].items():
        draft = DFlashDraftModel.from_pretrained(write_deepspec_folder(
            tmp_path / variant, record["config"], record["shapes"], target, record["seed"]))
        graphs = None
        for run in record["greedy"]:
            result = draft.spec_generate(target=target, input_ids=prompts[run["prompt"]],
                                         max_new_tokens=GOLDEN_RECORD["max_new_tokens"], stop_token_ids=[],
                                         confidence_threshold=run["threshold"] or None, compile=DYNAMO_ONLY,
                                         return_stats=True)
            where = f"{variant} prompt {run['prompt']} threshold {run['threshold']}"
            assert result.new_tokens(0) == run["new_tokens"], where
            # DeepSpec's steps before the eager loop narrows its block to what max_new_tokens leaves
            steps, left = 0, GOLDEN_RECORD["max_new_tokens"] - 1
            while steps < len(run["acceptance_lengths"]) and left >= draft.block_size:
                left -= run["acceptance_lengths"][steps]
                steps += 1
            assert result.acceptance_lengths[0][:steps] == run["acceptance_lengths"][:steps], where
            full_blocks += draft.block_size in result.acceptance_lengths[0]
            if graphs is not None:
                assert compiled_graphs() == graphs, (where, counters["stats"])
            graphs = compiled_graphs()
    assert full_blocks >= 3


@COMPILES
@pytest.mark.parametrize("kind", list(MARKOV))
def test_compiled_chains_and_trees_equal_generate_on_two_families(kind):
    """compile=True with DeepSpec's DFlash and each DSpark Markov head, chains and trees, on Qwen3 and Llama targets:
    the target's greedy tokens, and a second call (another prompt length and length budget) compiles nothing new."""
    draft = deepspec_draft(kind, seed=6)
    torch._dynamo.reset()
    counters.clear()
    for family in ("qwen3", "llama"):
        target = build_target(family)
        for tree_size in (None, 4):
            graphs = None
            for seed, length, new_tokens in ((0, 5, 14), (1, 9, 11)):
                input_ids = random_prompt(800 + seed, length)
                output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=new_tokens,
                                             block_size=5, tree_size=tree_size, compile=DYNAMO_ONLY)
                where = f"{family} tree_size {tree_size} seed {seed}"
                assert torch.equal(output, plain_greedy(target, input_ids, max_new_tokens=new_tokens)), where
                if graphs is not None:
                    assert compiled_graphs() == graphs, (where, counters["stats"])
                graphs = compiled_graphs()


@COMPILES
def test_compiled_sampled_dspark_drafts_draw_what_the_eager_loop_draws(tmp_path):
    """Same seed, same tokens, for an rnn DSpark draft's sampled chains and trees (each position's q after the token
    drawn before it): the compiled backend changes no draw, so the distribution the eager loop keeps (chi-square,
    above) is kept. Compared until the eager loop narrows its last blocks. Power: other seeds draw other tokens."""
    record = GOLDEN_RECORD["variants"]["dspark_rnn"]
    target = golden_target()
    draft = DFlashDraftModel.from_pretrained(write_deepspec_folder(
        tmp_path / "rnn", record["config"], record["shapes"], target, record["seed"]))
    prompt = golden_prompts()[1]
    new_tokens = 30
    compared = new_tokens - draft.block_size
    for tree_size in (None, 4):
        outputs = set()
        for seed in (0, 1, 2):
            arguments = dict(target=target, input_ids=prompt, max_new_tokens=new_tokens, temperature=1.0, seed=seed,
                             stop_token_ids=[], tree_size=tree_size)
            eager = draft.spec_generate(**arguments)[0, prompt.shape[1]:][:compared].tolist()
            compiled = draft.spec_generate(**arguments, compile=DYNAMO_ONLY)[0, prompt.shape[1]:][:compared]
            assert compiled.tolist() == eager, (tree_size, seed)
            outputs.add(tuple(eager))
        assert len(outputs) == 3


def test_published_readme_names_every_deepspec_config():
    text = (PUBLISHED_CONFIGS / "README.md").read_text(encoding="utf-8")
    for name in PUBLISHED:
        assert f"`deepspec/{name}.json`" in text and f"deepseek-ai/{name}" in text
    assert Path(PUBLISHED_CONFIGS / "deepspec" / "dspark_qwen3_8b_block7.json").is_file()
