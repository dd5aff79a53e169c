"""Measuring a draft: time prompts with `generate` and DFlash, summarise (tau, tokens/s, speedup, lossless), and the
cost model built on the loop's own stage functions. `bench`, `train` and `demo` all measure through this module.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch

from .cache_dflash import crop_cache, left_pad
from .generation_dflash import (
    GenerationSettings,
    SpecGenerateOutput,
    StepCosts,
    TargetContext,
    dflash_proposer,
    plan_step,
    prefill,
    propose,
    synchronize,
    verify,
)
from .modeling_dflash import DFlashDraftModel
from .proposer_dflash import Proposal
from .sampling_dflash import cut_after_stop, mean_acceptance_length
from .target_dflash import (
    MAX_FEW_ROWS,
    few_row_product,
    grouped_query_attention,
    is_plain_linear,
    last_logits_only,
    neutral_overrides,
    target_device,
)

METHODS = ("plain", "dflash", "prompt_lookup", "transformers_dflash")  # the last: Transformers' own DFlash loop
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
    block_size: int | None = None  # None: the draft's trained block size
    temperature: float = 0.0
    prompt_lookup_tokens: int | None = 10  # None: skip prompt-lookup decoding
    seed: int = 0
    batch_size: int = 1  # prompts per generate / spec_generate call (left-padded); > 1 skips prompt lookup
    auto_block_size: bool = False  # per dataset: calibrate on its first prompt, then take choose_block_size's pick
    acceptance: str = "rejection"  # sampling: speculative (rejection) sampling, or the equality rule
    adaptive_verify: bool = False  # per dataset: time this machine's step costs, then verify the worthwhile prefix
    step_costs: StepCosts | None = None  # spec_generate's step_costs (set by run_benchmark when adaptive_verify)


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
    verify `block_size` tokens (and every method meets those widths) before anything is timed."""
    return replace(settings, max_new_tokens=2 * block_size + 1)


def prime_few_row_kernels(draft: DFlashDraftModel, target: torch.nn.Module, max_rows: int) -> int:
    """Time the few-row products (`few_row_product`) now, so that no timed run pays for choosing a kernel: the LM heads
    (the target's, the draft vocabulary's) for 1 .. `max_rows` rows, every other Linear shape of target and draft for
    1 .. `MAX_FEW_ROWS` (the draft's first pass reads a short prompt's rows); how many products were primed."""
    heads = [target.get_output_embeddings()]
    vocabulary = dflash_proposer(draft, target, draft.mask_token_id).vocab
    head_weights = [(head.weight, head.bias) for head in heads if is_plain_linear(head)]
    if vocabulary is not None and vocabulary.lm_head is None:
        head_weights.append((vocabulary.weight, vocabulary.bias))
    layer_weights = [(module.weight, module.bias) for model in (target, draft) for module in model.modules()
                     if is_plain_linear(module) and module not in heads]
    shapes: dict[Any, tuple[torch.Tensor, torch.Tensor | None, int]] = {}  # the kernel choice is made per shape
    for weights, rows in ((head_weights, max_rows), (layer_weights, MAX_FEW_ROWS)):
        for weight, bias in weights:
            key = (tuple(weight.shape), weight.dtype, weight.device)
            shapes[key] = (weight, bias, max(rows, shapes.get(key, (None, None, 0))[2]))
    for weight, bias, rows in shapes.values():
        for count in range(1, rows + 1):
            few_row_product(weight, bias, weight.new_zeros(count, weight.shape[1]))
    return sum(rows for _, _, rows in shapes.values())


def warm_up(draft: DFlashDraftModel, target: torch.nn.Module, prompts: list[list[int]], settings: BenchSettings,
            stop_token_ids: list[int], mask_token_id: int | None = None, native_draft: torch.nn.Module | None = None
            ) -> None:
    """The untimed warm-up before measuring: every method over `prompts` for two full blocks, kernels primed."""
    block_size = settings.block_size or draft.block_size
    prime_few_row_kernels(draft, target, len(prompts) * block_size)
    measure_prompts(draft, target, prompts, warm_up_settings(settings, block_size), stop_token_ids, mask_token_id,
                    native_draft)


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
    turn: int = 0,
) -> list[TurnRecord]:
    """Generate from N prompts at once (left-padded) with `generate`, DFlash and, for one prompt, prompt lookup and
    Transformers' own DFlash loop with `native_draft` (the same weights, `conversion.to_native`) when given.

    One record per row; each row carries 1/N of the batch's wall time, so summed seconds are wall time. The methods
    run in `method_order(..., turn)`; greedy records hold each method's `compare_outputs` verdict against "plain".
    """
    device = target_device(target)
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
            acceptance=settings.acceptance, step_costs=settings.step_costs, **neutral,
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
    timed = {method: _timed(methods[method], device, settings.seed) for method in method_order(list(methods), turn)}
    timed = {method: timed[method] for method in methods}  # records list the methods in the usual order
    return turn_records(target, prompts, timed, results[-1], greedy=settings.temperature == 0)


