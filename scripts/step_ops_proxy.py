"""GPU-shaped costs on any machine: compute ops and milliseconds per step, on a compute-free target of real depth.

On a GPU at batch 1 an eager forward is bound by kernel launches, and every aten op that computes is at least one
launch. This proxy makes the arithmetic negligible (a random Qwen3 of 36 layers, width 64, vocabulary 512; a 5-layer
draft, block 16), so what remains is what each loop dispatches: plain `generate` per token, eager and compiled
(Transformers' documented way: a static cache and `torch.compile` of the forward), the target's verify and the
draft's forward alone (what any DFlash loop must run), a dflash-hf chain step and a tree step, eager and compiled
(`spec_generate(compile=True)`: inductor on a CPU; its ops are not counted, they run inside compiled graphs).
Compute ops leave out views and aliases (`VIEW_OPS`, and any op that returns its input), which launch no kernel; all
ops are shown beside them. Every output is checked against `generate` first.

    python scripts/step_ops_proxy.py                       # prompt of 32 tokens, 96 new tokens
    python scripts/step_ops_proxy.py --prompt-length 2048  # the long-context row
    python scripts/step_ops_proxy.py --no-compile          # eager rows only (no compiled generate either)
    python scripts/step_ops_proxy.py --device cuda --no-tree  # a GPU: compiled is CUDA graphs (scripts/gpu_check.sh)
    python scripts/step_ops_proxy.py --device cuda --no-tree --synthetic Qwen3-8B  # the real pair, random, bfloat16
    python scripts/step_ops_proxy.py --hybrid --no-tree    # a Qwen3.5-shaped hybrid target, eager and compiled

`--hybrid` swaps the target for a Qwen3.5-shaped one (Gated DeltaNet layers, three to each attention layer, 32 layers
of width 64 as Qwen3.5-9B's depth; `--hybrid-layers 64` for Qwen3.5-27B's) and prints the compiled chain step over
the eager one. Compiled `generate` is not run for it (Transformers' generate does not compile recurrent layers).

`--synthetic` builds a pair of `dflash-hf bench --synthetic` (random weights, bfloat16 on a GPU; on a CPU float32 with
widths / 8): real arithmetic, so the rows show what launches cost next to it. Its random draft accepts nothing (tau 1)
and bfloat16 ties may part the loops' tokens from `generate`'s, so there the rows report the agreement, not assert it.

Numbers depend on the machine; compare rows of one run only.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from contextlib import nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM

from dflash_hf import DFlashDraftModel
from dflash_hf.generation_dflash import DecodeSession, dflash_proposer, synchronize
from dflash_hf.settings_dflash import resolve_settings
from dflash_hf.synthetic import CPU_SHRINK, build_synthetic_pair, shrink_configs, synthetic_spec
from dflash_hf.training.recipe import draft_config_for

# aten ops that launch no kernel: views, aliases and no-op markers (a same-dtype `to` returns its input: see below)
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "t", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze", "permute", "alias",
    "detach", "detach_", "as_strided", "split", "split_with_sizes", "unbind", "reshape", "_reshape_alias", "view_as",
    "chunk", "narrow", "lift_fresh", "resolve_conj", "resolve_neg", "expand_as",
})


class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while active: all of them, and the compute ops (not a view, an alias, or an op
    that returns its own input, as a same-dtype `to` does)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.compute: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        name = str(func.overloadpacket)
        result = func(*args, **(kwargs or {}))
        self.ops[name] += 1
        if name.split(".")[-1] not in VIEW_OPS and not (args and result is args[0]):
            self.compute[name] += 1
        return result

    def per(self, count: int) -> tuple[float, float]:
        """(compute ops, all ops) per unit, for `count` units."""
        return sum(self.compute.values()) / count, sum(self.ops.values()) / count


class CompiledForward:
    """Transformers' documented compiled decoding, as a user sets it up: the target's forward under `torch.compile`
    (an instance attribute while inside, removed on exit), `generate` with `cache_implementation="static"` and its own
    auto-compile off (`disable_compile`: the forward is compiled already). One compiled forward per target."""

    compiled: dict[int, object] = {}

    def __init__(self, target: torch.nn.Module) -> None:
        self.target = target
        key = id(target)
        if key not in self.compiled:
            self.compiled[key] = torch.compile(target.forward, fullgraph=True,
                                               **({"mode": "reduce-overhead"} if target.device.type == "cuda" else {}))
        self.forward = self.compiled[key]

    def __enter__(self) -> dict:
        self.target.forward = self.forward
        return {"cache_implementation": "static", "disable_compile": True}

    def __exit__(self, *exc_info: object) -> None:
        del self.target.forward


def proxy_pair(seed: int = 0) -> tuple[torch.nn.Module, DFlashDraftModel]:
    """The compute-free target (36 layers of width 64) and a 5-layer random draft of block 16 for it."""
    torch.manual_seed(seed)
    target = Qwen3ForCausalLM(Qwen3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=36, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=4096, tie_word_embeddings=False)).eval()
    draft = DFlashDraftModel(draft_config_for(target, num_layers=5, block_size=16, mask_token_id=511)).eval()
    return target, draft


def hybrid_proxy_pair(num_layers: int = 32, seed: int = 0) -> tuple[torch.nn.Module, DFlashDraftModel]:
    """A compute-free Qwen3.5-shaped target (Gated DeltaNet layers, every fourth full attention, width 64) and a
    5-layer random draft of block 16 for it."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    target = Qwen3_5ForCausalLM(Qwen3_5TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=num_layers, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=4096, tie_word_embeddings=False,
        layer_types=["full_attention" if (layer + 1) % 4 == 0 else "linear_attention"
                     for layer in range(num_layers)])).eval()
    draft = DFlashDraftModel(draft_config_for(target, num_layers=5, block_size=16, mask_token_id=511)).eval()
    return target, draft


