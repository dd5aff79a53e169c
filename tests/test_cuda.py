"""The lossless tests on CUDA, in float32 (exact) and bfloat16 (exact up to near-ties)."""

from __future__ import annotations

import pytest
import torch

from dflash_hf import speculative_decode
from helpers import ReferenceProposer, VOCAB_SIZE, assert_equal_up_to_near_tie, make_draft, make_target, plain_greedy

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none"),
]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_cuda_greedy_matches_plain(arch, dtype, seed):
    target = make_target(arch, seed).to("cuda", dtype)
    draft = make_draft(seed).to("cuda", dtype)
    input_ids = torch.randint(0, VOCAB_SIZE - 1, (1, 9), generator=torch.Generator().manual_seed(seed)).cuda()
    expected = plain_greedy(target, input_ids, max_new_tokens=40)
    for block_size in (1, 4, 8):
        output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=40, block_size=block_size)
        if dtype == torch.float32:
            assert torch.equal(output, expected)
        else:
            assert_equal_up_to_near_tie(target, output, expected)


def test_cuda_perfect_proposer_float32():
    target = make_target("qwen3", seed=3).cuda()
    input_ids = torch.tensor([[5, 6, 7, 8]], device="cuda")
    expected = plain_greedy(target, input_ids, max_new_tokens=33)
    result = speculative_decode(target, ReferenceProposer(expected), input_ids, max_new_tokens=33, block_size=8)
    assert torch.equal(result.output_ids, expected)
    assert result.acceptance_lengths == [[8, 8, 8, 8]]
