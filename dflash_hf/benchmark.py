"""`dflash-hf bench`: DFlash against plain decoding and prompt lookup, per dataset, in one process.

For every prompt (every turn of a multi-turn conversation) the same target runs plain `generate`,
DFlash `spec_generate` and Transformers' prompt-lookup decoding; a dataset's summary holds tau, the
acceptance-length histogram, tokens/s of each method, the speedup, the cost-model bound measured on
the same machine, and whether every DFlash output equalled the plain greedy output.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from .decoding import (
    DFlashProposer,
    DraftStep,
    _synchronize,
    cache_keyword,
    crop_cache,
    first_stop_index,
    left_pad,
    returned_cache,
    select_features,
    verify_forward,
)
from .modeling_dflash import DFlashDraftModel
from .smollm2 import chat_prompt_ids

METHODS = ("plain", "dflash", "prompt_lookup")


def default_data_dir() -> Path:
    """$DFLASH_HF_DATA_DIR, else the first `shared/data` beside the working folder or beside this checkout."""
    if os.environ.get("DFLASH_HF_DATA_DIR"):
        return Path(os.environ["DFLASH_HF_DATA_DIR"])
    candidates = [Path.cwd().parent / "shared" / "data", Path(__file__).resolve().parents[2] / "shared" / "data"]
    return next((path for path in candidates if path.is_dir()), candidates[0])


@dataclass(frozen=True)
class DatasetSource:
    """Where a benchmark's prompts live: a local JSONL file, and the Hub copy for online users."""

    file_name: str
    field: str  # the prompt field; "turns" holds a list of user turns
    hub: tuple[str, str | None, str]  # (dataset id, config, split) for `datasets.load_dataset`
    hub_field: str


DATASETS = {
    "gsm8k": DatasetSource("gsm8k_test.jsonl", "question", ("openai/gsm8k", "main", "test"), "question"),
    "math500": DatasetSource("math500.jsonl", "problem", ("HuggingFaceH4/MATH-500", None, "test"), "problem"),
    "humaneval": DatasetSource("humaneval.jsonl", "prompt", ("openai/openai_humaneval", None, "test"), "prompt"),
    "mbpp": DatasetSource("mbpp_sanitized_test.jsonl", "prompt", ("google-research-datasets/mbpp", "sanitized", "test"),
                          "prompt"),
    "mt-bench": DatasetSource("mt_bench.jsonl", "turns", ("HuggingFaceH4/mt_bench_prompts", None, "train"), "prompt"),
}


def _turns(record: dict[str, Any], field_name: str) -> list[str]:
    value = record[field_name]
    turns = [value] if isinstance(value, str) else list(value)
    if not turns or not all(isinstance(turn, str) and turn for turn in turns):
        raise ValueError(f"A record's {field_name!r} must be a non-empty string or list of strings, got {value!r}.")
    return turns


def read_prompt_file(path: str | Path, limit: int | None = None) -> list[list[str]]:
    """Conversations from a JSONL file with one `{"turns": [...]}` object per line."""
    conversations = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            record = json.loads(line)
            if "turns" not in record:
                raise ValueError(f"{path}:{number}: expected an object with a 'turns' list, got keys {sorted(record)}.")
            conversations.append(_turns(record, "turns"))
            if limit is not None and len(conversations) >= limit:
                break
    return conversations


def load_conversations(dataset: str, data_dir: str | Path, limit: int | None = None) -> list[list[str]]:
    """User turns of a benchmark's first `limit` prompts: the local copy in `data_dir`, else the Hub."""
    if dataset not in DATASETS:
        raise ValueError(f"Unknown dataset {dataset!r}; choose from {', '.join(DATASETS)} or pass --prompts FILE.jsonl.")
    source = DATASETS[dataset]
    path = Path(data_dir) / source.file_name
    if path.exists():
        conversations = []
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                conversations.append(_turns(json.loads(line), source.field))
                if limit is not None and len(conversations) >= limit:
                    break
        return conversations
    try:
        from datasets import load_dataset
    except ImportError as error:
        raise FileNotFoundError(f"{path} does not exist and the `datasets` package is not installed to fetch "
                                f"{source.hub[0]}; pass --data-dir.") from error
    name, config, split = source.hub
    rows = load_dataset(name, config, split=split)
    rows = rows.select(range(min(limit, len(rows)))) if limit is not None else rows
    return [_turns(row, source.hub_field) for row in rows]


