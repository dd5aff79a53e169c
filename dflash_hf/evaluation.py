"""Measuring a draft: time prompts with `generate`, DFlash, prompt lookup and Transformers' own DFlash, judge each
greedy output against plain `generate` (exact, near-tie or NO), and summarise (tau, tokens/s, speedup, bound).
`bench`, `train` and `demo` all measure through this module; the step costs come from `cost_model`.
"""

from __future__ import annotations

import dataclasses
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from .cache_dflash import left_pad
from .cost_model import acceptance_histogram, cost_model_bound, prime_few_row_kernels
from .devices_dflash import target_device, target_text_config
from .generation_dflash import synchronize
from .modeling_dflash import DFlashDraftModel
from .sampling_dflash import cut_after_stop, mean_acceptance_length
from .settings_dflash import StepCosts, neutral_overrides, resolve_block_size
from .support_dflash import recurrent_layers
from .target_dflash import last_logits_only
from .tokens_dflash import GenerationTokens
from .versions_dflash import assisted_decoding_runs_recurrent_targets

# "transformers_dflash": Transformers' own DFlash loop; "plain_compiled": `generate` compiled as Transformers documents
# it (a static cache, the forward under torch.compile), timed with `--compile`: the baseline a GPU user compares with
METHODS = ("plain", "dflash", "prompt_lookup", "transformers_dflash", "plain_compiled")
VERDICTS = ("exact", "near-tie", "NO")
# a near-tie: the target's two candidate logits within 16 ulps of the logit's magnitude in the run's dtype; in bf16
# that is 1/8 of it, the tests' near-tie (`assert_equal_up_to_near_tie`); in float32 about 2e-6 of it
NEAR_TIE_ULPS = 16


@dataclass(frozen=True)
class Verdict:
    """How a method's greedy output compares with plain `generate`'s: "exact", "near-tie" or "NO"."""

    verdict: str
    first_divergence: int | None = None  # index (in the new tokens) of the first difference; None: exact
    logit_gap: float | None = None  # the target's top logit minus the lower of the two tokens' logits there
    tolerance: float | None = None  # the largest gap that reads as a near-tie


@dataclass
class TurnRecord:
    """One prompt (one turn) measured with every method."""

    new_tokens: dict[str, list[int]]  # method -> generated ids (prompt excluded)
    seconds: dict[str, float]  # method -> wall time of its generation
    acceptance_lengths: list[int] = field(default_factory=list)  # DFlash: tokens committed per step
    verified_lengths: list[int] = field(default_factory=list)  # DFlash: tokens verified per step
    verdicts: dict[str, Verdict] = field(default_factory=dict)  # greedy: method -> its comparison with "plain"


@dataclass
class BenchSettings:
    """What every prompt is run with."""

    max_new_tokens: int = 256
    # an integer; None: the draft's trained size; "auto" / "adaptive": resolved per dataset on its first prompt
    # (`cost_model.resolve_block_choice`), which also sets `step_costs` for "adaptive"
    block_size: int | str | None = None
    temperature: float = 0.0
    prompt_lookup_tokens: int | None = 10  # None: skip prompt-lookup decoding
    seed: int = 0
    batch_size: int = 1  # prompts per generate / spec_generate call (left-padded); > 1 skips prompt lookup
    acceptance: str = "rejection"  # sampling: speculative (rejection) sampling, or the equality rule
    step_costs: StepCosts | None = None  # spec_generate's step_costs (adaptive verify)
    cpu_kernels: bool | str | None = None  # spec_generate's cpu_kernels (None: `bench` times the modes per dataset)
    thinking: bool = False  # chat templates with a thinking switch (Qwen3) render it on; off as the paper measures
    # spec_generate's tree_size (None: a chain; "auto": chosen per dataset on its first prompt by
    # `cost_model.choose_tree_size`); the peers run with chains only
    tree_size: int | str | None = None
    compile: bool = False  # spec_generate's compile (README "Compiled decoding"): the warm-up call compiles


def assisted_decoding_refusal(target: torch.nn.Module) -> str | None:
    """Why Transformers' assisted decoding (prompt lookup, its own DFlash) cannot run `target` (None: it can; whether
    it is exact there, each run's verdicts say)."""
    if recurrent_layers(target_text_config(target)) and not assisted_decoding_runs_recurrent_targets():
        return "refused by Transformers: a recurrent cache cannot be cropped"
    return None


_COMPILED_FORWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> its compiled forward


