"""The compiled backend (`compile=True`, static_dflash) beside the eager one: chains and trees on every attention
family (sliding windows included, counted by position) exact against `generate` (greedy) and drawing what the eager
loop draws (sampling), with no recompilation once the first verify has compiled, and refused up front where it cannot
run.

Most tests compile with dynamo's `eager` backend: the same graph capture, guards and recompilations as inductor,
without inductor's C++ build; one test runs the default (inductor) end to end.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import (
    WINDOW,
    ReferenceProposer,
    TreeReferenceProposer,
    build_target,
    make_draft,
    make_target,
    make_variant_draft,
    plain_greedy,
    random_prompt,
)
from torch._dynamo.utils import counters

from dflash_hf import speculative_decode
from dflash_hf.cache_dflash import left_pad
from dflash_hf.draft_backends_dflash import draft_backend
from dflash_hf.proposer_dflash import DFlashProposer
from dflash_hf.settings_dflash import StepCosts
from dflash_hf.versions_dflash import NEWER_TORCH_FEATURES, torch_refusal

DYNAMO_ONLY = {"backend": "eager"}
# compile=True needs a newer torch than pyproject's floor (versions_dflash); on older ones it is refused, as
# test_compile_is_refused_on_an_older_torch_naming_the_release_it_needs checks on every torch
COMPILES = pytest.mark.skipif(torch_refusal("compile=True") is not None,
                              reason=f"compile=True is refused on torch {torch.__version__}")


def compiled_graphs() -> int:
    """Graphs dynamo has compiled since the counters were last cleared (a recompilation adds one)."""
    return counters["stats"]["unique_graphs"]


class GuidedDFlashProposer(DFlashProposer):
    """Runs the draft at every step (its context cache follows the loop) and records what it drafted, but proposes
    the target's own continuation, wrong from a random offset: accepted lengths vary as a trained draft's do."""

    def __init__(self, draft, target, reference: torch.Tensor, seed: int, compile: dict | None = None,
                 context_columns: int = 0) -> None:
        super().__init__(draft, target, draft.mask_token_id,
                         backend=draft_backend(draft, compile, 1, context_columns, torch.device("cpu"),
                                               draft.block_size))
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


@COMPILES
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


@COMPILES
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



@COMPILES
@pytest.mark.parametrize("tree_size", [None, 4])
def test_generates_processors_and_stop_strings_run_on_the_compiled_backend(tree_size):
    """The processors run on the compiled verify's logits, each row with its own prefix; a stop string ends a row of
    the compiled batch where `generate` ends that row alone."""
    from helpers import make_char_tokenizer

    target, tokenizer = make_target(seed=3), make_char_tokenizer()
    prompts = [random_prompt(seed, length)[0].tolist() for seed, length in ((4, 7), (5, 3))]
    settings = {"repetition_penalty": 1.5, "no_repeat_ngram_size": 3}
    references = [target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                                  **settings) for prompt in prompts]
    stop = tokenizer.decode(references[0][0, len(prompts[0]) + 9 : len(prompts[0]) + 11])
    expected = [target.generate(torch.tensor([prompt]), max_new_tokens=24, do_sample=False, pad_token_id=0,
                                stop_strings=stop, tokenizer=tokenizer, **settings) for prompt in prompts]
    assert expected[0].shape[1] < len(prompts[0]) + 24
    input_ids, attention_mask = left_pad(prompts, pad_token_id=0)
    proposer = (TreeReferenceProposer(references, k=3, seed=1) if tree_size else
                ReferenceProposer(references, corrupt_seed=2))
    result = speculative_decode(target, proposer, input_ids, attention_mask=attention_mask, max_new_tokens=24,
                                block_size=6, temperature=0.0, pad_token_id=0, tree_size=tree_size,
                                stop_strings=stop, tokenizer=tokenizer, compile=DYNAMO_ONLY, **settings)
    for row, reference in enumerate(expected):
        assert result.new_tokens(row) == reference[0, len(prompts[row]):].tolist()

@COMPILES
@pytest.mark.parametrize("tree_size", [None, 4])
def test_the_compiled_drafts_proposals_see_the_processors_without_a_new_graph(tree_size):
    """The DFlash draft's compiled forward under generate's processors (applied to its logits, outside the graph):
    a left-padded batch equals generate's, and a second call with other processors compiles nothing new."""
    target, draft = make_target(seed=3), make_draft(5)
    prompts = [random_prompt(seed, length)[0].tolist() for seed, length in ((4, 7), (5, 3))]
    input_ids, attention_mask = left_pad(prompts, pad_token_id=0)
    graphs = None
    for settings in ({"repetition_penalty": 1.5, "no_repeat_ngram_size": 2}, {"bad_words_ids": [[3], [7, 9]]}):
        expected = target.generate(input_ids, attention_mask=attention_mask, max_new_tokens=20, do_sample=False,
                                   pad_token_id=0, **settings)
        result = draft.spec_generate(target=target, input_ids=input_ids, attention_mask=attention_mask,
                                     max_new_tokens=20, temperature=0.0, pad_token_id=0, block_size=6,
                                     tree_size=tree_size, compile=DYNAMO_ONLY, **settings)
        assert torch.equal(result, expected)
        if graphs is not None:
            assert compiled_graphs() == graphs
        graphs = compiled_graphs()


