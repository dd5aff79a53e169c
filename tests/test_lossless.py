"""Greedy spec_generate equals the target's own greedy decode, token for token (float32, CPU)."""

from __future__ import annotations

import pytest
import torch
from helpers import (
    VOCAB_SIZE,
    ReferenceProposer,
    assert_equal_up_to_near_tie,
    make_draft,
    make_target,
    plain_greedy,
    random_prompt,
)

from dflash_hf import speculative_decode

ARCHS = ["qwen3", "llama"]



@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("prompt_length", [1, 6, 23])
def test_random_draft_matches_plain_greedy(arch, seed, prompt_length):
    target = make_target(arch, seed)
    draft = make_draft(seed, block_size=8)
    input_ids = random_prompt(100 + seed, prompt_length)
    expected = plain_greedy(target, input_ids, max_new_tokens=30)
    for block_size in (1, 2, 4, 8):
        result = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=30,
                                     block_size=block_size, return_stats=True)
        assert torch.equal(result.output_ids, expected), f"block_size={block_size}"
        assert result.num_output_tokens == 30
        assert sum(result.acceptance_lengths[0]) == 29  # the first token comes from the prefill
        assert all(1 <= a <= block_size for a in result.acceptance_lengths[0])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("block_size", [2, 4, 8])
def test_perfect_proposer_is_always_accepted(arch, block_size):
    target = make_target(arch, seed=3)
    input_ids = random_prompt(100 + 3, 9)
    expected = plain_greedy(target, input_ids, max_new_tokens=40)
    proposer = ReferenceProposer(expected, target=target)
    result = speculative_decode(target, proposer, input_ids, max_new_tokens=40, block_size=block_size)
    assert torch.equal(result.output_ids, expected)
    # every step commits a full block, except the last one which is cut to what is still needed
    full_steps, tail = divmod(39, block_size)
    assert result.acceptance_lengths[0] == [block_size] * full_steps + ([tail] if tail else [])


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("seed", [0, 1])
def test_partially_correct_proposer_matches_plain_greedy(arch, seed):
    target = make_target(arch, seed)
    input_ids = random_prompt(100 + seed, 12)
    expected = plain_greedy(target, input_ids, max_new_tokens=50)
    proposer = ReferenceProposer(expected, target=target, corrupt_seed=seed)
    result = speculative_decode(target, proposer, input_ids, max_new_tokens=50, block_size=8)
    assert torch.equal(result.output_ids, expected)
    assert len(set(result.acceptance_lengths[0])) > 2  # a mix of acceptance lengths was exercised


@pytest.mark.parametrize("max_new_tokens", [1, 2, 3, 7])
def test_max_new_tokens_smaller_than_a_block(max_new_tokens):
    target = make_target("qwen3", seed=4)
    input_ids = random_prompt(100 + 4, 5)
    expected = plain_greedy(target, input_ids, max_new_tokens=max_new_tokens)
    perfect = ReferenceProposer(plain_greedy(target, input_ids, max_new_tokens=20))
    result = speculative_decode(target, perfect, input_ids, max_new_tokens=max_new_tokens, block_size=8)
    assert torch.equal(result.output_ids, expected)
    draft = make_draft(4, block_size=8)
    assert torch.equal(draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=max_new_tokens),
                       expected)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("stop_index", [0, 3, 5, 12])
def test_stop_token_hit_mid_block(arch, stop_index):
    target = make_target(arch, seed=5)
    input_ids = random_prompt(100 + 5, 4)
    continuation = plain_greedy(target, input_ids, max_new_tokens=40)
    generated = continuation[0, 4:].tolist()
    stop_token = generated[stop_index]
    first = generated.index(stop_token)  # the stop token may occur earlier than stop_index
    expected = plain_greedy(target, input_ids, max_new_tokens=40, stop_token_ids=[stop_token])
    assert expected.shape[1] == 4 + first + 1
    perfect = speculative_decode(target, ReferenceProposer(continuation), input_ids, max_new_tokens=40,
                                 block_size=8, stop_token_ids=[stop_token])
    assert torch.equal(perfect.output_ids, expected)
    draft = make_draft(5, block_size=8)
    for block_size in (1, 3, 8):
        out = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=40,
                                  block_size=block_size, stop_token_ids=stop_token)
        assert torch.equal(out, expected)


