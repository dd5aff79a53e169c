"""Hybrid targets (Gated DeltaNet + full attention: Qwen3-Next, Qwen3.5, Qwen3.5-MoE and the multimodal Qwen3.5
wrapper) decode exactly: their recurrent states are rolled back to each row's accepted prefix (recurrent_dflash)."""

from __future__ import annotations

import re

import pytest
import torch
import transformers
from helpers import (
    HYBRID_FAMILIES,
    RECURRENT_FAMILIES,
    ReferenceProposer,
    TreeReferenceProposer,
    make_draft,
    make_hybrid_target,
    plain_greedy,
    random_prompt,
)
from sampling_checks import NUM_NEW, NUM_SAMPLES, assert_follows, exact_joint, sampled_counts
from sampling_checks import SAMPLING_VOCAB as VOCAB

from dflash_hf import mixers_dflash, recurrent_dflash, speculative_decode
from dflash_hf.cache_dflash import left_pad
from dflash_hf.devices_dflash import target_text_config
from dflash_hf.families_dflash import RECURRENT_REFUSALS, ROLLBACK_MODEL_TYPES
from dflash_hf.generation_dflash import DecodeSession
from dflash_hf.proposer_dflash import DFlashProposer
from dflash_hf.settings_dflash import resolve_settings
from dflash_hf.support_dflash import recurrent_cache_layers
from dflash_hf.target_dflash import plain_head_parts
from dflash_hf.versions_dflash import cache_keyword

HAS_HYBRID_CACHE = hasattr(transformers, "Qwen3_5ForCausalLM")  # Transformers 5.x
needs_hybrid = pytest.mark.skipif(not HAS_HYBRID_CACHE, reason="Qwen3.5 and the linear-attention cache: 5.x only")


@pytest.fixture(scope="module")
def hybrid_targets() -> dict[str, torch.nn.Module]:
    """One tiny target per hybrid family, seed 0 (built on first use)."""
    return {}


def hybrid(targets: dict[str, torch.nn.Module], family: str) -> torch.nn.Module:
    if family not in targets:
        targets[family] = make_hybrid_target(family, seed=0)
    return targets[family]


@needs_hybrid
@pytest.mark.parametrize("family", HYBRID_FAMILIES)
@pytest.mark.parametrize("seed,length,block_size", [(0, 1, 2), (1, 7, 5), (2, 40, 16), (3, 13, 8)])
def test_greedy_equals_generate_with_rows_that_reject(hybrid_targets, family, seed, length, block_size):
    """Proposals right up to a random point: every step keeps a different count, so every step rolls back."""
    target = hybrid(hybrid_targets, family)
    prompt = random_prompt(seed, length)
    expected = plain_greedy(target, prompt, 40)
    checks_features = family not in ("qwen3_next", "qwen3_5_moe")  # MoE routing: features agree to ~2e-4 only
    proposer = ReferenceProposer(expected, target=target if checks_features else None, corrupt_seed=seed)
    result = speculative_decode(target, proposer, prompt, max_new_tokens=40, block_size=block_size)
    assert torch.equal(result.output_ids, expected)
    lengths = result.acceptance_lengths[0]
    assert len(set(lengths)) > 1 and min(lengths) < block_size, "every step accepted alike: no rollback was tested"


@needs_hybrid
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_vl"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_spec_generate_with_a_draft_equals_generate(hybrid_targets, family, block_size):
    """The real draft path: features of the (language model's) layers, then `spec_generate` == `generate`."""
    target = hybrid(hybrid_targets, family)
    draft = make_draft(3, block_size=block_size)
    for seed, length in ((0, 5), (1, 21)):
        prompt = random_prompt(seed, length)
        output = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=24)
        assert torch.equal(output, plain_greedy(target, prompt, 24))


@needs_hybrid
@pytest.mark.parametrize("family", ["qwen3_5_vl", "qwen3_5_moe_vl"])
def test_the_multimodal_wrappers_read_the_language_models_layers(hybrid_targets, family):
    target = hybrid(hybrid_targets, family)
    assert type(target).__name__.endswith("ForConditionalGeneration")
    prompt = random_prompt(4, 9)
    expected = plain_greedy(target, prompt, 20)
    checks = target if family == "qwen3_5_vl" else None  # features == hidden_states (MoE routing: to ~2e-4 only)
    proposer = ReferenceProposer(expected, target=checks, corrupt_seed=4)
    assert torch.equal(speculative_decode(target, proposer, prompt, max_new_tokens=20, block_size=6).output_ids,
                       expected)


