"""The cost model: what one step of the loop costs on this machine, the block size (or adaptive verify width) worth
running, and whether the few-row CPU kernels pay here. It times the loop's own stages through
`generation_dflash.DecodeSession`, the loop's step API.

speedup <= tau * t(target, 1 token) / (t(target, B-token verify) + t(draft pass)); docs/architecture.md, "The cost
model". `bench`, `demo` and `train` choose "auto" and "adaptive" block sizes through `resolve_block_choice`; `demo`
chooses its CPU kernels through `choose_cpu_kernels`.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch

from .backends_dflash import TimedBackend
from .devices_dflash import target_device
from .generation_dflash import DecodeSession, dflash_proposer, synchronize
from .kernels_dflash import CPU_KERNEL_MODES, MAX_FEW_ROWS, cpu_kernels, few_row_product, is_plain_linear
from .modeling_dflash import DFlashDraftModel
from .proposer_dflash import Proposal, draft_vocab_ids, draft_vocabulary
from .settings_dflash import StepCosts, neutral_overrides, resolve_block_size, resolve_settings
from .steps_dflash import TreeStep, kept_mask
from .tree_dflash import tree_refusal

BLOCK_SIZE_CANDIDATES = (2, 3, 4, 6, 8, 12, 16)  # what "auto" chooses among (and the draft's trained size)
BLOCK_CHOICES = ("auto", "adaptive")
TREE_SIZE_CANDIDATES = (4, 8, 16, 32)  # what tree_size "auto" chooses among, and the chain
TREE_CALIBRATION_TOKENS = 64  # new tokens of each timed calibration run of tree_size "auto"


def prime_few_row_kernels(draft: DFlashDraftModel, target: torch.nn.Module, max_rows: int) -> int:
    """Time the few-row products (`kernels_dflash.few_row_product`) now, so that no timed run pays for choosing a
    kernel: the LM heads (the target's, the draft vocabulary's) for 1 .. `max_rows` rows, every other Linear shape of
    target and draft for 1 .. `MAX_FEW_ROWS` (a short prompt's first draft pass); how many products were primed."""
    heads = [target.get_output_embeddings()]
    head_weights = [(head.weight, head.bias) for head in heads if is_plain_linear(head)]
    vocabulary_ids = draft_vocab_ids(draft, None, heads[0].weight.shape[0])
    if vocabulary_ids is not None:
        vocabulary = draft_vocabulary(draft, heads[0], vocabulary_ids.to(heads[0].weight.device))
        heads.append(vocabulary.head)
        if vocabulary.called_head is None:
            head_weights.append((vocabulary.weight, vocabulary.bias))
    layer_weights = [(module.weight, module.bias) for model in (target, draft) for module in model.modules()
                     if is_plain_linear(module) and module not in heads]
    shapes: dict[Any, tuple[torch.Tensor, torch.Tensor | None, int]] = {}  # the kernel choice is made per shape
    for weights, rows in ((head_weights, max_rows), (layer_weights, MAX_FEW_ROWS)):
        for weight, bias in weights:
            key = (tuple(weight.shape), weight.dtype, weight.device)
            shapes[key] = (weight, bias, max(rows, shapes.get(key, (None, None, 0))[2]))
    with torch.no_grad(), cpu_kernels(True):
        for weight, bias, rows in shapes.values():
            for count in range(1, rows + 1):
                few_row_product(weight, bias, weight.new_zeros(count, weight.shape[1]))
    return sum(rows for _, _, rows in shapes.values())


class StepStages:
    """The loop's own stages, each ready to run once more after a prefilled context: one token of plain decoding, a
    chain verify of a given width, a tree verify of a given size, a draft pass. Built inside `session.running()`,
    after `session.prefill`; each run leaves the state as it found it once `discard` has run. A hybrid target's verify
    includes its state rollback over half the verified columns (a tree's: half its first root-to-leaf path)."""

    def __init__(self, session: DecodeSession) -> None:
        self.session, self.state = session, session.state
        if not isinstance(session.state.backend, TimedBackend):
            raise ValueError("The cost model times the eager loop's stages (a plain token, a verify and its keep, "
                             "each undone after): run its session with compile=False.")
        self.backend: TimedBackend = session.state.backend
        self.block = session.plan()
        self.proposal = session.propose(self.block)  # the draft reads the whole context once
        self.single = session.plan(1)

    def plain_token(self) -> Any:
        """One token of `generate`: the target's own forward, its full LM head over that token."""
        return self.backend.decode_token(self.single.pending, self.single.positions)

    def chain_verify(self, width: int) -> Callable[[], Any]:
        """A verify of `width` tokens per row (the pending token and the first width - 1 proposals)."""
        step = self.session.plan(width)
        shortened = Proposal(self.proposal.tokens[:, : width - 1])
        half = list(range(max(1, width // 2)))
        return lambda: self.advance([half] * len(self.state.active), self.session.verify(step, shortened))

    def tree_verify(self, tree_size: int) -> Callable[[], Any]:
        """The verify of a tree of `tree_size` drafted nodes per row, planted from the draft's candidates, with its
        greedy walk."""
        tree = TreeStep(tree_size)
        step, proposal = self.session.arrange(self.block, self.session.propose(self.block, tree), tree)
        paths = [step.tree.paths(row)[0] for row in range(len(self.state.active))]
        halves = [path[: max(1, len(path) // 2)] for path in paths]
        return lambda: self.advance(halves, self.session.verify(step, proposal, tree))

    def draft_pass(self) -> Any:
        """A draft pass over the cached context and the block."""
        return self.session.propose(self.block)

    def advance(self, kept_columns: list[list[int]], verdict: Any) -> Any:
        """What the loop's keep does after a verify (a hybrid target: its states rolled back to `kept_columns`)."""
        self.backend.keep(kept_columns, kept_mask(kept_columns, self.state.device))
        return verdict

    def discard(self) -> None:
        """What the last run added leaves the cache again."""
        self.session.discard_verify()


def median_seconds(stages: dict[Any, Callable[[], Any]], discard: Callable[[], None], device: torch.device,
                   repeats: int) -> dict[Any, float]:
    """Median seconds of each stage over `repeats` rounds after a warm-up round; the stages take turns, so that a
    slow spell of the machine spreads over all of them, and `discard` runs after each."""
    def seconds(run: Callable[[], Any]) -> float:
        synchronize(device)
        started = time.perf_counter()
        run()  # its outputs are not kept: freed here
        synchronize(device)
        elapsed = time.perf_counter() - started
        discard()
        return elapsed

    for run in stages.values():
        seconds(run)  # warm-up
    samples: dict[Any, list[float]] = {name: [] for name in stages}
    for _ in range(repeats):
        for name, run in stages.items():
            samples[name].append(seconds(run))
    return {name: statistics.median(values) for name, values in samples.items()}


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
    tree_sizes: tuple[int, ...] = (),
    cpu_kernels: bool | str | None = None,
) -> dict[str, Any]:
    """Median seconds after a context [1, T] copied to `batch_size` rows: "target_1" (one token of plain decoding per
    row), "draft" (a draft pass over a `block_size` block), "verify" {w: a w-token verify per row} and "tree_verify"
    {N: the verify of a tree of N drafted nodes per row, planted from the draft's candidates, with its greedy walk}.
    The stages are the loop's own (`StepStages`, through `DecodeSession`); `cpu_kernels` as `spec_generate` takes
    it."""
    input_ids = context_ids.repeat(batch_size, 1)
    settings = resolve_settings(target, input_ids, draft, block_size=block_size, max_new_tokens=block_size + 1,
                                mask_token_id=mask_token_id, temperature=0.0, stop_token_ids=[],
                                cpu_kernels=cpu_kernels,
                                **neutral_overrides(getattr(target, "generation_config", None)))
    session = DecodeSession(target, dflash_proposer(draft, target, settings), settings)
    with session.running():
        session.prefill(input_ids)
        stages = StepStages(session)
        runs: dict[Any, Callable[[], Any]] = {"target_1": stages.plain_token,
                                              **{width: stages.chain_verify(width) for width in verify_widths},
                                              **{("tree", size): stages.tree_verify(size) for size in tree_sizes}}
        if block_size > 1:  # a block of 1 drafts nothing
            runs["draft"] = stages.draft_pass
        medians = median_seconds(runs, stages.discard, input_ids.device, repeats)
    return {"target_1": medians["target_1"], "draft": medians.get("draft", 0.0),
            "verify": {width: medians[width] for width in verify_widths},
            "tree_verify": {size: medians[("tree", size)] for size in tree_sizes}}


def measure_step_costs(draft: DFlashDraftModel, target: torch.nn.Module, context_ids: torch.Tensor, block_size: int,
                       mask_token_id: int, repeats: int = 5, batch_size: int = 1,
                       cpu_kernels: bool | str | None = None) -> dict[str, float]:
    """The cost model's terms (median seconds, `time_step_stages`): "target_1", "target_block" (a `block_size`-token
    verify per row) and "draft"."""
    timings = time_step_stages(draft, target, context_ids, block_size, mask_token_id, [block_size], repeats,
                               batch_size, cpu_kernels=cpu_kernels)
    return {"target_1": timings["target_1"], "target_block": timings["verify"][block_size], "draft": timings["draft"]}


def measure_verify_costs(draft: DFlashDraftModel, target: torch.nn.Module, context_ids: torch.Tensor,
                         mask_token_id: int, block_size: int | None = None, repeats: int = 5,
                         batch_size: int = 1, cpu_kernels: bool | str | None = None) -> StepCosts:
    """This machine's `StepCosts` for `spec_generate(step_costs=...)`: a draft pass over a block (default: the
    draft's trained size) and a verify of every width 1 .. block (made non-decreasing), after a context [1, T]."""
    block_size = resolve_block_size(block_size, draft.block_size)
    timings = time_step_stages(draft, target, context_ids, block_size, mask_token_id, list(range(1, block_size + 1)),
                               repeats, batch_size, cpu_kernels=cpu_kernels)
    verify = nondecreasing([timings["verify"][width] for width in range(1, block_size + 1)])
    return StepCosts(timings["draft"], tuple(verify))


@torch.no_grad()
def choose_cpu_kernels(draft: DFlashDraftModel, target: torch.nn.Module, context_ids: torch.Tensor, block_size: int,
                       mask_token_id: int, batch_size: int = 1, rounds: int = 3
                       ) -> tuple[bool | str, dict[bool | str, dict[str, float]]]:
    """`cpu_kernels` for this machine and target: the mode (`kernels_dflash.CPU_KERNEL_MODES`: off, the LM heads
    only, every few-row product) in which a step (a `block_size`-token verify and a draft pass, after a context
    [1, T]) costs least. Returns (the mode, the step costs of each mode: the least of `rounds` medians of
    `measure_step_costs`, the modes taking turns). A target that does not compute on the CPU: (False, {}), nothing
    timed (the kernels never run there)."""
    if target_device(target).type != "cpu":
        return False, {}
    samples: dict[bool | str, list[dict[str, float]]] = {mode: [] for mode in CPU_KERNEL_MODES}
    for _ in range(rounds):
        for mode in CPU_KERNEL_MODES:
            samples[mode].append(measure_step_costs(draft, target, context_ids, block_size, mask_token_id,
                                                    repeats=3, batch_size=batch_size, cpu_kernels=mode))
    costs = {mode: {term: min(run[term] for run in runs) for term in runs[0]} for mode, runs in samples.items()}
    return min(costs, key=lambda mode: costs[mode]["target_block"] + costs[mode]["draft"]), costs


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


def acceptance_histogram(acceptance_lengths: list[int], block_size: int) -> list[int]:
    """Steps per acceptance length: entry k-1 counts the steps that committed k tokens (k = 1..B)."""
    histogram = [0] * block_size
    for length in acceptance_lengths:
        if not 1 <= length <= block_size:
            raise ValueError(f"acceptance length {length} is outside 1..{block_size}")
        histogram[length - 1] += 1
    return histogram


def truncated_tau(acceptance_histogram: list[int], block_size: int) -> float:
    """tau at a smaller block, from a histogram measured at the full block: the sum over k <= B of P(length >= k)."""
    total = sum(acceptance_histogram)
    if total == 0:
        raise ValueError("the acceptance histogram is empty: no draft/verify step was measured")
    return sum(sum(acceptance_histogram[k - 1 :]) for k in range(1, block_size + 1)) / total


@torch.no_grad()
def choose_block_size(draft: DFlashDraftModel, target: torch.nn.Module, context_ids: torch.Tensor,
                      acceptance_histogram: list[int], batch_size: int, mask_token_id: int,
                      cpu_kernels: bool | str | None = None) -> tuple[int, dict[int, float]]:
    """The block size with the best predicted speedup for `batch_size` rows on this machine, and every prediction.

    Prediction for B: truncated_tau(B) * t(1 token) / (t(B-token verify) + t(draft)), timed here at N rows;
    B = 1 is plain decoding by the same loop (1.0). Drafting shorter blocks is assumed to keep the acceptance
    of the positions it keeps.
    """
    candidates = sorted({b for b in BLOCK_SIZE_CANDIDATES if b <= draft.block_size} | {draft.block_size})
    predictions = {1: 1.0}
    for block_size in candidates:
        costs = measure_step_costs(draft, target, context_ids, block_size, mask_token_id, batch_size=batch_size,
                                   cpu_kernels=cpu_kernels)
        predictions[block_size] = cost_model_bound(truncated_tau(acceptance_histogram, block_size), costs)
    return max(predictions, key=predictions.get), predictions


@torch.no_grad()
def choose_tree_size(draft: DFlashDraftModel, target: torch.nn.Module, prompt: list[int], block_size: int,
                     max_new_tokens: int, batch_size: int, stop_token_ids: list[int], mask_token_id: int,
                     cpu_kernels: bool | str | None = None) -> tuple[int | None, dict[int, float]]:
    """tree_size "auto": the tree size (None: a chain) with the most tokens per second for `batch_size` copies of
    `prompt` on this machine, and the tokens/s of every candidate (0: the chain).

    Each candidate decodes `TREE_CALIBRATION_TOKENS` (at most `max_new_tokens`) greedily, once to warm up and once
    timed, the candidates taking turns; the measure holds both the tree's acceptance and its verify's cost. A draft
    or target that cannot verify trees (`spec_generate`'s refusal) gets the chain.
    """
    input_ids = torch.tensor([prompt] * batch_size, device=target_device(target))
    calibration_tokens = min(TREE_CALIBRATION_TOKENS, max_new_tokens)
    neutral = neutral_overrides(getattr(target, "generation_config", None))

    def tokens_per_second(tree_size: int | None) -> float:
        output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=calibration_tokens,
                                     block_size=block_size, temperature=0.0, stop_token_ids=stop_token_ids,
                                     mask_token_id=mask_token_id, tree_size=tree_size, return_stats=True,
                                     cpu_kernels=cpu_kernels, **neutral)
        return output.tokens_per_second

    candidates = [None, *(TREE_SIZE_CANDIDATES if tree_refusal(target, draft) is None else ())]
    for tree_size in candidates:  # the warm-up round
        tokens_per_second(tree_size)
    rates = {tree_size: tokens_per_second(tree_size) for tree_size in candidates}  # the timed round
    best = max(rates, key=rates.get)
    return best, {tree_size or 0: rate for tree_size, rate in rates.items()}


def typical_context(prompt: list[int], answer: list[int], device: torch.device) -> torch.Tensor:
    """Where the cost model is timed: the prompt and half of an answer, [1, T]."""
    return torch.tensor([prompt + answer[: max(len(answer) // 2, 1)]], device=device)


@dataclass(frozen=True)
class BlockChoice:
    """A resolved `--block-size`: the block to draft, and (adaptive) the step costs to verify a prefix of it by."""

    block_size: int
    step_costs: StepCosts | None = None  # "adaptive": each step verifies the prefix worth its cost
    predictions: dict[int, float] | None = None  # "auto": the predicted speedup of every candidate block size


def resolve_block_and_kernels(choice: int | str | None, draft: DFlashDraftModel, target: torch.nn.Module,
                              prompt: list[int], max_new_tokens: int, batch_size: int, stop_token_ids: list[int],
                              mask_token_id: int, cpu_kernels: bool | str | None,
                              time_kernels: Callable[[int], bool | str] | None = None
                              ) -> tuple[BlockChoice, bool | str | None]:
    """(`resolve_block_choice`'s block, the `cpu_kernels` mode to run it in). With `time_kernels` (`--cpu-kernels
    auto`: block size -> the mode cheapest at it), the modes are timed at the block given as a number, else (None,
    "auto", "adaptive") at the trained one, the block is chosen in that mode, and where "auto" picks another block they
    are timed again there; without, `cpu_kernels` is kept."""
    timed_block = draft.block_size if choice in BLOCK_CHOICES else resolve_block_size(choice, draft.block_size)
    if time_kernels is not None:
        cpu_kernels = time_kernels(timed_block)
    block = resolve_block_choice(choice, draft, target, prompt, max_new_tokens, batch_size, stop_token_ids,
                                 mask_token_id, cpu_kernels)
    if time_kernels is not None and block.block_size != timed_block:  # the mode that pays at the block that runs
        cpu_kernels = time_kernels(block.block_size)
    return block, cpu_kernels


@torch.no_grad()
def resolve_block_choice(choice: int | str | None, draft: DFlashDraftModel, target: torch.nn.Module,
                         prompt: list[int], max_new_tokens: int, batch_size: int, stop_token_ids: list[int],
                         mask_token_id: int, cpu_kernels: bool | str | None = None) -> BlockChoice:
    """A block size as `bench` and `demo` take it: an integer (None: the draft's trained size), "auto" (the best
    predicted for `batch_size` rows here) or "adaptive" (the trained block, verified by this machine's step costs).

    "auto" and "adaptive" are calibrated on one greedy run of `prompt` at the trained block: its acceptance histogram,
    and step costs timed after its typical context; `cpu_kernels` as `spec_generate` takes it."""
    if choice not in BLOCK_CHOICES:
        return BlockChoice(draft.block_size if choice is None else int(choice))
    device = target_device(target)
    calibration = draft.spec_generate(target=target, input_ids=torch.tensor([prompt], device=device),
                                      max_new_tokens=max_new_tokens, temperature=0.0, stop_token_ids=stop_token_ids,
                                      mask_token_id=mask_token_id, return_stats=True, cpu_kernels=cpu_kernels,
                                      **neutral_overrides(getattr(target, "generation_config", None)))
    context = typical_context(prompt, calibration.new_tokens(0), device)
    if choice == "adaptive":
        costs = measure_verify_costs(draft, target, context, mask_token_id, batch_size=batch_size,
                                     cpu_kernels=cpu_kernels)
        return BlockChoice(draft.block_size, step_costs=costs)
    histogram = acceptance_histogram(calibration.acceptance_lengths[0], draft.block_size)
    block_size, predictions = choose_block_size(draft, target, context, histogram, batch_size, mask_token_id,
                                                cpu_kernels)
    return BlockChoice(block_size, predictions=predictions)
