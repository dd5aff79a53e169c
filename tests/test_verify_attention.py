"""A verify's attention on CPU: `use_grouped_query_sdpa` sends grouped key/value heads to SDPA as they are (no
copies) with the same numbers, on the torch releases where they are the same (`versions_dflash`); dflash-hf's commands
switch a target at load, and the loop never changes a model's attention implementation itself."""

from __future__ import annotations

import pytest
import torch
from helpers import make_draft, make_target, plain_greedy, random_prompt

from dflash_hf import speculative_decode
from dflash_hf.cache_dflash import crop_cache
from dflash_hf.devices_dflash import GROUPED_QUERY_SDPA
from dflash_hf.kernels_dflash import use_grouped_query_sdpa
from dflash_hf.versions_dflash import cache_keyword, exact_grouped_query_sdpa, returned_cache

# torch 2.6 to 2.8 (CI's oldest end runs 2.6) give SDPA's grouped mode other last bits: the switch stays off there
NEEDS_EXACT_GROUPED_SDPA = pytest.mark.skipif(
    not exact_grouped_query_sdpa(), reason="this torch's grouped-query SDPA is not bit-equal: the switch stays off "
    "(test_an_older_torch_keeps_sdpa checks that)")


@NEEDS_EXACT_GROUPED_SDPA
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
        assert use_grouped_query_sdpa(target) and target.config._attn_implementation == GROUPED_QUERY_SDPA
        logits = target(input_ids=block, use_cache=True, **{keyword: cache}).logits
    assert torch.equal(logits, expected)


@NEEDS_EXACT_GROUPED_SDPA
def test_a_switched_target_decodes_through_the_grouped_path(monkeypatch):
    import dflash_hf.kernels_dflash as kernels_dflash

    target, draft = make_target("llama", seed=3), make_draft(3)
    widths = []  # query width of each target attention call while generating
    grouped = kernels_dflash.grouped_query_sdpa

    def recording(module, query, *args, **kwargs):
        widths.append(query.shape[2])
        return grouped(module, query, *args, **kwargs)

    monkeypatch.setattr(kernels_dflash, "grouped_query_sdpa", recording)
    assert use_grouped_query_sdpa(target)
    input_ids = random_prompt(3, 9)
    expected = plain_greedy(target, input_ids, 20)
    widths.clear()  # from here on: the DFlash call's attention calls only
    output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=20, block_size=4)
    assert torch.equal(output, expected)
    layers = target.config.num_hidden_layers
    assert (widths[:layers] == [9] * layers and set(widths[layers:]) <= {1, 2, 3, 4}
            and 4 in widths)  # prefill, verifies


@pytest.mark.parametrize("cpu_kernels", [True, False])
def test_the_loop_never_changes_the_targets_attention(cpu_kernels):
    """Another thread may be using the model: during a call its attention implementation is the user's own."""
    target, draft = make_target("qwen3", seed=4), make_draft(4)
    seen = []

    class Watching:
        target_layer_ids = draft.target_layer_ids

        def propose(self, step):
            seen.append(target.config._attn_implementation)
            return torch.zeros(len(step.row_ids), step.block_size - 1, dtype=torch.long)

    speculative_decode(target, Watching(), random_prompt(4, 5), max_new_tokens=10, block_size=4,
                       cpu_kernels=cpu_kernels)
    assert seen and set(seen) == {"sdpa"}


def test_other_attention_implementations_are_left_alone():
    target = make_target("qwen3", seed=5)
    target.set_attn_implementation("eager")
    assert not use_grouped_query_sdpa(target)
    assert target.config._attn_implementation == "eager"


@pytest.mark.parametrize("release, switches", [((2, 8), False), ((2, 9), True)])
def test_an_older_torch_keeps_sdpa(monkeypatch, release, switches):
    """torch 2.8 and older give SDPA's grouped mode other last bits than Transformers' copied heads (measured on 2.6
    and 2.8): there the target keeps "sdpa", so a verify's logits stay those of `generate`."""
    import dflash_hf.versions_dflash as versions_dflash

    monkeypatch.setattr(versions_dflash, "TORCH_RELEASE", release)
    target = make_target("qwen3", seed=6)
    assert use_grouped_query_sdpa(target) is switches
    assert target.config._attn_implementation == (GROUPED_QUERY_SDPA if switches else "sdpa")