@needs_hybrid
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next"])
def test_a_left_padded_batch_whose_rows_accept_different_counts(hybrid_targets, family):
    target = hybrid(hybrid_targets, family)
    prompts = [random_prompt(seed, length)[0].tolist() for seed, length in ((1, 5), (2, 17), (3, 11))]
    references = [plain_greedy(target, torch.tensor([prompt]), 30) for prompt in prompts]
    input_ids, attention_mask = left_pad(prompts, 0)
    proposer = ReferenceProposer(references, corrupt_seed=5, corrupt_rows={0, 2})  # row 1 is always right
    result = speculative_decode(target, proposer, input_ids, max_new_tokens=30, block_size=6,
                                attention_mask=attention_mask)
    for row, (prompt, reference) in enumerate(zip(prompts, references)):
        assert result.new_tokens(row) == reference[0, len(prompt):].tolist(), row
    first_steps = [lengths[:3] for lengths in result.acceptance_lengths]
    assert first_steps[1] == [6, 6, 6] and first_steps[0] != first_steps[1], first_steps


@needs_hybrid
def test_a_stop_token_mid_block_and_max_new_tokens_mid_block(hybrid_targets):
    target = hybrid(hybrid_targets, "qwen3_5")
    prompt = random_prompt(6, 8)
    free = plain_greedy(target, prompt, 30)[0, 8:].tolist()
    stop = next(token for index, token in enumerate(free) if index >= 5 and token not in free[:index])
    expected = plain_greedy(target, prompt, 30, stop_token_ids=[stop])
    proposer = ReferenceProposer(plain_greedy(target, prompt, 40))  # always right: the stop falls inside a block
    result = speculative_decode(target, proposer, prompt, max_new_tokens=30, block_size=8, stop_token_ids=[stop])
    assert torch.equal(result.output_ids, expected) and result.new_tokens(0)[-1] == stop
    result = speculative_decode(target, ReferenceProposer(plain_greedy(target, prompt, 40)), prompt,
                                max_new_tokens=13, block_size=8)
    assert torch.equal(result.output_ids, plain_greedy(target, prompt, 13))


@needs_hybrid
def test_the_generation_configs_stop_token_and_a_draft_vocabulary(hybrid_targets):
    import copy

    target = copy.deepcopy(hybrid(hybrid_targets, "qwen3_5"))
    prompt = random_prompt(6, 8)
    free = plain_greedy(target, prompt, 30)[0, 8:].tolist()
    stop = next(token for index, token in enumerate(free) if index >= 4 and token not in free[:index])
    target.generation_config.eos_token_id = stop
    expected = target.generate(prompt, max_new_tokens=30, do_sample=False, pad_token_id=0)
    draft = make_draft(2, block_size=5)
    assert torch.equal(draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=30), expected)
    vocabulary = sorted(set(free) | set(range(0, 127, 3)))
    assert torch.equal(draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=30,
                                           draft_vocab=vocabulary), expected)


OTHER_FAMILIES = sorted(family for family in RECURRENT_FAMILIES if family in ROLLBACK_MODEL_TYPES)


@needs_hybrid
@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_other_recurrent_families_run_exactly_through_the_same_rollback(hybrid_targets, family):
    """Kimi Delta Attention, OLMo-Hybrid's Gated DeltaNet, Mamba-2 (Nemotron-H, Granite 4), LFM2 short convolutions."""
    target = hybrid(hybrid_targets, family)
    assert recurrent_cache_layers(transformers.DynamicCache(config=target_text_config(target)))
    for seed, length, block_size in ((0, 1, 3), (1, 9, 6)):
        prompt = random_prompt(seed, length)
        expected = plain_greedy(target, prompt, 30)
        result = speculative_decode(target, ReferenceProposer(expected, corrupt_seed=seed), prompt,
                                    max_new_tokens=30, block_size=block_size)
        assert torch.equal(result.output_ids, expected), (seed, length, block_size)
        assert len(set(result.acceptance_lengths[0])) > 1
    prompts = [random_prompt(seed, length)[0].tolist() for seed, length in ((1, 5), (2, 12), (3, 8))]
    references = [plain_greedy(target, torch.tensor([prompt]), 20) for prompt in prompts]
    input_ids, attention_mask = left_pad(prompts, 0)
    result = speculative_decode(target, ReferenceProposer(references, corrupt_seed=3), input_ids, max_new_tokens=20,
                                block_size=5,
                                attention_mask=attention_mask)
    for row, (prompt, reference) in enumerate(zip(prompts, references)):
        assert result.new_tokens(row) == reference[0, len(prompt):].tolist(), row