@COMPILES
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


@COMPILES
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


@COMPILES
def test_the_first_compiled_call_says_it_compiles_and_later_calls_do_not(caplog):
    """A long compile is announced (a warning naming what compiles), once per target and batch size."""
    target, draft = make_target(seed=16), make_draft(16)
    with caplog.at_level("WARNING", logger="dflash_hf.static_dflash"):
        for seed in (0, 1):
            draft.spec_generate(target=target, input_ids=random_prompt(seed, 5), max_new_tokens=6,
                                compile=DYNAMO_ONLY)
    announced = [record for record in caplog.records if "compiles the target's verify" in record.getMessage()]
    assert len(announced) == 1


@COMPILES
def test_compiled_eager_and_compiled_again_on_the_same_models_return_ordinary_tensors():
    """The loop runs in inference mode; what outlives a call (the compiled verifier's static cache, the compiled
    draft) is written only inside it, so a compiled call, an eager one and a compiled one again on the same models
    all decode exactly; the ids returned are ordinary tensors the caller may edit in place, and the models still
    train afterwards (no weight became an inference tensor)."""
    target, draft = make_target(seed=17), make_draft(17)
    prompt = random_prompt(17, 6)
    expected = plain_greedy(target, prompt, 12)
    for compile in (DYNAMO_ONLY, False, DYNAMO_ONLY):
        output = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=12, compile=compile)
        assert output.tolist() == expected.tolist()
        assert not output.is_inference()
        output[0, -1] = 0  # would raise for an inference tensor outside inference mode
    target(prompt).logits.sum().backward()
    assert all(parameter.grad is not None for parameter in target.lm_head.parameters())


@COMPILES
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


@COMPILES
def test_the_default_compiled_path_equals_generate():
    """`compile=True`: inductor on a CPU, exact on a tiny target with a DFlash draft."""
    target, draft = make_target(seed=6), make_draft(6)
    prompt = random_prompt(8, 7)
    expected = plain_greedy(target, prompt, 20)
    assert draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=20, compile=True).tolist() == \
        expected.tolist()


@pytest.mark.parametrize("arguments, message", [
    (dict(step_costs=StepCosts(draft=0.0, verify=[1.0] * 8)), "step_costs=None"),
    (dict(cpu_kernels=True), "cpu_kernels=False"),
])
def test_compile_is_refused_with_what_it_cannot_run(arguments, message):
    target, draft = make_target(seed=0), make_draft(0)
    with pytest.raises(ValueError, match=message):
        draft.spec_generate(target=target, input_ids=random_prompt(0, 5), max_new_tokens=4, compile=True,
                            **arguments)


