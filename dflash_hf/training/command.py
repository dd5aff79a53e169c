"""`dflash-hf train`: generate the data (resumable), train (resumable), measure, save a Hub-ready draft with
its card."""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from ..devices_dflash import GROUPED_QUERY_SDPA, target_device
from ..evaluation import evaluate_draft
from ..kernels_dflash import use_grouped_query_sdpa
from ..loading import DTYPES, SHIPPED_DRAFT, SMOLLM2, SMOLLM2_HUB_ID, device_description, load_target
from ..model_card import card_info_for_config, write_model_card
from ..modeling_dflash import DFlashDraftModel
from ..prompts import default_data_dir, user_prompt_ids
from ..smollm2 import SMOLLM2_MASK_TOKEN
from ..tokens_dflash import GenerationTokens, generation_tokens
from ..validation_dflash import check_draft_target
from .data import (
    SHARD_POLL_SECONDS,
    SHARD_STALL_MINUTES,
    PromptTexts,
    engine_refusal,
    generate_responses,
    read_chat_rows,
    read_prompts,
    regenerate_conversations,
    stored_row_offsets,
    training_rows,
    wait_for_files,
)
from .plan import overhead_warning, plan_text, planned, resolve_schedule, run_steps, this_machine
from .processes import check_fsdp_applies, gather_json, process_state, sum_over_processes
from .recipe import (
    DEFAULT_DRAFT_BLOCK_SIZE,
    DEFAULT_DRAFT_LAYERS,
    draft_config_for,
    dspark_config,
    ids_by_count,
    initialize_draft_vocabulary,
    initialize_from_target,
    with_dspark_heads,
    with_own_head,
)
from .store import (
    PARTS,
    STORE_DIR,
    SequenceStore,
    check_datasets_installed,
    part_file,
    read_store_facts,
    write_sequences,
    write_store_facts,
)
from .trainer import TrainingLog, TrainingSettings, check_trackers, prefers_bf16, train_draft
from .vllm_engine import VllmTarget, engine_gpus, load_vllm_target, vllm_refusal


def training_target_dtype(choice: str, device: torch.device, width: int | None = None) -> torch.dtype:
    """The target's dtype in a phase of `train` (`--gen-dtype`, `--target-dtype`, `--eval-dtype`), where `auto` is
    bfloat16 where `trainer.prefers_bf16(device, width)`: on CUDA (the frozen target only gives features, teacher
    logits and batched answers), and on a CPU whose bf16 products of many rows measure faster at the target's
    `width` (None: few-row decoding, as the evaluation's, stays float32 there)."""
    if choice != "auto":
        return DTYPES[choice]
    return torch.bfloat16 if prefers_bf16(device, width) else torch.float32


def check_train_arguments(args: argparse.Namespace, prompt_files: list[str]) -> None:
    """Exit naming the first `train` argument that cannot be run (before anything is read, loaded or trained)."""
    args = checked_schedule(args)
    if args.renamed_block_size is not None:
        raise SystemExit(f"train --block-size is now --draft-block-size {args.renamed_block_size} (the block the "
                         "draft is trained for); --block-size in bench and demo is the block verified per step")
    if prompt_files and args.num_prompts is not None:  # none with --conversations alone: nothing to generate
        check_prompt_counts(args, prompt_files)
    if args.eval_every < 0 or (args.eval_every and not args.num_eval):
        raise SystemExit(f"--eval-every {args.eval_every}: expected 0 (evaluate after training only) or N > 0 with "
                         f"held-out prompts to measure (--num-eval >= 1, got {args.num_eval})")
    if any(count < 1 for count in args.num_prompts or ()) or args.num_eval < 0:
        raise SystemExit(f"--num-prompts must be >= 1 and --num-eval >= 0 (0: no evaluation), got "
                         f"{' '.join(map(str, args.num_prompts))} and {args.num_eval}")
    if args.held_out_rows < 0 or (args.held_out_rows > 0) != (args.held_out_every > 0) or args.held_out_every < 0:
        raise SystemExit(f"--held-out-rows {args.held_out_rows} and --held-out-every {args.held_out_every}: pass "
                         "both >= 1 (measure the loss on K held-out rows every N steps), or neither")
    check_generation_arguments(args)
    if args.train_batch_size < 1 or args.gradient_accumulation_steps < 1:
        raise SystemExit(f"--train-batch-size {args.train_batch_size} and --gradient-accumulation-steps "
                         f"{args.gradient_accumulation_steps}: both must be >= 1")
    check_dspark_arguments(args)
    if args.draft_vocab_size is not None and args.draft_vocab_size < 1:
        raise SystemExit(f"--draft-vocab-size {args.draft_vocab_size}: expected K >= 1 tokens (or leave it out: the "
                         "draft borrows the target's LM head)")
    if args.regenerate_turns == "all" and not args.conversations:
        raise SystemExit("--regenerate-turns all re-answers the assistant turns of --conversations rows: pass them "
                         "(--prompts give one user turn each, answered either way)")
    if args.cache_limit_gib is not None and not args.cache_target_features:
        raise SystemExit("--cache-limit-gib bounds the feature cache: pass it with --cache-target-features")
    missing = [path for path in args.responses if not Path(path).is_file()]
    if missing:
        raise SystemExit(f"--responses {missing[0]}: no such file")
    try:
        check_trackers(training_settings(args).report_to)
    except ValueError as error:
        raise SystemExit(f"dflash-hf train: {error}") from error