def layer_tensors(value: object, name: str = "") -> dict[str, torch.Tensor]:
    """Every tensor a cache layer holds, by attribute path (`conv_states.0`, ...): its attributes, dicts and lists
    walked, whatever the installed Transformers keeps (states, token counters, ...)."""
    if isinstance(value, torch.Tensor):
        return {name: value}
    items = (vars(value).items() if name == "" else value.items() if isinstance(value, dict)
             else enumerate(value) if isinstance(value, (list, tuple)) else ())
    return {path: tensor for key, item in items
            for path, tensor in layer_tensors(item, f"{name}.{key}" if name else str(key)).items()}


def plain_states(target: torch.nn.Module, tokens: list[int]) -> dict[int, dict[str, torch.Tensor]]:
    """Every tensor of each recurrent cache layer after one plain forward over `tokens` with a fresh cache."""
    cache = transformers.DynamicCache(config=target_text_config(target))
    with torch.no_grad():
        target(input_ids=torch.tensor([tokens]), use_cache=True, **{cache_keyword(target): cache})
    return {layer: layer_tensors(cache.layers[layer]) for layer in recurrent_cache_layers(cache)}


def assert_states_equal_plain_forwards(target: torch.nn.Module, session: DecodeSession, atol: float = 1e-5) -> None:
    """Each active row's recurrent cache layers hold, tensor for tensor, what a plain forward over its committed tokens
    leaves (to `atol`): per-row tensors that row's, and a batch-wide count (a 0-d tensor) the cache's columns (holes
    included, as the attention layers keep them). A compiled batch keeps finished rows: its live rows' places in the
    cache are its `rows`."""
    state = session.state
    fixed = getattr(state.backend, "rows", None)  # static_dflash.FixedRowBatch
    for position, row in enumerate(state.active):
        if state.finished[row]:
            continue
        place = position if fixed is None else fixed.rows[position]
        committed = state.prompts[row] + state.generated[row][:-1]  # the pending token is not in the cache
        for layer, expected in plain_states(target, committed).items():
            live = layer_tensors(state.backend.cache.layers[layer])
            assert live.keys() == expected.keys(), layer
            for name, tensor in expected.items():
                if tensor.dim() == 0:  # a token count
                    holes = state.backend.columns.width - len(committed)
                    assert int(live[name]) == int(tensor) + holes, (layer, name)
                else:
                    torch.testing.assert_close(live[name][place], tensor[0], rtol=1e-4, atol=atol,
                                               msg=lambda message, at=(layer, name): f"{at}: {message}")


def decode_checking_states(target: torch.nn.Module, batch: bool, tree_size: int | None,
                           compile: bool | dict = False, atol: float = 1e-5) -> int:
    """A chain's rows keep different prefixes, a tree's rows different root-to-leaf paths; after the prefill and every
    step each recurrent cache layer's tensors equal a plain forward's over the row's committed tokens, to `atol` (eager
    or compiled backend). The number of steps."""
    prompts = [random_prompt(7, 9)[0].tolist()] + ([random_prompt(8, 3)[0].tolist()] if batch else [])
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
        assert_states_equal_plain_forwards(target, session, atol)
        while session.step():
            steps += 1
            assert_states_equal_plain_forwards(target, session, atol)
    return steps


def verify_and_discard(target: torch.nn.Module, compile: bool | dict = False) -> DecodeSession:
    """A verify, then `discard_verify` (what the cost model does): every tensor of every recurrent cache layer must be
    as before the verify. The session, to go on with."""
    prompt = random_prompt(9, 6)
    settings = resolve_settings(target, prompt, None, max_new_tokens=8, block_size=4, compile=compile)
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
            live = layer_tensors(cache.layers[layer])
            assert live.keys() == before[layer].keys()
            for name, tensor in before[layer].items():
                assert torch.equal(live[name], tensor), (layer, name)
    return session


@needs_hybrid
@pytest.mark.parametrize("batch,tree_size", [(False, None), (True, None), (False, 9), (True, 9)])
def test_after_every_step_each_state_equals_a_plain_forwards(hybrid_targets, batch, tree_size):
    """Every tensor of every recurrent cache layer (states and token counts alike) after every step."""
    assert decode_checking_states(hybrid(hybrid_targets, "qwen3_5"), batch, tree_size) >= 3


