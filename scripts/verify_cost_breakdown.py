"""Where a verify's time goes on this CPU: SmolLM2-135M-Instruct (float32) forwards of 1, 8 and 16 new tokens over a
cached context, split by op class, and every few-row product shape timed with each kernel.

    python scripts/verify_cost_breakdown.py                    # 1 and 2 threads, rows 1 8 16
    python scripts/verify_cost_breakdown.py --threads 1 --repeats 30

Part 1, the forward by op class: forward hooks time every module of the target (the q/k/v/o and gate/up/down
products, the norms, the rotary embedding's cos/sin, attention, MLP, decoder layer); "attention core" is the attention
module less its four products (RoPE applied, cache update, SDPA), "MLP activation" the MLP less its products,
"residual" a layer less its attention, MLP and norms, "rest" the base model less its layers, embedding, cos/sin and
final norm (masks); the LM head is timed alone. Two ways of running the products: "F.linear" (as `generate` runs
them) and "cpu_kernels" (the loop's verify: `kernels_dflash.few_row_kernels` inside one `cpu_kernels()` scope, the
kernel table primed first as `evaluation` primes it). The hooks' own cost lands in the derived rows; the "total
(no hooks)" row is timed without them.

Part 2, per product shape: each kernel of `kernels_dflash` and the alternatives, over every layer's weight of that
shape in turn (as a forward streams them from memory), milliseconds per product; "fused q/k/v" and "fused gate/up"
multiply by the layer's weights concatenated. The kernel `cpu_kernels` chose for the shape is shown beside them.

Runs take turns (A, B, A, B ...) and each number is the minimum over the repeats: the machine is shared, and the
minimum is the least disturbed run. Compare numbers within one run only; write `uptime`'s load average beside them.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import time
from collections import defaultdict
from contextlib import nullcontext
from typing import Callable

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from dflash_hf import load_demo
from dflash_hf.cost_model import prime_few_row_kernels
from dflash_hf.kernels_dflash import (
    FEW_ROW_KERNEL_CHOICE,
    HAS_ONEDNN_LINEAR,
    cpu_kernels,
    few_row_kernels,
    few_row_logits,
)
from dflash_hf.loading import device_description

CONTEXT = 128  # cached context tokens before the timed forward
PRODUCTS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONTAINERS = ("self_attn", "mlp")


class ModuleTimer:
    """Seconds spent in each named module of a model during one forward (inclusive), by forward hooks."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.started: dict[str, float] = {}
        self.handles = []
        for name, module in model.named_modules():
            if name:
                self.handles.append(module.register_forward_pre_hook(self.pre(name)))
                self.handles.append(module.register_forward_hook(self.post(name)))

    def pre(self, name: str) -> Callable:
        def hook(module, args):
            self.started[name] = time.perf_counter()
        return hook

    def post(self, name: str) -> Callable:
        def hook(module, args, output):
            self.seconds[name] += time.perf_counter() - self.started[name]
        return hook

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def op_classes(seconds: dict[str, float], head_seconds: float) -> dict[str, float]:
    """Module seconds of one forward grouped by op class (exclusive: containers less what they contain)."""
    classes: dict[str, float] = defaultdict(float)
    for name, value in seconds.items():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in PRODUCTS:
            classes[leaf] += value
        elif leaf in ("input_layernorm", "post_attention_layernorm", "norm"):
            classes["norms"] += value
        elif leaf == "rotary_emb":
            classes["RoPE cos/sin"] += value
    layers = [name for name in seconds if name.count(".") == 1 and name.startswith("layers.")]
    for layer in layers:
        attention = seconds[f"{layer}.self_attn"] - sum(seconds[f"{layer}.self_attn.{p}"] for p in PRODUCTS[:4])
        mlp = seconds[f"{layer}.mlp"] - sum(seconds[f"{layer}.mlp.{p}"] for p in PRODUCTS[4:])
        classes["attention core (RoPE, cache, SDPA)"] += attention
        classes["MLP activation"] += mlp
        classes["residual"] += seconds[layer] - seconds[f"{layer}.self_attn"] - seconds[f"{layer}.mlp"] - sum(
            seconds[f"{layer}.{n}"] for n in ("input_layernorm", "post_attention_layernorm"))
    classes["LM head"] = head_seconds
    return dict(classes)


def forward_runner(target: torch.nn.Module, cache: DynamicCache, rows: int, kernels: bool) -> Callable[[], float]:
    """One forward of `rows` new tokens over the cached context and the LM head over them; returns the head's
    seconds. The cache is cut back after it."""
    base, head = target.model, target.lm_head
    ids = torch.randint(100, 40000, (1, rows))
    positions = torch.arange(CONTEXT, CONTEXT + rows)[None]

    def run() -> float:
        with (nullcontext() if kernels else cpu_kernels(False)), few_row_kernels(target, rows):
            hidden = base(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True)
        states = hidden.last_hidden_state[0]  # [rows, H]
        started = time.perf_counter()
        if kernels:
            few_row_logits(head, states)
        else:
            head(states)
        head_seconds = time.perf_counter() - started
        cache.crop(-rows)
        return head_seconds
    return run


