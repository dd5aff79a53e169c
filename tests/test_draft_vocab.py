"""The draft vocabulary: the draft proposes from K frequent tokens (its LM head over K rows); output stays exact."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import (
    HIDDEN_SIZE,
    VOCAB_SIZE,
    RecordingProposer,
    draft_config,
    make_draft,
    make_target,
    make_variant_draft,
    plain_greedy,
    random_prompt,
)
from sampling_checks import chi_square_p_value

from dflash_hf import DFlashDraftModel, speculative_decode
from dflash_hf.training.recipe import ids_by_count
from dflash_hf.versions_dflash import torch_refusal

VOCAB = list(range(1, VOCAB_SIZE - 1, 3))  # 42 of the 128 ids



@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
@pytest.mark.parametrize("seed, length, block_size", [(0, 9, 8), (1, 1, 4), (2, 23, 2)])
def test_greedy_with_a_draft_vocabulary_equals_plain_greedy(variant, seed, length, block_size):
    target = make_target("qwen3", seed=seed)
    draft = make_draft(seed) if variant == "dflash" else make_variant_draft("dflash2", seed=seed)
    input_ids = random_prompt(seed, length)
    output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=30, block_size=block_size,
                                 draft_vocab=VOCAB)
    assert torch.equal(output, plain_greedy(target, input_ids, 30))


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_proposals_come_from_the_draft_vocabulary_only(temperature):
    target, draft = make_target("llama", seed=3), make_draft(3)
    proposer = RecordingProposer(draft, target, VOCAB_SIZE - 1, draft_vocab=torch.tensor(VOCAB))
    speculative_decode(target, proposer, random_prompt(3, 7), max_new_tokens=40, block_size=8, temperature=temperature,
                       generator=torch.Generator().manual_seed(3))
    proposed = torch.cat([tokens.flatten() for tokens in proposer.steps])
    assert len(proposed) > 20 and set(proposed.tolist()) <= set(VOCAB)
    full = RecordingProposer(draft, target, VOCAB_SIZE - 1)  # power: without it the draft proposes other ids
    speculative_decode(target, full, random_prompt(3, 7), max_new_tokens=40, block_size=8, temperature=temperature,
                       generator=torch.Generator().manual_seed(3))
    assert not set(torch.cat([tokens.flatten() for tokens in full.steps]).tolist()) <= set(VOCAB)


def test_sampling_with_a_draft_vocabulary_keeps_the_target_distribution():
    """q is zero outside the draft's vocabulary, so tokens there come from the residual: the token after the first
    (accepted proposal or residual sample) follows p given the first, over 1500 rows (chi-square)."""
    target, draft = make_target("qwen3", seed=4, init_std=0.02), make_draft(4)
    input_ids, num_samples = random_prompt(4, 5), 1500
    output = draft.spec_generate(target=target, input_ids=input_ids.repeat(num_samples, 1), max_new_tokens=3,
                                 temperature=1.0, top_k=0, draft_vocab=VOCAB, seed=4, return_stats=True)
    firsts, seconds = output.new_token_ids[:, 0], output.new_token_ids[:, 1]  # the second: the verify's token
    with torch.no_grad():
        follow = target(torch.cat((input_ids.repeat(VOCAB_SIZE, 1), torch.arange(VOCAB_SIZE)[:, None]), 1)).logits
    expected = (torch.bincount(firsts, minlength=VOCAB_SIZE).double()[:, None]
                * follow[:, -1].double().softmax(-1)).sum(0)  # sum over the drawn firsts of p(second | first)
    counts = torch.bincount(seconds, minlength=VOCAB_SIZE).double()
    outside = torch.tensor([token not in VOCAB for token in range(VOCAB_SIZE)])
    assert counts[outside].sum() > 0.4 * num_samples  # most tokens lie outside the draft's 42 ids: the residual's
    law = dict(enumerate((expected / expected.sum()).tolist()))
    p_value = chi_square_p_value(dict(enumerate(counts.tolist())), law, num_samples)
    assert p_value > 1e-3


def test_the_config_carries_the_vocabulary_and_refuses_a_bad_one(tmp_path):
    draft = DFlashDraftModel(draft_config(dflash_config={"mask_token_id": VOCAB_SIZE - 1, "draft_vocab": VOCAB}))
    draft.save_pretrained(tmp_path)
    assert "draft_vocab_size" not in json.loads((tmp_path / "config.json").read_text())  # it borrows the head
    assert DFlashDraftModel.from_pretrained(tmp_path).draft_vocab == VOCAB
    for bad in ([], [1, 1], [VOCAB_SIZE], [-1], "abc"):
        with pytest.raises(ValueError, match="draft_vocab"):
            draft_config(dflash_config={"mask_token_id": VOCAB_SIZE - 1, "draft_vocab": bad})


def test_the_call_chooses_the_vocabulary():
    target = make_target("qwen3", seed=5)
    draft = DFlashDraftModel(draft_config(dflash_config={"mask_token_id": VOCAB_SIZE - 1,
                                                         "draft_vocab": VOCAB})).eval()
    input_ids = random_prompt(5, 6)
    expected = plain_greedy(target, input_ids, 20)
    for choice in (None, True, False, VOCAB[:10], torch.tensor(VOCAB[5:])):
        assert torch.equal(draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=20,
                                               draft_vocab=choice), expected)
    with pytest.raises(ValueError, match="no `draft_vocab`"):
        make_draft(5).spec_generate(target=target, input_ids=input_ids, max_new_tokens=4, draft_vocab=True)
    with pytest.raises(ValueError, match="distinct token ids of the target's vocabulary"):
        draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=4, draft_vocab=[0, VOCAB_SIZE])


def test_ids_by_count_rank_by_count_then_fill_with_low_ids():
    def counts(tokens: list[int], vocab_size: int) -> torch.Tensor:
        return torch.bincount(torch.tensor(tokens), minlength=vocab_size)

    assert ids_by_count(counts([5, 7, 7, 9, 9, 7], 12), 6) == [7, 9, 5, 0, 1, 2]  # 7 x3, 9 x2, 5 x1, then unseen
    assert ids_by_count(counts([3, 3, 1], 5), 1) == [3]
    with pytest.raises(ValueError, match="vocabulary size"):
        ids_by_count(counts([1], 5), 6)


@pytest.mark.parametrize("own_head", [False, True])
def test_step_costs_time_the_draft_with_its_vocabulary(monkeypatch, own_head):
    """The bench's cost model and `--block-size auto` time the proposer spec_generate runs, not a full-vocabulary
    one (the config's list over the target's rows, or the draft's own head)."""
    from dflash_hf.cost_model import measure_step_costs
    from dflash_hf.proposer_dflash import DraftVocabulary

    target = make_target("qwen3", seed=6)
    draft = own_head_draft(target, 6) if own_head else DFlashDraftModel(draft_config(
        dflash_config={"mask_token_id": VOCAB_SIZE - 1, "draft_vocab": VOCAB})).eval()
    rows_scored = []
    original = DraftVocabulary.logits
    monkeypatch.setattr(DraftVocabulary, "logits",
                        lambda self, states: (rows_scored.append(original(self, states).shape)
                                              or original(self, states)))
    measure_step_costs(draft, target, random_prompt(6, 12), block_size=4, mask_token_id=VOCAB_SIZE - 1, repeats=2)
    assert rows_scored and set(rows_scored) == {torch.Size([3, len(VOCAB)])}


def test_warm_up_primes_the_few_row_kernels_so_timed_runs_do_not_choose_them(monkeypatch):
    import dflash_hf.kernels_dflash as kernels_dflash
    from dflash_hf.cost_model import prime_few_row_kernels
    from dflash_hf.evaluation import BenchSettings, measure_prompts, warm_up
    from dflash_hf.tokens_dflash import GenerationTokens

    target = make_target("qwen3", seed=7)
    draft = DFlashDraftModel(draft_config(dflash_config={"mask_token_id": VOCAB_SIZE - 1,
                                                         "draft_vocab": VOCAB})).eval()
    monkeypatch.setattr(kernels_dflash, "FEW_ROW_KERNEL_CHOICE", {})
    rows_of = {(VOCAB_SIZE, target.config.hidden_size): 5, (len(VOCAB), target.config.hidden_size): 5}  # the heads
    for module in [*target.model.modules(), *draft.modules()]:  # every other Linear: up to MAX_FEW_ROWS rows
        if type(module) is torch.nn.Linear:
            rows_of[tuple(module.weight.shape)] = kernels_dflash.MAX_FEW_ROWS  # a layer shaped like a head too
    assert prime_few_row_kernels(draft, target, max_rows=5) == sum(rows_of.values())
    primed = {(shape, rows) for _, shape, rows, _ in kernels_dflash.FEW_ROW_KERNEL_CHOICE}
    assert primed == {(shape, rows) for shape, most in rows_of.items() for rows in range(1, most + 1)}
    # after the warm-up, a measured run times no kernel (it would be timed with the run), on other prompts too
    settings = BenchSettings(max_new_tokens=24, block_size=4, prompt_lookup_tokens=None, batch_size=2)
    tokens = GenerationTokens(stop_token_ids=[VOCAB_SIZE - 2], pad_token_id=VOCAB_SIZE - 2,
                              mask_token_id=VOCAB_SIZE - 1)
    warm_up(draft, target, [random_prompt(7, 12)[0].tolist(), random_prompt(8, 5)[0].tolist()], settings,
            tokens)
    monkeypatch.setattr(kernels_dflash, "fastest_kernel", lambda *args: pytest.fail("kernel timed in a measured run"))
    measure_prompts(draft, target, [random_prompt(9, 17)[0].tolist(), random_prompt(10, 3)[0].tolist()], settings,
                    tokens)


# --- a draft with its own LM head over K tokens (config `draft_vocab_size`, buffers d2t / t2d) ---------------------


def own_head_draft(target: torch.nn.Module, seed: int, **config_kwargs) -> DFlashDraftModel:
    """`make_draft(seed)`'s weights with an LM head of its own over VOCAB: the target's rows of those ids, so it
    proposes what `make_draft(seed)` with `draft_vocab=VOCAB` proposes."""
    borrowed = make_draft(seed, **config_kwargs)
    draft = DFlashDraftModel(draft_config(draft_vocab_size=len(VOCAB), **config_kwargs)).eval()
    draft.load_state_dict(borrowed.state_dict(), strict=False)
    draft.set_draft_vocabulary(VOCAB)
    with torch.no_grad():
        draft.lm_head.weight.copy_(target.get_output_embeddings().weight[sorted(VOCAB)])
    return draft


def test_an_own_head_draft_has_its_vocabulary_in_d2t_and_t2d():
    draft = DFlashDraftModel(draft_config(draft_vocab_size=len(VOCAB)))
    assert draft.draft_vocab == list(range(len(VOCAB)))  # before set_draft_vocabulary: the first K ids
    draft.set_draft_vocabulary(list(reversed(VOCAB)))
    assert draft.draft_vocab == sorted(VOCAB) and draft.lm_head.weight.shape == (len(VOCAB), draft.config.hidden_size)
    assert draft.d2t.dtype == torch.long and torch.equal(draft.d2t + torch.arange(len(VOCAB)), torch.tensor(VOCAB))
    assert draft.t2d.dtype == torch.bool and draft.t2d.nonzero().flatten().tolist() == VOCAB
    with torch.no_grad():
        draft.t2d[0] = True  # t2d no longer says what d2t says
    with pytest.raises(ValueError, match="d2t.*t2d"):
        assert draft.draft_vocab
    for bad, match in ((0, "draft_vocab_size"), (VOCAB_SIZE + 1, "draft_vocab_size")):
        with pytest.raises(ValueError, match=match):
            draft_config(draft_vocab_size=bad)
    with pytest.raises(ValueError, match="remove `draft_vocab`"):
        draft_config(draft_vocab_size=4, dflash_config={"mask_token_id": VOCAB_SIZE - 1, "draft_vocab": VOCAB[:4]})
    with pytest.raises(ValueError, match="needs 42 distinct ids from 0 to 127"):
        draft.set_draft_vocabulary(VOCAB[:5])


@pytest.mark.parametrize("seed, length, block_size, tree_size", [(0, 9, 8, None), (1, 1, 4, None), (2, 23, 8, 8),
                                                                   (3, 5, 4, 6)])
def test_greedy_with_an_own_head_equals_plain_greedy_and_the_borrowed_rows(seed, length, block_size, tree_size):
    """Chain and tree: the output is the target's greedy one, and every proposal is the one the same draft makes from
    the target's rows of its vocabulary (`draft_vocab`), the rows its own head holds here."""
    target = make_target("qwen3", seed=seed)
    draft, borrowed = own_head_draft(target, seed), make_draft(seed)
    input_ids = random_prompt(seed, length)
    output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=30, block_size=block_size,
                                 tree_size=tree_size)
    assert torch.equal(output, plain_greedy(target, input_ids, 30))
    own = RecordingProposer(draft, target, VOCAB_SIZE - 1, draft_vocab=torch.tensor(draft.draft_vocab))
    rows = RecordingProposer(borrowed, target, VOCAB_SIZE - 1, draft_vocab=torch.tensor(VOCAB))
    for proposer in (own, rows):
        speculative_decode(target, proposer, input_ids, max_new_tokens=30, block_size=block_size)
    assert len(own.steps) > 2 and all(torch.equal(a, b) for a, b in zip(own.steps, rows.steps))
    assert set(torch.cat([tokens.flatten() for tokens in own.steps]).tolist()) <= set(VOCAB)