@needs_hybrid
def test_a_discarded_verify_leaves_every_tensor_as_it_was(hybrid_targets):
    """The cost model verifies and discards: every tensor of the recurrent layers must be the committed one again."""
    verify_and_discard(hybrid(hybrid_targets, "qwen3_5"))


@needs_hybrid
def test_the_state_checks_catch_any_one_piece_of_state_left_out(hybrid_targets, monkeypatch):
    """Power of the two tests above: a rollback that leaves out any one attribute of a cache layer (a state, a token
    count, whatever the installed Transformers keeps), or that leaves the token count as the replay left it, fails."""
    target = hybrid(hybrid_targets, "qwen3_5")
    cache = transformers.DynamicCache(config=target_text_config(target))
    with torch.no_grad():
        target(input_ids=random_prompt(1, 4), use_cache=True, **{cache_keyword(target): cache})
    layer = cache.layers[recurrent_cache_layers(cache)[0]]
    held = sorted({name.split(".")[0] for name in layer_tensors(layer)})
    assert {"conv_states", "recurrent_states"} <= set(held)
    copied = recurrent_dflash.copied
    for left_out in held:  # its live tensors stand in for the snapshot: that attribute is never put back
        monkeypatch.setattr(recurrent_dflash, "snapshot", lambda layer, left_out=left_out: {
            name: value if name == left_out else copied(value) for name, value in vars(layer).items()})
        with pytest.raises(AssertionError):
            decode_checking_states(target, batch=False, tree_size=None)
            verify_and_discard(target)
    monkeypatch.undo()
    if any(tensor.dim() == 0 for tensor in layer_tensors(layer).values()):  # a Transformers that counts tokens
        monkeypatch.setattr(recurrent_dflash, "align_token_count", lambda layer, num_columns: None)
        with pytest.raises(AssertionError):
            decode_checking_states(target, batch=True, tree_size=None)


@needs_hybrid
@pytest.mark.parametrize("tree_size", [None, 5])
def test_sampling_keeps_the_hybrid_targets_distribution(tree_size):
    """A chain, and a tree (its mixers along the tree's paths, the states along the accepted one)."""
    target = make_hybrid_target("qwen3_5", seed=11, vocab_size=VOCAB, init_std=0.4)
    draft = make_draft(12, block_size=4, vocab_size=VOCAB, mask_token_id=VOCAB - 1)
    input_ids = torch.tensor([[1, 4, 2, 5]])
    counts, accepted = sampled_counts(target, DFlashProposer(draft, target, VOCAB - 1, sample_proposals=True),
                                      input_ids, torch.Generator().manual_seed(1234), max_new_tokens=NUM_NEW,
                                      block_size=4, temperature=1.0, tree_size=tree_size)
    assert accepted > NUM_SAMPLES // 10  # proposals were accepted and rejected: the rollback ran
    # power: the same counts reject a nearby wrong distribution
    assert_follows(counts, exact_joint(target, input_ids, 1.0, None, None),
                   exact_joint(target, input_ids, 1.5, None, None))


# --- Trees on hybrid targets: each column's mixer output from its ancestors only; states along the accepted path ----


@needs_hybrid
@pytest.mark.parametrize("family", [*HYBRID_FAMILIES, *OTHER_FAMILIES])
def test_greedy_trees_equal_generate_through_the_rollback(hybrid_targets, family):
    """The tree's best candidate is often not the target's token, so paths through later siblings are kept (a
    recurrence over the columns in order would feed a kept node its earlier siblings: that fails here)."""
    target = hybrid(hybrid_targets, family)
    for seed, length, block_size, tree_size in ((1, 9, 8, 8), (3, 5, 8, 24)):
        prompt = random_prompt(seed, length)
        expected = plain_greedy(target, prompt, 30)
        result = speculative_decode(target, TreeReferenceProposer(expected, 4, seed), prompt, max_new_tokens=30,
                                    block_size=block_size,
                                    tree_size=tree_size)
        assert torch.equal(result.output_ids, expected), (seed, length, block_size, tree_size)
        assert len(set(result.acceptance_lengths[0])) > 1


@needs_hybrid
def test_spec_generate_with_a_tree_on_the_multimodal_wrapper_equals_generate(hybrid_targets):
    target = hybrid(hybrid_targets, "qwen3_5_vl")
    draft = make_draft(3, block_size=8)
    for seed, length in ((0, 5), (1, 21)):
        prompt = random_prompt(seed, length)
        output = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=20, tree_size=8)
        assert torch.equal(output, plain_greedy(target, prompt, 20))