def synthetic_pair(name: str, device: torch.device) -> tuple[torch.nn.Module, DFlashDraftModel]:
    """The pair `bench --synthetic NAME` builds: full size in bfloat16 on a GPU, widths / 8 in float32 on a CPU."""
    spec, gpu = synthetic_spec(name), device.type == "cuda"
    target_config, draft_config = shrink_configs(spec.target_config, spec.draft_config, 1 if gpu else CPU_SHRINK)
    return build_synthetic_pair(target_config, draft_config, device, torch.bfloat16 if gpu else torch.float32)


def generate_costs(target: torch.nn.Module, prompt: torch.Tensor, new_tokens: int, compiled: bool = False
                   ) -> tuple[float, tuple[float, float] | None, list[int], float]:
    """(ms, (compute ops, all ops) or None when compiled) per token of greedy `generate`, its tokens, and the seconds
    of its first call (compiled: mostly the compilation)."""
    arguments = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with CompiledForward(target) if compiled else nullcontext({}) as extra:
        arguments.update(extra)
        started = time.perf_counter()
        target.generate(prompt, **arguments)  # warm-up (compiled: the compilation)
        first_call = time.perf_counter() - started
        target.generate(prompt, **arguments)
        ops = None
        if not compiled:
            counter = OpCounter()
            with counter:
                target.generate(prompt, **arguments)
            ops = counter.per(new_tokens)
        synchronize(prompt.device)
        started = time.perf_counter()
        output = target.generate(prompt, **arguments)
        synchronize(prompt.device)
        seconds = time.perf_counter() - started
    return 1000 * seconds / new_tokens, ops, output[0, prompt.shape[1]:].tolist(), first_call


@torch.inference_mode()
def forward_costs(target: torch.nn.Module, draft: DFlashDraftModel, prompt: torch.Tensor
                  ) -> tuple[float, tuple[float, float]]:
    """(ms, (compute ops, all ops)) of one 16-token target verify (returning every hidden state) and one draft
    forward over a block of 16 with 16 new context columns: what a DFlash step cannot avoid (in inference mode, as
    the loop runs)."""
    cache = DynamicCache(config=target.config)
    target(prompt, past_key_values=cache, use_cache=True)
    width = prompt.shape[1]
    block = torch.randint(0, 500, (1, 16), generator=torch.Generator().manual_seed(2)).to(prompt.device)
    positions = torch.arange(width, width + 16, device=prompt.device)[None]
    features = torch.randn(1, 16, len(draft.target_layer_ids) * target.config.hidden_size, device=prompt.device,
                           dtype=draft.dtype)
    embeddings = draft.embed_block(block, target.get_input_embeddings().weight)

    def step(counter: OpCounter | None) -> float:
        synchronize(prompt.device)
        started = time.perf_counter()
        with counter or torch.inference_mode():
            target(block, position_ids=positions, past_key_values=cache, use_cache=True, output_hidden_states=True)
            draft(embeddings, features, positions, positions, cache=draft.new_cache())
        synchronize(prompt.device)
        seconds = time.perf_counter() - started
        cache.crop(-16)
        return seconds

    step(None)  # warm-up
    counter = OpCounter()
    step(counter)
    return 1000 * sum(step(None) for _ in range(20)) / 20, counter.per(1)  # a mean, as the loop's rows