def compiled_generate(target: torch.nn.Module, input_ids: torch.Tensor, **generate_kwargs: Any) -> torch.Tensor:
    """`target.generate` compiled as Transformers documents it: a static cache and the target's forward under
    `torch.compile` (CUDA graphs on a GPU, `mode="reduce-overhead"`), with generate's own compile switched off
    (`disable_compile`) so that one compiled forward runs on every device; the forward is compiled once per target
    (the first call compiles) and set only for the call."""
    compiled = _COMPILED_FORWARDS.get(target)
    if compiled is None:
        on_gpu = target_device(target).type == "cuda"
        compiled = _COMPILED_FORWARDS[target] = torch.compile(
            type(target).forward, fullgraph=True, **({"mode": "reduce-overhead"} if on_gpu else {}))
    target.forward = compiled.__get__(target)
    try:
        return target.generate(input_ids, cache_implementation="static", disable_compile=True, **generate_kwargs)
    finally:
        del target.forward


def near_tie_tolerance(logit: float, dtype: torch.dtype, ulps: float = NEAR_TIE_ULPS) -> float:
    """The largest logit gap that reads as a near-tie: `ulps` units of `dtype`'s precision at the logit's magnitude."""
    return ulps * torch.finfo(dtype).eps * max(abs(logit), 1.0)


@torch.no_grad()
def compare_outputs(
    target: torch.nn.Module,
    prompt_ids: list[int],
    reference_tokens: list[int],
    candidate_tokens: list[int],
    dtype: torch.dtype | None = None,
    ulps: float = NEAR_TIE_ULPS,
) -> Verdict:
    """A candidate's greedy tokens against the reference's (plain `generate`), both without the prompt.

    "near-tie" when they first differ where the target's own logits (a plain forward over the prompt and the common
    prefix) hold both tokens within `near_tie_tolerance` of the best one; "NO" otherwise, or when one output only
    stops earlier. `dtype`: the run's (default: the target's embedding weights').
    """
    if candidate_tokens == reference_tokens:
        return Verdict("exact")
    index = next((i for i, (a, b) in enumerate(zip(reference_tokens, candidate_tokens)) if a != b), None)
    if index is None:  # equal up to the shorter one
        return Verdict("NO", min(len(reference_tokens), len(candidate_tokens)))
    weights = target.get_input_embeddings().weight
    input_ids = torch.tensor([prompt_ids + reference_tokens[:index]], device=target_device(target))
    logits = target(input_ids=input_ids, **last_logits_only(target)).logits[0, -1].float()
    best = logits.max().item()
    gap = best - min(logits[reference_tokens[index]].item(), logits[candidate_tokens[index]].item())
    tolerance = near_tie_tolerance(best, dtype or weights.dtype, ulps)
    return Verdict("near-tie" if gap <= tolerance else "NO", index, gap, tolerance)


def method_order(methods: list[str], turn: int) -> list[str]:
    """The order the methods run in at turn `turn`: rotated by one per turn, so no method always runs first."""
    start = turn % len(methods) if methods else 0
    return methods[start:] + methods[:start]


def warm_up_settings(settings: BenchSettings, block_size: int) -> BenchSettings:
    """Settings of the untimed warm-up: two full blocks of new tokens, so that the first step and a later one both
    verify `block_size` tokens (and every method meets those widths) before anything is timed; compiled, the whole
    length, so that the static cache it compiles for is the one the timed calls use."""
    return replace(settings, max_new_tokens=settings.max_new_tokens if settings.compile else 2 * block_size + 1)


