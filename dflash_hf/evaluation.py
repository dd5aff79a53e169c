"""Measuring a draft: time prompts with `generate` and DFlash, summarise (tau, tokens/s, speedup, lossless), and the
cost model built on the loop's own stage functions. `bench`, `train` and `demo` all measure through this module.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from .cache_dflash import crop_cache, left_pad
from .generation_dflash import GenerationSettings, TargetContext, plan_step, prefill, propose, synchronize, verify
from .modeling_dflash import DFlashDraftModel
from .proposer_dflash import DFlashProposer, Proposal
from .sampling_dflash import cut_after_stop, mean_acceptance_length
from .target_dflash import neutral_overrides

METHODS = ("plain", "dflash", "prompt_lookup", "transformers_dflash")  # the last: Transformers' own DFlash loop


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
    acceptance: str = "rejection"  # sampling: speculative (rejection) sampling, or the equality rule


def _timed(run: Callable[[], list[list[int]]], device: torch.device, seed: int) -> tuple[list[list[int]], float]:
    torch.manual_seed(seed)
    synchronize(device)
    started = time.perf_counter()
    rows = run()
    synchronize(device)
    return rows, time.perf_counter() - started


@torch.no_grad()
def measure_prompts(
    draft: DFlashDraftModel,
    target: torch.nn.Module,
    prompts: list[list[int]],
    settings: BenchSettings,
    stop_token_ids: list[int],
    mask_token_id: int | None = None,
    native_draft: torch.nn.Module | None = None,
) -> list[TurnRecord]:
    """Generate from N prompts at once (left-padded) with `generate`, DFlash and, for one prompt, prompt lookup and
    Transformers' own DFlash loop with `native_draft` (the same weights, `conversion.to_native`) when given.

    One record per row; each row carries 1/N of the batch's wall time, so summed seconds are wall time.
    """
    device = target.get_input_embeddings().weight.device
    pad_id = stop_token_ids[0]
    input_ids, attention_mask = left_pad(prompts, pad_id, device)  # [N, T]
    sampling = {"do_sample": True, "temperature": settings.temperature, "top_k": 0, "top_p": 1.0} \
        if settings.temperature > 0 else {"do_sample": False}
    # settings of the target's generation config that DFlash cannot apply (a repetition penalty, ...) are switched
    # off for both methods, so that both decode the same distribution
    neutral = neutral_overrides(getattr(target, "generation_config", None))
    common = {"attention_mask": attention_mask, "max_new_tokens": settings.max_new_tokens,
              "eos_token_id": stop_token_ids, "pad_token_id": pad_id, **sampling, **neutral}
    stops = frozenset(stop_token_ids)
    results = []

    def generated(output_ids: torch.Tensor) -> list[list[int]]:
        return [cut_after_stop(row, stops) for row in output_ids[:, input_ids.shape[1]:].tolist()]

    def dflash() -> list[list[int]]:
        results.append(draft.spec_generate(
            target=target, input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature, top_k=0, top_p=1.0,  # as `generate` above: no other filter
            stop_token_ids=stop_token_ids, block_size=settings.block_size,
            seed=settings.seed if settings.temperature > 0 else None, mask_token_id=mask_token_id, return_stats=True,
            acceptance=settings.acceptance, **neutral,
        ))
        return [results[-1].new_tokens(row) for row in range(len(prompts))]

    methods: dict[str, Callable[[], list[list[int]]]] = {
        "plain": lambda: generated(target.generate(input_ids, **common)),
        "dflash": dflash,
    }
    if settings.prompt_lookup_tokens and len(prompts) == 1:  # Transformers' prompt lookup takes one prompt
        methods["prompt_lookup"] = lambda: generated(target.generate(
            input_ids, prompt_lookup_num_tokens=settings.prompt_lookup_tokens, **common))
    # Transformers' DFlash is assisted decoding (one prompt) and drafts the draft's own block size
    if native_draft is not None and len(prompts) == 1 and settings.block_size in (None, draft.block_size):
        methods["transformers_dflash"] = lambda: generated(target.generate(
            input_ids, assistant_model=native_draft, speculation_type="dflash", **common))
    timed = {method: _timed(run, device, settings.seed) for method, run in methods.items()}
    share = 1.0 / len(prompts)
    return [
        TurnRecord(new_tokens={method: rows[row] for method, (rows, _) in timed.items()},
                   seconds={method: seconds * share for method, (_, seconds) in timed.items()},
                   acceptance_lengths=list(results[-1].acceptance_lengths[row]))
        for row in range(len(prompts))
    ]


# --- The cost model ----------------------------------------------------------------------------------------------


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

    The terms: one token of plain decoding per row (the target's own forward, as `generate` runs it), and, timed on
    the loop's own stages, a B-token verify per row and a draft pass over the rows.
    """
    device = context_ids.device
    settings = GenerationSettings(max_new_tokens=block_size + 1, block_size=block_size,
                                  generators=(None,) * batch_size)
    proposer = DFlashProposer(draft, target, mask_token_id)
    state = prefill(target, context_ids.repeat(batch_size, 1), None, proposer.target_layer_ids, settings)
    block = plan_step(state, settings)
    single = plan_step(state, replace(settings, block_size=1))
    no_new_context = TargetContext(state.context.hidden[:, :0], state.context.position_ids[:, :0], None)
    proposal = propose(proposer, state, block, settings)  # hands the whole context to the draft

    def plain_step() -> Any:  # one token of `generate`: the target's own forward, its full LM head
        return target(input_ids=single.pending, position_ids=single.positions, use_cache=True,
                      **{state.cache_argument: state.cache})

    def draft_pass() -> Proposal:
        state.context = no_new_context  # a pass over the cached context and the block
        return propose(proposer, state, block, settings)

    def seconds(run: Callable[[], Any]) -> float:
        synchronize(device)
        started = time.perf_counter()
        run()
        synchronize(device)
        elapsed = time.perf_counter() - started
        crop_cache(state.cache, state.columns.width)  # a verify's columns leave the cache again
        return elapsed

    def median(run: Callable[[], Any]) -> float:
        seconds(run)  # warm-up
        return statistics.median(seconds(run) for _ in range(repeats))

    return {
        "target_1": median(plain_step),
        "target_block": median(lambda: verify(target, state, block, proposal, settings)),
        "draft": median(draft_pass) if block_size > 1 else 0.0,  # a block of 1 drafts nothing
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
                                 max_new_tokens=settings.max_new_tokens, temperature=0.0, stop_token_ids=stop_token_ids,
                                 mask_token_id=mask_token_id, return_stats=True,
                                 **neutral_overrides(getattr(target, "generation_config", None)))
    histogram = acceptance_histogram(result.acceptance_lengths[0], draft.block_size)
    return choose_block_size(draft, target, typical_context(prompt, result.new_tokens(0), device), histogram,
                             settings.batch_size, mask_token_id)