# --------------------------------------------------------------------------------------------------
# Measurement
# --------------------------------------------------------------------------------------------------


@dataclass
class TurnRecord:
    """One prompt (one turn) measured with every method."""

    new_tokens: dict[str, list[int]]  # method -> generated ids (prompt excluded)
    seconds: dict[str, float]  # method -> wall time of its generation
    acceptance_lengths: list[int] = field(default_factory=list)  # DFlash: tokens committed per step


@dataclass
class BenchSettings:
    """What every prompt is run with."""

    max_new_tokens: int = 256
    block_size: int | None = None  # None: the draft's trained block size
    temperature: float = 0.0
    prompt_lookup_tokens: int | None = 10  # None: skip prompt-lookup decoding
    seed: int = 0
    batch_size: int = 1  # prompts per generate / spec_generate call (left-padded); > 1 skips prompt lookup
    auto_block_size: bool = False  # per dataset: calibrate on its first prompt, then take choose_block_size's pick


def stop_token_ids_of(target: torch.nn.Module, tokenizer: Any) -> list[int]:
    """The ids that end a response: the tokenizer's EOS and the target's generation-config EOS ids."""
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    configured = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    ids.update([configured] if isinstance(configured, int) else (configured or []))
    return sorted(ids)


def new_tokens_until_stop(tokens: list[int], stop_token_ids: list[int]) -> list[int]:
    """A generated row cut after its first stop token (batched `generate` pads finished rows after it)."""
    stop_at = first_stop_index(tokens, set(stop_token_ids))
    return tokens if stop_at is None else tokens[: stop_at + 1]


@torch.no_grad()
def measure_prompts(
    draft: DFlashDraftModel,
    target: torch.nn.Module,
    prompts: list[list[int]],
    settings: BenchSettings,
    stop_token_ids: list[int],
    mask_token_id: int | None = None,
) -> list[TurnRecord]:
    """Generate from N prompts at once (left-padded) with `generate`, DFlash and, for one prompt, prompt lookup.

    One record per row; each row carries 1/N of the batch's wall time, so summed seconds are wall time.
    """
    device = target.get_input_embeddings().weight.device
    pad_id = stop_token_ids[0]
    input_ids, attention_mask = left_pad(prompts, pad_id, device)  # [N, T]
    width = input_ids.shape[1]
    sampling = {"do_sample": True, "temperature": settings.temperature, "top_k": 0, "top_p": 1.0} \
        if settings.temperature > 0 else {"do_sample": False}
    common = {"attention_mask": attention_mask, "max_new_tokens": settings.max_new_tokens,
              "eos_token_id": stop_token_ids, "pad_token_id": pad_id, **sampling}
    result = None

    def generated(output_ids: torch.Tensor) -> list[list[int]]:
        return [new_tokens_until_stop(row, stop_token_ids) for row in output_ids[:, width:].tolist()]

    def dflash() -> list[list[int]]:
        nonlocal result
        result = draft.spec_generate(
            target=target, input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature, stop_token_ids=stop_token_ids, block_size=settings.block_size,
            seed=settings.seed if settings.temperature > 0 else None, mask_token_id=mask_token_id, return_stats=True,
        )
        return [result.new_tokens(row) for row in range(len(prompts))]

    methods: list[tuple[str, Callable[[], list[list[int]]]]] = [
        ("plain", lambda: generated(target.generate(input_ids, **common))),
        ("dflash", dflash),
    ]
    if settings.prompt_lookup_tokens and len(prompts) == 1:  # Transformers' prompt lookup takes one prompt
        methods.append(("prompt_lookup", lambda: generated(target.generate(
            input_ids, prompt_lookup_num_tokens=settings.prompt_lookup_tokens, **common))))
    new_tokens: dict[str, list[list[int]]] = {}
    seconds: dict[str, float] = {}
    for method, run in methods:
        torch.manual_seed(settings.seed)
        _synchronize(device)
        started = time.perf_counter()
        new_tokens[method] = run()
        _synchronize(device)
        seconds[method] = time.perf_counter() - started
    share = 1.0 / len(prompts)
    return [
        TurnRecord(new_tokens={method: rows[row] for method, rows in new_tokens.items()},
                   seconds={method: total * share for method, total in seconds.items()},
                   acceptance_lengths=list(result.acceptance_lengths[row]))
        for row in range(len(prompts))
    ]