@needs_hybrid
def test_a_users_hooks_on_a_mixer_see_the_trees_columns_and_shape_the_output():
    """A pre-hook (before the loop's own, which turns columns into paths) and a forward hook (after the loop's, which
    turns paths back into columns) change what the target computes: the tree's output is still the hooked target's."""
    target = make_hybrid_target("qwen3_5", seed=4)
    mixer = target.model.layers[0].linear_attn
    shapes: list[tuple[int, ...]] = []

    def scale_input(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        return args, {**kwargs, "hidden_states": kwargs["hidden_states"] * 1.5}

    def halve_output(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        shapes.append(tuple(output.shape[:2]))
        return output * 0.5

    handles = [mixer.register_forward_pre_hook(scale_input, with_kwargs=True),
               mixer.register_forward_hook(halve_output)]
    try:
        prompt = random_prompt(5, 7)
        expected = plain_greedy(target, prompt, 20)
        shapes.clear()
        result = speculative_decode(target, TreeReferenceProposer(expected, 3, 5), prompt, max_new_tokens=20,
                                    block_size=6, tree_size=7)
        assert torch.equal(result.output_ids, expected)
        assert (1, 8) in shapes and {rows for rows, _ in shapes} == {1}  # the tree's columns, never the paths
    finally:
        for handle in handles:
            handle.remove()
    assert not torch.equal(plain_greedy(target, prompt, 20), expected)  # the hooks changed the target's output


# --- Refusals --------------------------------------------------------------------------------------------------------


@needs_hybrid
@pytest.mark.parametrize("family", sorted(RECURRENT_REFUSALS))
def test_recurrent_families_that_cannot_be_rolled_back_are_refused_by_name_and_reason(family):
    target = make_hybrid_target(family)
    reason = re.escape(RECURRENT_REFUSALS[family][:40])
    with pytest.raises(ValueError, match=rf"{type(target).__name__} \({family}\) is not supported: .*{reason}"):
        make_draft(0).spec_generate(target=target, input_ids=random_prompt(0, 5), max_new_tokens=4)


@pytest.mark.skipif(HAS_HYBRID_CACHE, reason="Transformers 4.x only: its Qwen3-Next cache")
@pytest.mark.parametrize("compile", [False, True])
def test_qwen3_next_on_transformers_4_is_refused_with_the_version_to_install(compile):
    """4.57 keeps Qwen3-Next's states in a model-specific cache: refused by name before any forward, eager or compiled
    (the compiled backend gives the eager loop's reason first)."""
    torch.manual_seed(0)
    config = transformers.Qwen3NextConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32)
    target = transformers.Qwen3NextForCausalLM(config).eval()
    with pytest.raises(ValueError, match=r"Qwen3NextForCausalLM \(qwen3_next\) is not supported: .*linear_attention.*"
                                         r"model-specific cache.*install transformers 5\.25"):
        make_draft(0).spec_generate(target=target, input_ids=random_prompt(0, 5), max_new_tokens=4, compile=compile)


# --- The rest of the package with a hybrid target -------------------------------------------------------------------


@needs_hybrid
def test_generate_with_custom_generate_and_a_streamer_on_a_hybrid_target(hybrid_targets, tmp_path):
    from transformers import TextStreamer

    class Collect(TextStreamer):
        def __init__(self) -> None:
            self.tokens: list[int] = []

        def put(self, value: torch.Tensor) -> None:
            self.tokens.extend(value.flatten().tolist())

        def end(self) -> None:
            pass

    target = hybrid(hybrid_targets, "qwen3_5")
    draft = make_draft(5, block_size=6)
    draft.save_pretrained(tmp_path / "draft")
    prompt = random_prompt(10, 7)
    expected = plain_greedy(target, prompt, 16)
    output = target.generate(prompt, custom_generate=str(tmp_path / "draft"), trust_remote_code=True,
                             max_new_tokens=16, do_sample=False)
    assert torch.equal(output, expected)
    streamer = Collect()
    streamed = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=16, streamer=streamer)
    assert torch.equal(streamed, expected) and streamer.tokens == expected[0].tolist()


