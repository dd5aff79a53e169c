"""`dflash-hf bench`: DFlash against plain decoding and prompt lookup, per dataset, in one process.

For every prompt (every turn of a multi-turn conversation) the same target runs plain `generate`,
DFlash `spec_generate` and Transformers' prompt-lookup decoding (measured by `evaluation`); a dataset's
summary holds tau, the acceptance-length histogram, tokens/s of each method, the speedup, the cost-model
bound measured on the same machine, and per method how its greedy outputs compare with plain decoding's
("exact", "near-tie" or "NO": `evaluation.compare_outputs`). The method that runs first rotates from turn to turn.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from .cost_model import (
    choose_cpu_kernels,
    choose_tree_size,
    measure_step_costs,
    resolve_block_and_kernels,
    typical_context,
)
from .devices_dflash import target_device
from .evaluation import (
    BenchSettings,
    TurnRecord,
    assisted_decoding_refusal,
    measure_prompts,
    records_tau,
    summarize,
    warm_up,
)
from .modeling_dflash import DFlashDraftModel
from .prompts import chat_prompt_ids, read_conversations, record_turns, user_prompt_ids
from .settings_dflash import resolve_block_size
from .tokens_dflash import GenerationTokens, generation_tokens


@dataclass(frozen=True)
class DatasetSource:
    """Where a benchmark's prompts live: a local JSONL file, and the Hub copy for online users."""

    file_name: str
    field: str  # the prompt field; "turns" holds a list of user turns
    hub: tuple[str, str | None, str] | None  # (dataset id, config, split) for `datasets.load_dataset`; None: ours
    hub_field: str


DATASETS = {
    "gsm8k": DatasetSource("gsm8k_test.jsonl", "question", ("openai/gsm8k", "main", "test"), "question"),
    "math500": DatasetSource("math500.jsonl", "problem", ("HuggingFaceH4/MATH-500", None, "test"), "problem"),
    "humaneval": DatasetSource("humaneval.jsonl", "prompt", ("openai/openai_humaneval", None, "test"), "prompt"),
    "mbpp": DatasetSource("mbpp_sanitized_test.jsonl", "prompt",
                          ("google-research-datasets/mbpp", "sanitized", "test"), "prompt"),
    "mt-bench": DatasetSource("mt_bench.jsonl", "turns", ("HuggingFaceH4/mt_bench_prompts", None, "train"), "prompt"),
    "general": DatasetSource("general.jsonl", "prompt", None, "prompt"),  # writing, advice, explanation (ours)
}


def read_prompt_file(path: str | Path, limit: int | None = None) -> list[list[str]]:
    """Conversations from a JSONL prompt file: one object a line, its turns in a field of `prompts.PROMPT_FIELDS`."""
    return read_conversations(path, None, limit)


def load_conversations(dataset: str, data_dir: str | Path, limit: int | None = None) -> list[list[str]]:
    """User turns of a benchmark's first `limit` prompts: the local copy in `data_dir`, else the Hub."""
    if dataset not in DATASETS:
        raise ValueError(f"Unknown dataset {dataset!r}; choose from {', '.join(DATASETS)} "
                         "or pass --prompts FILE.jsonl.")
    source = DATASETS[dataset]
    path = Path(data_dir) / source.file_name
    if path.exists():
        return read_conversations(path, source.field, limit)
    if source.hub is None:
        raise FileNotFoundError(f"No {source.file_name} in {Path(data_dir)}: it ships with dflash-hf only "
                                f"(dflash_hf/data/{source.file_name}); copy it into that folder or leave out "
                                "--data-dir.")
    try:
        from datasets import load_dataset
    except ImportError as error:
        raise FileNotFoundError(f"No {source.file_name} in {Path(data_dir)}: pass --data-dir FOLDER (or set "
                                f"$DFLASH_HF_DATA_DIR) to a folder holding it, or `pip install datasets` to fetch "
                                f"{source.hub[0]} from the Hub.") from error
    name, config, split = source.hub
    rows = load_dataset(name, config, split=split)
    rows = rows.select(range(min(limit, len(rows)))) if limit is not None else rows
    return [record_turns(row, source.hub_field) for row in rows]


# --------------------------------------------------------------------------------------------------
# A whole run
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcessContext:
    """This process under `accelerate launch` / `torchrun` (a single process otherwise)."""

    device: torch.device
    index: int = 0
    count: int = 1
    gather: Callable[[list], list] = lambda items: items
    close: Callable[[], None] = lambda: None  # shut the process group down (before the interpreter exits)

    @property
    def is_main(self) -> bool:
        """Whether this process reports."""
        return self.index == 0