def turn_records(target: torch.nn.Module, prompts: list[list[int]],
                 timed: dict[str, tuple[list[list[int]], float]], dflash_result: Any, greedy: bool) -> list[TurnRecord]:
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


# --- The cost model ----------------------------------------------------------------------------------------------


@torch.no_grad()
def time_step_stages(
    draft: DFlashDraftModel,
    target: torch.nn.Module,
    context_ids: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    verify_widths: list[int],
    repeats: int = 5,
    batch_size: int = 1,
) -> dict[str, Any]:
    """Median seconds after a context [1, T] copied to `batch_size` rows: "target_1" (one token of plain decoding per
    row), "draft" (a draft pass over a `block_size` block) and "verify" {w: a w-token verify per row}.

    The verify and the draft pass are timed on the loop's own stages; the stages take turns, so that a slow spell of
    the machine spreads over all of them. Every output is dropped as soon as it is timed; between repetitions only
    the cache and the proposal are kept.
    """
    with grouped_query_attention(target):  # as in speculative_decode
        return _time_step_stages(draft, target, context_ids, block_size, mask_token_id, verify_widths, repeats,
                                 batch_size)


def _time_step_stages(draft: DFlashDraftModel, target: torch.nn.Module, context_ids: torch.Tensor, block_size: int,
                      mask_token_id: int, verify_widths: list[int], repeats: int, batch_size: int) -> dict[str, Any]:
    device = context_ids.device
    settings = GenerationSettings(max_new_tokens=block_size + 1, block_size=block_size,
                                  generators=(None,) * batch_size)
    proposer = dflash_proposer(draft, target, mask_token_id)  # spec_generate's, draft vocabulary included
    state = prefill(target, context_ids.repeat(batch_size, 1), None, proposer.target_layer_ids, settings)
    block = plan_step(state, settings)
    single = plan_step(state, replace(settings, block_size=1))
    hidden = state.context.hidden  # [N, T, L*H]: an empty copy, as a [:, :0] view would keep the prompt's features
    no_new_context = TargetContext(hidden.new_empty((hidden.shape[0], 0, hidden.shape[2])),
                                   state.context.position_ids[:, :0].clone(), None)
    del hidden
    proposal = propose(proposer, state, block, settings)  # hands the whole context to the draft
    last_only = last_logits_only(target)

    def plain_step() -> Any:  # one token of `generate`: the target's own forward, its full LM head over that token
        return target(input_ids=single.pending, position_ids=single.positions, use_cache=True, **last_only,
                      **{state.cache_argument: state.cache})

    def draft_pass() -> Proposal:
        state.context = no_new_context  # a pass over the cached context and the block
        return propose(proposer, state, block, settings)

    def verify_pass(width: int) -> Callable[[], Any]:
        step = plan_step(state, replace(settings, block_size=width))
        shortened = Proposal(proposal.tokens[:, : width - 1])
        return lambda: verify(target, state, step, shortened, settings)

    def seconds(run: Callable[[], Any]) -> float:
        synchronize(device)
        started = time.perf_counter()
        run()  # its outputs are not kept: freed here
        synchronize(device)
        elapsed = time.perf_counter() - started
        crop_cache(state.cache, state.columns.width)  # a verify's columns leave the cache again
        return elapsed

    stages: dict[Any, Callable[[], Any]] = {"target_1": plain_step, **{width: verify_pass(width) for width in verify_widths}}
    if block_size > 1:  # a block of 1 drafts nothing
        stages["draft"] = draft_pass
    for run in stages.values():
        seconds(run)  # warm-up
    samples: dict[Any, list[float]] = {name: [] for name in stages}
    for _ in range(repeats):
        for name, run in stages.items():
            samples[name].append(seconds(run))
    medians = {name: statistics.median(values) for name, values in samples.items()}
    return {"target_1": medians["target_1"], "draft": medians.get("draft", 0.0),
            "verify": {width: medians[width] for width in verify_widths}}


def measure_step_costs(
    draft: DFlashDraftModel,
    target: torch.nn.Module,
    context_ids: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    repeats: int = 5,
    batch_size: int = 1,
) -> dict[str, float]:
    """The cost model's terms (median seconds, `time_step_stages`): "target_1", "target_block" (a `block_size`-token
    verify per row) and "draft"."""
    timings = time_step_stages(draft, target, context_ids, block_size, mask_token_id, [block_size], repeats, batch_size)
    return {"target_1": timings["target_1"], "target_block": timings["verify"][block_size], "draft": timings["draft"]}


def measure_verify_costs(
    draft: DFlashDraftModel,
    target: torch.nn.Module,
    context_ids: torch.Tensor,
    mask_token_id: int,
    block_size: int | None = None,
    repeats: int = 5,
    batch_size: int = 1,
) -> StepCosts:
    """This machine's `StepCosts` for `spec_generate(step_costs=...)`: a draft pass over a block (default: the
    draft's trained size) and a verify of every width 1 .. block (made non-decreasing), after a typical context [1, T]
    (`typical_context`)."""
    block_size = block_size or draft.block_size
    timings = time_step_stages(draft, target, context_ids, block_size, mask_token_id, list(range(1, block_size + 1)),
                               repeats, batch_size)
    verify = nondecreasing([timings["verify"][width] for width in range(1, block_size + 1)])
    return StepCosts(timings["draft"], tuple(verify))


def nondecreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence in squared error (pool adjacent violators): verify times measured on a busy
    machine, where a wider verify sometimes times faster than a narrower one by chance."""
    pools: list[list[float]] = []  # [mean, count] per pool of adjacent values
    for value in values:
        pools.append([value, 1])
        while len(pools) > 1 and pools[-2][0] > pools[-1][0]:
            mean, count = pools.pop()
            pools[-1] = [(pools[-1][0] * pools[-1][1] + mean * count) / (pools[-1][1] + count), pools[-1][1] + count]
    return [mean for mean, count in pools for _ in range(int(count))]


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
def calibration_run(
    draft: DFlashDraftModel,
    target: torch.nn.Module,
    prompt: list[int],
    settings: BenchSettings,
    stop_token_ids: list[int],
    mask_token_id: int,
) -> SpecGenerateOutput:
    """One prompt, greedy, at the draft's full block: the acceptance and the answer the automatic choices rest on."""
    device = target_device(target)
    return draft.spec_generate(target=target, input_ids=torch.tensor([prompt], device=device),
                               max_new_tokens=settings.max_new_tokens, temperature=0.0, stop_token_ids=stop_token_ids,
                               mask_token_id=mask_token_id, return_stats=True,
                               **neutral_overrides(getattr(target, "generation_config", None)))


@torch.no_grad()
def calibrate_block_size(
    draft: DFlashDraftModel,
    target: torch.nn.Module,
    prompt: list[int],
    settings: BenchSettings,
    stop_token_ids: list[int],
    mask_token_id: int,
) -> tuple[int, dict[int, float]]:
    """`calibration_run` on one prompt for its acceptance histogram, then `choose_block_size` for N rows."""
    result = calibration_run(draft, target, prompt, settings, stop_token_ids, mask_token_id)
    histogram = acceptance_histogram(result.acceptance_lengths[0], draft.block_size)
    return choose_block_size(draft, target, typical_context(prompt, result.new_tokens(0), target_device(target)),
                             histogram, settings.batch_size, mask_token_id)


@torch.no_grad()
def calibrate_step_costs(
    draft: DFlashDraftModel,
    target: torch.nn.Module,
    prompt: list[int],
    settings: BenchSettings,
    stop_token_ids: list[int],
    mask_token_id: int,
) -> StepCosts:
    """`measure_verify_costs` for N rows at the draft's full block, after `calibration_run`'s typical context."""
    result = calibration_run(draft, target, prompt, settings, stop_token_ids, mask_token_id)
    context = typical_context(prompt, result.new_tokens(0), target_device(target))
    return measure_verify_costs(draft, target, context, mask_token_id, batch_size=settings.batch_size)


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
        "speedup_prompt_lookup": tokens_per_s["prompt_lookup"] / plain if plain > 0 and "prompt_lookup" in tokens_per_s else None,
        "speedup_transformers_dflash": tokens_per_s["transformers_dflash"] / plain
        if plain > 0 and "transformers_dflash" in tokens_per_s else None,
        "bound": bound,
        "step_costs_ms": {k: v * 1000 for k, v in step_costs.items()} if step_costs else None,
        "adaptive_verify": verify_costs is not None,
        "mean_verified_length": mean_acceptance_length(verified) if verified else None,
        "verify_costs_ms": None if verify_costs is None else
        {"draft": verify_costs.draft * 1000, "verify": [seconds * 1000 for seconds in verify_costs.verify]},
        "lossless": lossless["dflash"],
        "lossless_prompt_lookup": lossless.get("prompt_lookup"),
        "lossless_transformers_dflash": lossless.get("transformers_dflash"),
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
        lines.append(
            f"| {result['dataset']} | {result['num_prompts']} |{batch} {block} | {result['tau']:.2f} | "
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
    step_costs: StepCosts | None = None,
) -> dict[str, Any]:
    """`dflash-hf bench`'s greedy measurement of prompts one at a time: tau, tokens/s against `target.generate`, lossless.

    `on_result(prompt_index, record)` sees each prompt's record as soon as it is measured; the method that runs first
    rotates from prompt to prompt. `step_costs`: adaptive verify length (`spec_generate(step_costs=...)`).
    """
    if not stop_token_ids:
        raise ValueError("evaluate_draft needs a stop token (the first one also pads): see dflash_hf.generation_tokens.")
    settings = BenchSettings(max_new_tokens=max_new_tokens, block_size=block_size, prompt_lookup_tokens=None,
                             step_costs=step_costs)
    warm_up(draft, target, prompts[:1], settings, stop_token_ids)
    records = []
    for index, prompt in enumerate(prompts):
        records += measure_prompts(draft, target, [prompt], settings, stop_token_ids, turn=index)
        if on_result is not None:
            on_result(index, records[-1])
    return summarize("evaluation", records, len(prompts), block_size or draft.block_size, None, greedy=True,
                     verify_costs=step_costs)
