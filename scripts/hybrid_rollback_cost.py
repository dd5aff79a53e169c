"""What the state rollback of a hybrid target costs: its time next to a verify's, and its memory.

A random Qwen3.5-shaped target (three Gated DeltaNet layers to each full-attention layer) is prefilled with a random
context; then, many times over, a B-token verify runs (recording the mixers' inputs) and the rollback advances the
states over k kept columns, for several k, timed on its own (median). Prints a markdown table (MEASUREMENTS.md,
"Hybrid targets: the rollback's cost").

    python scripts/hybrid_rollback_cost.py --layers 8 --hidden-size 1024 --block-size 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from dflash_hf.generation_dflash import DecodeSession
from dflash_hf.proposer_dflash import Proposal
from dflash_hf.settings_dflash import resolve_settings


def tensor_bytes(value: object) -> int:
    """Bytes of every tensor in `value` (a cache layer's snapshot: dicts, lists and tensors)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return sum(tensor_bytes(item) for item in items)


def build_target(layers: int, hidden_size: int, vocab_size: int) -> torch.nn.Module:
    """A random float32 Qwen3_5ForCausalLM of Qwen3.5-27B's proportions at `hidden_size` (head sizes kept)."""
    scale = hidden_size / 5120
    key_heads = max(1, round(16 * scale))  # Qwen3.5-27B: 16 key heads, 48 value heads
    config = transformers.Qwen3_5TextConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=int(17408 * scale),
        num_hidden_layers=layers, num_attention_heads=max(1, round(24 * scale)),
        num_key_value_heads=max(1, round(4 * scale)), head_dim=256, linear_num_key_heads=key_heads,
        linear_num_value_heads=3 * key_heads, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                               for i in range(layers)], tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.Qwen3_5ForCausalLM(config).eval()


def seconds(run, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden-size", type=int, default=1024)
    parser.add_argument("--vocab-size", type=int, default=32768)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--context-length", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    transformers.utils.logging.set_verbosity_error()
    target = build_target(args.layers, args.hidden_size, args.vocab_size)
    context = torch.randint(0, args.vocab_size, (1, args.context_length), generator=torch.Generator().manual_seed(0))
    settings = resolve_settings(target, context, None, block_size=args.block_size, max_new_tokens=4 * args.block_size,
                                temperature=0.0, stop_token_ids=[])
    session = DecodeSession(target, None, settings)
    proposal = Proposal(torch.randint(0, args.vocab_size, (1, args.block_size - 1)))
    rows = []
    with session.running():
        session.prefill(context)
        recurrent = session.state.backend.states
        step = session.plan()

        def verify() -> None:
            session.verify(step, proposal)

        def rollback_seconds(kept: int) -> float:
            """The median time of `advance` alone, each after its own verify."""
            samples = []
            for _ in range(args.repeats):
                verify()
                started = time.perf_counter()
                recurrent.advance([list(range(kept))], session.state.backend.columns.width)
                samples.append(time.perf_counter() - started)
                session.discard_verify()
            return statistics.median(samples)

        verify(), session.discard_verify(), rollback_seconds(1)  # warm-up
        verify_time = seconds(lambda: (verify(), session.discard_verify()), args.repeats)
        for kept in sorted({1, 2, 4, args.block_size // 2, args.block_size - 1}):
            rows.append((kept, rollback_seconds(kept)))
        session.verify(step, proposal)
        inputs = sum(tensor.numel() * tensor.element_size() for tensor in recurrent.inputs.values())
        snapshot = sum(tensor_bytes(saved) for saved in recurrent.before.values())
        # the Gated DeltaNet calls' arguments the rollback replays (the live state they start from excluded)
        calls = sum(tensor_bytes(list(args)) + tensor_bytes({key: value for key, value in kwargs.items()
                                                             if key != "initial_state"})
                    for layer_calls in recurrent.calls.values() for _, args, kwargs in layer_calls)
        session.discard_verify()
    parameters = sum(p.numel() for p in target.parameters())
    print(f"Qwen3.5-shaped target, {args.layers} layers ({len(recurrent.mixers)} Gated DeltaNet), hidden "
          f"{args.hidden_size}, {parameters / 1e6:.0f}M parameters, float32, {torch.get_num_threads()} threads; "
          f"context {args.context_length}, verify of {args.block_size} tokens: {verify_time * 1e3:.1f} ms (median of "
          f"{args.repeats}).\n")
    print("| kept columns | rollback ms | share of the verify |\n|---:|---:|---:|")
    for kept, extra in rows:
        print(f"| {kept} | {extra * 1e3:.1f} | {extra / verify_time:.0%} |")
    print(f"\nMemory per step: the mixers' inputs {inputs / 2**10:.0f} KiB "
          f"({inputs / args.block_size / 2**10:.1f} KiB "
          f"per verified token), the recorded convolution and recurrence arguments {calls / 2**10:.0f} KiB "
          f"({calls / args.block_size / 2**10:.1f} KiB per verified token), the state snapshot "
          f"{snapshot / 2**20:.2f} MiB per row.")


if __name__ == "__main__":
    main()