@torch.no_grad()
def measure_step_costs(
    draft: DFlashDraftModel,
    target: torch.nn.Module,
    context_ids: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    repeats: int = 5,
    batch_size: int = 1,
) -> dict[str, float]:
    """Median seconds of the cost model's terms after a context [1, T] copied to `batch_size` rows.

    The terms: one target token per row, a B-token verify per row, a draft pass over the rows.
    """
    device = context_ids.device
    keyword = cache_keyword(target)
    context_ids = context_ids.repeat(batch_size, 1)  # [N, T]
    length = context_ids.shape[1]
    prefill = target(input_ids=context_ids, use_cache=True, output_hidden_states=True)
    cache = returned_cache(prefill)
    features = select_features(prefill.hidden_states, draft.target_layer_ids)  # [N, T, L*H]
    next_ids = context_ids[:, -block_size:] if length >= block_size else context_ids[:, :1].repeat(1, block_size)

    def target_step(num_tokens: int, hidden: bool) -> float:
        _synchronize(device)
        started = time.perf_counter()
        forward = verify_forward if hidden else (lambda model, **inputs: model(**inputs))  # the loop's verify, or a plain step
        forward(target, input_ids=next_ids[:, :num_tokens],
                position_ids=torch.arange(length, length + num_tokens, device=device)[None],
                use_cache=True, output_hidden_states=hidden, **{keyword: cache})
        _synchronize(device)
        elapsed = time.perf_counter() - started
        crop_cache(cache, length)
        return elapsed

    def draft_step() -> float:
        proposer = DFlashProposer(draft, target, mask_token_id)
        new = min(2, length - 1)  # a typical step hands over a few new context positions
        tokens, rows = context_ids[0].tolist(), list(range(batch_size))
        positions = torch.arange(length - 1, device=device)[None].expand(batch_size, -1)  # [N, T-1]
        proposer.propose(DraftStep([tokens[: length - new]] * batch_size, features[:, : length - new - 1],
                                   positions[:, : length - new - 1], None, block_size, rows))
        step = DraftStep([tokens] * batch_size, features[:, length - new - 1 : length - 1],
                         positions[:, length - new - 1 :], None, block_size, rows)
        _synchronize(device)
        started = time.perf_counter()
        proposer.propose(step)
        _synchronize(device)
        return time.perf_counter() - started

    def median(measure: Callable[[], float]) -> float:
        measure()  # warm-up
        return statistics.median(measure() for _ in range(repeats))

    return {
        "target_1": median(lambda: target_step(1, False)),
        "target_block": median(lambda: target_step(block_size, True)),
        "draft": median(draft_step) if block_size > 1 else 0.0,  # a block of 1 drafts nothing
    }


def cost_model_bound(tau: float, step_costs: dict[str, float]) -> float:
    """Speedup the cost model allows: tau * t(1 token) / (t(B-token verify) + t(draft))."""
    return tau * step_costs["target_1"] / (step_costs["target_block"] + step_costs["draft"])