@pytest.mark.parametrize("release, refused", [((2, 6), True), (NEWER_TORCH_FEATURES["compile=True"][0], False)])
def test_compile_is_refused_on_an_older_torch_naming_the_release_it_needs(monkeypatch, release, refused):
    """Below the release compile=True needs, spec_generate and `dflash-hf bench --compile` refuse it with both releases
    named, before any forward or model load; from that release on nothing refuses it."""
    import dflash_hf.cli as cli
    import dflash_hf.versions_dflash as versions_dflash

    monkeypatch.setattr(versions_dflash, "TORCH_RELEASE", release)
    monkeypatch.setattr(versions_dflash, "TORCH_VERSION", f"{release[0]}.{release[1]}.0+cu124")
    if not refused:
        assert torch_refusal("compile=True") is None
        return
    target, draft = make_target(seed=0), make_draft(0)
    forwards = []
    target.register_forward_pre_hook(lambda *_: forwards.append(1))
    major, minor = NEWER_TORCH_FEATURES["compile=True"][0]
    needs = rf"compile=True needs torch >= {major}\.{minor} \(.*\); this is torch 2\.6\.0\+cu124\. Upgrade torch"
    with pytest.raises(ValueError, match=needs):
        draft.spec_generate(target=target, input_ids=random_prompt(0, 5), max_new_tokens=4, compile=True)
    assert not forwards

    def no_loading(*_, **__):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(cli, "load_target", no_loading)
    with pytest.raises(SystemExit, match=f"dflash-hf bench --compile: {needs}"):
        cli.main(["bench", "--compile", "--num-prompts", "1", "--max-new-tokens", "4"])


@COMPILES
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


# --- Every strategy on every backend and attention family ------------------------------------------------------------

# llama3_rope: Llama 3.1's rope scaling; windows: in every layer (mistral), or in every other one (gemma3, gpt_oss)
STRATEGY_FAMILIES = ["qwen3", "llama3_rope", "mistral", "gemma3", "gpt_oss"]


def family_target(family: str) -> torch.nn.Module:
    """A tiny target of the family (sliding window WINDOW where it has one), at one thread."""
    return build_target(family)


def decode_family_batch(target, tree_size: int | None, compile: dict | None, seed: int, block_size: int,
                        lengths: tuple[int, ...], max_new_tokens: int = 20):
    """A left-padded batch whose rows are longer than the window, each decoded by a proposer of the target's own
    continuation that goes wrong at random (a chain's, or a tree's candidates with the truth at a random rank);
    asserts every row equals its own greedy decode. The result."""
    prompts = [random_prompt(seed * 10 + row, length)[0].tolist() for row, length in enumerate(lengths)]
    references = [plain_greedy(target, torch.tensor([prompt]), max_new_tokens) for prompt in prompts]
    input_ids, attention_mask = left_pad(prompts, pad_token_id=0)
    proposer = (ReferenceProposer(references, target, corrupt_seed=seed) if tree_size is None
                else TreeReferenceProposer(references, 3, seed))
    result = speculative_decode(target, proposer, input_ids, attention_mask=attention_mask,
                                max_new_tokens=max_new_tokens, block_size=block_size, tree_size=tree_size,
                                compile=compile or False)
    for row, reference in enumerate(references):
        assert result.new_tokens(row) == reference[0, len(prompts[row]):].tolist(), row
    return result


# Transformers 4.57's gpt-oss experts loop over the experts a batch was routed to, which dynamo cannot capture
ONE_GRAPH = {"gpt_oss": int(transformers.__version__.split(".")[0]) >= 5}


@COMPILES
@pytest.mark.parametrize("family", STRATEGY_FAMILIES)
@pytest.mark.parametrize("tree_size", [None, 6])
def test_compiled_chains_and_trees_equal_generate_on_every_attention_family(family, tree_size):
    """Greedy, batches of left-padded rows crossing the window, rows accepting different lengths: each row is its own
    greedy decode; a second call of other prompt lengths and length budget compiles no new graph. A forward that
    torch.compile cannot capture whole is refused by name, with the alternative."""
    target = family_target(family)
    torch._dynamo.reset()
    counters.clear()
    if not ONE_GRAPH.get(family, True):
        with pytest.raises(ValueError, match="cannot capture .* as one graph.*compile=False"):
            decode_family_batch(target, tree_size, DYNAMO_ONLY, seed=1, block_size=5, lengths=(2 * WINDOW + 3, 4))
        return
    result = decode_family_batch(target, tree_size, DYNAMO_ONLY, seed=1, block_size=5,
                                 lengths=(2 * WINDOW + 3, 4))
    assert len({length for row in result.acceptance_lengths for length in row}) > 1
    graphs = compiled_graphs()
    assert graphs == 1, counters["stats"]  # the verify (these proposers run no draft)
    decode_family_batch(target, tree_size, DYNAMO_ONLY, seed=2, block_size=5, lengths=(3, WINDOW + 5),
                        max_new_tokens=17)
    assert compiled_graphs() == graphs, counters["stats"]