def warm_up(draft: DFlashDraftModel, target: torch.nn.Module, prompts: list[list[int]], settings: BenchSettings,
            tokens: GenerationTokens, native_draft: torch.nn.Module | None = None) -> float:
    """The untimed warm-up before measuring: every method over `prompts` for two full blocks (compiled: the whole
    length), kernels primed; its seconds (compiled: mostly the compilation)."""
    started = time.perf_counter()
    block_size = resolve_block_size(settings.block_size, draft.block_size)
    prime_few_row_kernels(draft, target, len(prompts) * block_size)
    measure_prompts(draft, target, prompts, warm_up_settings(settings, block_size), tokens, native_draft)
    return time.perf_counter() - started


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
    tokens: GenerationTokens,
    native_draft: torch.nn.Module | None = None,
    turn: int = 0,
) -> list[TurnRecord]:
    """Generate from N prompts at once (left-padded) with `generate`, DFlash and, for one prompt, prompt lookup and
    Transformers' own DFlash loop with `native_draft` (the same weights, `conversion.to_native`) when given.

    One record per row; each row carries 1/N of the batch's wall time, so summed seconds are wall time. The methods
    run in `method_order(..., turn)`; greedy records hold each method's `compare_outputs` verdict against "plain".
    `tokens`: the stop, pad and mask ids (`generation_tokens`).
    """
    device = target_device(target)
    stop_token_ids, pad_id = tokens.stop_token_ids, tokens.pad_token_id
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
            seed=settings.seed if settings.temperature > 0 else None, mask_token_id=tokens.mask_token_id,
            return_stats=True,
            acceptance=settings.acceptance, step_costs=settings.step_costs, cpu_kernels=settings.cpu_kernels,
            tree_size=settings.tree_size, compile=settings.compile, **neutral,
        ))
        return [results[-1].new_tokens(row) for row in range(len(prompts))]

    methods: dict[str, Callable[[], list[list[int]]]] = {
        "plain": lambda: generated(target.generate(input_ids, **common)),
        "dflash": dflash,
    }
    if settings.compile:  # the compiled DFlash against the compiled baseline, not only the eager one
        methods["plain_compiled"] = lambda: generated(compiled_generate(target, input_ids, **common))
    # Transformers' assisted decoding takes one prompt; it is timed next to chains (a tree row would repeat it)
    assisted = len(prompts) == 1 and settings.tree_size is None and assisted_decoding_refusal(target) is None
    if settings.prompt_lookup_tokens and assisted:
        methods["prompt_lookup"] = lambda: generated(target.generate(
            input_ids, prompt_lookup_num_tokens=settings.prompt_lookup_tokens, **common))
    # Transformers' DFlash is assisted decoding (one prompt) and drafts the draft's own block size
    if (native_draft is not None and assisted
            and resolve_block_size(settings.block_size, draft.block_size) == draft.block_size):
        methods["transformers_dflash"] = lambda: generated(target.generate(
            input_ids, assistant_model=native_draft, speculation_type="dflash", **common))
    timed = {method: _timed(methods[method], device, settings.seed) for method in method_order(list(methods), turn)}
    timed = {method: timed[method] for method in methods}  # records list the methods in the usual order
    return turn_records(target, prompts, timed, results[-1], greedy=settings.temperature == 0)


def turn_records(target: torch.nn.Module, prompts: list[list[int]],
                 timed: dict[str, tuple[list[list[int]], float]], dflash_result: Any,
                 greedy: bool) -> list[TurnRecord]:
    """One record per prompt from each method's (rows, seconds): 1/N of the wall time each, the DFlash row's
    acceptance lengths, and (greedy) each method's verdict against "plain"."""
    share = 1.0 / len(prompts)
    records = []
    for row, prompt in enumerate(prompts):
        new_tokens = {method: rows[row] for method, (rows, _) in timed.items()}
        # sampled outputs differ from run to run by design: the comparison is a check of greedy decoding
        verdicts = {method: compare_outputs(target, prompt, new_tokens["plain"], tokens)
                    for method, tokens in new_tokens.items() if method != "plain"} if greedy else {}
        records.append(TurnRecord(new_tokens=new_tokens,
                                  seconds={method: seconds * share for method, (_, seconds) in timed.items()},
                                  acceptance_lengths=list(dflash_result.acceptance_lengths[row]),
                                  verified_lengths=list(dflash_result.verified_lengths[row]), verdicts=verdicts))
    return records


# --- Summaries ----------------------------------------------------------------------------------------------------


def records_tau(records: list[TurnRecord]) -> float:
    """tau over every step of every record."""
    return mean_acceptance_length(length for record in records for length in record.acceptance_lengths)


def record_verdict(record: TurnRecord, method: str) -> Verdict:
    """The record's verdict for `method`; records without one (built by hand) compare by equality."""
    if method in record.verdicts:
        return record.verdicts[method]
    return Verdict("exact") if record.new_tokens[method] == record.new_tokens["plain"] else Verdict("NO")


def verdict_summary(records: list[TurnRecord], methods: list[str]) -> tuple[dict[str, dict[str, int]], list[dict]]:
    """Per method the count of each verdict, and every turn that was not exact (its index, method and verdict)."""
    counts = {method: dict.fromkeys(VERDICTS, 0) for method in methods}
    divergences = []
    for index, record in enumerate(records):
        for method in methods:
            verdict = record_verdict(record, method)
            counts[method][verdict.verdict] += 1
            if verdict.verdict != "exact":
                divergences.append({"turn": index, "method": method, **dataclasses.asdict(verdict)})
    return counts, divergences


