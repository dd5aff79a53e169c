"""The verify's few-row products on a CPU (`FewRowLinear`): whichever kernel a shape is timed fastest with, the loop's
greedy output stays the target's own, models stay untouched, and nothing else is rerouted."""

from __future__ import annotations

import time

import pytest
import torch
from helpers import VOCAB_SIZE, ReferenceProposer, left_pad_prompts, make_draft, make_target, plain_greedy, prompts_of

from dflash_hf import kernels_dflash
from dflash_hf.kernels_dflash import FewRowLinear, cpu_kernels, few_row_kernels

KERNELS = ["linear", "transposed", "onednn"] if kernels_dflash.HAS_ONEDNN_LINEAR else ["linear", "transposed"]
needs_onednn = pytest.mark.skipif(not kernels_dflash.HAS_ONEDNN_LINEAR, reason="this torch build has no oneDNN linear")


@pytest.fixture
def forced_kernel(monkeypatch):
    """Force every few-row product onto one kernel; record the shapes that were routed."""
    routed = []

    def force(kernel: str) -> list:
        monkeypatch.setattr(kernels_dflash, "FEW_ROW_KERNEL_CHOICE", {})
        monkeypatch.setattr(kernels_dflash, "fastest_kernel",
                            lambda weight, bias, states: routed.append((tuple(weight.shape),
                                                                        states.shape[0])) or kernel)
        return routed

    return force


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_greedy_equals_generate_whichever_kernel_the_verify_uses(kernel, arch, forced_kernel):
    routed = forced_kernel(kernel)
    for seed, prompt_length in ((0, 1), (1, 9), (2, 23)):
        target = make_target(arch, seed)
        draft = make_draft(seed, block_size=8)
        input_ids = torch.randint(0, VOCAB_SIZE - 1, (1, prompt_length), generator=torch.Generator().manual_seed(seed))
        expected = plain_greedy(target, input_ids, max_new_tokens=30)
        for block_size in (2, 4, 8):
            output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=30, block_size=block_size)
            assert torch.equal(output, expected), (seed, block_size)
    layer_shapes = {tuple(module.weight.shape) for module in target.modules() if type(module) is torch.nn.Linear}
    # the decoder layers' products were rerouted, not only the head
    assert layer_shapes <= {shape for shape, _ in routed}


@pytest.mark.parametrize("kernel", KERNELS)
def test_left_padded_batch_with_a_stop_token_equals_each_row_alone(kernel, forced_kernel):
    forced_kernel(kernel)
    target = make_target("qwen3", seed=1)
    draft = make_draft(1, block_size=8)
    prompts = prompts_of([1, 6, 23, 11], seed=1)
    input_ids, attention_mask = left_pad_prompts(prompts)
    stop_token = plain_greedy(target, prompts[2], max_new_tokens=20)[0, 23 + 7].item()
    result = draft.spec_generate(target=target, input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=20,
                                 block_size=4, stop_token_ids=[stop_token], return_stats=True)
    for row, prompt in enumerate(prompts):
        expected = plain_greedy(target, prompt, max_new_tokens=20, stop_token_ids=[stop_token])[0, prompt.shape[1]:]
        assert result.new_tokens(row) == expected.tolist(), f"row {row}"
    assert result.new_tokens(2)[-1] == stop_token and len(result.new_tokens(2)) <= 8


@pytest.mark.parametrize("kernel", KERNELS)
def test_features_and_tokens_handed_to_the_proposer_are_the_targets(kernel, forced_kernel):
    forced_kernel(kernel)
    target = make_target("llama", seed=2)
    input_ids = torch.randint(0, VOCAB_SIZE - 1, (1, 12), generator=torch.Generator().manual_seed(2))
    expected = plain_greedy(target, input_ids, max_new_tokens=40)
    from dflash_hf import speculative_decode

    proposer = ReferenceProposer(expected, target=target, corrupt_seed=2)  # checks features against a plain forward
    result = speculative_decode(target, proposer, input_ids, max_new_tokens=40, block_size=6)
    assert torch.equal(result.output_ids, expected)