def process_context() -> ProcessContext:
    """The device, index and count of this process, and a gather of Python lists (Accelerate's when installed)."""
    default = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        from accelerate import PartialState
        from accelerate.utils import gather_object
    except ImportError:
        return ProcessContext(default)
    state = PartialState(cpu=not torch.cuda.is_available())  # cpu=True: several CPU processes under torchrun
    if state.num_processes == 1:
        return ProcessContext(state.device)
    return ProcessContext(state.device, state.process_index, state.num_processes, gather_object,
                          state.destroy_process_group)


@torch.no_grad()
def run_benchmark(
    draft: DFlashDraftModel,
    target: torch.nn.Module,
    tokenizer: Any,
    datasets: dict[str, list[list[str]]],
    settings: BenchSettings,
    progress: bool = True,
) -> list[dict[str, Any]]:
    """Measure every conversation of every dataset with each method; one summary per dataset.

    Stop, pad and mask ids come from `generation_tokens`. Under `accelerate launch` the conversations are sharded
    over the processes and the records gathered.
    """
    from tqdm.auto import tqdm

    process = process_context()
    tokens = generation_tokens(target, tokenizer, draft)
    native_draft = transformers_dflash_peer(draft, settings, progress and process.is_main)
    first_prompt = user_prompt_ids(tokenizer, next(iter(datasets.values()))[0][0], settings.thinking)
    warm_up_seconds = warm_up(draft, target, [first_prompt] * settings.batch_size,
            dataclasses.replace(settings, block_size=resolve_block_size(None, draft.block_size)
                                if settings.block_size in ("auto", "adaptive") else settings.block_size,
                                tree_size=None if settings.tree_size == "auto" else settings.tree_size),
            tokens, native_draft)  # the batch's shape
    shards = {name: conversations[process.index :: process.count] for name, conversations in datasets.items()}
    bar = tqdm(total=sum(len(turns) for shard in shards.values() for turns in shard), desc="bench",
               disable=not progress or not process.is_main)
    results = []
    for name, conversations in datasets.items():
        calibration_prompt = user_prompt_ids(tokenizer, conversations[0][0], settings.thinking)
        # `--cpu-kernels auto`: the modes timed on the first prompt; each process times its own (under accelerate the
        # JSON has process 0's)
        time_kernels = (None if settings.cpu_kernels is not None or settings.compile else
                        functools.partial(cheapest_cpu_kernels, draft, target, calibration_prompt, settings=settings,
                                          tokens=tokens))
        choice, cpu_kernels = resolve_block_and_kernels(settings.block_size, draft, target, calibration_prompt,
                                                        settings.max_new_tokens, settings.batch_size,
                                                        tokens.stop_token_ids, tokens.mask_token_id,
                                                        settings.cpu_kernels, time_kernels)
        tree_size, tree_rates = settings.tree_size, None
        if tree_size == "auto":  # calibrated on the same first prompt, at the block chosen for it
            tree_size, tree_rates = choose_tree_size(draft, target, calibration_prompt, choice.block_size,
                                                     settings.max_new_tokens, settings.batch_size,
                                                     tokens.stop_token_ids, tokens.mask_token_id, cpu_kernels)
        dataset_settings = dataclasses.replace(settings, block_size=choice.block_size, step_costs=choice.step_costs,
                                               tree_size=tree_size, cpu_kernels=cpu_kernels)
        records, step_costs = measure_dataset(draft, target, tokenizer, shards[name], dataset_settings, tokens,
                                              on_turns=lambda records, rows, name=name: _show(bar, name,
                                                                                              records, rows),
                                              native_draft=native_draft)
        results.append(summarize(name, process.gather(records), len(conversations), choice.block_size,
                                 process.gather([step_costs])[0], settings.temperature == 0, settings.batch_size,
                                 choice.step_costs))
        results[-1]["assisted_refused"] = assisted_decoding_refusal(target)
        results[-1]["warm_up_seconds"] = warm_up_seconds
        results[-1]["tree_size"] = tree_size or 0
        results[-1]["cpu_kernels"] = cpu_kernels
        if tree_rates is not None:  # "auto": the calibration's tokens/s per tree size (0: the chain)
            results[-1]["tree_size_rates"] = tree_rates
        if tree_size:  # the cost model times chains: its bound would price a tree's verify as a chain's
            results[-1]["bound"] = None
        if choice.predictions is not None:
            results[-1]["block_size_predictions"] = choice.predictions
    bar.close()
    return results


def cheapest_cpu_kernels(draft: DFlashDraftModel, target: torch.nn.Module, prompt: list[int], block_size: int,
                         settings: BenchSettings, tokens: GenerationTokens) -> bool | str:
    """`--cpu-kernels auto`: the mode (`kernels_dflash.CPU_KERNEL_MODES`) in which a `block_size` step for the
    bench's batch costs least here, as the demo chooses it (`cost_model.choose_cpu_kernels`; False off the CPU)."""
    prompt_ids = torch.tensor([prompt], device=target_device(target))
    return choose_cpu_kernels(draft, target, prompt_ids, block_size, tokens.mask_token_id, settings.batch_size)[0]