def summarize(
    dataset: str,
    records: list[TurnRecord],
    num_prompts: int,
    block_size: int,
    step_costs: dict[str, float] | None,
    greedy: bool,
    batch_size: int = 1,
    verify_costs: StepCosts | None = None,
) -> dict[str, Any]:
    """One dataset's results: tau, histogram, tokens/s per method (all rows), speedup, bound, lossless.

    With `verify_costs` (adaptive verify length): the mean verified length and the costs; no bound, as the verify
    widths' costs were timed at another moment than the plain step (on a busy CPU they drift by 10-20 %).

    Greedy only (None under sampling): `verdicts` counts each method's "exact" / "near-tie" / "NO" turns against plain
    `generate`, `divergences` lists the turns that were not exact, and `lossless` (DFlash) and `lossless_<method>`
    are true when no turn of the method reads "NO" (every output exact, or diverging first at a near-tie).
    """
    methods = [m for m in METHODS if all(m in record.seconds for record in records)]
    tokens_per_s = {}
    for method in methods:
        tokens = sum(len(record.new_tokens[method]) for record in records)
        seconds = sum(record.seconds[method] for record in records)
        tokens_per_s[method] = tokens / seconds if seconds > 0 else 0.0
    tau = records_tau(records)
    plain = tokens_per_s.get("plain", 0.0)
    # sampled outputs differ from run to run by design: the comparison is only a check of greedy decoding
    compared = [method for method in methods if method != "plain"]
    verdicts, divergences = verdict_summary(records, compared) if greedy else (None, None)
    lossless = {method: verdicts[method]["NO"] == 0 if greedy else None for method in compared}
    verified = [length for record in records for length in record.verified_lengths]
    bound = cost_model_bound(tau, step_costs) if step_costs and verify_costs is None else None
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
        "speedup_prompt_lookup": tokens_per_s["prompt_lookup"] / plain
        if plain > 0 and "prompt_lookup" in tokens_per_s else None,
        "speedup_transformers_dflash": tokens_per_s["transformers_dflash"] / plain
        if plain > 0 and "transformers_dflash" in tokens_per_s else None,
        # the compiled DFlash against compiled `generate` (`--compile`); None where not timed
        "speedup_vs_compiled": tokens_per_s["dflash"] / tokens_per_s["plain_compiled"]
        if tokens_per_s.get("plain_compiled") else None,
        "bound": bound,
        "step_costs_ms": {k: v * 1000 for k, v in step_costs.items()} if step_costs else None,
        "adaptive_verify": verify_costs is not None,
        "mean_verified_length": mean_acceptance_length(verified) if verified else None,
        "verify_costs_ms": None if verify_costs is None else
        {"draft": verify_costs.draft * 1000, "verify": [seconds * 1000 for seconds in verify_costs.verify]},
        "lossless": lossless["dflash"],
        "lossless_prompt_lookup": lossless.get("prompt_lookup"),
        "lossless_transformers_dflash": lossless.get("transformers_dflash"),
        "lossless_plain_compiled": lossless.get("plain_compiled"),
        "verdicts": verdicts,
        "divergences": divergences,
    }


def lossless_cell(result: dict[str, Any], method: str = "dflash") -> str:
    """The table's lossless entry: "yes", "yes (k near-tie)", "NO (k of n)", or "n/a (sampling)"."""
    flag = result.get("lossless" if method == "dflash" else f"lossless_{method}")
    counts = (result.get("verdicts") or {}).get(method)
    if flag is None:
        return "n/a (sampling)"
    if counts is None:  # results written before verdicts were counted
        return "yes" if flag else "NO"
    if counts["NO"]:
        return f"NO ({counts['NO']} of {sum(counts.values())})"
    return f"yes ({counts['near-tie']} near-tie)" if counts["near-tie"] else "yes"