def check_dspark_arguments(args: argparse.Namespace) -> None:
    """Exit naming the first DSpark flag (`--markov-rank`, `--markov-head`, `--confidence-head`, `--shifted-labels`)
    that cannot be trained as asked."""
    if args.markov_rank is not None and args.markov_rank < 0:
        raise SystemExit(f"--markov-rank {args.markov_rank}: expected the Markov head's rank R >= 1 (DeepSpec's "
                         "DSpark drafts: 256), or 0 for none")
    if args.markov_head is not None and not args.markov_rank:
        raise SystemExit(f"--markov-head {args.markov_head} needs --markov-rank R >= 1, the head's rank (DeepSpec's "
                         "DSpark drafts: 256)")
    if (args.markov_rank or args.confidence_head) and args.draft_vocab_size is not None:
        raise SystemExit("--markov-rank and --confidence-head train DeepSpec's heads over the target's whole "
                         "vocabulary; a draft with its own LM head (--draft-vocab-size) cannot have them: drop one")
    if args.confidence_head and not args.distill:
        raise SystemExit("--confidence-head learns each position's acceptance against the target's distribution, "
                         "which only distillation keeps: drop --no-distill")


def dspark_heads(args: argparse.Namespace, draft: DFlashDraftModel | None = None) -> dict[str, Any] | None:
    """DeepSpec's DSpark config fields (`DEEPSPEC_FIELDS`) that `--shifted-labels`, `--markov-rank`, `--markov-head`
    and `--confidence-head` ask for, on top of `draft`'s own (an `--init-from` draft); None where nothing is asked.
    Exits naming a flag that would change a head the draft already has."""
    rank = args.markov_rank or 0
    if not (rank or args.confidence_head or args.shifted_labels):
        return None
    kind = (args.markov_head or "vanilla") if rank else None
    if draft is None:
        return {"shifted_labels": True, "markov_rank": rank, "markov_head_type": kind,
                "enable_confidence_head": args.confidence_head,
                "confidence_head_with_markov": args.confidence_head and rank > 0}
    config = draft.config
    conflicts = []
    if config.markov_rank and args.markov_rank is not None and rank != config.markov_rank:
        conflicts.append(f"--markov-rank {rank} (the draft's Markov head has rank {config.markov_rank})")
    if config.markov_rank and args.markov_head is not None and kind != config.markov_head_type:
        conflicts.append(f"--markov-head {kind} (the draft's is {config.markov_head_type})")
    if conflicts:
        raise SystemExit(f"--init-from {args.init_from} already has DSpark heads; drop or change: "
                         + ", ".join(conflicts))
    # a confidence head the draft has keeps its inputs; a new one reads the Markov head where there is one (DeepSpec's)
    rank = config.markov_rank or rank
    with_markov = config.confidence_head_with_markov if config.enable_confidence_head else rank > 0
    return {"shifted_labels": True, "markov_rank": rank,
            "markov_head_type": config.markov_head_type or kind,
            "enable_confidence_head": config.enable_confidence_head or args.confidence_head,
            "confidence_head_with_markov": (config.enable_confidence_head or args.confidence_head) and with_markov}


def checked_schedule(args: argparse.Namespace) -> argparse.Namespace:
    """`args` with --checkpoint-every, --eval-every and --held-out-every as steps of a one-step run, for the checks
    before anything loads (`plan.resolve_schedule`); exits naming a value it refuses, or a time where no GPU of the
    cost model runs the job (its steps' time is then unknown)."""
    try:
        return resolve_schedule(args, 1, 1.0 if this_machine()[1] else None)
    except ValueError as error:
        raise SystemExit(f"dflash-hf train: {error}") from error


def run_schedule(args: argparse.Namespace, rows: SequenceStore, state: Any) -> argparse.Namespace:
    """`args` with --checkpoint-every, --eval-every and --held-out-every as optimiser steps of this run (the steps
    its plan of steps counts; a time by the cost model's step time on this machine's GPU); where the cost model knows
    the GPU, the main process prints what the checkpoints and held-out measurements cost when that is more than
    OVERHEAD_LIMIT of the training time (docs/training.md, "The cost of a run")."""
    steps = run_steps(rows, state.num_processes, training_settings(checked_schedule(args)))
    gpu = this_machine()[1]
    try:  # the cost model's plan where it knows this GPU and finds the target's config (none elsewhere)
        plan = planned(args, len(rows), state.num_processes, gpu)[1] if gpu else None
    except OSError:
        plan = None
    try:
        resolved = resolve_schedule(args, steps, plan.step_seconds if plan else None)
    except ValueError as error:
        raise SystemExit(f"dflash-hf train: {error}") from error
    warning = overhead_warning(plan) if plan else None
    if warning and state.is_main_process:
        print(warning)
    return resolved


