"""spec_generate across target families: lossless for every decoder whose KV cache can be cut back to the accepted
prefix (sliding-window layers included), refused up front for targets whose cache holds a recurrent state.

Tiny random float32 targets (hidden 64, 4 layers, vocab 128, sliding window 8), one per family and module. A family
is skipped only when the installed Transformers lacks its class.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from helpers import (
    COMMON_DECODER,
    FAMILIES,
    SOFT_CAPPED,
    WINDOW,
    WINDOWED,
    ReferenceProposer,
    build_target,
    make_draft,
    plain_greedy,
    random_prompt,
    transformers_class,
)

from dflash_hf import backends_dflash, left_pad, speculative_decode
from dflash_hf.target_dflash import plain_head_parts, verify_forward
from dflash_hf.versions_dflash import cache_keyword, returned_cache

NEW_TOKENS = 24


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models gain nothing from a second thread, and one keeps the module fast on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def targets() -> dict[str, torch.nn.Module]:
    """Each family's tiny target, built once for the module (on first use: see `target_of`)."""
    return {}


def target_of(targets: dict[str, torch.nn.Module], family: str) -> torch.nn.Module:
    if family not in targets:
        targets[family] = build_target(family)
    return targets[family]



# --- Lossless: every family equals its own greedy decode -------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_spec_generate_equals_plain_greedy(targets, family):
    """Short prompts and prompts longer than the window; generations that cross it; block sizes 4 and 8."""
    target = target_of(targets, family)
    for seed, length in ((0, 5), (1, 3 * WINDOW - 3)):
        draft = make_draft(seed, block_size=8)
        input_ids = random_prompt(500 + seed, length)
        expected = plain_greedy(target, input_ids, max_new_tokens=NEW_TOKENS)
        for block_size in (4, 8):
            output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=NEW_TOKENS,
                                         block_size=block_size)
            assert torch.equal(output, expected), f"seed={seed} prompt={length} block_size={block_size}"


@pytest.mark.parametrize("family", FAMILIES)
def test_a_left_padded_batch_equals_each_row_alone(targets, family):
    target = target_of(targets, family)
    prompts = [random_prompt(500 + 2, 4), random_prompt(500 + 3, 2 * WINDOW + 3)]
    input_ids, attention_mask = left_pad([ids[0].tolist() for ids in prompts], pad_token_id=0)
    result = make_draft(2, block_size=8).spec_generate(
        target=target, input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=NEW_TOKENS, block_size=4,
        return_stats=True)
    for row, ids in enumerate(prompts):
        expected = plain_greedy(target, ids, max_new_tokens=NEW_TOKENS)[0, ids.shape[1]:].tolist()
        assert result.new_tokens(row) == expected, f"row {row}"


@pytest.mark.parametrize("family", WINDOWED)
def test_rows_accepting_different_lengths_keep_the_window_exact(targets, family, monkeypatch):
    """One row accepts every proposal, the other only a random prefix: the rejected columns of the second row must not
    shrink its attention window (the window counts cache columns), so its cache is compacted before each verify."""
    target = target_of(targets, family)
    prompts = [random_prompt(500 + 4, 2 * WINDOW + 1), random_prompt(500 + 5, 3)]
    references = [plain_greedy(target, ids, max_new_tokens=NEW_TOKENS) for ids in prompts]
    input_ids, attention_mask = left_pad([ids[0].tolist() for ids in prompts], pad_token_id=0)
    compactions = []
    reorder = backends_dflash.reorder_cache_columns
    monkeypatch.setattr(backends_dflash, "reorder_cache_columns",
                        lambda cache, index: compactions.append(index.shape) or reorder(cache, index))
    proposer = ReferenceProposer(references, corrupt_seed=6, corrupt_rows={1})
    result = speculative_decode(target, proposer, input_ids, max_new_tokens=NEW_TOKENS, block_size=6,
                                attention_mask=attention_mask)
    for row, reference in enumerate(references):
        assert result.new_tokens(row) == reference[0, prompts[row].shape[1]:].tolist(), f"row {row}"
    assert compactions  # the rows' holes were removed, far below the usual hole budget
    assert len(set(map(tuple, result.acceptance_lengths))) > 1


# --- The verify pass gives the target's own logits ------------------------------------------------------------------