def test_only_few_row_products_by_a_models_weight_without_autograd_on_a_cpu_are_rerouted(forced_kernel):
    routed = forced_kernel("transposed")
    layer = torch.nn.Linear(16, 24)
    for rows, grad in ((3, False), (kernels_dflash.MAX_FEW_ROWS + 1, False), (3, True),
                       (kernels_dflash.MAX_FEW_ROWS, False)):
        states = torch.randn(rows, 2, 16)[:, 0]  # [rows, 16], not contiguous
        with torch.set_grad_enabled(grad), cpu_kernels(), FewRowLinear():
            output = layer(states[None])  # [1, rows, 24]
        torch.testing.assert_close(output, torch.nn.functional.linear(states[None], layer.weight, layer.bias))
    assert routed == [((24, 16), 3), ((24, 16), kernels_dflash.MAX_FEW_ROWS)]  # not 65 rows, not with autograd
    with torch.no_grad(), FewRowLinear():  # outside a generation call's scope: F.linear
        layer(torch.randn(5, 16))
    assert len(routed) == 2
    states = torch.randn(3, 16)
    with torch.no_grad(), cpu_kernels(), FewRowLinear():
        per_call = torch.nn.functional.linear(states, layer.weight * 1)  # a weight made per call (an expert's slice)
        by_keyword = torch.nn.functional.linear(states, weight=layer.weight)
    torch.testing.assert_close(per_call, states @ layer.weight.T)
    torch.testing.assert_close(by_keyword, states @ layer.weight.T)
    # neither was rerouted; outside the mode nothing is; the layer itself was never changed
    layer(torch.randn(3, 16))
    assert (len(routed) == 2 and type(layer) is torch.nn.Linear and not layer._forward_hooks
            and "forward" not in vars(layer))


@needs_onednn
def test_a_packed_weight_follows_changes_to_the_weight_within_a_call_and_lives_only_as_long_as_the_call():
    layer = torch.nn.Linear(16, 24, bias=False)
    states = torch.randn(3, 16)
    product = kernels_dflash.FEW_ROW_KERNELS["onednn"]
    with cpu_kernels() as packed:
        torch.testing.assert_close(product(layer.weight, None, states), states @ layer.weight.T)
        assert packed.holds(layer.weight)
        with torch.no_grad():
            layer.weight.mul_(2)  # in place: its version changes
        torch.testing.assert_close(product(layer.weight, None, states), states @ layer.weight.T)
        layer.weight.data = torch.randn(24, 16)  # new storage
        torch.testing.assert_close(product(layer.weight, None, states), states @ layer.weight.T)
        with torch.inference_mode():
            frozen = torch.randn(24, 16)  # no version counter: never packed
        torch.testing.assert_close(product(frozen, None, states), states @ frozen.T)
        assert not packed.holds(frozen)
    layer.weight.data.add_(1.0)  # through `.data`, between calls: neither version nor storage changes
    with cpu_kernels() as packed:  # a new call packs from the values as they are now
        assert not packed.holds(layer.weight)
        torch.testing.assert_close(product(layer.weight, None, states), states @ layer.weight.T)
    torch.testing.assert_close(product(layer.weight, None, states), states @ layer.weight.T)  # no call: F.linear


@needs_onednn
def test_a_weight_changed_through_data_between_calls_is_verified_with_its_new_values(forced_kernel):
    forced_kernel("onednn")
    target = make_target("qwen3", seed=3)
    draft = make_draft(3, block_size=4)
    input_ids = torch.randint(0, VOCAB_SIZE - 1, (1, 7), generator=torch.Generator().manual_seed(3))
    draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=12)  # packs the target's weights
    with torch.no_grad():
        for module in target.modules():
            if type(module) is torch.nn.Linear:
                module.weight.data.add_(0.05 * torch.randn_like(module.weight))  # e.g. an adapter merged in place
    expected = plain_greedy(target, input_ids, max_new_tokens=12)
    assert torch.equal(draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=12), expected)