def part_one(target, cache, rows_list, repeats) -> tuple[dict, dict]:
    """{(rows, way): {class: min ms}} and {(rows, way): total min ms without hooks}."""
    ways = ("F.linear", "cpu_kernels")
    runners = {(rows, way): forward_runner(target, cache, rows, way == "cpu_kernels") for rows in rows_list
               for way in ways}
    totals: dict = defaultdict(list)
    for _ in range(repeats):
        for key, run in runners.items():
            started = time.perf_counter()
            run()
            totals[key].append(time.perf_counter() - started)
    classes: dict = defaultdict(lambda: defaultdict(list))
    timer = ModuleTimer(target.model)
    try:
        for _ in range(repeats):
            for key, run in runners.items():
                timer.seconds.clear()
                started = time.perf_counter()
                head = run()
                forward = time.perf_counter() - started - head
                grouped = op_classes(timer.seconds, head)
                layers = sum(v for k, v in timer.seconds.items() if k.count(".") == 1 and k.startswith("layers."))
                grouped["rest (embedding, masks)"] = forward - layers - timer.seconds["rotary_emb"] - timer.seconds[
                    "norm"]
                for name, value in grouped.items():
                    classes[key][name].append(value)
    finally:
        timer.remove()
    return ({key: {name: min(values) * 1000 for name, values in per.items()} for key, per in classes.items()},
            {key: min(values) * 1000 for key, values in totals.items()})


def product_kernels(weights: list[torch.Tensor], packed) -> dict[str, Callable[[torch.Tensor], None]]:
    """Each way to multiply rows [N, H] by every weight of `weights` in turn."""
    transposed = [w.t().contiguous() for w in weights]  # [H, V]
    kernels = {
        "F.linear": lambda x: [F.linear(x, w) for w in weights],
        "(W @ x^T)^T": lambda x: [(w @ x.T).T for w in weights],
        "x @ W^T (W^T contiguous)": lambda x: [torch.mm(x, wt) for wt in transposed],
        "W^T contiguous, (W^T^T @ x^T)^T": lambda x: [torch.mm(wt.t(), x.T).T for wt in transposed],
    }
    if HAS_ONEDNN_LINEAR:
        copies = [packed.packed(w) for w in weights]
        kernels["oneDNN packed"] = lambda x: [torch.ops.mkldnn._linear_pointwise(x, c, None, "none", [], "")
                                              for c in copies]
    return kernels