def test_sampling_with_an_own_head_proposes_its_vocabulary_and_keeps_the_target_distribution():
    """q is over the K tokens (zero elsewhere): the first two new tokens follow p, over 1500 rows (chi-square on the
    second given the first), as with `draft_vocab`."""
    target = make_target("qwen3", seed=4, init_std=0.02)
    draft = own_head_draft(target, 4)
    with pytest.raises(ValueError, match="its own LM head"):
        draft.spec_generate(target=target, input_ids=random_prompt(4, 5), max_new_tokens=3, draft_vocab=False)
    input_ids, num_samples = random_prompt(4, 5), 1500
    output = draft.spec_generate(target=target, input_ids=input_ids.repeat(num_samples, 1), max_new_tokens=3,
                                 temperature=1.0, top_k=0, seed=4, return_stats=True)
    firsts, seconds = output.new_token_ids[:, 0], output.new_token_ids[:, 1]
    with torch.no_grad():
        follow = target(torch.cat((input_ids.repeat(VOCAB_SIZE, 1), torch.arange(VOCAB_SIZE)[:, None]), 1)).logits
    expected = (torch.bincount(firsts, minlength=VOCAB_SIZE).double()[:, None]
                * follow[:, -1].double().softmax(-1)).sum(0)
    counts = torch.bincount(seconds, minlength=VOCAB_SIZE).double()
    law = dict(enumerate((expected / expected.sum()).tolist()))
    assert chi_square_p_value(dict(enumerate(counts.tolist())), law, num_samples) > 1e-3
    proposer = RecordingProposer(draft, target, VOCAB_SIZE - 1, draft_vocab=torch.tensor(draft.draft_vocab))
    speculative_decode(target, proposer, random_prompt(3, 7), max_new_tokens=40, block_size=8, temperature=1.0,
                       generator=torch.Generator().manual_seed(3))
    assert set(torch.cat([tokens.flatten() for tokens in proposer.steps]).tolist()) <= set(VOCAB)