def typical_context(prompt: list[int], answer: list[int], device: torch.device) -> torch.Tensor:
    """Where the cost model is timed: the prompt and half of an answer, [1, T]."""
    return torch.tensor([prompt + answer[: max(len(answer) // 2, 1)]], device=device)


# --- Summaries ----------------------------------------------------------------------------------------------------


def acceptance_histogram(acceptance_lengths: list[int], block_size: int) -> list[int]:
    """Steps per acceptance length: entry k-1 counts the steps that committed k tokens (k = 1..B)."""
    histogram = [0] * block_size
    for length in acceptance_lengths:
        if not 1 <= length <= block_size:
            raise ValueError(f"acceptance length {length} is outside 1..{block_size}")
        histogram[length - 1] += 1
    return histogram


def records_tau(records: list[TurnRecord]) -> float:
    """tau over every step of every record."""
    return mean_acceptance_length(length for record in records for length in record.acceptance_lengths)


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
    tau = records_tau(records)
    plain = tokens_per_s.get("plain", 0.0)
    # sampled outputs differ from run to run by design: equality is only a check of greedy decoding
    lossless = {method: all(record.new_tokens[method] == record.new_tokens["plain"] for record in records)
                if greedy else None for method in methods if method != "plain"}
    return {
        "dataset": dataset,
        "num_prompts": num_prompts,
        "num_turns": len(records),
        "batch_size": batch_size,
        "block_size": block_size,
        "tau": tau,
        "acceptance_histogram": acceptance_histogram([n for r in records for n in r.acceptance_lengths], block_size),
        "tokens_per_s": tokens_per_s,
        "speedup": tokens_per_s["dflash"] / plain if plain > 0 else 0.0,
        "speedup_prompt_lookup": tokens_per_s["prompt_lookup"] / plain if plain > 0 and "prompt_lookup" in tokens_per_s else None,
        "speedup_transformers_dflash": tokens_per_s["transformers_dflash"] / plain
        if plain > 0 and "transformers_dflash" in tokens_per_s else None,
        "bound": cost_model_bound(tau, step_costs) if step_costs else None,
        "step_costs_ms": {k: v * 1000 for k, v in step_costs.items()} if step_costs else None,
        "lossless": lossless["dflash"],
        "lossless_transformers_dflash": lossless.get("transformers_dflash"),
    }


def markdown_table(results: list[dict[str, Any]]) -> str:
    """The results as a Markdown table (one row per dataset, and per batch size N when some N > 1)."""
    batched = any(result.get("batch_size", 1) > 1 for result in results)
    lines = [
        "| dataset | prompts |" + (" N |" if batched else "")
        + " B | tau | plain tok/s | DFlash tok/s | prompt lookup tok/s | Transformers DFlash tok/s | speedup | bound"
        + " | lossless |",
        "|---|---:|" + ("---:|" if batched else "") + "---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for result in results:
        rates = result["tokens_per_s"]
        lookup = f"{rates['prompt_lookup']:.1f}" if "prompt_lookup" in rates else "-"
        native = f"{rates['transformers_dflash']:.1f}" if "transformers_dflash" in rates else "-"
        if result.get("lossless_transformers_dflash") is False:
            native += " (NOT lossless)"
        bound = f"{result['bound']:.2f}x" if result["bound"] is not None else "-"
        lossless = {True: "yes", False: "NO", None: "n/a (sampling)"}[result["lossless"]]
        batch = f" {result.get('batch_size', 1)} |" if batched else ""
        lines.append(
            f"| {result['dataset']} | {result['num_prompts']} |{batch} {result['block_size']} | {result['tau']:.2f} | "
            f"{rates['plain']:.1f} | {rates['dflash']:.1f} | {lookup} | {native} | {result['speedup']:.2f}x | {bound} | "
            f"{lossless} |"
        )
    return "\n".join(lines)


@torch.no_grad()
def evaluate_draft(
    draft: DFlashDraftModel,
    target: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int = 256,
    block_size: int | None = None,
    *,
    stop_token_ids: list[int],
    on_result: Callable[[int, TurnRecord], None] | None = None,
) -> dict[str, Any]:
    """`dflash-hf bench`'s greedy measurement of prompts one at a time: tau, tokens/s against `target.generate`, lossless.

    `on_result(prompt_index, record)` sees each prompt's record as soon as it is measured.
    """
    if not stop_token_ids:
        raise ValueError("evaluate_draft needs a stop token (the first one also pads): see dflash_hf.generation_tokens.")
    settings = BenchSettings(max_new_tokens=max_new_tokens, block_size=block_size, prompt_lookup_tokens=None)
    measure_prompts(draft, target, prompts[:1], replace(settings, max_new_tokens=8), stop_token_ids)  # warm-up
    records = []
    for index, prompt in enumerate(prompts):
        records += measure_prompts(draft, target, [prompt], settings, stop_token_ids)
        if on_result is not None:
            on_result(index, records[-1])
    return summarize("evaluation", records, len(prompts), block_size or draft.block_size, None, greedy=True)