def truncated_tau(acceptance_histogram: list[int], block_size: int) -> float:
    """tau at a smaller block, from a histogram measured at the full block: the sum over k <= B of P(length >= k)."""
    total = sum(acceptance_histogram)
    if total == 0:
        raise ValueError("the acceptance histogram is empty: no draft/verify step was measured")
    return sum(sum(acceptance_histogram[k - 1 :]) for k in range(1, block_size + 1)) / total


@torch.no_grad()
def choose_block_size(
    draft: DFlashDraftModel,
    target: torch.nn.Module,
    context_ids: torch.Tensor,
    acceptance_histogram: list[int],
    batch_size: int,
    mask_token_id: int,
) -> tuple[int, dict[int, float]]:
    """The block size with the best predicted speedup for `batch_size` rows on this machine, and every prediction.

    Prediction for B: truncated_tau(B) * t(1 token) / (t(B-token verify) + t(draft)), timed here at N rows;
    B = 1 is plain decoding by the same loop (1.0). Drafting shorter blocks is assumed to keep the acceptance
    of the positions it keeps.
    """
    candidates = sorted({b for b in (2, 3, 4, 6, 8, 12, 16) if b <= draft.block_size} | {draft.block_size})
    predictions = {1: 1.0}
    for block_size in candidates:
        costs = measure_step_costs(draft, target, context_ids, block_size, mask_token_id, batch_size=batch_size)
        predictions[block_size] = cost_model_bound(truncated_tau(acceptance_histogram, block_size), costs)
    return max(predictions, key=predictions.get), predictions


def acceptance_histogram(acceptance_lengths: list[int], block_size: int) -> list[int]:
    """Steps per acceptance length: entry k-1 counts the steps that committed k tokens (k = 1..B)."""
    histogram = [0] * block_size
    for length in acceptance_lengths:
        if not 1 <= length <= block_size:
            raise ValueError(f"acceptance length {length} is outside 1..{block_size}")
        histogram[length - 1] += 1
    return histogram


def summarize(
    dataset: str,
    records: list[TurnRecord],
    num_prompts: int,
    block_size: int,
    step_costs: dict[str, float] | None,
    greedy: bool,
    batch_size: int = 1,
) -> dict[str, Any]:
    """One dataset's results: tau, histogram, tokens/s per method (all rows), speedup, bound, lossless."""
    methods = [m for m in METHODS if all(m in record.seconds for record in records)]
    tokens_per_s = {}
    for method in methods:
        tokens = sum(len(record.new_tokens[method]) for record in records)
        seconds = sum(record.seconds[method] for record in records)
        tokens_per_s[method] = tokens / seconds if seconds > 0 else 0.0
    lengths = [length for record in records for length in record.acceptance_lengths]
    tau = sum(lengths) / len(lengths) if lengths else 0.0
    plain = tokens_per_s.get("plain", 0.0)
    # sampled outputs differ from run to run by design: equality is only a check of greedy decoding
    lossless = all(record.new_tokens["dflash"] == record.new_tokens["plain"] for record in records) if greedy else None
    return {
        "dataset": dataset,
        "num_prompts": num_prompts,
        "num_turns": len(records),
        "batch_size": batch_size,
        "block_size": block_size,
        "tau": tau,
        "acceptance_histogram": acceptance_histogram(lengths, block_size),
        "tokens_per_s": tokens_per_s,
        "speedup": tokens_per_s["dflash"] / plain if plain > 0 else 0.0,
        "speedup_prompt_lookup": tokens_per_s["prompt_lookup"] / plain if plain > 0 and "prompt_lookup" in tokens_per_s else None,
        "bound": cost_model_bound(tau, step_costs) if step_costs else None,
        "step_costs_ms": {k: v * 1000 for k, v in step_costs.items()} if step_costs else None,
        "lossless": lossless,
    }


# --------------------------------------------------------------------------------------------------
# A whole run
# --------------------------------------------------------------------------------------------------