@needs_hybrid
def test_bench_on_a_hybrid_target_runs_transformers_own_assisted_decoding_and_says_whether_it_is_exact(
        hybrid_targets):
    """Transformers 5.25 runs its assisted decoding (prompt lookup, its DFlash) on hybrid targets, not always exactly:
    the table marks a method whose output is not the target's own."""
    from helpers import make_tokenizer

    from dflash_hf.benchmark import run_benchmark
    from dflash_hf.evaluation import BenchSettings, markdown_table

    target = make_hybrid_target("qwen3_5", seed=1)
    draft = make_draft(2, block_size=4, mask_token_id=127)
    results = run_benchmark(draft, target, make_tokenizer(), {"gsm8k": [["w10 w11 w12"], ["w20 w21"]]},
                            BenchSettings(max_new_tokens=8, prompt_lookup_tokens=3), progress=False)
    result = results[0]
    assert result["lossless"] is True
    assert set(result["tokens_per_s"]) == {"plain", "dflash", "prompt_lookup", "transformers_dflash"}
    row = markdown_table(results).splitlines()[-1]
    assert "refused by Transformers" not in row
    assert row.count("(NOT lossless)") == [result["lossless_prompt_lookup"], result["lossless_transformers_dflash"]
                                           ].count(False)


@needs_hybrid
def test_a_draft_trains_on_a_hybrid_targets_features(tmp_path):
    from dflash_hf.training.trainer import TrainingSettings, train_draft

    target = make_hybrid_target("qwen3_5", seed=4)
    generator = torch.Generator().manual_seed(3)
    rows = []
    for _ in range(3):
        prompt = torch.randint(0, 127, (1, 5), generator=generator)
        response = plain_greedy(target, prompt, 16)[0, 5:]
        rows.append({"prompt_ids": prompt[0].tolist(), "response_ids": response.tolist()})
    draft = make_draft(5, block_size=4)
    before = {name: value.clone() for name, value in draft.state_dict().items()}
    log = train_draft(draft, target, rows, TrainingSettings(epochs=1, learning_rate=2e-3, num_anchors=4, distill=True),
                      tmp_path / "run", progress=False)
    assert log.steps == 3 and all(loss == loss for loss in log.losses)  # finite losses
    assert any(not torch.equal(before[name], value) for name, value in draft.state_dict().items())


@needs_hybrid
def test_the_published_qwen3_5_draft_config_maps_onto_a_qwen3_5_27b_shaped_target():
    """`z-lab/Qwen3.5-27B-DFlash`'s config (8 tapped layers of 64) on the 64-layer hybrid shape, widths / 40."""
    from dflash_hf.synthetic import build_synthetic_pair, shrink_configs, synthetic_spec

    spec = synthetic_spec("Qwen3.5-27B")
    target_config, draft_config = shrink_configs(spec.target_config, spec.draft_config, 40)
    target, draft = build_synthetic_pair(target_config, draft_config, torch.device("cpu"), torch.float32)
    target.generation_config.eos_token_id = None
    assert len(recurrent_cache_layers(transformers.DynamicCache(config=target.config))) == 48
    assert max(draft.target_layer_ids) == 61
    prompt = torch.randint(0, target_config["vocab_size"] - 1, (1, 6), generator=torch.Generator().manual_seed(0))
    output = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=8)
    assert torch.equal(output, plain_greedy(target, prompt, 8))


@needs_hybrid
def test_a_draft_for_another_layer_count_is_refused_on_a_hybrid_target(hybrid_targets):
    target = hybrid(hybrid_targets, "qwen3_5")
    draft = make_draft(0, num_target_layers=64)
    with pytest.raises(ValueError, match=r"num_target_layers"):
        draft.spec_generate(target=target, input_ids=random_prompt(0, 5), max_new_tokens=4)


@needs_hybrid
def test_the_dflash2_draft_config_runs_on_its_qwen3_5_family_target_shape():
    """The DFlash2 draft (for Qwen3.8-27B, a qwen3_5-family target of Qwen3.5-27B's shape), widths / 40."""
    from dflash_hf.loading import PUBLISHED_CONFIGS
    from dflash_hf.synthetic import build_synthetic_pair, shrink_configs, synthetic_spec

    spec = synthetic_spec("Qwen3.5-27B", draft_config=PUBLISHED_CONFIGS / "Qwen3.8-27B-DFlash2.json")
    target_config, draft_config = shrink_configs(spec.target_config, spec.draft_config, 40)
    target, draft = build_synthetic_pair(target_config, draft_config, torch.device("cpu"), torch.float32)
    assert type(draft).__name__ == "DFlash2DraftModel" and draft.target_layer_ids == [5, 19, 33, 47, 61]
    target.generation_config.eos_token_id = None
    prompt = torch.randint(0, target_config["vocab_size"] - 1, (1, 6), generator=torch.Generator().manual_seed(1))
    output = draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=8)
    assert torch.equal(output, plain_greedy(target, prompt, 8))