@pytest.mark.parametrize("family", ["mistral", "gemma3", "gpt_oss"])
def test_eager_trees_count_the_window_in_positions(family):
    """Trees on sliding-window targets, eagerly: a tree's branches are columns but not positions, so the window is
    applied by a mask built from positions; every row equals its own greedy decode, over several seeds."""
    target = family_target(family)
    for seed in (3, 4):
        decode_family_batch(target, 7, None, seed=seed, block_size=4 + seed, lengths=(2 * WINDOW + seed, 5))


@COMPILES
@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
def test_a_compiled_tree_with_a_draft_commits_what_the_eager_tree_commits(variant):
    """The draft's features of a tree's accepted path (gathered to the left) reach the compiled draft as the eager
    one: the same tokens (the target's own) and the same acceptance lengths, step for step."""
    target = make_target(seed=11)
    draft = make_draft(11) if variant == "dflash" else make_variant_draft(variant, seed=11)
    prompts = [random_prompt(seed, length)[0].tolist() for seed, length in ((12, 9), (13, 4))]
    input_ids, attention_mask = left_pad(prompts, pad_token_id=0)
    arguments = dict(target=target, input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=24,
                     tree_size=8, return_stats=True)
    eager = draft.spec_generate(**arguments)
    compiled = draft.spec_generate(**arguments, compile=DYNAMO_ONLY)
    for row, prompt in enumerate(prompts):
        expected = plain_greedy(target, torch.tensor([prompt]), 24)[0, len(prompt):].tolist()
        assert eager.new_tokens(row) == expected
        assert compiled.new_tokens(row) == expected
    def remaining(step: int) -> int:  # what the longest row still needs before eager step `step`
        return max(24 - 1 - sum(row[:step]) for row in eager.acceptance_lengths)

    # the eager loop narrows its last blocks (so its draft drafts otherwise); the compiled one never does
    steps = next(step for step in range(len(eager.acceptance_lengths[0]) + 1) if remaining(step) < draft.block_size)
    assert steps > 5
    assert [row[:steps] for row in compiled.acceptance_lengths] == [row[:steps] for row in eager.acceptance_lengths]


@COMPILES
@pytest.mark.parametrize("family", ["llama3_rope", "gemma3", "gpt_oss"])
@pytest.mark.parametrize("tree_size", [None, 6])
def test_compiled_sampling_draws_what_the_eager_loop_draws_on_other_families(family, tree_size):
    """Sampling with a DFlash draft on targets with scaled rope or sliding windows, chain and tree, prompts past the
    window: the compiled backend draws the eager one's tokens (same seed), up to the eager loop's last, narrower
    block; other seeds draw other tokens."""
    target, draft = family_target(family), make_draft(18)
    prompt = random_prompt(19, 2 * WINDOW + 2)
    arguments = dict(target=target, input_ids=prompt, max_new_tokens=30, temperature=1.0, tree_size=tree_size)
    if not ONE_GRAPH.get(family, True):  # refused by name there
        with pytest.raises(ValueError, match="as one graph.*compile=False"):
            draft.spec_generate(**arguments, seed=0, compile=DYNAMO_ONLY)
        return
    outputs = set()
    for seed in (0, 1):
        eager = draft.spec_generate(**arguments, seed=seed)[0, prompt.shape[1]:][:30 - draft.block_size]
        compiled = draft.spec_generate(**arguments, seed=seed, compile=DYNAMO_ONLY)[0, prompt.shape[1]:]
        assert compiled[:30 - draft.block_size].tolist() == eager.tolist(), seed
        outputs.add(tuple(eager.tolist()))
    assert len(outputs) == 2