def markdown_table(results: list[dict[str, Any]]) -> str:
    """The results as a Markdown table (one row per dataset, and per batch size N when some N > 1)."""
    batched = any(result.get("batch_size", 1) > 1 for result in results)
    trees = any(result.get("tree_size") or "tree_size_rates" in result for result in results)
    compiled = any(result.get("speedup_vs_compiled") is not None for result in results)
    lines = [
        "| dataset | prompts |" + (" N |" if batched else "")
        + " B |" + (" tree |" if trees else "") + " tau | plain tok/s |"
        + (" compiled plain tok/s |" if compiled else "") + " DFlash tok/s | prompt lookup tok/s"
        + " | Transformers DFlash tok/s | speedup |" + (" vs compiled |" if compiled else "") + " bound | lossless |",
        "|---|---:|" + ("---:|" if batched else "") + "---:|" + ("---:|" if trees else "")
        + "---:|---:|" + ("---:|" if compiled else "") + "---:|---:|---:|---:|" + ("---:|" if compiled else "")
        + "---:|---|",
    ]
    for result in results:
        rates = result["tokens_per_s"]
        refused = result.get("assisted_refused")  # Transformers' assisted decoding cannot run the target
        lookup = f"{rates['prompt_lookup']:.1f}" if "prompt_lookup" in rates else refused or "-"
        native = f"{rates['transformers_dflash']:.1f}" if "transformers_dflash" in rates else refused or "-"
        if result.get("lossless_prompt_lookup") is False:
            lookup += " (NOT lossless)"
        if result.get("lossless_transformers_dflash") is False:
            native += " (NOT lossless)"
        bound = f"{result['bound']:.2f}x" if result["bound"] is not None else "-"
        lossless = lossless_cell(result)
        batch = f" {result.get('batch_size', 1)} |" if batched else ""
        block = result["block_size"]
        if result.get("adaptive_verify"):  # drafted `block`, verified a worthwhile prefix of it per step
            block = f"{block} (adaptive, verified {result['mean_verified_length']:.2f})"
        tree = f"{result.get('tree_size') or 'chain'}" + (" (auto)" if "tree_size_rates" in result else "")
        versus = result.get("speedup_vs_compiled")
        compiled_rate = f" {rates['plain_compiled']:.1f} |" if "plain_compiled" in rates else " - |"
        if result.get("lossless_plain_compiled") is False:
            compiled_rate = compiled_rate[:-2] + " (NOT exact) |"
        lines.append(
            f"| {result['dataset']} | {result['num_prompts']} |{batch} {block} |"
            + (f" {tree} |" if trees else "") + f" {result['tau']:.2f} | {rates['plain']:.1f} |"
            + (compiled_rate if compiled else "") + f" {rates['dflash']:.1f} | {lookup} | {native} | "
            f"{result['speedup']:.2f}x |" + ((f" {versus:.2f}x |" if versus else " - |") if compiled else "")
            + f" {bound} | {lossless} |"
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
    tokens: GenerationTokens,
    on_result: Callable[[int, TurnRecord], None] | None = None,
    step_costs: StepCosts | None = None,
    cpu_kernels: bool | str | None = None,
    tree_size: int | None = None,
    compile: bool = False,
) -> dict[str, Any]:
    """`dflash-hf bench`'s greedy measurement of prompts one at a time: tau, tokens/s against `target.generate`,
    lossless.

    `tokens`: stop, pad and mask ids (`generation_tokens`). `on_result(prompt_index, record)` sees each prompt's
    record as soon as it is measured; the method that runs first rotates from prompt to prompt. `step_costs`:
    adaptive verify length (`spec_generate(step_costs=...)`); `tree_size`: trees (`spec_generate(tree_size=...)`);
    `compile`: the compiled verify (`spec_generate(compile=True)`) and compiled `generate` beside the eager one,
    both compiled by the untimed warm-up (its seconds: `warm_up_seconds`).
    """
    if not prompts:
        raise ValueError("evaluate_draft needs at least one prompt.")
    block_size = resolve_block_size(block_size, draft.block_size)
    settings = BenchSettings(max_new_tokens=max_new_tokens, block_size=block_size, prompt_lookup_tokens=None,
                             step_costs=step_costs, cpu_kernels=cpu_kernels, tree_size=tree_size, compile=compile)
    warm_up_seconds = warm_up(draft, target, prompts[:1], settings, tokens)
    records = []
    for index, prompt in enumerate(prompts):
        records += measure_prompts(draft, target, [prompt], settings, tokens, turn=index)
        if on_result is not None:
            on_result(index, records[-1])
    return {**summarize("evaluation", records, len(prompts), block_size, None, greedy=True, verify_costs=step_costs),
            "warm_up_seconds": warm_up_seconds}