@needs_onednn
def test_no_packed_copy_is_kept_for_a_weight_whose_product_it_does_not_speed_up(monkeypatch):
    monkeypatch.setattr(kernels_dflash, "FEW_ROW_KERNEL_CHOICE", {})
    weight, states = torch.randn(24, 16), torch.randn(3, 16)
    onednn = kernels_dflash.FEW_ROW_KERNELS["onednn"]

    def slow_onednn(*args):
        time.sleep(0.01)
        return onednn(*args)

    monkeypatch.setitem(kernels_dflash.FEW_ROW_KERNELS, "onednn", slow_onednn)
    with cpu_kernels() as packed:
        assert kernels_dflash.fastest_kernel(weight, None, states) in ("linear", "transposed")
        assert not packed.holds(weight)
        monkeypatch.setitem(kernels_dflash.FEW_ROW_KERNELS, "onednn", onednn)
        packed.packed(weight)
        assert packed.holds(weight)


def test_a_torch_without_onednn_falls_back_to_the_other_kernels(monkeypatch):
    """The private oneDNN operators may be missing or refuse a call in another torch: the choice skips them."""
    monkeypatch.setattr(kernels_dflash, "FEW_ROW_KERNEL_CHOICE", {})

    def missing(*args):
        raise AttributeError("torch.ops.mkldnn has no _linear_pointwise")

    monkeypatch.setitem(kernels_dflash.FEW_ROW_KERNELS, "onednn", missing)
    monkeypatch.setattr(kernels_dflash, "HAS_ONEDNN_LINEAR", True)  # as if it claimed to have them
    target, draft = make_target("qwen3", seed=4), make_draft(4, block_size=4)
    input_ids = torch.randint(0, VOCAB_SIZE - 1, (1, 6), generator=torch.Generator().manual_seed(4))
    expected = plain_greedy(target, input_ids, max_new_tokens=16)
    assert torch.equal(draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=16), expected)
    assert kernels_dflash.FEW_ROW_KERNEL_CHOICE  # products were routed ...
    assert "onednn" not in set(kernels_dflash.FEW_ROW_KERNEL_CHOICE.values())  # ... never to the broken kernel
    monkeypatch.setattr(kernels_dflash, "HAS_ONEDNN_LINEAR", False)
    monkeypatch.setattr(kernels_dflash, "FEW_ROW_KERNEL_CHOICE", {})
    assert torch.equal(draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=16), expected)


def test_cpu_kernels_off_and_on_give_the_same_output_and_off_routes_nothing(forced_kernel):
    routed = forced_kernel("transposed")
    target, draft = make_target("llama", seed=5), make_draft(5, block_size=8)
    prompts = prompts_of([3, 14], seed=5)
    input_ids, attention_mask = left_pad_prompts(prompts)
    off = draft.spec_generate(target=target, input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=24,
                              block_size=4, cpu_kernels=False)
    assert routed == []  # nothing rerouted: every product as the models compute it
    on = draft.spec_generate(target=target, input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=24,
                             block_size=4, cpu_kernels=True)
    assert routed and torch.equal(off, on)


def test_a_block_of_one_runs_its_layers_as_generate_does(forced_kernel):
    """Block 1 is `generate`'s own step: with cpu_kernels on, its layers' products are not rerouted (the function
    mode's cost per op is more than the few-row kernels save there), only the LM head's; output unchanged."""
    routed = forced_kernel("transposed")
    target, draft = make_target("llama", seed=9), make_draft(9, block_size=4)
    input_ids = torch.randint(0, VOCAB_SIZE - 1, (2, 7), generator=torch.Generator().manual_seed(9))
    expected = plain_greedy(target, input_ids, max_new_tokens=12)
    assert torch.equal(draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=12, block_size=1,
                                           cpu_kernels=True), expected)
    assert {shape for shape, _ in routed} == {tuple(target.get_output_embeddings().weight.shape)}
    with cpu_kernels(True), few_row_kernels(target, 1) as rerouted:
        assert not rerouted
    with cpu_kernels(True), few_row_kernels(target, 2) as rerouted:
        assert rerouted


