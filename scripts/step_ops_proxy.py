"""GPU-shaped costs on any machine: compute ops and milliseconds per step, on a compute-free target of real depth.

On a GPU at batch 1 an eager forward is bound by kernel launches, and every aten op that computes is at least one
launch. This proxy makes the arithmetic negligible (a random Qwen3 of 36 layers, width 64, vocabulary 512; a 5-layer
draft, block 16), so what remains is what each loop dispatches: plain `generate` per token, eager and compiled
(Transformers' documented way: a static cache and `torch.compile` of the forward), that compiled forward alone over
one token and over a block (the floor of any compiled verify: once inductor has fused the launches, a block's
arithmetic is no longer negligible on a CPU), the target's verify and the draft's forward alone (what any DFlash
loop must run), a dflash-hf chain step and a tree step, eager and compiled
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
import statistics
import time
from collections import Counter
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field
from functools import partial

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import DynamicCache, Qwen3Config, Qwen3ForCausalLM, StaticCache

from dflash_hf import DFlashDraftModel
from dflash_hf.cache_dflash import static_capacity
from dflash_hf.generation_dflash import DecodeSession, dflash_proposer, synchronize
from dflash_hf.settings_dflash import resolve_settings
from dflash_hf.synthetic import CPU_SHRINK, build_synthetic_pair, shrink_configs, synthetic_spec
from dflash_hf.training.recipe import draft_config_for
from dflash_hf.versions_dflash import cache_keyword, rewind_static_cache

# aten ops that launch no kernel: views, aliases and no-op markers (a same-dtype `to` returns its input: see below)
VIEW_OPS = frozenset({
    "view", "_unsafe_view", "t", "transpose", "expand", "slice", "select", "unsqueeze", "squeeze", "permute", "alias",
    "detach", "detach_", "as_strided", "split", "split_with_sizes", "unbind", "reshape", "_reshape_alias", "view_as",
    "chunk", "narrow", "lift_fresh", "resolve_conj", "resolve_neg", "expand_as",
})

Timer = Callable[[], float]  # one more timed run: ms per step (per token for `generate`)


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
                   ) -> tuple[Timer, tuple[float, float] | None, list[int], float]:
    """A timer of greedy `generate` (ms per token of one more call), its (compute ops, all ops) per token or None when
    compiled, its tokens, and the seconds of its first call (compiled: mostly the compilation)."""
    arguments = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with CompiledForward(target) if compiled else nullcontext({}) as extra:
        arguments.update(extra)
        started = time.perf_counter()
        output = target.generate(prompt, **arguments)  # warm-up (compiled: the compilation)
        first_call = time.perf_counter() - started
        target.generate(prompt, **arguments)
        ops = None
        if not compiled:
            counter = OpCounter()
            with counter:
                target.generate(prompt, **arguments)
            ops = counter.per(new_tokens)

    def timer() -> float:
        with CompiledForward(target) if compiled else nullcontext({}):
            synchronize(prompt.device)
            started = time.perf_counter()
            target.generate(prompt, **arguments)
            synchronize(prompt.device)
            return 1000 * (time.perf_counter() - started) / new_tokens

    return timer, ops, output[0, prompt.shape[1]:].tolist(), first_call


@torch.inference_mode()
def compiled_forward_costs(target: torch.nn.Module, prompt: torch.Tensor, widths: tuple[int, ...], capacity: int,
                           calls: int = 96) -> dict[int, Timer]:
    """Timers (ms per call, the mean of `calls`) of the target's compiled forward (Transformers' own, as compiled
    `generate` runs it) over each of `widths` new tokens after the prompt, on a StaticCache of `capacity` columns (a
    compiled verify's), written and rewound at the same columns: the floor of any compiled verify of that width."""
    forward = CompiledForward(target).forward
    timed = {}
    for width in widths:
        cache = StaticCache(config=target.config, max_cache_len=capacity)
        target(prompt, use_cache=True, **{cache_keyword(target): cache})
        tokens = torch.randint(0, 500, (1, width), generator=torch.Generator().manual_seed(3)).to(prompt.device)
        positions = torch.arange(prompt.shape[1], prompt.shape[1] + width, device=prompt.device)

        def call(cache: StaticCache = cache, tokens: torch.Tensor = tokens, positions: torch.Tensor = positions
                 ) -> None:
            forward(input_ids=tokens, position_ids=positions[None], use_cache=True, cache_position=positions,
                    **{cache_keyword(target): cache})
            rewind_static_cache(cache, positions.shape[0])

        for _ in range(3):
            call()  # warm-up (the first: the compilation of this width)
        timed[width] = call

    def timer(call: Callable[[], None]) -> float:
        synchronize(prompt.device)
        started = time.perf_counter()
        for _ in range(calls):
            call()
        synchronize(prompt.device)
        return 1000 * (time.perf_counter() - started) / calls

    return {width: partial(torch.inference_mode()(timer), call) for width, call in timed.items()}


@torch.inference_mode()
def forward_costs(target: torch.nn.Module, draft: DFlashDraftModel, prompt: torch.Tensor
                  ) -> tuple[Timer, tuple[float, float]]:
    """A timer (ms, the mean of 20) and the (compute ops, all ops) of one 16-token target verify (returning every
    hidden state) and one draft forward over a block of 16 with 16 new context columns: what a DFlash step cannot
    avoid (in inference mode, as the loop runs)."""
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
    return lambda: 1000 * sum(step(None) for _ in range(20)) / 20, counter.per(1)  # a mean, as the loop's rows


def loop_costs(target: torch.nn.Module, draft: DFlashDraftModel, prompt: torch.Tensor, new_tokens: int,
               tree_size: int | None, compile: bool = False
               ) -> tuple[Timer, tuple[float, float] | None, float, list[int], float]:
    """A timer of the loop (ms per draft-and-verify step of one more call), its (compute ops, all ops) per step or
    None when compiled, its tau and tokens, and the seconds of its first call (compiled: mostly the compilation)."""
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
    _, _, session = run(None)
    result = session.finish()

    def timer() -> float:
        seconds, steps, _ = run(None)
        return 1000 * seconds / steps

    return timer, ops, result.tau, result.new_tokens(0), first_call


@dataclass
class Row:
    """A row of the table: what it times, its timer and its ms per round, its op counts, tau and first call."""

    name: str
    timer: Timer
    ops: tuple[float, float] | None = None
    tau: str = ""
    first_call: str = ""
    ms: list[float] = field(default_factory=list)

    def line(self) -> str:
        """The row as a markdown line: the median of its rounds, and their range when there are several."""
        counts = "- | -" if self.ops is None else f"{self.ops[0]:,.0f} | {self.ops[1]:,.0f}"
        ms = f"{statistics.median(self.ms):.1f}" + (f" ({min(self.ms):.1f}-{max(self.ms):.1f})" if len(self.ms) > 1
                                                     else "")
        return f"| {self.name} | {ms} | {counts} | {self.tau} | {self.first_call} |"


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
    parser.add_argument("--rounds", type=int, default=5,
                        help="timed rounds, every row once a round, in turns (a passing load touches all rows alike); "
                             "the table shows each row's median and range")
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
    print(f"prompt {args.prompt_length} tokens, {args.new_tokens} new, torch {torch.__version__}, {shape}, "
          f"{args.device}, {torch.get_num_threads()} threads")
    rows = measure(args, target, draft, prompt)
    for _ in range(args.rounds - 1):
        for row in rows.values():
            row.ms.append(row.timer())
    report(rows, args.rounds)


def measure(args: argparse.Namespace, target: torch.nn.Module, draft: DFlashDraftModel, prompt: torch.Tensor
            ) -> dict[str, Row]:
    """The rows `args` asks for, each warmed up, counted and timed once (printed as it comes)."""
    rows: dict[str, Row] = {}

    def add(key: str, row: Row) -> None:  # its first round now, so a run stopped early still shows it
        row.ms.append(row.timer())
        rows[key] = row
        print(f"first round: {row.name}: {row.ms[0]:.1f} ms", flush=True)

    timer, ops, expected, _ = generate_costs(target, prompt, args.new_tokens)
    add("generate", Row("plain `generate` (per token)", timer, ops, "1"))
    compiled = not args.no_compile
    if compiled and not args.hybrid:
        timer, _, tokens, first_call = generate_costs(target, prompt, args.new_tokens, compiled=True)
        differs = "" if tokens == expected else " (differs from eager!)"
        add("compiled generate", Row(f"plain `generate`, compiled (static cache; per token){differs}", timer, None,
                                     "1", f"{first_call:.1f}"))
        block = 16
        capacity = static_capacity(args.prompt_length + args.new_tokens + block)  # the compiled verify's cache
        floor = compiled_forward_costs(target, prompt, (1, block), capacity)
        add("forward 1", Row(f"the target's compiled forward alone, 1 token ({capacity}-column static cache)",
                             floor[1]))
        add("forward block", Row(f"the target's compiled forward alone, {block} tokens: the floor of a compiled "
                                 "verify", floor[block]))
    if not args.hybrid:  # (a hybrid target's verify alone would leave its recurrent states advanced)
        timer, ops = forward_costs(target, draft, prompt)
        add("verify + draft", Row("target verify + draft forward alone", timer, ops))
    loops = [("chain", "dflash-hf chain", None, False)]
    loops += [] if args.no_tree else [("tree", f"dflash-hf tree of {args.tree_size}", args.tree_size, False)]
    loops += [("compiled chain", "dflash-hf chain, compiled", None, True)] if compiled else []
    loops += [("compiled tree", f"dflash-hf tree of {args.tree_size}, compiled", args.tree_size, True)
              ] if compiled and not args.no_tree else []
    for key, name, tree_size, compile in loops:
        timer, ops, tau, tokens, first_call = loop_costs(target, draft, prompt, args.new_tokens, tree_size, compile)
        if args.synthetic:
            agree = next((index for index, (a, b) in enumerate(zip(tokens, expected)) if a != b), len(expected))
            name += f" (first {agree} of {len(expected)} tokens as generate's)"
        else:
            assert tokens == expected, f"{name}: output differs from generate"
        add(key, Row(name, timer, ops, f"{tau:.2f}", f"{first_call:.1f}"))
    return rows


def report(rows: dict[str, Row], rounds: int) -> None:
    """The table of every row's median (and range) over the rounds, then the ratios between rows that README quotes."""
    print(f"\n{rounds} rounds; ms: the median (the range)\n"
          "| loop | ms per step | compute ops per step | all aten ops | tau | first call, s |\n"
          "|---|---:|---:|---:|---:|---:|")
    for row in rows.values():
        print(row.line())
    median = {key: statistics.median(row.ms) for key, row in rows.items()}
    ratios = [("compiled chain step / eager chain step", "compiled chain", "chain"),
              ("compiled chain step / compiled `generate` token", "compiled chain", "compiled generate"),
              ("compiled tree step / compiled chain step", "compiled tree", "compiled chain"),
              ("the compiled block forward alone / the compiled 1-token forward", "forward block", "forward 1"),
              ("the compiled block forward alone / compiled `generate` token", "forward block", "compiled generate")]
    print()
    for name, numerator, denominator in ratios:
        if numerator in median and denominator in median:
            print(f"{name}: {median[numerator] / median[denominator]:.2f}")


if __name__ == "__main__":
    main()
