"""What a GPU run needs from the loop, checked on CPU: one host synchronisation per chain step (two per tree step), no
autograd graph, no 4-D mask for a flash-attention draft, Accelerate-dispatched and offloaded targets, features without
every hidden state."""

from __future__ import annotations

import warnings

import pytest
import torch
from device_costs import HostSyncCounter, marked_host_copies, peak_cpu_bytes
from helpers import HIDDEN_SIZE, VOCAB_SIZE, make_draft, make_target, make_variant_draft, plain_greedy
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash_hf import modeling_dflash, speculative_decode, steps_dflash
from dflash_hf.cache_dflash import left_pad
from dflash_hf.generation_dflash import prefill
from dflash_hf.proposer_dflash import DFlashProposer
from dflash_hf.settings_dflash import DecodingSettings
from dflash_hf.validation_dflash import check_draft_target

MASK = VOCAB_SIZE - 1


def random_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB_SIZE - 1, (length,), generator=generator).tolist() for length in lengths]


# --- Host synchronisations -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", ["dflash", "dflash2"])
@pytest.mark.parametrize("temperature, acceptance", [(0.0, "rejection"), (1.0, "rejection"), (0.7, "equality")])
@pytest.mark.parametrize("tree_size, reads_per_step", [(None, 1), (4, 2)])
def test_host_synchronisations_per_step(monkeypatch, variant, temperature, acceptance, tree_size, reads_per_step):
    """A chain step waits for the device once (the committed tokens); a tree step twice (the draft's candidates,
    to plan the tree; the verify's argmax, or p, q and the uniforms, to walk it on the host); greedy and sampling,
    while rows of a left-padded batch stop at different steps. Nothing else dflash-hf does in a step reads a value,
    has a data-dependent shape or copies host data to the device blocking. (Transformers' own sdpa mask preparation
    checks a padding mask when a single token is verified: the last step of a padded batch, as in `generate`; not
    counted here.)"""
    marked_host_copies(monkeypatch, steps_dflash)
    target = make_target("qwen3", seed=2)
    draft = make_draft(2) if variant == "dflash" else make_variant_draft("dflash2", seed=2)
    input_ids, attention_mask = left_pad(random_prompts([5, 9, 3], seed=2), pad_token_id=0)
    stop_token_ids = [plain_greedy(target, input_ids[2:, -3:], 8)[0, -2].item(), *range(4)]  # rows stop at will

    def run(max_new_tokens: int):
        with HostSyncCounter(source="dflash_hf") as counter:
            result = draft.spec_generate(target=target, input_ids=input_ids, attention_mask=attention_mask,
                                         max_new_tokens=max_new_tokens, temperature=temperature, seed=0,
                                         acceptance=acceptance, stop_token_ids=stop_token_ids, return_stats=True,
                                         tree_size=tree_size)
        return counter, result

    run(2)  # once per target: the probe of its LM head
    prefill_only, _ = run(1)  # no step runs
    counter, result = run(40)
    widths = max(result.verified_lengths, key=len)  # of the row that took part in every step
    assert min(result.num_new_tokens) < max(result.num_new_tokens)  # rows did finish at different steps
    assert len(widths) > 5
    reads = sum(reads_per_step if width > 1 else 1 for width in widths)  # a one-token step is a chain's
    assert counter.total - prefill_only.total == reads, (counter.counts, prefill_only.counts)


def test_the_counter_sees_what_waits():
    """Power check of the counter: each kind of call it must count is counted."""
    values = torch.arange(6)
    with HostSyncCounter() as counter:
        values.tolist(), values[0].item(), bool(values.sum() > 0), int(values[1])
        values.nonzero(), values[values > 2], torch.tensor([1, 2], device=values.device)
        torch.multinomial(values.float(), 1)
        torch.tensor([1, 2]).to(values.device, non_blocking=True)  # not counted
    assert counter.total == 8, counter.counts


def test_every_target_forward_gets_explicit_position_ids():
    """No position comes from a cache's token counter (Transformers 5.25 reports a recurrent layer's for the whole
    cache): the prefill and every verify pass `position_ids`, single rows and padded batches alike."""
    target, draft = make_target("llama", seed=3), make_draft(3)
    calls = []
    handle = target.model.register_forward_pre_hook(
        lambda module, args, kwargs: calls.append(kwargs.get("position_ids") is not None), with_kwargs=True)
    try:
        draft.spec_generate(target=target, input_ids=torch.tensor([random_prompts([7], 3)[0]]), max_new_tokens=20)
        single = list(calls)
        calls.clear()
        input_ids, attention_mask = left_pad(random_prompts([4, 8], 3), pad_token_id=0)
        draft.spec_generate(target=target, input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=20)
    finally:
        handle.remove()
    assert len(single) > 2 and all(single)
    assert len(calls) > 2 and all(calls)


