"""Small end-to-end example on a tiny random Qwen3 target (CPU, seconds, no download).

Checks that spec_generate equals target.generate token for token and reports the loop's own
overhead: greedy tokens/s of spec_generate(block_size=1) (plain decoding through the DFlash loop)
against target.generate, and of an (untrained, random) draft at its full block size.

    python examples/tiny_example.py [--max-new-tokens 128] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_hf import DFlashConfig, DFlashDraftModel


def build(seed: int = 0) -> tuple[Qwen3ForCausalLM, DFlashDraftModel]:
    """A tiny random target (8 layers, hidden 256) and an untrained 2-layer block-8 draft."""
    torch.manual_seed(seed)
    attention = dict(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, vocab_size=1024)
    target = Qwen3ForCausalLM(Qwen3Config(**attention, intermediate_size=768, num_hidden_layers=8,
                                          max_position_embeddings=2048, initializer_range=0.1)).eval()
    draft = DFlashDraftModel(DFlashConfig(**attention, intermediate_size=768, num_hidden_layers=2, block_size=8,
                                          num_target_layers=8, dflash_config={"mask_token_id": 1023},
                                          max_position_embeddings=2048)).eval()
    return target, draft


def best_time(function, repeats: int) -> tuple[float, torch.Tensor]:
    """Fastest wall time of `repeats` calls (after one warm-up) and the last output."""
    output = function()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        output = function()
        times.append(time.perf_counter() - started)
    return min(times), output


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    target, draft = build()
    input_ids = torch.randint(0, 1023, (1, 32), generator=torch.Generator().manual_seed(0))
    n = args.max_new_tokens
    with torch.no_grad():
        plain_time, plain = best_time(lambda: target.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=n, min_new_tokens=n,
            do_sample=False, pad_token_id=0), args.repeats)
        loop_time, loop = best_time(lambda: draft.spec_generate(target=target, input_ids=input_ids,
                                                                max_new_tokens=n, block_size=1, stop_token_ids=[]),
                                    args.repeats)
        draft_time, drafted = best_time(lambda: draft.spec_generate(target=target, input_ids=input_ids,
                                                                    max_new_tokens=n, stop_token_ids=[],
                                                                    return_stats=True), args.repeats)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {n} new tokens, best of {args.repeats}")
    print(f"target.generate (greedy)          : {n / plain_time:8.1f} tokens/s")
    print(f"spec_generate(block_size=1)       : {n / loop_time:8.1f} tokens/s  "
          f"({plain_time / loop_time:.2f}x of generate)  identical: {torch.equal(loop, plain)}")
    print(f"spec_generate(block_size=8), random draft: {n / draft_time:8.1f} tokens/s  tau {drafted.tau:.2f}  "
          f"identical: {torch.equal(drafted.output_ids, plain)}")
    if not (torch.equal(loop, plain) and torch.equal(drafted.output_ids, plain)):
        raise SystemExit("spec_generate differed from target.generate")


if __name__ == "__main__":
    main()