def test_an_own_head_draft_saves_its_head_and_mapping_and_reloads_to_the_same_proposals(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModel

    target = make_target("qwen3", seed=6)
    draft = own_head_draft(target, 6)
    draft.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    head = weights["lm_head.weight"]
    assert (head.shape, head.dtype) == ((len(VOCAB), HIDDEN_SIZE), torch.float32)
    assert (weights["d2t"].shape, weights["d2t"].dtype) == ((len(VOCAB),), torch.int64)
    assert (weights["t2d"].shape, weights["t2d"].dtype) == ((VOCAB_SIZE,), torch.bool)
    assert torch.equal(weights["d2t"] + torch.arange(len(VOCAB)), torch.tensor(VOCAB))
    config = (tmp_path / "config.json").read_text()
    assert '"draft_vocab_size": 42' in config and '"draft_vocab"' not in config
    input_ids = random_prompt(6, 8)
    expected = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=20, block_size=4)
    for loaded in (DFlashDraftModel.from_pretrained(tmp_path),
                   AutoModel.from_pretrained(tmp_path, trust_remote_code=True)):
        assert loaded.draft_vocab == VOCAB and torch.equal(loaded.lm_head.weight, draft.lm_head.weight)
        steps = []
        for model in (draft, loaded):
            proposer = RecordingProposer(model, target, VOCAB_SIZE - 1, draft_vocab=torch.tensor(VOCAB))
            speculative_decode(target, proposer, input_ids, max_new_tokens=20, block_size=4)
            steps.append(proposer.steps)
        assert all(torch.equal(a, b) for a, b in zip(*steps))
        assert torch.equal(loaded.spec_generate(target=target, input_ids=input_ids, max_new_tokens=20, block_size=4),
                           expected)
    # a folder whose weights lack the mapping is refused by name
    del weights["d2t"]
    from safetensors.torch import save_file

    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="d2t"):
        DFlashDraftModel.from_pretrained(tmp_path)