def transformers_dflash_peer(draft: DFlashDraftModel, settings: BenchSettings,
                             verbose: bool) -> torch.nn.Module | None:
    """The draft's weights as Transformers' native DFlash draft, timed as a peer on single prompts; None where the
    installed Transformers has no native DFlash, the draft cannot be expressed there, or batches are measured."""
    from .conversion import to_native

    if settings.batch_size > 1:
        return None
    try:
        return to_native(draft).to(draft.device)
    except ValueError as error:
        if verbose:
            print(f"bench: no Transformers DFlash column ({error})")
        return None


def _show(bar: Any, name: str, records: list[TurnRecord], rows: int) -> None:
    bar.update(rows)
    bar.set_postfix_str(f"{name} tau {records_tau(records):.2f}")


def measure_dataset(
    draft: DFlashDraftModel,
    target: torch.nn.Module,
    tokenizer: Any,
    conversations: list[list[str]],
    settings: BenchSettings,
    tokens: GenerationTokens,
    on_turns: Callable[[list[TurnRecord], int], None] = lambda records, rows: None,
    native_draft: torch.nn.Module | None = None,
) -> tuple[list[TurnRecord], dict[str, float] | None]:
    """Records of every turn of `conversations`, `batch_size` conversations at a time, and the step costs.

    Each turn after the first sees the model's own answer to the previous one (the plain greedy one: every method's
    prompt is the same). The cost model is timed once, at the first batch's typical context. Each `measure_prompts`
    call gets the next `turn`, so the method that runs first rotates.
    """
    device = target_device(target)
    block_size = resolve_block_size(settings.block_size, draft.block_size)
    records: list[TurnRecord] = []
    step_costs = None
    turn = 0
    for start in range(0, len(conversations), settings.batch_size):
        group = conversations[start : start + settings.batch_size]
        histories: list[list[dict[str, str]]] = [[] for _ in group]
        for turn_index in range(max(len(turns) for turns in group)):
            rows = [row for row, turns in enumerate(group) if turn_index < len(turns)]
            for row in rows:
                histories[row].append({"role": "user", "content": group[row][turn_index]})
            prompts = [chat_prompt_ids(tokenizer, histories[row], settings.thinking) for row in rows]
            turn_records = measure_prompts(draft, target, prompts, settings, tokens, native_draft, turn=turn)
            turn += 1
            records.extend(turn_records)
            if step_costs is None:
                context = typical_context(prompts[0], turn_records[0].new_tokens["plain"], device)
                step_costs = measure_step_costs(draft, target, context, block_size, tokens.mask_token_id,
                                                batch_size=len(prompts), cpu_kernels=settings.cpu_kernels)
            for row, record in zip(rows, turn_records):
                answer = [token for token in record.new_tokens["plain"] if token not in tokens.stop_token_ids]
                histories[row].append({"role": "assistant",
                                       "content": tokenizer.decode(answer, skip_special_tokens=True)})
            on_turns(records, len(rows))
    return records, step_costs


# --------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------


def plot_results(results: list[dict[str, Any]], path: str | Path) -> None:
    """A PNG: speedup (measured, cost-model bound, prompt lookup, Transformers' DFlash) and tau per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    repeated = len({result["dataset"] for result in results}) < len(results)  # several rows per dataset: name them
    names = [result["dataset"] + (f"\nB {result['block_size']}" + (f", tree {result['tree_size']}"
                                                                    if result.get("tree_size") else "")
                                  if repeated else "") for result in results]
    positions = range(len(names))
    figure, (speed_axis, tau_axis) = plt.subplots(1, 2, figsize=(4 + 2 * len(names), 4))
    bars = [("DFlash (measured)", "speedup"), ("cost-model bound", "bound"),
            ("prompt lookup", "speedup_prompt_lookup"), ("Transformers' DFlash", "speedup_transformers_dflash")]
    width = 0.8 / len(bars)
    for index, (label, key) in enumerate(bars):
        offset = (index - (len(bars) - 1) / 2) * width
        speed_axis.bar([p + offset for p in positions], [r.get(key) or 0.0 for r in results], width, label=label)
    speed_axis.axhline(1.0, color="gray", linewidth=0.8)
    speed_axis.set(xticks=list(positions), xticklabels=names, ylabel="speedup over target.generate")
    speed_axis.legend(fontsize=8, loc="best", framealpha=0.9)
    tau_axis.bar(list(positions), [r["tau"] for r in results], 0.5, color="tab:green")
    tau_axis.set(xticks=list(positions), xticklabels=names, ylabel="tau (tokens per target forward)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