# --- Autograd --------------------------------------------------------------------------------------------------------


def test_decoding_keeps_no_autograd_graph_when_parameters_require_grad():
    target, draft = make_target("qwen3", seed=4), make_draft(4)
    assert all(parameter.requires_grad for parameter in [*target.parameters(), *draft.parameters()])
    proposer = DFlashProposer(draft, target, MASK)
    caches = []
    handle = target.model.register_forward_pre_hook(
        lambda module, args, kwargs: caches.append(kwargs.get("cache", kwargs.get("past_key_values"))),
        with_kwargs=True)
    try:
        result = speculative_decode(target, proposer, torch.tensor([random_prompts([6], 4)[0]]), max_new_tokens=30,
                                    block_size=8)
    finally:
        handle.remove()
    assert len(result.acceptance_lengths[0]) > 3
    assert all(layer.keys.grad_fn is None and not layer.keys.requires_grad for layer in caches[-1].layers)
    assert all(keys.grad_fn is None and not keys.requires_grad for keys in proposer.backend.cache.keys)


# --- A flash-attention draft never gets a 4-D mask -------------------------------------------------------------------


@pytest.fixture
def flash_attention_calls(monkeypatch):
    """A stand-in flash-attention backend (sdpa underneath) that records the masks it receives."""
    received = []
    sdpa = modeling_dflash.ALL_ATTENTION_FUNCTIONS["sdpa"]

    def flash_attention(module, query, key, value, attention_mask, **kwargs):
        received.append(attention_mask)
        return sdpa(module, query, key, value, attention_mask, **kwargs)

    monkeypatch.setattr(modeling_dflash, "ALL_ATTENTION_FUNCTIONS",
                        {**modeling_dflash.ALL_ATTENTION_FUNCTIONS, "flash_attention_2": flash_attention})
    return received


@pytest.mark.parametrize("variant", [None, "sliding_mixed"])
def test_a_flash_attention_draft_gets_no_mask_and_decodes_the_same(flash_attention_calls, variant):
    target = make_target("qwen3", seed=5)
    drafts = {}
    for backend in ("sdpa", "flash_attention_2"):
        drafts[backend] = make_draft(5) if variant is None else make_variant_draft(variant, seed=5)
        drafts[backend].config._attn_implementation = backend
    single = torch.tensor([random_prompts([9], 5)[0]])
    batch, attention_mask = left_pad(random_prompts([3, 9, 6], 5), pad_token_id=0)
    for input_ids, mask in ((single, None), (batch, attention_mask)):
        outputs = [drafts[backend].spec_generate(target=target, input_ids=input_ids, attention_mask=mask,
                                                 max_new_tokens=24) for backend in drafts]
        assert torch.equal(outputs[0], outputs[1])
    assert flash_attention_calls  # the unpadded row's full-attention layers did run on it
    assert all(mask is None for mask in flash_attention_calls)


# --- Accelerate: dispatched and offloaded targets --------------------------------------------------------------------


@pytest.mark.parametrize("offloaded", [["lm_head"], ["model.embed_tokens", "model.layers.1", "lm_head"]])
def test_an_offloaded_target_decodes_like_the_loaded_one(tmp_path, offloaded):
    """Accelerate's hooks load offloaded weights (here from disk, `meta` in the model) in each forward: the head and
    embedding the draft shares are called or loaded through them, and the output is the target's own."""
    target, draft = make_target("llama", seed=6), make_draft(6)
    target.save_pretrained(tmp_path / "target")
    modules = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(4)), "model.norm", "model.rotary_emb",
               "lm_head"]
    device_map = {name: "disk" if name in offloaded else "cpu" for name in modules}
    dispatched = AutoModelForCausalLM.from_pretrained(tmp_path / "target", device_map=device_map,
                                                      offload_folder=str(tmp_path / "offload"))
    assert all(parameter.device.type == "meta" for name in offloaded
               for parameter in dispatched.get_submodule(name).parameters())
    prompts = random_prompts([7, 4], seed=6)
    for prompt in prompts:
        expected = plain_greedy(target, torch.tensor([prompt]), 20)
        assert torch.equal(draft.spec_generate(target=dispatched, input_ids=torch.tensor([prompt]),
                                               max_new_tokens=20), expected)
    input_ids, attention_mask = left_pad(prompts, pad_token_id=0)
    batch = draft.spec_generate(target=dispatched, input_ids=input_ids, attention_mask=attention_mask,
                                max_new_tokens=20, return_stats=True)
    for row, prompt in enumerate(prompts):
        assert batch.new_tokens(row) == plain_greedy(target, torch.tensor([prompt]), 20)[0, len(prompt):].tolist()


