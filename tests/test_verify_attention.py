"""A verify's attention on CPU: grouped key/value heads go to SDPA as they are (no copies), with the same numbers,
and only while DFlash generates: the target's own attention implementation is set back after."""

from __future__ import annotations

import pytest
import torch
from helpers import make_draft, make_target, plain_greedy, random_prompt

from dflash_hf.cache_dflash import crop_cache
from dflash_hf.kernels_dflash import GROUPED_QUERY_SDPA, grouped_query_attention
from dflash_hf.versions_dflash import cache_keyword, returned_cache


@pytest.mark.parametrize("arch, context, width", [("qwen3", 7, 3), ("llama", 40, 8), ("qwen3", 100, 2)])
def test_a_verify_gives_the_same_logits_with_and_without_the_switch(arch, context, width):
    target = make_target(arch, seed=1)
    assert target.config._attn_implementation == "sdpa"
    keyword = cache_keyword(target)
    with torch.no_grad():
        cache = returned_cache(target(input_ids=random_prompt(1, context), use_cache=True))
        block = random_prompt(2, width)
        expected = target(input_ids=block, use_cache=True, **{keyword: cache}).logits
        crop_cache(cache, context)
        with grouped_query_attention(target) as switched:
            assert switched and target.config._attn_implementation == GROUPED_QUERY_SDPA
            logits = target(input_ids=block, use_cache=True, **{keyword: cache}).logits
    assert torch.equal(logits, expected)
    assert target.config._attn_implementation == "sdpa"


def test_generation_runs_the_grouped_path_and_sets_the_attention_back(monkeypatch):
    import dflash_hf.kernels_dflash as kernels_dflash

    target, draft = make_target("llama", seed=3), make_draft(3)
    widths = []  # query width of each target attention call while generating
    grouped = kernels_dflash.grouped_query_sdpa

    def recording(module, query, *args, **kwargs):
        widths.append(query.shape[2])
        return grouped(module, query, *args, **kwargs)

    monkeypatch.setattr(kernels_dflash, "grouped_query_sdpa", recording)
    input_ids = random_prompt(3, 9)
    output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=20, block_size=4)
    assert torch.equal(output, plain_greedy(target, input_ids, 20))
    layers = target.config.num_hidden_layers
    assert (widths[:layers] == [9] * layers and set(widths[layers:]) <= {1, 2, 3, 4}
            and 4 in widths)  # prefill, verifies
    assert target.config._attn_implementation == "sdpa"


def test_the_attention_is_set_back_when_generation_fails():
    target, draft = make_target("qwen3", seed=4), make_draft(4)

    class Failing:
        target_layer_ids = draft.target_layer_ids

        def propose(self, step):
            assert target.config._attn_implementation == GROUPED_QUERY_SDPA
            raise RuntimeError("proposer failed")

    from dflash_hf import speculative_decode

    with pytest.raises(RuntimeError, match="proposer failed"):
        speculative_decode(target, Failing(), random_prompt(4, 5), 10, 4)
    assert target.config._attn_implementation == "sdpa"


def test_other_attention_implementations_are_left_alone():
    target = make_target("qwen3", seed=5)
    target.set_attn_implementation("eager")
    with grouped_query_attention(target) as switched:
        assert not switched and target.config._attn_implementation == "eager"
    assert target.config._attn_implementation == "eager"