@pytest.mark.skipif(torch_refusal("compile=True") is not None, reason="compile=True is refused on this torch")
def test_an_own_head_draft_decodes_compiled_as_it_does_eager():
    """compile (dynamo's graph capture, eager backend): greedy chain and tree equal `generate`, and sampling draws the
    tokens the eager loop draws (the own head scores outside the compiled draft forward, as the target's rows do)."""
    target = make_target("qwen3", seed=9)
    draft, input_ids = own_head_draft(target, 9), random_prompt(9, 7)
    expected = plain_greedy(target, input_ids, 24)
    for tree_size in (None, 6):
        assert torch.equal(draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=24, block_size=4,
                                               tree_size=tree_size, compile={"backend": "eager"}), expected)
    arguments = dict(target=target, input_ids=input_ids, max_new_tokens=24, block_size=4, temperature=1.0, seed=2)
    eager = draft.spec_generate(**arguments)[0, 7:20]
    assert torch.equal(draft.spec_generate(**arguments, compile={"backend": "eager"})[0, 7:20], eager)


@pytest.mark.parametrize("tree_size", [None, 6])
def test_a_dflash2_draft_with_its_own_head_equals_plain_greedy(tree_size):
    """The selector walks the own head's K tokens (logits -inf elsewhere), chain and tree."""
    target = make_target("qwen3", seed=10)
    draft = make_variant_draft("dflash2", seed=10, draft_vocab_size=len(VOCAB))
    draft.set_draft_vocabulary(VOCAB)
    input_ids = random_prompt(10, 6)
    output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=24, block_size=4,
                                 tree_size=tree_size)
    assert torch.equal(output, plain_greedy(target, input_ids, 24))