def test_a_draft_on_another_device_than_the_embedding_computes_on_is_refused():
    target, draft = make_target("llama", seed=7), make_draft(7)
    draft.to("meta")
    with pytest.raises(ValueError, match="embedding computes on cpu.*draft.to\\('cpu'\\)"):
        check_draft_target(draft, target, None, 20)


def test_a_draft_of_another_dtype_than_the_target_is_named():
    target = make_target("llama", seed=7)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_draft_target(make_draft(7), target, None, 20)  # same dtype: silent
    with pytest.warns(UserWarning,
                      match="draft is torch.bfloat16 but the target is torch.float32.*dtype=torch.float32"):
        check_draft_target(make_draft(7).to(torch.bfloat16), target, None, 20)


# --- Features: the draft's layers, not every hidden state ------------------------------------------------------------


def deep_target(num_layers: int) -> torch.nn.Module:
    torch.manual_seed(8)
    config = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=HIDDEN_SIZE, intermediate_size=128,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=1024, tie_word_embeddings=False)
    return Qwen3ForCausalLM(config).eval()


def test_prefill_memory_does_not_grow_with_the_number_of_target_layers():
    """A long prefill keeps the draft's layers' features only: peak memory beyond the KV cache is the same for 4 and
    for 12 target layers, while keeping every hidden state (`output_hidden_states`) grows with the layers."""
    length = 512
    input_ids = torch.randint(0, VOCAB_SIZE - 1, (1, length), generator=torch.Generator().manual_seed(8))
    hidden_state_bytes = length * HIDDEN_SIZE * 4
    beyond_cache, every_state = {}, {}
    for num_layers in (4, 12):
        target = deep_target(num_layers)
        layer_ids = [1, num_layers - 2]
        settings = DecodingSettings(max_new_tokens=8, block_size=8, generators=(None,))
        states = []
        with torch.no_grad():
            prefill(target, input_ids, None, layer_ids, settings)  # one-time work (lazy buffers, kernel timing) first
            peak = peak_cpu_bytes(lambda: states.append(prefill(target, input_ids, None, layer_ids, settings)))  # noqa: B023
            cache_bytes = sum(layer.keys.nbytes + layer.values.nbytes for layer in states[0].backend.cache.layers)
            beyond_cache[num_layers] = peak - cache_bytes
            every_state[num_layers] = peak_cpu_bytes(lambda: target(input_ids, output_hidden_states=True))  # noqa: B023
        assert states[0].context.hidden.shape == (1, length, 2 * HIDDEN_SIZE)
    assert abs(beyond_cache[12] - beyond_cache[4]) < hidden_state_bytes
    assert every_state[12] - every_state[4] > 6 * hidden_state_bytes  # power: the same target keeping every state


# --- The draft's context cache: written in place ---------------------------------------------------------------------


def test_the_draft_context_cache_grows_in_place_and_equals_one_pass():
    """Each step writes its context columns (and the block's, overwritten next step) into one buffer per layer: no
    copy of the cached context per step, buffers reallocated only when doubling; the result equals one full pass."""
    draft = make_draft(9)
    generator = torch.Generator().manual_seed(9)
    features = torch.randn(1, 40, 2 * HIDDEN_SIZE, generator=generator)
    block = torch.randn(1, 8, HIDDEN_SIZE, generator=generator)
    cache, pointers = draft.new_cache(), []
    with torch.no_grad():
        for start in range(0, 40, 4):
            incremental = draft(block, features[:, start:start + 4], torch.arange(start + 4, start + 12)[None],
                                torch.arange(start, start + 4)[None], cache=cache)
            pointers.append(cache.key_buffers[0].data_ptr())
        full = draft(block, features, torch.arange(40, 48)[None], torch.arange(40)[None])
    assert cache.get_seq_length() == 40
    assert len(set(pointers)) <= 4  # 10 steps, the buffer reallocated only when it doubled
    torch.testing.assert_close(incremental, full, rtol=1e-5, atol=1e-5)


def test_a_layer_that_runs_twice_in_one_forward_is_refused():
    """Shared (looped) layers have no single output per layer: the features would be ambiguous."""
    from dflash_hf.target_dflash import FeatureCapture

    target = make_target("llama", seed=10)
    target.model.layers[1] = target.model.layers[0]  # one module, run as layers 0 and 1
    with pytest.raises(ValueError, match="layer 0 ran twice in one forward"):
        with torch.no_grad(), FeatureCapture(target, [0, 2], torch.device("cpu")):
            target(torch.tensor([[1, 2, 3]]))
    with torch.no_grad(), FeatureCapture(target, [2, 3], torch.device("cpu")) as capture:  # other layers: fine
        target(torch.tensor([[1, 2, 3]]))
    assert capture.features.shape == (1, 3, 2 * HIDDEN_SIZE)