def check_generation_arguments(args: argparse.Namespace) -> None:
    """Exit naming the first --gen-* argument that cannot be run."""
    if args.gen_batch_size < 1:
        raise SystemExit(f"--gen-batch-size {args.gen_batch_size}: expected >= 1 prompts per call of the engine")
    if args.gen_max_new_tokens is not None and args.gen_max_new_tokens < 1:
        raise SystemExit(f"--gen-max-new-tokens {args.gen_max_new_tokens}: expected >= 1 (or leave it out: what "
                         "--max-length leaves after each prompt)")
    if args.gen_tensor_parallel_size != 1 and (args.gen_engine != "vllm" or args.gen_tensor_parallel_size < 1):
        raise SystemExit(f"--gen-tensor-parallel-size {args.gen_tensor_parallel_size}: vLLM's tensor parallelism, "
                         "a number >= 1 with --gen-engine vllm (the other engines run one copy of the target per "
                         "process: launch N processes instead)")


def check_prompt_counts(args: argparse.Namespace, prompt_files: list[str]) -> None:
    """Exit when the `--num-prompts` counts do not fit the prompt files."""
    if len(args.num_prompts) not in (1, len(prompt_files)):
        raise SystemExit(f"--num-prompts {' '.join(map(str, args.num_prompts))}: give one count for all prompt "
                         f"files, or one per file ({len(prompt_files)})")


def check_first_prompt(args: argparse.Namespace, num_prompts: int) -> None:
    """Exit when `--first-prompt` is not one of the `num_prompts` prompts read."""
    if not 0 <= args.first_prompt < num_prompts:
        source = "--num-prompts" if args.num_prompts else "the prompt files"
        raise SystemExit(f"--first-prompt {args.first_prompt}: expected 0 <= it < the {num_prompts} prompts of "
                         f"{source}")


def training_settings(args: argparse.Namespace) -> TrainingSettings:
    """The TrainingSettings of `train`'s flags (a ValueError names a value it refuses)."""
    return TrainingSettings(
        epochs=args.epochs, learning_rate=args.learning_rate, num_anchors=args.num_anchors, distill=args.distill,
        l1_weight=args.l1_weight, logit_weight=args.logit_weight, token_cross_entropy=args.token_cross_entropy,
        seed=args.seed, mixed_precision=args.mixed_precision, max_length=args.max_length,
        batch_size=args.train_batch_size, gradient_accumulation_steps=args.gradient_accumulation_steps,
        tokens_per_step=args.tokens_per_step, gradient_checkpointing=args.gradient_checkpointing,
        cache_target=args.cache_target_features,
        cache_limit_gib=args.cache_limit_gib,
        checkpoint_every=args.checkpoint_every, keep_checkpoints=args.keep_checkpoints,
        process_group_timeout_minutes=args.process_group_timeout, report_to=args.report_to)


def generation_target(args: argparse.Namespace, state: Any) -> tuple[torch.nn.Module | VllmTarget, Any]:
    """The target that answers the prompts, and its tokenizer: loaded straight onto this process's device in the
    `--gen-dtype` (where generation and training run), or vLLM's (`--gen-engine vllm`, which loads the target itself,
    only to generate) once `vllm_engine.vllm_refusal` lets it run."""
    dtype = training_target_dtype(args.gen_dtype, state.device)
    refusal = engine_refusal(args.gen_engine, args.gen_draft is not None)
    if refusal is not None:
        raise SystemExit(f"dflash-hf train: {refusal}")
    if args.gen_engine != "vllm":
        target, tokenizer = load_target(args.target, dtype, device=state.device)
        # batched answers are many-row products: "auto" is bf16 on a CPU where they measure faster at this width
        return target.to(training_target_dtype(args.gen_dtype, state.device, target.config.hidden_size)), tokenizer
    refusal = vllm_refusal(args.target, args.generate_only)
    if refusal is not None:
        raise SystemExit(f"dflash-hf train: {refusal}")
    try:  # several processes: each its own engine on its own GPUs (one process: where vLLM puts it)
        gpus = (engine_gpus(state.local_process_index, args.gen_tensor_parallel_size,
                            os.environ.get("CUDA_VISIBLE_DEVICES"), torch.cuda.device_count())
                if state.num_processes > 1 and state.device.type == "cuda" else None)
        return load_vllm_target(args.target, dtype, args.seed, args.gen_tensor_parallel_size, gpus)
    except ValueError as error:  # a generation config vLLM would not follow, more GPUs than the machine shows
        raise SystemExit(f"dflash-hf train: {error}") from error