# --- Hub kernels (Transformers 5.25 `kernelize`, on by default in `from_pretrained`) ---------------------------------

# A stand-in Hub kernel for `causal_conv1d_forward` that keeps the convolution state to itself, as a runtime that
# manages its own state may: the cache layer's `conv_states` are never written (it keeps the token count as
# Transformers' function does).
PRIVATE_STATE_KERNEL = '''
import weakref

import torch
from torch import nn


class PrivateStateConv(nn.Module):
    has_backward = False

    def forward(self, conv1d, hidden_states, cache, layer_idx, activation=None, state_idx=0, **kwargs):
        CALLS.append(layer_idx)
        states = self.__dict__.setdefault("private_states", weakref.WeakKeyDictionary())
        width, length = conv1d.kernel_size[0], hidden_states.shape[-1]
        layer = None if cache is None else cache.layers[layer_idx]
        previous = states.get(cache, {}).get(layer_idx) if layer is not None and layer.has_previous_state[0] else None
        if previous is None:
            previous = hidden_states.new_zeros(*hidden_states.shape[:2], width - 1)
        full = torch.cat((previous, hidden_states), dim=-1)
        out = torch.nn.functional.conv1d(full, conv1d.weight, conv1d.bias, groups=full.shape[1])[..., -length:]
        if layer is not None:
            states.setdefault(cache, {})[layer_idx] = full[..., 1 - width:].clone()
            layer.has_previous_state[0] = True
            layer.cumulative_length_linear.add_(length)
        return torch.nn.functional.silu(out) if activation in ("silu", "swish") else out


class layers:
    PrivateStateConv = PrivateStateConv


CALLS = []
'''


def with_private_state_kernel(target: torch.nn.Module, folder) -> list[int]:
    """Install the stand-in through kernels' own `kernelize`, as a Hub kernel is; the list of its calls."""
    import importlib
    import json

    from kernels import LocalLayerRepository, Mode, kernelize, use_kernel_mapping

    build = folder / "build" / "torch-universal"  # any torch build: a CUDA build of torch on a CPU too
    build.mkdir(parents=True)
    (build / "__init__.py").write_text(PRIVATE_STATE_KERNEL)
    (build / "metadata.json").write_text(json.dumps({
        "id": f"dflash_private_state_{id(folder)}", "name": "private-state", "version": 1, "license": "Apache-2.0",
        "python-depends": [], "backend": {"type": "universal"}}))
    repository = LocalLayerRepository(repo_path=folder, layer_name="PrivateStateConv")
    with use_kernel_mapping({"causal_conv1d_forward": {"cpu": {Mode.INFERENCE: repository}}}, inherit_mapping=False):
        kernelize(target, mode=Mode.INFERENCE, device="cpu")
    return importlib.import_module(f"dflash_private_state_{id(folder)}").CALLS


@needs_hybrid
def test_a_kernel_that_keeps_its_conv_state_privately_is_refused_before_any_forward(tmp_path, monkeypatch):
    """Refused by name, before the prefill; power: with the refusal bypassed the output stops being the target's."""
    target = make_hybrid_target("qwen3_5", seed=0)
    prompt = random_prompt(4, 9)
    expected = plain_greedy(target, prompt, 24)
    calls = with_private_state_kernel(target, tmp_path)
    assert torch.equal(plain_greedy(target, prompt, 24), expected) and calls  # the stand-in is faithful, and ran
    forwards = []
    target.register_forward_pre_hook(lambda module, args: forwards.append(1))
    calls.clear()
    with pytest.raises(ValueError, match=r"Hub kernels .*causal_conv1d_forward.*use_kernels=False"):
        speculative_decode(target, ReferenceProposer(expected, corrupt_seed=4), prompt, max_new_tokens=24,
                           block_size=6)
    assert not forwards and not calls
    monkeypatch.setattr(mixers_dflash, "kernel_replacements", lambda mixer: [])
    with pytest.raises(AssertionError, match="a token the target would not produce"):  # its state escaped the rollback
        speculative_decode(target, ReferenceProposer(expected, corrupt_seed=4), prompt, max_new_tokens=24,
                           block_size=6)


