"""The main job in one call: SmolLM2-135M-Instruct with the shipped DFlash draft, on a CPU."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

import torch

from .loading import SHIPPED_DRAFT, SMOLLM2, load_target
from .sampling_dflash import mean_acceptance_length
from .settings_dflash import StepCosts
from .tokens_dflash import GenerationTokens, generation_tokens

if TYPE_CHECKING:
    from .modeling_dflash import DFlashDraftModel

DEMO_PROMPTS = [  # held out: a gsm8k test question (the draft trained on gsm8k train), a general question (writing
    # advice, of a kind no training set holds) and a coding request
    "Janet\u2019s ducks lay 16 eggs per day. She eats three for breakfast every morning and bakes muffins for her "
    "friends every day with four. She sells the remainder at the farmers' market daily for $2 per fresh duck egg. "
    "How much in dollars does she make every day at the farmers' market?",
    "Give me three tips for writing a clear email to a busy colleague.",
    "Write a Python function that returns the n-th Fibonacci number.",
]


def load_demo(dtype: torch.dtype = torch.float32, draft_path: str | Path | None = None):
    """(target, tokenizer, draft): SmolLM2-135M-Instruct and the shipped draft, in `dtype`, eval mode; the target
    verifies with `kernels_dflash.grouped_query_sdpa` (`loading.load_target`).

    float32 is the default: on CPUs without native bfloat16 matrix kernels, verifying a block in bfloat16 costs
    several one-token steps, which cancels the speculative gain.
    """
    from .modeling_dflash import DFlashDraftModel

    path = Path(draft_path) if draft_path is not None else SHIPPED_DRAFT
    if (path.is_dir() or draft_path is None) and not (path / "config.json").exists():  # else a Hub id
        raise FileNotFoundError(f"No draft at {path}; train one with `dflash-hf train --output runs/smollm2`.")
    target, tokenizer = load_target(SMOLLM2, dtype)
    draft = DFlashDraftModel.from_pretrained(draft_path if draft_path is not None else path, dtype=dtype).eval()
    return target, tokenizer, draft


def kernel_mode(draft: DFlashDraftModel, target: torch.nn.Module, prompt: list[int], block_size: int,
                mask_token_id: int) -> bool | str:
    """The `cpu_kernels` mode in which a `block_size`-token step costs least on this machine, printed with each
    mode's step cost (`cost_model.choose_cpu_kernels`)."""
    from .cost_model import choose_cpu_kernels
    from .kernels_dflash import CPU_KERNEL_NAMES

    mode, costs = choose_cpu_kernels(draft, target, torch.tensor([prompt]), block_size, mask_token_id)
    if costs:
        print(f"step costs on this machine (one token: {costs[False]['target_1'] * 1000:.1f} ms), a "
              f"{block_size}-token verify + a draft pass with the few-row CPU kernels "
              + ", ".join(f"{CPU_KERNEL_NAMES[each]}: {(terms['target_block'] + terms['draft']) * 1000:.1f} ms"
                          for each, terms in costs.items()) + f" -> {CPU_KERNEL_NAMES[mode]}", flush=True)
    return mode


@dataclass(frozen=True)
class DecodingChoice:
    """What the demo and `dflash-hf chat` decode with, chosen on this machine by `choose_decoding`."""

    block_size: int
    tree_size: int | None  # None: the chain
    cpu_kernels: bool | str | None  # as spec_generate takes it
    step_costs: StepCosts | None = None  # block size "adaptive": this machine's step costs


def choose_decoding(draft: DFlashDraftModel, target: torch.nn.Module, prompt: list[int], tokens: GenerationTokens,
                    max_new_tokens: int, block_size: int | str = "auto", tree_size: int | str | None = "auto",
                    cpu_kernels: bool | str | None = None, compile: bool = False) -> DecodingChoice:
    """The block size, tree size and `cpu_kernels` mode to decode with, timed on `prompt` here (what `run_demo` says
    of each), each choice printed with its measurements."""
    from .cost_model import choose_tree_size, resolve_block_and_kernels

    # the few-row kernels where a step costs less with them
    time_kernels = (None if cpu_kernels is not None or compile else
                    lambda block: kernel_mode(draft, target, prompt, block, tokens.mask_token_id))
    choice, cpu_kernels = resolve_block_and_kernels(block_size, draft, target, prompt, max_new_tokens, 1,
                                                    tokens.stop_token_ids, tokens.mask_token_id, cpu_kernels,
                                                    time_kernels)
    if choice.predictions is not None:
        print("predicted speedup per block size on this machine: "
              + ", ".join(f"{size}: {value:.2f}x" for size, value in sorted(choice.predictions.items()))
              + f" -> block size {choice.block_size}", flush=True)
    if choice.step_costs is not None:
        print(f"step costs on this machine: draft {choice.step_costs.draft * 1000:.1f} ms, verify of "
              f"1..{choice.block_size} tokens "
              + " ".join(f"{seconds * 1000:.1f}" for seconds in choice.step_costs.verify)
              + " ms", flush=True)

    if tree_size == "auto" and choice.step_costs is None:  # adaptive verify widths and trees do not combine
        tree_size, rates = choose_tree_size(draft, target, prompt, choice.block_size, max_new_tokens, 1,
                                            tokens.stop_token_ids, tokens.mask_token_id, cpu_kernels)
        print("tokens/s per tree size on this machine: "
              + ", ".join(f"{size or 'chain'}: {rate:.1f}" for size, rate in sorted(rates.items()))
              + f" -> {f'a tree of {tree_size}' if tree_size else 'the chain'}", flush=True)
    elif tree_size == "auto":
        tree_size = None
    return DecodingChoice(choice.block_size, tree_size or None, cpu_kernels, choice.step_costs)