def regenerate(args: argparse.Namespace, target: torch.nn.Module | VllmTarget, tokenizer: Any,
               prompts: Sequence[str], responses: Path) -> int:
    """Answer every prompt into `responses` (`generate_responses` with the --gen-* flags); returns the row count.
    Continuous batching pages "sdpa" itself: a target `load_target` switched to grouped_query_sdpa generates with
    "sdpa" and is switched back after."""
    paged = args.gen_engine == "continuous" and target.config._attn_implementation == GROUPED_QUERY_SDPA
    if paged:  # continuous batching pages "sdpa" itself, not load_target's grouped_query_sdpa: back to it after
        target.set_attn_implementation("sdpa")
    draft = generation_draft(args.gen_draft, target)
    rows = generate_responses(target, tokenizer, prompts, responses, batch_size=args.gen_batch_size,
                              max_new_tokens=args.gen_max_new_tokens, max_length=args.max_length,
                              temperature=args.gen_temperature, seed=args.seed,
                              by_length=args.gen_order == "length", engine=args.gen_engine,
                              draft=draft, seed_paths=args.responses)
    if args.regenerate_turns == "all":  # every assistant turn of the conversations, turn by turn
        regenerate_conversations(target, tokenizer, args.conversations, regenerated_conversations(responses),
                                 batch_size=args.gen_batch_size, max_new_tokens=args.gen_max_new_tokens,
                                 max_length=args.max_length, temperature=args.gen_temperature, seed=args.seed,
                                 by_length=args.gen_order == "length", engine=args.gen_engine, draft=draft)
    if paged:
        use_grouped_query_sdpa(target)
    return rows


def regenerated_conversations(responses: Path) -> Path:
    """Where `--regenerate-turns all` writes the conversations the target re-answered: beside responses.jsonl."""
    return responses.with_name("conversations.jsonl")