def test_a_model_dispatched_by_accelerate_keeps_its_own_kernels():
    target = make_target("qwen3", seed=0)
    with few_row_kernels(target, 4) as rerouted:
        assert not rerouted  # outside a generation call
    with cpu_kernels(), few_row_kernels(target, 4) as rerouted:
        assert rerouted
    target.hf_device_map = {"": "cpu"}
    with cpu_kernels(), few_row_kernels(target, 4) as rerouted:
        assert not rerouted


@pytest.mark.parametrize("cheapest", kernels_dflash.CPU_KERNEL_MODES)
def test_the_cost_model_keeps_the_kernels_only_where_a_step_costs_less_with_them(cheapest, monkeypatch):
    from dflash_hf import cost_model

    target, draft = make_target("llama", seed=6), make_draft(6, block_size=4)
    timed = []

    def step_costs(draft, target_model, context_ids, block_size, mask_token_id, repeats=5, batch_size=1,
                   cpu_kernels=None):
        timed.append(cpu_kernels)
        verify = 0.010 if cpu_kernels == cheapest and type(cpu_kernels) is type(cheapest) else 0.020
        return {"target_1": 0.012, "target_block": verify + 0.001 * len(timed), "draft": 0.002}

    monkeypatch.setattr(cost_model, "measure_step_costs", step_costs)
    mode, costs = cost_model.choose_cpu_kernels(draft, target, torch.arange(5, 15)[None], 4, VOCAB_SIZE - 1, rounds=2)
    assert mode is cheapest if isinstance(cheapest, bool) else mode == cheapest
    assert timed == list(kernels_dflash.CPU_KERNEL_MODES) * 2  # the modes take turns
    assert costs[cheapest]["target_block"] == pytest.approx(0.010 + 0.001 * (timed.index(cheapest) + 1))  # least


def test_the_lm_head_mode_verifies_the_layers_by_f_linear_and_the_heads_by_the_kernel_table(forced_kernel):
    routed = forced_kernel("transposed")
    target, draft = make_target("llama", seed=8), make_draft(8, block_size=4)
    input_ids = torch.randint(0, VOCAB_SIZE - 1, (1, 9), generator=torch.Generator().manual_seed(8))
    expected = plain_greedy(target, input_ids, max_new_tokens=20)
    assert torch.equal(draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=20,
                                           cpu_kernels="lm_head"), expected)
    assert {shape for shape, _ in routed} == {tuple(target.get_output_embeddings().weight.shape)}  # the head only
    with cpu_kernels("lm_head"), few_row_kernels(target, 4) as rerouted:
        assert not rerouted
    with cpu_kernels(True), few_row_kernels(target, 4) as rerouted:
        assert rerouted


def test_an_unknown_cpu_kernels_mode_is_refused_by_name():
    target, draft = make_target("llama", seed=8), make_draft(8, block_size=4)
    with pytest.raises(ValueError, match="cpu_kernels='head'.*'lm_head'"):
        draft.spec_generate(target=target, input_ids=torch.tensor([[5, 6, 7]]), max_new_tokens=4, cpu_kernels="head")


def test_step_costs_can_be_timed_without_the_kernels(forced_kernel):
    from dflash_hf.cost_model import measure_step_costs

    routed = forced_kernel("transposed")
    target, draft = make_target("llama", seed=7), make_draft(7, block_size=4)
    costs = measure_step_costs(draft, target, torch.arange(5, 15)[None], 4, VOCAB_SIZE - 1, repeats=1,
                               cpu_kernels=False)
    assert routed == [] and costs["target_block"] > 0
    measure_step_costs(draft, target, torch.arange(5, 15)[None], 4, VOCAB_SIZE - 1, repeats=1)
    assert routed  # the default (None): on for a CPU target