def part_two(target, rows_list, repeats) -> dict:
    """{(shape name, rows): {kernel: min ms per product}}."""
    layers = target.model.layers
    groups = {}
    for name in ("q_proj", "k_proj", "gate_proj", "down_proj"):
        weights = [getattr(layer.self_attn if name in PRODUCTS[:4] else layer.mlp, name).weight for layer in layers]
        groups[f"{name} {tuple(weights[0].shape)}"] = weights
    groups["fused q/k/v (960, 576)"] = [torch.cat([layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight,
                                                   layer.self_attn.v_proj.weight]) for layer in layers]
    groups["fused gate/up (3072, 576)"] = [torch.cat([layer.mlp.gate_proj.weight, layer.mlp.up_proj.weight])
                                           for layer in layers]
    groups["LM head (49152, 576)"] = [target.lm_head.weight]
    results: dict = {}
    with cpu_kernels(True) as packed:
        for group, weights in groups.items():
            kernels = product_kernels(weights, packed)
            for rows in rows_list:
                states = torch.randn(rows, weights[0].shape[1])
                samples: dict = defaultdict(list)
                for _ in range(repeats if len(weights) > 1 else max(3, repeats // 3)):
                    for name, kernel in kernels.items():
                        started = time.perf_counter()
                        kernel(states)
                        samples[name].append((time.perf_counter() - started) / len(weights))
                chosen = FEW_ROW_KERNEL_CHOICE.get((torch.float32, tuple(weights[0].shape), rows,
                                                    torch.get_num_threads()), "-")
                results[(group, rows)] = {**{n: min(v) * 1000 for n, v in samples.items()}, "chosen": chosen}
            for weight in weights:
                packed.drop(weight)
    return results


def step_costs(target, tokenizer, draft, widths: list[int], rounds: int) -> dict:
    """The loop's step costs (`cost_model.time_step_stages`, as bench times them) after the demo's first prompt, for
    each of the modes `cost_model.choose_cpu_kernels` times, in turn for `rounds` rounds: {(mode's name, stage): min
    ms}."""
    from dflash_hf.cost_model import time_step_stages
    from dflash_hf.demo import DEMO_PROMPTS
    from dflash_hf.kernels_dflash import CPU_KERNEL_MODES, CPU_KERNEL_NAMES
    from dflash_hf.prompts import user_prompt_ids
    from dflash_hf.tokens_dflash import generation_tokens

    context = torch.tensor([user_prompt_ids(tokenizer, DEMO_PROMPTS[0])])
    mask_token_id = generation_tokens(target, tokenizer, draft).mask_token_id
    samples: dict = defaultdict(list)
    for _ in range(rounds):
        for mode in CPU_KERNEL_MODES:
            way = CPU_KERNEL_NAMES[mode]
            timings = time_step_stages(draft, target, context, max(widths), mask_token_id, widths, repeats=3,
                                       cpu_kernels=mode)
            samples[(way, "one token")].append(timings["target_1"])
            samples[(way, "draft")].append(timings["draft"])
            for width in widths:
                samples[(way, f"verify {width}")].append(timings["verify"][width])
    return {key: min(values) * 1000 for key, values in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--skip-products", action="store_true", help="no per-shape product table")
    parser.add_argument("--step-costs", type=int, default=0, metavar="ROUNDS",
                        help="also the loop's step costs (a verify of each --rows width, a draft pass, one token) "
                        "with the kernels off, on the LM head only and on everything, in turn, ROUNDS rounds")
    parser.add_argument("--skip-forward", action="store_true", help="no op-class table")
    args = parser.parse_args()
    target, tokenizer, draft = load_demo()
    print(f"# {device_description(target)}, torch {torch.__version__}, {platform.python_version()}, "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, load {os.getloadavg()}, "
          f"mkldnn fp32 precision {torch.backends.mkldnn.matmul.fp32_precision}, "
          f"matmul precision {torch.get_float32_matmul_precision()}")
    for threads in args.threads:
        torch.set_num_threads(threads)
        if args.step_costs:
            costs = step_costs(target, tokenizer, draft, sorted(set(args.rows) - {1}), args.step_costs)
            print(f"\n## {threads} thread(s): step costs, min ms over {args.step_costs} rounds (each a median of 3), "
                  f"load {os.getloadavg()[0]:.2f}")
            ways = list(dict.fromkeys(way for way, _ in costs))
            print("| stage | " + " | ".join(f"kernels: {way}" for way in ways) + " |\n|---|" + "---:|" * len(ways))
            for stage in dict.fromkeys(stage for _, stage in costs):
                print(f"| {stage} | " + " | ".join(f"{costs[(way, stage)]:.1f}" for way in ways) + " |")
            for width in sorted(set(args.rows) - {1}):
                print(f"| verify {width} / one token | " + " | ".join(
                    f"{costs[(way, f'verify {width}')] / costs[(way, 'one token')]:.2f}" for way in ways) + " |")
        if args.skip_forward:
            continue
        with torch.no_grad():
            cache = DynamicCache(config=target.config)
            target.model(input_ids=torch.randint(100, 40000, (1, CONTEXT)), past_key_values=cache, use_cache=True)
            prime_few_row_kernels(draft, target, max(args.rows))
            with cpu_kernels(True):  # one scope, as a generation call: weights packed once
                classes, totals = part_one(target, cache, args.rows, args.repeats)
            keys = list(totals)
            print(f"\n## {threads} thread(s): forward of N new tokens after {CONTEXT}, min ms over {args.repeats}, "
                  f"load {os.getloadavg()[0]:.2f}")
            print("| op class | " + " | ".join(f"{rows} rows {way}" for rows, way in keys) + " |")
            print("|---|" + "---:|" * len(keys))
            names = list(dict.fromkeys(name for key in keys for name in classes[key]))
            for name in names:
                print(f"| {name} | " + " | ".join(f"{classes[key].get(name, 0.0):.2f}" for key in keys) + " |")
            print("| total (no hooks) | " + " | ".join(f"{totals[key]:.1f}" for key in keys) + " |")
            one = totals[(args.rows[0], "F.linear")]
            print("| over 1 row F.linear | " + " | ".join(f"{totals[key] / one:.2f}" for key in keys) + " |")
            if args.skip_products:
                continue
            products = part_two(target, args.rows, args.repeats)
            print(f"\n## {threads} thread(s): ms per product, over each layer's weight in turn, load "
                  f"{os.getloadavg()[0]:.2f}")
            kernels = [k for k in next(iter(products.values())) if k != "chosen"]
            print("| shape | rows | " + " | ".join(kernels) + " | cpu_kernels chose |")
            print("|---|---:|" + "---:|" * len(kernels) + "---|")
            for (group, rows), times in products.items():
                print(f"| {group} | {rows} | " + " | ".join(f"{times.get(k, float('nan')):.3f}" for k in kernels)
                      + f" | {times['chosen']} |")


if __name__ == "__main__":
    main()