def test_stop_token_in_the_prompt_is_ignored():
    target = make_target("llama", seed=6)
    input_ids = random_prompt(100 + 6, 8)
    stop_token = int(input_ids[0, 3])
    expected = plain_greedy(target, input_ids, max_new_tokens=15, stop_token_ids=[stop_token])
    out = make_draft(6).spec_generate(target=target, input_ids=input_ids, max_new_tokens=15,
                                      stop_token_ids=[stop_token])
    assert torch.equal(out, expected)
    assert out.shape[1] > input_ids.shape[1] + 1 or int(out[0, -1]) == stop_token


def test_generated_mask_token_is_a_normal_token():
    target = make_target("qwen3", seed=7)
    input_ids = random_prompt(100 + 7, 6)
    expected = plain_greedy(target, input_ids, max_new_tokens=30)
    frequent = int(torch.mode(expected[0, 6:]).values)  # a token the target generates
    draft = make_draft(7, block_size=8, mask_token_id=frequent)
    for block_size in (2, 8):
        out = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=30, block_size=block_size)
        assert torch.equal(out, expected)


def test_perfect_dflash_run_reports_consistent_stats():
    target = make_target("qwen3", seed=8)
    input_ids = random_prompt(100 + 8, 6)
    result = make_draft(8).spec_generate(target=target, input_ids=input_ids, max_new_tokens=17,
                                         block_size=4, return_stats=True)
    assert result.num_output_tokens == 17 == result.new_token_ids.shape[1]
    assert result.tau == pytest.approx(sum(result.acceptance_lengths[0]) / len(result.acceptance_lengths[0]))
    assert result.time_to_first_token > 0 and result.time_per_output_token > 0
    assert result.block_size == 4


def test_other_decoder_only_targets_work():
    """A target outside Qwen3/Llama (GPT-2) is not refused: its hidden states are exposed the same way."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(9)
    target = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB_SIZE, n_embd=64, n_layer=4, n_head=4, n_positions=256,
                                        initializer_range=0.1, bos_token_id=0, eos_token_id=0)).eval()
    input_ids = random_prompt(100 + 9, 7)
    expected = plain_greedy(target, input_ids, max_new_tokens=25)
    draft = make_draft(9)
    for block_size in (1, 4, 8):
        assert torch.equal(draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=25,
                                               block_size=block_size), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ARCHS)
def test_half_precision_on_cpu_is_equal_up_to_near_ties(arch, dtype):
    target = make_target(arch, seed=10).to(dtype)
    draft = make_draft(10).to(dtype)
    input_ids = random_prompt(100 + 10, 8)
    expected = plain_greedy(target, input_ids, max_new_tokens=30)
    for block_size in (1, 4, 8):
        output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=30, block_size=block_size)
        assert_equal_up_to_near_tie(target, output, expected)


@pytest.mark.parametrize("arch", ARCHS)
def test_verify_forward_gives_the_targets_own_logits_and_states(arch):
    """Llama/Qwen3 verify passes run the base model and apply the LM head themselves: same logits and hidden states."""
    from dflash_hf.target_dflash import verify_forward

    target = make_target(arch, seed=11)
    input_ids = random_prompt(100 + 11, 9)
    with torch.no_grad():
        expected = target(input_ids=input_ids, output_hidden_states=True)
        logits, outputs = verify_forward(target, input_ids=input_ids, output_hidden_states=True)
    assert outputs is not expected and not hasattr(outputs, "logits")  # the base model's outputs: the fast path ran
    torch.testing.assert_close(logits, expected.logits, rtol=1e-5, atol=1e-5)
    assert len(outputs.hidden_states) == len(expected.hidden_states)
    torch.testing.assert_close(outputs.hidden_states[-1], expected.hidden_states[-1])