class WrongProposer:
    """Proposes token 0 everywhere: the target rejects it (at these seeds), so every step keeps one column."""

    target_layer_ids = None

    def propose(self, step):
        return torch.zeros(len(step.row_ids), step.block_size - 1, dtype=torch.long)


@needs_hybrid
def test_the_first_step_of_a_new_target_replays_only_the_recurrence():
    """The LM-head probe of a target's first verify runs before the rollback's hooks: none of its calls is recorded,
    so the first step's rollback replays the Gated DeltaNet recurrence from the verify's calls alone (a recorded probe
    made it run each whole mixer again, projections included, outside any target forward)."""
    target = make_hybrid_target("qwen3_5", seed=3)  # never probed: its first verify runs the probe
    mixers = mixers_dflash.find_mixers(target, recurrent_cache_layers(
        transformers.DynamicCache(config=target_text_config(target))))
    mixer_forwards, decoder_forwards, rules = [], [], []
    handles = [mixer.module.register_forward_hook(lambda *args: mixer_forwards.append(1)) for mixer in mixers]
    handles += [rule.register_forward_hook(lambda *args: rules.append(1)) for mixer in mixers
                for rule in mixer.gated_delta[1:]]
    handles.append(target.get_decoder().register_forward_hook(lambda *args: decoder_forwards.append(1)))
    prompt = random_prompt(9, 7)
    session = DecodeSession(target, WrongProposer(), resolve_settings(target, prompt, None, max_new_tokens=20,
                                                                      block_size=6))
    try:
        with session.running():
            session.prefill(prompt)
            assert session.step()  # the first step
    finally:
        for handle in handles:
            handle.remove()
    assert session.state.acceptance_lengths[0] == [1]  # it kept 1 of its 6 columns: its states were rolled back
    assert session.state.generated[0] == plain_greedy(target, prompt, 2)[0, 7:].tolist()
    assert len(decoder_forwards) == 4  # the prefill, the probe's two (target and base model), the verify
    assert len(mixer_forwards) == len(mixers) * len(decoder_forwards)  # no mixer ran outside a target forward
    assert len(rules) == len(mixers) * (len(decoder_forwards) + 1)  # each forward's rule, and the replay's


@needs_hybrid
def test_a_new_hybrid_target_keeps_its_lm_head_fast_path_under_a_tree():
    """A tree's first verify probes the LM head before its mixers are hooked to run along the tree's paths: the probe
    succeeds and the fast path (the base model and the head, called directly) stays on for every later verify."""
    target = make_hybrid_target("qwen3_5", seed=4)  # never probed
    prompt = random_prompt(10, 6)
    expected = plain_greedy(target, prompt, 12)
    result = speculative_decode(target, TreeReferenceProposer(expected, 3, 4), prompt, max_new_tokens=12,
                                block_size=4, tree_size=5)
    assert torch.equal(result.output_ids, expected)
    assert plain_head_parts(target) is not None


@needs_hybrid
@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_next", "olmo_hybrid"])
def test_a_chains_rollback_replays_only_the_gated_delta_recurrence(hybrid_targets, family):
    """Gated DeltaNet layers: after a chain's verify only the convolution's state update and the recurrence run again
    (from their recorded arguments), never the mixer with its projections; the output stays the target's own."""
    target = hybrid(hybrid_targets, family)
    prompt = random_prompt(5, 11)
    expected = plain_greedy(target, prompt, 30)
    mixers = mixers_dflash.find_mixers(target, recurrent_cache_layers(
        transformers.DynamicCache(config=target_text_config(target))))
    assert all(mixer.gated_delta is not None for mixer in mixers)
    forwards, decoder_forwards = [], []
    handles = [mixer.module.register_forward_hook(lambda *args: forwards.append(1)) for mixer in mixers]
    handles.append(target.get_decoder().register_forward_hook(lambda *args: decoder_forwards.append(1)))
    try:
        result = speculative_decode(target, ReferenceProposer(expected, corrupt_seed=5), prompt, max_new_tokens=30,
                                    block_size=6)
    finally:
        for handle in handles:
            handle.remove()
    assert torch.equal(result.output_ids, expected)
    assert min(result.acceptance_lengths[0]) < 6  # steps rolled back
    assert len(decoder_forwards) >= 1 + len(result.acceptance_lengths[0])  # the prefill and one verify per step
    assert len(forwards) == len(mixers) * len(decoder_forwards)  # no mixer ran outside a target forward