@pytest.mark.parametrize("family", SOFT_CAPPED)
def test_verify_logits_are_the_targets_own_soft_capped_logits(targets, family):
    """Greedy output alone would not show a missing soft-cap (tanh keeps the argmax): compare the logits that
    sampling uses, for a verify block on top of a cached prefix as in the loop."""
    target = target_of(targets, family)
    sequence = random_prompt(500 + 7, 2 * WINDOW + 6)
    prefix, block = sequence[:, :-6], sequence[:, -6:]
    keyword = cache_keyword(target)

    def verify_inputs():  # a fresh cache of the prefix, and the block at its positions
        cache = returned_cache(target(input_ids=prefix, use_cache=True))
        return dict(input_ids=block, position_ids=torch.arange(prefix.shape[1], sequence.shape[1])[None],
                    use_cache=True, **{keyword: cache})

    with torch.no_grad():
        logits, _ = verify_forward(target, **verify_inputs())
        own = target(**verify_inputs()).logits
        whole = target(input_ids=sequence).logits[:, -6:]
        bare = target.get_output_embeddings()(target.model(input_ids=sequence).last_hidden_state[:, -6:])
    torch.testing.assert_close(logits, own)  # the same pass
    torch.testing.assert_close(logits, whole, rtol=1e-4, atol=1e-4)  # cached and uncached agree up to rounding
    assert not torch.allclose(bare, whole, atol=1e-2)  # the bare head's logits would differ: the check is meaningful
    assert (whole.softmax(-1) - bare.softmax(-1)).abs().max() > 1e-3  # and so would the sampling distribution
    assert plain_head_parts(target) is None  # the fast path refused itself


@pytest.mark.parametrize("family", ["qwen3", "mistral", "gpt_oss"])
def test_plain_heads_keep_the_fast_path(targets, family):
    assert plain_head_parts(target_of(targets, family)) is not None


# --- Recurrent-state targets: rolled back (5.x, tests/test_hybrid_targets.py) or refused up front ------------------

LINEAR_HEADS = dict(linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
RECURRENT = {  # name -> (causal LM class, config class, settings beyond COMMON_DECODER, layer type the message names)
    "qwen3_next": ("Qwen3NextForCausalLM", "Qwen3NextConfig",
                   dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, **LINEAR_HEADS),
                   "linear_attention"),
    "qwen3_5": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", LINEAR_HEADS, "linear_attention"),
    "kimi_linear": ("KimiLinearForCausalLM", "KimiLinearConfig",
                    dict(pad_token_id=0, num_key_value_heads=4,  # MLA: Transformers' attention takes kv = heads
                         linear_num_heads=4, linear_head_dim=16, num_experts=4,
                         num_experts_per_token=2, moe_intermediate_size=32, kv_lora_rank=16, qk_rope_head_dim=8,
                         qk_nope_head_dim=8, v_head_dim=16,
                         layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"]),
                    "linear_attention"),
    "lfm2": ("Lfm2ForCausalLM", "Lfm2Config", dict(full_attn_idxs=[1, 3]), "conv"),
    "jamba": ("JambaForCausalLM", "JambaConfig", dict(num_experts=2, attn_layer_period=2, attn_layer_offset=1,
                                                      expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8),
              "(mamba|linear_attention) \\(layers 0, 2\\)"),
}


@pytest.mark.parametrize("name", RECURRENT)
def test_recurrent_state_targets_run_exactly_or_are_refused_before_any_forward(name):
    from dflash_hf.families_dflash import ROLLBACK_MODEL_TYPES

    model_class, config_class, settings, layer_type = RECURRENT[name]
    model_class, config_class = transformers_class(model_class), transformers_class(config_class)
    torch.manual_seed(0)
    target = model_class(config_class(**{**COMMON_DECODER, **settings})).eval()
    draft = make_draft(0, block_size=8)  # the draft itself is fine
    prompt = random_prompt(500 + 8, 6)
    if name in ROLLBACK_MODEL_TYPES and hasattr(transformers, "Qwen3_5ForCausalLM"):  # rolled back on 5.x
        target.generation_config.eos_token_id = None
        assert torch.equal(draft.spec_generate(target=target, input_ids=prompt, max_new_tokens=8),
                           plain_greedy(target, prompt, 8))
        return
    forwards = []
    target.register_forward_pre_hook(lambda module, args: forwards.append(1))
    message = f"is not supported: its layers of type {layer_type}.*keep a recurrent state"
    with pytest.raises(ValueError, match=message):
        draft.spec_generate(target=target, input_ids=random_prompt(500 + 8, 6), max_new_tokens=8)
    with pytest.raises(ValueError, match=message):  # the loop itself refuses too, whatever the proposer
        speculative_decode(target, None, random_prompt(500 + 8, 6), max_new_tokens=8, block_size=1)
    assert forwards == []