def demo_questions(prompts: Sequence[str] | None) -> list[str]:
    """The demo's questions: `prompts` (`dflash-hf demo --prompt TEXT`), else DEMO_PROMPTS; an empty one is
    refused."""
    if prompts is None or len(prompts) == 0:
        return list(DEMO_PROMPTS)
    empty = [index for index, text in enumerate(prompts) if not text.strip()]
    if empty:
        raise ValueError(f"--prompt number {empty[0] + 1} is empty: give each --prompt some text, e.g. "
                         "dflash-hf demo --prompt \"Why is the sky blue?\"")
    return list(prompts)


def run_demo(max_new_tokens: int = 256, dtype: torch.dtype = torch.float32, draft_path: str | Path | None = None,
             block_size: int | str = "auto", cpu_kernels: bool | str | None = None,
             tree_size: int | str | None = "auto", compile: bool = False,
             prompts: Sequence[str] | None = None) -> dict:
    """Answer the demo prompts (or `prompts`, the user's own) with spec_generate; print answers, tau, tokens/s and
    the speedup over generate, and whether every answer is generate's own.

    block_size "auto": the block with the best predicted speedup on this machine, chosen on the first prompt before
    anything is timed; "adaptive": draft the trained block, verify per step the prefix worth its cost
    (`cost_model.resolve_block_choice`, as bench chooses). tree_size "auto": a tree of the size that decodes
    fastest here, or the chain (`cost_model.choose_tree_size`); None: the chain. `cpu_kernels`: see `spec_generate`;
    None: the mode in which a step costs least here (`cost_model.choose_cpu_kernels`, timed at the trained block
    first, then again at the block chosen if it differs). `compile`: see
    `spec_generate` (compiled: a chain, or a tree of a given size; compiled by the untimed warm-up, which also
    compiles `generate` for the compiled baseline).
    """
    from .evaluation import evaluate_draft
    from .prompts import user_prompt_ids

    questions = demo_questions(prompts)  # before anything loads
    target, tokenizer, draft = load_demo(dtype, draft_path)
    prompt_ids = [user_prompt_ids(tokenizer, question) for question in questions]
    tokens = generation_tokens(target, tokenizer, draft)  # as bench and train's evaluation stop
    decoding = choose_decoding(draft, target, prompt_ids[0], tokens, max_new_tokens, block_size, tree_size,
                               cpu_kernels, compile)
    tree_size = decoding.tree_size

    def show(index: int, record) -> None:
        new_tokens, lengths = record.new_tokens["dflash"], record.acceptance_lengths
        print(f"\n### {questions[index]}\n{tokenizer.decode(new_tokens, skip_special_tokens=True)}")
        print(f"[tau {mean_acceptance_length(lengths):.2f}, {len(new_tokens)} tokens]", flush=True)

    summary = evaluate_draft(draft, target, prompt_ids, max_new_tokens, decoding.block_size, tokens=tokens,
                             on_result=show, step_costs=decoding.step_costs, cpu_kernels=decoding.cpu_kernels,
                             tree_size=tree_size, compile=compile)
    verified = "" if decoding.step_costs is None else (f", adaptive: {summary['mean_verified_length']:.2f} "
                                                     "verified per step")
    rates = summary["tokens_per_s"]
    if compile:  # the first (untimed) calls compiled both; the compiled baseline is what a GPU user compares with
        print(f"\ncompiled: the first calls took {summary['warm_up_seconds']:.0f} s (torch.compile); compiled "
              f"target.generate {rates['plain_compiled']:.1f} tokens/s, spec_generate "
              f"{summary['speedup_vs_compiled']:.2f}x of it")
    print(f"\ntau {summary['tau']:.2f} | target.generate {rates['plain']:.1f} tokens/s | spec_generate "
          f"{rates['dflash']:.1f} tokens/s | speedup {summary['speedup']:.2f}x | identical to generate: "
          f"{summary['lossless']} ({dtype}, block size {decoding.block_size} of {draft.block_size}{verified}, "
          f"{f'tree of {tree_size}' if tree_size else 'chain'}{', compiled' if compile else ''}, "
          f"{torch.get_num_threads()} threads)")
    return summary