def resolve_mask_token_id(draft: DFlashDraftModel, tokenizer: Any) -> int:
    """The draft's mask id, looked up in the tokenizer when the config names the mask token as a string."""
    if draft.mask_token_id is not None:
        return draft.mask_token_id
    name = draft.config.dflash_config.get("mask_token")
    mask_token_id = tokenizer.convert_tokens_to_ids(name) if name is not None else None
    if mask_token_id is None or mask_token_id == tokenizer.unk_token_id:
        raise ValueError(f"The draft's mask token {name!r} is not in the target tokenizer's vocabulary.")
    return int(mask_token_id)


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

    Under `accelerate launch` the conversations are sharded over the processes and the records gathered.
    """
    from tqdm.auto import tqdm

    process_index, num_processes, gather = _distributed()
    device = target.get_input_embeddings().weight.device
    mask_token_id = resolve_mask_token_id(draft, tokenizer)
    stop_token_ids = stop_token_ids_of(target, tokenizer)
    first_prompt = next(iter(datasets.values()))[0][0]
    warm_up_prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": first_prompt}])
    warm_up = dataclasses.replace(settings, max_new_tokens=8)
    measure_prompts(draft, target, [warm_up_prompt] * settings.batch_size, warm_up, stop_token_ids, mask_token_id)
    total_turns = sum(len(turns) for conversations in datasets.values() for turns in conversations[process_index::num_processes])
    bar = tqdm(total=total_turns, desc="bench", disable=not progress or process_index != 0)
    results = []
    for name, conversations in datasets.items():
        records: list[TurnRecord] = []
        step_costs = None
        dataset_settings, predictions = settings, None
        if settings.auto_block_size:
            prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": conversations[0][0]}])
            block_size, predictions = calibrate_block_size(draft, target, prompt, settings, stop_token_ids, mask_token_id)
            dataset_settings = dataclasses.replace(settings, block_size=block_size)
        block_size = dataset_settings.block_size or draft.block_size
        shard = conversations[process_index::num_processes]
        for group in [shard[i : i + settings.batch_size] for i in range(0, len(shard), settings.batch_size)]:
            histories: list[list[dict[str, str]]] = [[] for _ in group]
            for turn_index in range(max(len(turns) for turns in group)):
                rows = [row for row, turns in enumerate(group) if turn_index < len(turns)]
                for row in rows:
                    histories[row].append({"role": "user", "content": group[row][turn_index]})
                prompts = [chat_prompt_ids(tokenizer, histories[row]) for row in rows]
                turn_records = measure_prompts(draft, target, prompts, dataset_settings, stop_token_ids, mask_token_id)
                records.extend(turn_records)
                if step_costs is None:  # the cost model, at a typical context: the prompt and half an answer
                    answer = turn_records[0].new_tokens["plain"]
                    context = torch.tensor([prompts[0] + answer[: max(len(answer) // 2, 1)]], device=device)
                    step_costs = measure_step_costs(draft, target, context, block_size, mask_token_id,
                                                    batch_size=len(prompts))
                # the next turn sees the model's own answer (the plain greedy one: every method's prompt is the same)
                for row, record in zip(rows, turn_records):
                    answer = tokenizer.decode([t for t in record.new_tokens["plain"] if t not in stop_token_ids],
                                              skip_special_tokens=True)
                    histories[row].append({"role": "assistant", "content": answer})
                bar.update(len(rows))
                bar.set_postfix_str(f"{name} tau {_running_tau(records):.2f}")
        records = gather(records)
        step_costs = gather([step_costs])[0]
        results.append(summarize(name, records, len(conversations), block_size, step_costs, settings.temperature == 0,
                                 settings.batch_size))
        if predictions is not None:
            results[-1]["block_size_predictions"] = predictions
    bar.close()
    return results


@torch.no_grad()
def calibrate_block_size(
    draft: DFlashDraftModel,
    target: torch.nn.Module,
    prompt: list[int],
    settings: BenchSettings,
    stop_token_ids: list[int],
    mask_token_id: int,
) -> tuple[int, dict[int, float]]:
    """Run one prompt at the draft's full block for its acceptance histogram, then `choose_block_size` for N rows."""
    device = target.get_input_embeddings().weight.device
    result = draft.spec_generate(target=target, input_ids=torch.tensor([prompt], device=device),
                                 max_new_tokens=settings.max_new_tokens, stop_token_ids=stop_token_ids,
                                 mask_token_id=mask_token_id, return_stats=True)
    histogram = acceptance_histogram(result.acceptance_lengths[0], draft.block_size)
    answer = result.new_tokens(0)
    context = torch.tensor([prompt + answer[: max(len(answer) // 2, 1)]], device=device)
    return choose_block_size(draft, target, context, histogram, settings.batch_size, mask_token_id)


def _running_tau(records: list[TurnRecord]) -> float:
    lengths = [length for record in records for length in record.acceptance_lengths]
    return sum(lengths) / len(lengths) if lengths else 0.0


def _distributed() -> tuple[int, int, Callable[[list], list]]:
    """(process index, process count, gather of Python lists) under Accelerate; a single process otherwise."""
    try:
        from accelerate import PartialState
        from accelerate.utils import gather_object
    except ImportError:
        return 0, 1, lambda items: items
    state = PartialState(cpu=not torch.cuda.is_available())
    if state.num_processes == 1:
        return 0, 1, lambda items: items
    return state.process_index, state.num_processes, gather_object


# --------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------


def markdown_table(results: list[dict[str, Any]]) -> str:
    """The results as a Markdown table (one row per dataset, and per batch size N when some N > 1)."""
    batched = any(result.get("batch_size", 1) > 1 for result in results)
    lines = [
        "| dataset | prompts |" + (" N |" if batched else "")
        + " B | tau | plain tok/s | DFlash tok/s | prompt lookup tok/s | speedup | bound | lossless |",
        "|---|---:|" + ("---:|" if batched else "") + "---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for result in results:
        rates = result["tokens_per_s"]
        lookup = f"{rates['prompt_lookup']:.1f}" if "prompt_lookup" in rates else "-"
        bound = f"{result['bound']:.2f}x" if result["bound"] is not None else "-"
        lossless = {True: "yes", False: "NO", None: "n/a (sampling)"}[result["lossless"]]
        batch = f" {result.get('batch_size', 1)} |" if batched else ""
        lines.append(
            f"| {result['dataset']} | {result['num_prompts']} |{batch} {result['block_size']} | {result['tau']:.2f} | "
            f"{rates['plain']:.1f} | {rates['dflash']:.1f} | {lookup} | {result['speedup']:.2f}x | {bound} | {lossless} |"
        )
    return "\n".join(lines)


def plot_results(results: list[dict[str, Any]], path: str | Path) -> None:
    """A PNG: speedup (measured, cost-model bound, prompt lookup) and tau per dataset."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [result["dataset"] for result in results]
    positions = range(len(names))
    figure, (speed_axis, tau_axis) = plt.subplots(1, 2, figsize=(4 + 2 * len(names), 4))
    width = 0.27
    speed_axis.bar([p - width for p in positions], [r["speedup"] for r in results], width, label="DFlash (measured)")
    speed_axis.bar(list(positions), [r["bound"] or 0.0 for r in results], width, label="cost-model bound")
    speed_axis.bar([p + width for p in positions], [r["speedup_prompt_lookup"] or 0.0 for r in results], width,
                   label="prompt lookup")
    speed_axis.axhline(1.0, color="gray", linewidth=0.8)
    speed_axis.set(xticks=list(positions), xticklabels=names, ylabel="speedup over target.generate")
    speed_axis.legend(fontsize=8, loc="lower left", framealpha=0.9)
    tau_axis.bar(list(positions), [r["tau"] for r in results], 0.5, color="tab:green")
    tau_axis.set(xticks=list(positions), xticklabels=names, ylabel="tau (tokens per target forward)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
