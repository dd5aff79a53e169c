"""GPU-shaped costs on any machine: aten ops and milliseconds per step, on a compute-free target of real depth.

On a GPU at batch 1 an eager forward is bound by kernel launches, and every aten op is at least one launch. This proxy
makes the arithmetic negligible (a random Qwen3 of 36 layers, width 64, vocabulary 512; a 5-layer draft, block 16),
so what remains is what each loop dispatches: plain `generate` per token, a dflash-hf chain step and a tree step.
Every output is checked against `generate` first.

    python scripts/step_ops_proxy.py                       # prompt of 32 tokens, 96 new tokens
    python scripts/step_ops_proxy.py --prompt-length 2048  # the long-context row

Numbers depend on the machine; compare rows of one run only.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_hf import DFlashDraftModel
from dflash_hf.generation_dflash import DecodeSession, dflash_proposer
from dflash_hf.settings_dflash import resolve_settings
from dflash_hf.training.recipe import draft_config_for


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def proxy_pair(seed: int = 0) -> tuple[torch.nn.Module, DFlashDraftModel]:
    """The compute-free target (36 layers of width 64) and a 5-layer random draft of block 16 for it."""
    torch.manual_seed(seed)
    target = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=36, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False)).eval()
    draft = DFlashDraftModel(draft_config_for(target, num_layers=5, block_size=16, mask_token_id=511)).eval()
    return target, draft


def generate_costs(target: torch.nn.Module, prompt: torch.Tensor, new_tokens: int) -> tuple[float, float, list[int]]:
    """(ms, aten ops) per token of greedy `generate`, and its tokens."""
    arguments = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    target.generate(prompt, **arguments)  # warm-up
    counter = OpCounter()
    with counter:
        target.generate(prompt, **arguments)
    started = time.perf_counter()
    output = target.generate(prompt, **arguments)
    seconds = time.perf_counter() - started
    return 1000 * seconds / new_tokens, sum(counter.ops.values()) / new_tokens, output[0, prompt.shape[1]:].tolist()


def loop_costs(target: torch.nn.Module, draft: DFlashDraftModel, prompt: torch.Tensor, new_tokens: int,
               tree_size: int | None) -> tuple[float, float, float, list[int]]:
    """(ms, aten ops, tau) per draft-and-verify step of the loop, and its tokens."""
    settings = resolve_settings(target, prompt, draft, max_new_tokens=new_tokens, block_size=16, cpu_kernels=False,
                                tree_size=tree_size, do_sample=False)

    def run(counter: OpCounter | None) -> tuple[float, int, DecodeSession]:
        session = DecodeSession(target, dflash_proposer(draft, target, settings), settings)
        seconds, steps = 0.0, 0
        with session.running(), torch.no_grad():
            session.prefill(prompt)
            while True:
                started = time.perf_counter()
                if counter is None:
                    going = session.step()
                else:
                    with counter:
                        going = session.step()
                seconds += time.perf_counter() - started
                if not going:
                    return seconds, steps, session
                steps += 1

    run(None)  # warm-up
    counter = OpCounter()
    _, steps, _ = run(counter)
    seconds, steps, session = run(None)
    result = session.finish()
    return 1000 * seconds / steps, sum(counter.ops.values()) / steps, result.tau, result.new_tokens(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--tree-size", type=int, default=8)
    args = parser.parse_args()
    target, draft = proxy_pair()
    prompt = torch.randint(0, 500, (1, args.prompt_length), generator=torch.Generator().manual_seed(1))
    ms, ops, expected = generate_costs(target, prompt, args.new_tokens)
    print(f"prompt {args.prompt_length} tokens, {args.new_tokens} new, torch {torch.__version__}, 36 layers x 64")
    print("| loop | ms per step | aten ops per step | tau |\n|---|---:|---:|---:|")
    print(f"| plain `generate` (per token) | {ms:.1f} | {ops:,.0f} | 1 |")
    for name, tree_size in (("dflash-hf chain", None), (f"dflash-hf tree of {args.tree_size}", args.tree_size)):
        ms, ops, tau, tokens = loop_costs(target, draft, prompt, args.new_tokens, tree_size)
        assert tokens == expected, f"{name}: output differs from generate"
        print(f"| {name} | {ms:.1f} | {ops:,.0f} | {tau:.2f} |")


if __name__ == "__main__":
    main()