def loop_costs(target: torch.nn.Module, draft: DFlashDraftModel, prompt: torch.Tensor, new_tokens: int,
               tree_size: int | None, compile: bool = False
               ) -> tuple[float, tuple[float, float] | None, float, list[int], float]:
    """(ms, (compute ops, all ops) or None when compiled, tau) per draft-and-verify step of the loop, its tokens, and
    the seconds of its first call (compiled: mostly the compilation)."""
    settings = resolve_settings(target, prompt, draft, max_new_tokens=new_tokens, block_size=16, cpu_kernels=False,
                                tree_size=tree_size, do_sample=False, compile=compile)

    def run(counter: OpCounter | None) -> tuple[float, int, DecodeSession]:
        session = DecodeSession(target, dflash_proposer(draft, target, settings, prompt.shape[1]), settings)
        seconds, steps = 0.0, 0
        with session.running():
            session.prefill(prompt)
            while True:
                synchronize(prompt.device)
                started = time.perf_counter()
                if counter is None:
                    going = session.step()
                else:
                    with counter:
                        going = session.step()
                synchronize(prompt.device)
                seconds += time.perf_counter() - started
                if not going:
                    return seconds, steps, session
                steps += 1

    started = time.perf_counter()
    run(None)  # warm-up (compiled: the compilation)
    first_call = time.perf_counter() - started
    ops = None
    if not compile:
        counter = OpCounter()
        _, steps, _ = run(counter)
        ops = counter.per(steps)
    seconds, steps, session = run(None)
    result = session.finish()
    return 1000 * seconds / steps, ops, result.tau, result.new_tokens(0), first_call


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompt-length", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--tree-size", type=int, default=8)
    parser.add_argument("--no-compile", action="store_true", help="skip the compiled chain")
    parser.add_argument("--no-tree", action="store_true", help="skip the tree")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--synthetic", metavar="PAIR", help="a pair of `bench --synthetic` (Qwen3-8B) instead")
    parser.add_argument("--hybrid", action="store_true", help="a Qwen3.5-shaped hybrid target instead")
    parser.add_argument("--hybrid-layers", type=int, default=32, help="its depth (Qwen3.5-27B: 64)")
    args = parser.parse_args()
    if args.synthetic:
        target, draft = synthetic_pair(args.synthetic, torch.device(args.device))
        shape = f"{args.synthetic}, random, {draft.dtype}"
    elif args.hybrid:
        target, draft = (model.to(args.device) for model in hybrid_proxy_pair(args.hybrid_layers))
        shape = f"Qwen3.5-shaped hybrid, {args.hybrid_layers} layers x 64"
    else:
        target, draft = (model.to(args.device) for model in proxy_pair())
        shape = "36 layers x 64"
    prompt = torch.randint(0, 500, (1, args.prompt_length), generator=torch.Generator().manual_seed(1))
    prompt = prompt.to(args.device)
    ms, ops, expected, _ = generate_costs(target, prompt, args.new_tokens)
    print(f"prompt {args.prompt_length} tokens, {args.new_tokens} new, torch {torch.__version__}, {shape}, "
          f"{args.device}, {torch.get_num_threads()} threads")
    print("| loop | ms per step | compute ops per step | all aten ops | tau | first call, s |\n"
          "|---|---:|---:|---:|---:|---:|")

    def row(name: str, ms: float, ops: tuple[float, float] | None, tau: str = "", first_call: str = "") -> None:
        counts = "- | -" if ops is None else f"{ops[0]:,.0f} | {ops[1]:,.0f}"
        print(f"| {name} | {ms:.1f} | {counts} | {tau} | {first_call} |")

    row("plain `generate` (per token)", ms, ops, "1")
    if not args.no_compile and not args.hybrid:
        ms, _, tokens, first_call = generate_costs(target, prompt, args.new_tokens, compiled=True)
        agree = tokens == expected
        row("plain `generate`, compiled (static cache; per token)" + ("" if agree else " (differs from eager!)"), ms,
            None, "1", f"{first_call:.1f}")
    if not args.hybrid:  # (a hybrid target's verify alone would leave its recurrent states advanced)
        ms, ops = forward_costs(target, draft, prompt)
        row("target verify + draft forward alone", ms, ops)
    rows = [("dflash-hf chain", None, False)]
    rows += [] if args.no_tree else [(f"dflash-hf tree of {args.tree_size}", args.tree_size, False)]
    rows += [] if args.no_compile else [("dflash-hf chain, compiled", None, True)]
    rows += [] if args.no_compile or args.no_tree else [(f"dflash-hf tree of {args.tree_size}, compiled",
                                                         args.tree_size, True)]
    step_ms = {}
    for name, tree_size, compile in rows:
        ms, ops, tau, tokens, first_call = loop_costs(target, draft, prompt, args.new_tokens, tree_size, compile)
        step_ms[tree_size, compile] = ms
        if args.synthetic:
            agree = next((index for index, (a, b) in enumerate(zip(tokens, expected)) if a != b), len(expected))
            name += f" (first {agree} of {len(expected)} tokens as generate's)"
        else:
            assert tokens == expected, f"{name}: output differs from generate"
        row(name, ms, ops, f"{tau:.2f}", f"{first_call:.1f}")
    if (None, True) in step_ms:
        print(f"\ncompiled chain step / eager chain step: {step_ms[None, True] / step_ms[None, False]:.2f}")

if __name__ == "__main__":
    main()
