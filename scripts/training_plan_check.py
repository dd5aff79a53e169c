"""A few real training steps at Qwen3-8B's shapes on one GPU, beside what the cost model computes for them.

A random Qwen3-8B-shaped target (36 layers, hidden 4096, bfloat16) and a random draft of the published
Qwen3-8B-DFlash-b16 shape (5 layers, float32 weights and AdamW, bf16 autocast) train with `train_draft` as
`dflash-hf train` runs them on one GPU (FSDP off): sequences of `--tokens` tokens (a 200-token prompt, the rest
response), `--anchors` anchors, one sequence per optimiser step. Two runs of `--steps A B` steps in one process: the
time per step is the difference of their wall times over B - A steps, which leaves out what each run pays once (the
checkpoint after the last step, written to /dev/shm where it exists); a one-step run before them pays the first
calls' set-up. Prints one JSON line:
the measured seconds per step, tokens/s and peak GPU memory, and the cost model's (`dflash_hf.training.plan`, as
`dflash-hf train --plan 1xh100` computes them: a step's seconds at its assumed utilisation, the memory per GPU
data-parallel), and their ratios.

    python scripts/training_plan_check.py                    # on a GPU: Qwen3-8B's shapes, 3,072 tokens
    python scripts/training_plan_check.py --gradient-checkpointing
    python scripts/training_plan_check.py --shrink 32 --tokens 256 --anchors 16   # a dry run on a CPU

`--shrink K` divides the widths (hidden, MLP, heads, vocabulary) and the target's layers by K: a CPU can run the
script end to end (its numbers say nothing of a GPU). `scripts/gpu_check.sh` runs it on a lent GPU.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
import time

import torch
from transformers import Qwen3ForCausalLM

from dflash_hf import DFlashConfig, DFlashDraftModel
from dflash_hf.loading import PUBLISHED_CONFIGS
from dflash_hf.training.plan import GPUS, Interval, RunInputs, plan_run, target_config, this_machine
from dflash_hf.training.trainer import TrainingSettings, train_draft

PROMPT_TOKENS = 200


def shapes(shrink: int) -> tuple[object, DFlashConfig]:
    """Qwen3-8B's decoder config and the published draft's config, their widths and target layers divided by
    `shrink`."""
    target = target_config("Qwen/Qwen3-8B")
    draft = DFlashConfig.from_json_file(str(PUBLISHED_CONFIGS / "Qwen3-8B-DFlash-b16.json"))
    if shrink > 1:
        for config in (target, draft):
            config.hidden_size //= shrink
            config.intermediate_size //= shrink
            config.vocab_size //= shrink
            config.num_attention_heads = max(config.num_attention_heads // shrink, 1)
            config.num_key_value_heads = max(config.num_key_value_heads // shrink, 1)
        target.num_hidden_layers = max(target.num_hidden_layers // shrink, 4)
        draft.num_target_layers = target.num_hidden_layers
        draft.dflash_config["target_layer_ids"] = [1, target.num_hidden_layers - 2]
        draft.dflash_config["mask_token_id"] = draft.vocab_size - 1
    return target, draft


def timed_run(target: torch.nn.Module, draft_config: DFlashConfig, rows: list[dict], settings: TrainingSettings,
              folder: str) -> tuple[float, int]:
    """(wall seconds, tokens trained) of `train_draft` on `rows` from a fresh draft, into a fresh `folder`."""
    gc.collect()  # the previous run's draft and optimiser state go before this one's are built
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    draft = DFlashDraftModel(draft_config)
    shutil.rmtree(folder, ignore_errors=True)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    started = time.perf_counter()
    log = train_draft(draft, target, rows, settings, folder, progress=False)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started, log.tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=3072, help="tokens per sequence")
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--steps", type=int, nargs=2, default=[2, 5], metavar=("A", "B"),
                        help="optimiser steps of the two runs (B > A)")
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--shrink", type=int, default=1, help="divide widths and target layers by K (a CPU dry run)")
    args = parser.parse_args()
    if args.steps[1] <= args.steps[0]:
        parser.error("--steps A B needs B > A")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    target_shape, draft_config = shapes(args.shrink)
    draft_config._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device):  # random weights straight on the device, in the target's dtype
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            target = Qwen3ForCausalLM(target_shape).eval()
        finally:
            torch.set_default_dtype(default)
    vocab = target_shape.vocab_size
    generator = torch.Generator().manual_seed(1)
    rows = [{"prompt_ids": torch.randint(0, vocab - 1, (PROMPT_TOKENS,), generator=generator).tolist(),
             "response_ids": torch.randint(0, vocab - 1, (args.tokens - PROMPT_TOKENS,), generator=generator).tolist()}
            for _ in range(args.steps[1])]
    settings = TrainingSettings(epochs=1, num_anchors=args.anchors, max_length=args.tokens,
                                gradient_checkpointing=args.gradient_checkpointing, checkpoint_every=10**9)
    scratch = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        timed_run(target, draft_config, rows[:1], settings, os.path.join(scratch, "warm-up"))  # first calls' set-up
        runs = [timed_run(target, draft_config, rows[:steps], settings, os.path.join(scratch, str(steps)))
                for steps in args.steps]
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    step_seconds = (runs[1][0] - runs[0][0]) / (args.steps[1] - args.steps[0])
    tokens_per_s = (runs[1][1] - runs[0][1]) / (runs[1][0] - runs[0][0])
    peak = torch.cuda.max_memory_allocated() / 1e9 if device.type == "cuda" else None
    measured = {"seconds_per_step": step_seconds, "tokens_per_s": tokens_per_s, "peak_gpu_memory_gb": peak}
    kind = this_machine()[1] or "h100"
    target_parameters = sum(p.numel() for p in target.parameters())
    draft_parameters = sum(p.numel() for p in DFlashDraftModel(draft_config).parameters() if p.requires_grad)
    run = RunInputs(sequences=args.steps[1], tokens=args.tokens, epochs=1, processes=1, gpu=GPUS[kind],
                    anchors=args.anchors, per_process=1, per_micro_batch=1,
                    gradient_checkpointing=args.gradient_checkpointing, checkpoint_every=Interval(100, "%"),
                    held_out_rows=0, held_out_every=Interval(0, ""), num_eval=0, eval_every=Interval(0, ""),
                    eval_max_new_tokens=0)
    plan = plan_run(run, target_shape, target_parameters, draft_config, draft_parameters)
    memory = sum(plan.memory["data-parallel"].values())
    print(json.dumps({
        "device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu", "shrink": args.shrink,
        "tokens": args.tokens, "anchors": args.anchors, "gradient_checkpointing": args.gradient_checkpointing,
        "measured": measured,
        "computed": {"gpu": kind, "seconds_per_step": plan.step_seconds,
                     "tokens_per_s": args.tokens / plan.step_seconds, "memory_per_gpu_gb": memory / 1e9},
        "measured_over_computed": {
            "seconds_per_step": step_seconds / plan.step_seconds,
            "memory": measured["peak_gpu_memory_gb"] * 1e9 / memory if measured["peak_gpu_memory_gb"] else None}}))


if __name__ == "__main__":
    main()