def run_train(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Generate data, train, measure tau and speed the way `bench` does, save `OUTPUT/draft` with its card.

    Under `accelerate launch` / `torchrun` the processes share the generation and the training; each process
    writes only its own generation shard and store part (and, under FSDP, its checkpoint shard); the main process
    alone merges responses.jsonl, writes the log, evaluates and saves the draft (the others end once training is
    saved, returning {})."""
    started = time.perf_counter()
    output = Path(args.output)
    prompt_files, prompts, eval_file, eval_texts = train_and_eval_prompts(args)
    conversations = training_conversations(args)
    if args.plan is not None:  # what the run will cost, before any model loads (once, under a launch of several)
        if int(os.environ.get("RANK", 0)) == 0:
            print(plan_text(args, max(1, len(prompts) - args.first_prompt + conversations - args.held_out_rows)))
        return {}
    if not args.generate_only:
        check_datasets_installed()
    state = process_state(args.process_group_timeout)  # the first call: it starts the process group
    check_fsdp_applies(state)  # before any model is loaded
    if state.is_main_process:
        output.mkdir(parents=True, exist_ok=True)
    state.wait_for_everyone()  # the folder exists before any process looks into it
    device = state.device
    target, tokenizer = generation_target(args, state)
    responses = output / "responses.jsonl"
    num_rows = regenerate(args, target, tokenizer, prompts, responses)
    if args.generate_only:
        if state.is_main_process:
            print(f"{num_rows} rows in {responses}" + (f", {conversations} conversations re-answered in "
                                                       f"{regenerated_conversations(responses)}"
                                                       if args.regenerate_turns == "all" else ""))
        return {"num_rows": num_rows}
    training_rows, held_out_rows = training_store(args, output, range(args.first_prompt, num_rows), conversations,
                                                  generation_tokens(target, tokenizer).stop_token_ids, tokenizer,
                                                  state)
    target = target.to(training_target_dtype(args.target_dtype, device, target.config.hidden_size))
    torch.manual_seed(args.seed)
    draft, mask_token = build_draft(args, target, tokenizer, lambda size: training_vocabulary(
        training_rows, size, target.get_output_embeddings().weight.shape[0], state))
    if args.init_from_target:
        initialize_from_target(draft, target, training_rows[0][0])
    args = run_schedule(args, training_rows, state)  # the intervals as steps of this run
    settings = training_settings(args)
    tokens = generation_tokens(target, tokenizer)
    eval_prompts = [user_prompt_ids(tokenizer, prompt) for prompt in eval_texts]

    def evaluate(trained: DFlashDraftModel) -> dict[str, Any]:
        return held_out_evaluation(trained, target, eval_prompts, args.eval_max_new_tokens, tokens, state)

    log = train_draft(draft, target, training_rows, settings, output, max_steps=args.max_steps,
                      evaluate=evaluate if args.eval_every else None, eval_every=args.eval_every,
                      held_out_rows=held_out_rows, held_out_every=args.held_out_every)
    if not state.is_main_process:  # evaluating and saving are the main process's (a barrier would time out on a
        return {}                  # long evaluation): train_draft returned once the log and checkpoint were written
    eval_dtype = training_target_dtype(args.eval_dtype, device)
    target, draft = target.to(eval_dtype), draft.to(torch.float32).eval()  # the draft is saved in float32
    evaluation = None
    if eval_texts:  # a copy of the draft in the evaluation dtype, where it differs
        measured = draft if eval_dtype == torch.float32 else copy.deepcopy(draft).to(eval_dtype)
        evaluation = evaluate_draft(measured, target, eval_prompts, args.eval_max_new_tokens, tokens=tokens)
    training = training_facts(args, argv, prompt_files, num_rows - args.first_prompt, mask_token,
                              draft.mask_token_id, settings, log, time.perf_counter() - started, conversations)
    save_trained_draft(args, draft, target, evaluation, eval_file, training, output / "draft")
    if evaluation is None:
        print(f"draft written to {output / 'draft'} (not evaluated: --num-eval 0)")
        return {}
    (output / "evaluation.json").write_text(json.dumps(evaluation, indent=2))
    print(json.dumps(evaluation, indent=2))
    return evaluation


def training_store(args: argparse.Namespace, output: Path, prompts: range, num_conversations: int,
                   stop_token_ids: list[int], tokenizer: Any, state: Any) -> tuple[SequenceStore, SequenceStore]:
    """(the sequences to train on, the last `--held-out-rows` held out of training), tokenized once into
    OUTPUT/data/ and memory-mapped by every process: the response rows of `prompts`, then the conversations. Each
    process writes its own range of the rows (one file per part); a store built from the same sources and settings
    is reused. Exits when no row would be left to train on."""
    total = len(prompts) + num_conversations
    if args.held_out_rows >= total:
        raise SystemExit(f"--held-out-rows {args.held_out_rows}: there are only {total} training rows; hold out fewer")
    folder, responses = output / STORE_DIR, output / "responses.jsonl"
    regenerated = regenerated_conversations(responses) if args.regenerate_turns == "all" else None
    sources = ([responses] if prompts else []) + ([regenerated] if regenerated else
                                                  [Path(path) for path in args.conversations])
    facts = {"sources": [[str(path), path.stat().st_size, path.stat().st_mtime_ns] for path in sources],
             "target": args.target, "prompts": [prompts.start, prompts.stop], "conversations": num_conversations,
             "max_length": args.max_length, "held_out_rows": args.held_out_rows, "processes": state.num_processes,
             "regenerate_turns": args.regenerate_turns}
    if read_store_facts(folder) != facts:
        state.wait_for_everyone()  # every process has read the old facts before they go
        if state.is_main_process:
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir(parents=True)
        state.wait_for_everyone()
        rank, split = state.process_index, total - args.held_out_rows
        mine = range(total * rank // state.num_processes, total * (rank + 1) // state.num_processes)
        # where each row starts: one pass over each rows file, shared by the processes (collectives)
        offsets = (stored_row_offsets(responses, prompts.stop, state) if prompts else None,
                   stored_row_offsets(regenerated, num_conversations, state) if regenerated else None)
        try:
            for part, rows in zip(PARTS, (range(mine.start, min(mine.stop, split)),
                                          range(max(mine.start, split), mine.stop))):
                write_sequences(part_file(folder, part, rank), training_rows(
                    responses, prompts, args.conversations, tokenizer, stop_token_ids, rows, regenerated, offsets),
                    args.max_length)
        except ValueError as error:
            raise SystemExit(f"dflash-hf train: {error}") from error
        parts = [part_file(folder, part, shard) for part in PARTS for shard in range(state.num_processes)]
        wait_for_files(lambda: all(path.exists() for path in parts),  # outside any collective: its timeout
                       [path.with_name(path.name + ".tmp") for path in parts], SHARD_POLL_SECONDS,
                       SHARD_STALL_MINUTES, lambda: "the other processes' store files")
        state.wait_for_everyone()  # every part file is written
        if state.is_main_process:
            write_store_facts(folder, facts)
    stores = tuple(SequenceStore(folder, part, state.num_processes) for part in PARTS)
    if not stores[0]:
        raise SystemExit(f"dflash-hf train: none of the {total - args.held_out_rows} training rows has a label within "
                         f"--max-length {args.max_length}")
    return stores


def training_vocabulary(store: SequenceStore, size: int, vocab_size: int, state: Any) -> list[int]:
    """The `size` tokens that are labels most often in the training sequences (`recipe.ids_by_count`): each process
    counts its own range of the store, and the counts are summed over the processes, so every process gets the same
    ids, those one process counting every sequence would choose."""
    rank, processes = state.process_index, state.num_processes
    mine = range(len(store) * rank // processes, len(store) * (rank + 1) // processes)
    return ids_by_count(sum_over_processes(store.label_counts(mine, vocab_size), state), size)


def held_out_evaluation(draft: DFlashDraftModel, target: torch.nn.Module, prompts: list[list[int]],
                        max_new_tokens: int, tokens: GenerationTokens, state: Any = None) -> dict[str, Any]:
    """Tau, losslessness and speedup of the draft on held-out prompts, greedy, as `bench` measures them (a copy in the
    target's dtype and on its device, where the draft's differ): one point of the curve `--eval-every` logs. Every
    process of `state` (None: this one alone) measures its share (prompts p, p + N, ...) and the shares are combined
    (a collective: every process calls this), into what one process measuring them all gives: tau over every step,
    lossless if every output was, the speedup of the summed tokens and seconds."""
    dtype, device = next(target.parameters()).dtype, target_device(target)
    weight = next(draft.parameters())
    if (weight.dtype, weight.device) != (dtype, device):
        draft = copy.deepcopy(draft).to(device=device, dtype=dtype)
    index, count = (state.process_index, state.num_processes) if state is not None else (0, 1)
    share, records = prompts[index::count], []
    lossless = True
    if share:
        lossless = evaluate_draft(draft, target, share, max_new_tokens, tokens=tokens,
                                  on_result=lambda index, record: records.append(record))["lossless"]
    part = {"accepted": sum(sum(record.acceptance_lengths) for record in records),
            "steps": sum(len(record.acceptance_lengths) for record in records), "lossless": lossless,
            **{f"{method}_{what}": sum(len(record.new_tokens[method]) if what == "tokens" else record.seconds[method]
                                       for record in records)
               for method in ("plain", "dflash") for what in ("tokens", "seconds")}}
    parts = gather_json([part], state) if count > 1 else [part]
    total = {name: sum(part[name] for part in parts) for name in part if name != "lossless"}
    rates = {method: total[f"{method}_tokens"] / total[f"{method}_seconds"] if total[f"{method}_seconds"] else 0.0
             for method in ("plain", "dflash")}
    return {"tau": total["accepted"] / total["steps"] if total["steps"] else 0.0,
            "lossless": all(part["lossless"] for part in parts),
            "speedup": rates["dflash"] / rates["plain"] if rates["plain"] else 0.0}


def train_and_eval_prompts(args: argparse.Namespace) -> tuple[list[str], PromptTexts, str, list[str]]:
    """(prompt files, training prompts, evaluation file, evaluation prompts) of `train`'s arguments, all checked
    before any model is loaded (the training prompts read when used, `data.PromptTexts`); exits naming the first
    argument or file that cannot be used."""
    data_dir = Path(args.data_dir) if args.data_dir else default_data_dir()
    prompt_files = args.prompts or ([] if args.conversations else [str(data_dir / "gsm8k_train.jsonl")])
    check_train_arguments(args, prompt_files)
    try:
        prompts = training_prompts(prompt_files, args.num_prompts)
        eval_file = args.eval_prompts or str(data_dir / "gsm8k_test.jsonl")
        eval_texts = read_prompts([eval_file], args.num_eval) if args.num_eval else []
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"dflash-hf train: {error}") from error
    if not prompts and prompt_files:
        raise SystemExit(f"dflash-hf train: {', '.join(prompt_files)} hold no prompts")
    if prompt_files:
        check_first_prompt(args, len(prompts))
    if args.num_eval and not eval_texts:
        raise SystemExit(f"dflash-hf train: {eval_file} holds no prompts to evaluate on (or pass --num-eval 0)")
    return prompt_files, prompts, eval_file, eval_texts


def training_prompts(prompt_files: list[str], counts: list[int] | None) -> PromptTexts:
    """The prompts to train on, the files in order, read when used (`data.PromptTexts`): all of them (`counts`
    None), the first `counts[0]` of each (or all it holds, if fewer), or exactly the first `counts[i]` of file i."""
    exact = counts if counts is not None and len(counts) > 1 else None  # one count per file
    prompts = PromptTexts(prompt_files, exact or [counts[0] if counts else None] * len(prompt_files))
    if exact is not None:
        for path, count, found in zip(prompt_files, exact, prompts.file_counts()):
            if found < count:
                raise SystemExit(f"--num-prompts {count} for {path}: it holds only {found} prompts")
    return prompts


def training_conversations(args: argparse.Namespace) -> int:
    """How many `--conversations` rows there are, each read and checked (one at a time) before any model is loaded;
    exits naming the first malformed row."""
    try:
        return sum(1 for _ in read_chat_rows(args.conversations))
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"dflash-hf train: {error}") from error


def generation_draft(name: str | None, target: torch.nn.Module) -> DFlashDraftModel | None:
    """The draft `--gen-draft` names ('shipped': the SmolLM2 demo draft), in the target's dtype and device; or None."""
    if name is None:
        return None
    dtype = next(target.parameters()).dtype
    draft = DFlashDraftModel.from_pretrained(SHIPPED_DRAFT if name == "shipped" else name, dtype=dtype)
    return draft.to(target_device(target)).eval()


def build_draft(args: argparse.Namespace, target: torch.nn.Module, tokenizer: Any,
                vocabulary: Callable[[int], list[int]] | None = None) -> tuple[DFlashDraftModel, str]:
    """(the draft to train, its mask token): a new draft shaped like the target, or the `--init-from` one. With
    `--draft-vocab-size K` a draft that has no LM head of its own (a new one, or an `--init-from` one without) gets
    one over the K ids `vocabulary(K)` chooses, its rows started from the target's (`initialize_draft_vocabulary`);
    an `--init-from` draft with its own head keeps it."""
    vocab_size = target.get_output_embeddings().weight.shape[0]
    if args.draft_vocab_size is not None and args.draft_vocab_size > vocab_size:
        raise SystemExit(f"--draft-vocab-size {args.draft_vocab_size}: the target has {vocab_size} tokens; pass "
                         f"K <= {vocab_size}")
    if args.init_from is not None:
        draft = start_from_trained_draft(args, target)
        mask_token = (draft.config.dflash_config.get("mask_token")
                      or tokenizer.convert_ids_to_tokens(draft.mask_token_id))
        if args.draft_vocab_size and draft.lm_head is None:
            draft = with_own_head(draft, args.draft_vocab_size)
            initialize_draft_vocabulary(draft, target, vocabulary(args.draft_vocab_size))
        heads = dspark_heads(args, draft)
        if heads is not None and draft.lm_head is not None and (heads["markov_rank"] or
                                                                heads["enable_confidence_head"]):
            raise SystemExit(f"--init-from {args.init_from} has its own LM head (draft_vocab_size), which DeepSpec's "
                             "heads do not read: drop --markov-rank and --confidence-head")
        if heads is not None and any(getattr(draft.config, name) != value for name, value in heads.items()):
            draft = with_dspark_heads(draft, heads)
        return draft, mask_token
    mask_token = args.mask_token or (SMOLLM2_MASK_TOKEN if args.target == SMOLLM2 else None)
    if mask_token is None:
        raise SystemExit("--mask-token is required for this target (an existing, rarely used special token)")
    mask_token_id = tokenizer.convert_tokens_to_ids(mask_token)
    if mask_token_id is None or mask_token_id == tokenizer.unk_token_id:
        raise SystemExit(f"mask token {mask_token!r} is not in the target's vocabulary")
    config = draft_config_for(target, args.draft_layers or DEFAULT_DRAFT_LAYERS,
                              args.draft_block_size or DEFAULT_DRAFT_BLOCK_SIZE, mask_token_id,
                              args.target_layer_ids, layer_attention_settings(args), args.draft_vocab_size)
    heads = dspark_heads(args)
    if heads is not None:
        config = dspark_config(config, heads)
    config.dflash_config["mask_token"] = mask_token
    draft = DFlashDraftModel(config)
    if args.draft_vocab_size:
        initialize_draft_vocabulary(draft, target, vocabulary(args.draft_vocab_size))
    return draft, mask_token


def layer_attention_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The draft config's per-layer attention fields from `--layer-types`, `--sliding-window`, `--causal`."""
    settings: dict[str, Any] = {}
    if args.layer_types is not None:
        settings["layer_types"] = args.layer_types
    if args.sliding_window is not None:
        settings["sliding_window"] = args.sliding_window
    if args.causal is not None:
        settings["is_causal"] = args.causal == "true"
    return settings


def start_from_trained_draft(args: argparse.Namespace, target: torch.nn.Module) -> DFlashDraftModel:
    """The draft of `--init-from`, in float32, after checking it fits the target and the other flags."""
    if args.init_from_target:
        raise SystemExit("--init-from and --init-from-target both say where the weights start; pass one")
    draft = DFlashDraftModel.from_pretrained(args.init_from, dtype=torch.float32).to(target_device(target))
    asked = {"--draft-block-size": (args.draft_block_size, draft.block_size),
             "--draft-layers": (args.draft_layers, len(draft.layers)),
             "--target-layer-ids": (args.target_layer_ids, draft.target_layer_ids),
             "--mask-token": (args.mask_token, draft.config.dflash_config.get("mask_token")),
             "--layer-types": (args.layer_types, draft.config.layer_types),
             "--sliding-window": (args.sliding_window, draft.config.sliding_window),
             "--causal": (None if args.causal is None else args.causal == "true", draft.config.is_causal)}
    if draft.lm_head is not None:  # its own head stays (without one, --draft-vocab-size gives it one: build_draft)
        asked["--draft-vocab-size"] = (args.draft_vocab_size, draft.config.draft_vocab_size)
    conflicts = [f"{flag} {wanted} (the draft has {has})" for flag, (wanted, has) in asked.items()
                 if wanted is not None and wanted != has]
    if conflicts:
        raise SystemExit(f"--init-from {args.init_from} fixes the architecture; "
                         "drop or change: " + ", ".join(conflicts))
    try:
        check_draft_target(draft, target, None, total_length=1)
    except ValueError as error:
        raise SystemExit(f"--init-from {args.init_from} does not fit the target: {error}") from error
    return draft


def training_facts(args: argparse.Namespace, argv: list[str], prompt_files: list[str], num_rows: int, mask_token: str,
                   mask_token_id: int | None, settings: TrainingSettings, log: TrainingLog, seconds: float,
                   num_conversations: int = 0) -> dict[str, str]:
    """What the card says about how the draft was trained (`num_rows` prompts, `num_conversations` conversations)."""
    return {
        **({"training data": f"{num_rows} prompts ({args.first_prompt}-{args.first_prompt + num_rows - 1}) of "
                             f"{prompt_files_text(prompt_files, args.num_prompts)}, "
                             f"responses regenerated by the target (greedy={args.gen_temperature == 0}, "
                             f"{answer_length_text(args)})"} if num_rows else {}),
        **({"conversations": f"{num_conversations} rows of {', '.join(map(str, args.conversations))}, "
                             + ("every assistant turn re-answered by the target, turn by turn (greedy="
                                f"{args.gen_temperature == 0}, {answer_length_text(args)})"
                                if args.regenerate_turns == "all" else "trained as given")
                             + " (the loss on the assistant turns)"} if num_conversations else {}),
        "mask token": f"{mask_token!r} (id {mask_token_id}), an existing token of the target vocabulary",
        "command": "`dflash-hf " + " ".join(shlex.quote(a) for a in argv) + "`",
        **({"initialisation": f"the trained draft {args.init_from}, then a new schedule on this data"}
           if args.init_from else {}),
        "optimiser steps": str(log.steps),
        "settings": json.dumps(settings.__dict__),
        "wall time (generation + training + evaluation)": f"{seconds / 60:.1f} min",
    }


def answer_length_text(args: argparse.Namespace) -> str:
    """How long the regenerated answers could be, for the card."""
    if args.gen_max_new_tokens is not None:
        return f"<= {args.gen_max_new_tokens} tokens"
    return f"up to {args.max_length} tokens with the prompt"


def prompt_files_text(prompt_files: list[str], counts: list[int] | None) -> str:
    """The prompt files for the card, with the count taken from each when there is one per file."""
    if counts is None or len(counts) == 1:
        names = ", ".join(Path(path).name for path in prompt_files)
        return names if len(prompt_files) == 1 or counts is None else f"{names} (the first {counts[0]} of each)"
    return ", ".join(f"{Path(path).name} (its first {count})" for path, count in zip(prompt_files, counts))


def save_trained_draft(args: argparse.Namespace, draft: DFlashDraftModel, target: torch.nn.Module,
                       evaluation: dict[str, Any] | None, eval_file: str, training: dict[str, str],
                       folder: Path) -> None:
    """Save the draft (float32 weights, remote code) and its model card with the measured results (if any)."""
    draft.to(torch.float32).save_pretrained(folder)
    base_model = SMOLLM2_HUB_ID if args.target == SMOLLM2 else args.target
    if evaluation is None:
        info = card_info_for_config(
            draft.config, repo_id=str(folder), base_model=base_model, title=f"DFlash draft for {base_model}",
            description=f"A DFlash draft for `{base_model}` trained with `dflash-hf train`.",
            results_source="Not measured: trained with `--num-eval 0`; measure it with `dflash-hf bench --draft "
                           f"{folder}`.", results_table="", training=training)
        write_model_card(folder, info)
        return
    rates = evaluation["tokens_per_s"]
    info = card_info_for_config(
        draft.config, repo_id=str(folder), base_model=base_model, title=f"DFlash draft for {base_model}",
        description=f"A DFlash draft for `{base_model}` trained with `dflash-hf train`.",
        results_source=f"Measured at the end of training: {args.num_eval} prompts of {Path(eval_file).name}, greedy, "
                       f"{args.eval_max_new_tokens} new tokens, "
                       f"{str(next(target.parameters()).dtype).removeprefix('torch.')}, {device_description(target)}, "
                       "against `target.generate` in the same process, stopping on every EOS id of the target.",
        results_table="| prompts | block | tau | target.generate tok/s | DFlash tok/s | speedup | "
                      "identical to generate |\n"
                      "|---:|---:|---:|---:|---:|---:|---|\n"
                      f"| {evaluation['num_prompts']} | {evaluation['block_size']} | {evaluation['tau']:.2f} | "
                      f"{rates['plain']:.1f} | {rates['dflash']:.1f} | {evaluation['speedup']:.2f}x | "
                      f"{evaluation['lossless']} |",
        training=training,
    )
    write_model_card(folder, info)