@COMPILES
def test_compiled_tree_sampling_draws_the_tokens_the_eager_tree_draws():
    """Same seed, same tokens for a sampled tree (the same uniforms for children and finals, the same candidates
    drawn by the draft), up to the eager loop's last, narrower block. Power: other seeds draw other tokens."""
    target, draft = make_target(seed=14), make_draft(14)
    prompt = random_prompt(15, 6)
    new_tokens, compared = 40, 40 - draft.block_size
    arguments = dict(target=target, input_ids=prompt, max_new_tokens=new_tokens, temperature=1.0, tree_size=6)
    outputs = set()
    for seed in (0, 1, 2):
        eager = draft.spec_generate(**arguments, seed=seed)[0, prompt.shape[1]:][:compared]
        compiled = draft.spec_generate(**arguments, seed=seed, compile=DYNAMO_ONLY)[0, prompt.shape[1]:][:compared]
        assert compiled.tolist() == eager.tolist(), seed
        outputs.add(tuple(eager.tolist()))
    assert len(outputs) == 3


@COMPILES
def test_targets_tried_one_after_another_in_a_process_never_reach_the_recompile_limit():
    """Targets of three families one after another in a process, then the first on a left-padded batch of two: four
    compiled verifies of the same code, each equal to `generate`, under a recompile limit of 2 (8 by default; 2 keeps
    the test short). Each verifier's graphs count apart (`isolate_recompiles`); counted together, as torch.compile does
    by default, dynamo stops at the limit during the third (a new family or row count compiles anew)."""
    prompts = [random_prompt(seed, length)[0].tolist() for seed, length in ((0, 5), (1, 9))]
    torch._dynamo.reset()
    targets = {family: build_target(family) for family in ("qwen3", "llama3_rope", "mistral")}
    for family, rows in [("qwen3", prompts[:1]), ("llama3_rope", prompts[:1]), ("mistral", prompts[:1]),
                         ("qwen3", prompts)]:
        target = targets[family]
        references = [plain_greedy(target, torch.tensor([prompt]), 6) for prompt in rows]
        input_ids, attention_mask = left_pad(rows, pad_token_id=0)
        result = speculative_decode(target, ReferenceProposer(references, corrupt_seed=3), input_ids,
                                    attention_mask=attention_mask, max_new_tokens=6, block_size=4,
                                    compile={**DYNAMO_ONLY, "recompile_limit": 2})
        for row, (prompt, reference) in enumerate(zip(rows, references)):
            assert result.new_tokens(row) == reference[0, len(prompt):].tolist(), (family, row)


@COMPILES
def test_reaching_the_recompile_limit_is_a_clear_error():
    """One verifier allowed a single graph (`recompile_limit`: 1): a later call that verifies a tree (another width)
    must compile anew and is refused by name with the option to pass, not with dynamo's own exception. Dynamo is
    reset first: shapes that earlier tests saw change would already be compiled as dynamic, and need no new graph."""
    torch._dynamo.reset()
    target, draft = make_target(seed=3), make_draft(3)
    options = {**DYNAMO_ONLY, "recompile_limit": 1}
    short = random_prompt(3, 6)
    assert draft.spec_generate(target=target, input_ids=short, max_new_tokens=6, compile=options).tolist() == \
        plain_greedy(target, short, 6).tolist()
    with pytest.raises(ValueError, match=r"verify has reached torch.compile's recompile limit.*compile=False"):
        draft.spec_generate(target=target, input_ids=short, max_new_tokens=6, compile=options, tree_size=4)


@pytest.mark.parametrize("compile, error, message", [
    (0, TypeError, "compile must be True, False or a dict"),
    ("no", TypeError, "compile must be True, False or a dict"),
    ({"bogus": 1}, ValueError, "takes no bogus; its options are .*backend"),
    ({"backend": "nope"}, ValueError, "names no backend of this torch.*inductor"),
])
def test_a_compile_value_torch_cannot_take_is_refused_by_name(compile, error, message):
    target, draft = make_target(seed=0), make_draft(0)
    with pytest.raises(error, match=message):
        draft.spec_generate(target=target, input_ids=random_prompt(0, 5), max_new_tokens=4, compile=compile)


def test_compile_none_is_compile_false():
    """compile=None reads as compile=False: the eager loop runs (cpu_kernels=True, refused under compile, is taken)."""
    target, draft = make_target(seed=0), make_draft(0)
    prompt = random_prompt(0, 5)
    output = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=6, compile=None, cpu_kernels=True)
    assert output.tolist() == plain_greedy(target, prompt, 6).tolist()
