"""The DFlash decoding loop (design doc section 3): draft a block, verify it in one target pass, keep the longest match.

`speculative_decode` takes any proposer and reads as named stages: `prefill`, then per step `drop_finished`,
`compact_caches`, `plan_step`, `propose`, `shorten_step`, `verify`, `commit` and `keep_context`, then `finish`. A
`DecodeState` holds what one call changes; `GenerationSettings` what it was asked. `spec_generate` wires the loop to a
DFlash draft.

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import torch

from .cache_dflash import (
    CacheColumns,
    check_cache,
    crop_cache,
    cache_keyword,
    full_history_cache,
    host_to_device,
    left_padded_positions,
    reorder_cache_columns,
    returned_cache,
    select_cache_rows,
)
from .proposer_dflash import DFlashProposer, DraftStep, Proposal, Proposer, draft_vocab_ids
from .sampling_dflash import (
    commit_block,
    draw_uniforms,
    mean_acceptance_length,
    process_logits,
    sample_from,
    speculative_sample,
)
from .target_dflash import (
    FeatureCapture,
    check_draft_target,
    check_generation_inputs,
    drop_changed_packed_weights,
    grouped_query_attention,
    last_logits_only,
    resolve_generation_choices,
    target_device,
    target_text_config,
    verify_forward,
)

if TYPE_CHECKING:  # pragma: no cover
    from .modeling_dflash import DFlashDraftModel


@dataclass
class SpecGenerateOutput:
    """Output ids of one speculative generation over N rows (N = 1 included), with per-row statistics.

    Row i's new tokens are `output_ids[i, num_prompt_tokens : num_prompt_tokens + num_new_tokens[i]]`;
    after them the row is padded with `pad_token_id` up to the longest row.
    """

    output_ids: torch.Tensor  # [N, T + W]: the prompts as passed (left padding kept), then the new tokens
    num_prompt_tokens: int  # T: the prompt width, padding included
    num_new_tokens: list[int]  # per row: generated tokens, a final stop token included
    acceptance_lengths: list[list[int]]  # per row: tokens committed by each verify step the row took part in
    verified_lengths: list[list[int]] = field(default_factory=list)  # per row: tokens each of those steps verified
    time_to_first_token: float = 0.0  # seconds: prefill and the first token of every row
    total_time: float = 0.0  # seconds: the whole generation
    block_size: int = 1

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens of all rows (padding excluded)."""
        return sum(self.num_new_tokens)

    @property
    def new_token_ids(self) -> torch.Tensor:
        """The generated part [N, W], right-padded with pad_token_id where a row ended early."""
        return self.output_ids[:, self.num_prompt_tokens :]

    def new_tokens(self, row: int) -> list[int]:
        """Row `row`'s generated tokens, without padding."""
        return self.new_token_ids[row, : self.num_new_tokens[row]].tolist()

    @property
    def tau(self) -> float:
        """Mean acceptance length over every row's steps: tokens per draft/verify step (0.0 when none ran)."""
        return mean_acceptance_length(length for row in self.acceptance_lengths for length in row)

    @property
    def mean_verified_length(self) -> float:
        """Mean tokens verified per step over every row's steps (the block size, unless steps were shortened)."""
        return mean_acceptance_length(length for row in self.verified_lengths for length in row)

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens of all rows divided by the whole generation time."""
        return self.num_output_tokens / self.total_time if self.total_time > 0 else 0.0

    @property
    def time_per_output_token(self) -> float:
        """Seconds per token after the first, along the longest row."""
        longest = max(self.num_new_tokens, default=0)
        return (self.total_time - self.time_to_first_token) / max(longest - 1, 1)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (CUDA), so that wall-clock times are complete."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- What one call was asked, and what it changes ------------------------------------------------------------------


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one loop step measured on this machine at one batch size (`evaluation.measure_verify_costs`)."""

    draft: float  # a draft pass over the block
    verify: tuple[float, ...]  # verify[w - 1]: a target verify of w tokens per row, w = 1 .. block size

    def __post_init__(self) -> None:
        if not self.verify or min(self.verify) <= 0 or self.draft < 0:
            raise ValueError(f"StepCosts needs positive verify seconds for widths 1 .. B and a draft time >= 0; got "
                             f"draft {self.draft}, verify {self.verify}. Measure them with "
                             "dflash_hf.evaluation.measure_verify_costs.")


@dataclass(frozen=True)
class GenerationSettings:
    """What one call of the loop was asked (per-row generators and streamers already expanded)."""

    max_new_tokens: int
    block_size: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    stop_token_ids: frozenset[int] = frozenset()
    pad_token_id: int = 0
    generators: tuple[torch.Generator | None, ...] = ()  # one per row
    streamers: tuple[Any, ...] | None = None  # one per row
    step_costs: StepCosts | None = None  # given: each step verifies only the prefix of proposals worth its cost


@dataclass
class TargetContext:
    """Target features of positions the proposer has not seen yet."""

    hidden: torch.Tensor  # [n, C, L*H]; zero where `valid` is False
    position_ids: torch.Tensor  # [n, C]
    valid: torch.Tensor | None  # [n, C] bool; None: every column is a real position

    @classmethod
    def of(cls, hidden: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor | None) -> TargetContext:
        """Features with padding and rejected columns zeroed (they carry no signal)."""
        return cls(hidden if valid is None else torch.where(valid[..., None], hidden, 0.0), position_ids, valid)

    def select_rows(self, index: torch.Tensor) -> TargetContext:
        """The rows `index` [n'] of this context."""
        return TargetContext(self.hidden[index], self.position_ids[index], None if self.valid is None else self.valid[index])


@dataclass
class DecodeState:
    """Everything one call of the loop changes while it runs; rows are indexed as the caller passed them."""

    input_ids: torch.Tensor  # [N, T] as passed (left padding kept)
    prompts: list[list[int]]  # per row, without padding
    generated: list[list[int]]  # per row: committed tokens; the last one is pending
    acceptance_lengths: list[list[int]]  # per row: tokens committed by each verify step
    verified_lengths: list[list[int]]  # per row: tokens verified by each step
    finished: list[bool]
    active: list[int]  # rows still decoding, in the caches' row order
    cache: Any  # the target's KV cache, shared by the active rows
    cache_argument: str  # the forward keyword that takes it
    columns: CacheColumns  # which of its columns are each row's positions
    layer_ids: list[int] | None  # target layers the proposer reads (None: it needs no features)
    context: TargetContext | None  # features the proposer has not seen yet
    started: float  # perf_counter() at the prefill
    first_token_time: float = 0.0

    @property
    def device(self) -> torch.device:
        """The target's device."""
        return self.input_ids.device


@dataclass
class StepPlan:
    """One step's verify block over the active rows."""

    width: int  # b: tokens verified per row (the pending token and b - 1 proposals)
    counts: list[int]  # per row: positions it may still commit (max_new_tokens)
    positions: torch.Tensor  # [n, b]: absolute positions s .. s + b - 1
    pending: torch.Tensor  # [n, 1]: the pending token of each row


# --- The stages -----------------------------------------------------------------------------------------------------


def pick_block(logits: torch.Tensor, rows: list[int], settings: GenerationSettings) -> torch.Tensor:
    """The target's tokens [n, b] for logits [n, b, V]: its argmax, or a sample per position (row i drawn with the
    generator of row rows[i])."""
    if settings.temperature == 0.0:
        return logits.argmax(dim=-1)
    probabilities = process_logits(logits.flatten(0, 1), settings.temperature, settings.top_k, settings.top_p)
    uniforms = draw_uniforms([settings.generators[row] for row in rows], logits.shape[1], logits.device)  # [n, b]
    return sample_from(probabilities.softmax(dim=-1).view(logits.shape), uniforms)


def prefill(target: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            layer_ids: list[int] | None, settings: GenerationSettings) -> DecodeState:
    """Run the target over the prompts [N, T]: its cache, the first token of every row, the features of the prompts."""
    cache = full_history_cache(target, target_text_config(target))  # None: the target's own cache can be cropped
    cache_argument = cache_keyword(target)
    device = target_device(target)
    input_ids = input_ids.to(device)
    num_rows, width = input_ids.shape
    padded = attention_mask is not None and not bool(attention_mask.bool().all())
    valid = attention_mask.to(device).bool() if padded else torch.ones_like(input_ids, dtype=torch.bool)  # [N, T]
    prompts = [ids[-length:].tolist() for ids, length in zip(input_ids, valid.sum(dim=1).tolist())]
    for prompt, streamer in zip(prompts, settings.streamers or ()):
        streamer.put(torch.tensor([prompt]))
    synchronize(device)
    started = time.perf_counter()
    positions = {"attention_mask": valid.long(), "position_ids": left_padded_positions(valid)} if padded else {}
    with FeatureCapture(target, layer_ids, device) as capture:
        outputs = target(input_ids=input_ids, use_cache=True, **positions, **last_logits_only(target),
                         **capture.forward_arguments(), **({} if cache is None else {cache_argument: cache}))
    windowed = cache is not None  # the target counts its attention window in cache columns
    cache = returned_cache(outputs)
    check_cache(cache, target, num_rows)
    features = capture.result(outputs)  # [N, T, L*H] or None
    state = DecodeState(
        input_ids=input_ids, prompts=prompts, generated=[], acceptance_lengths=[[] for _ in prompts],
        verified_lengths=[[] for _ in prompts], finished=[], active=list(range(num_rows)), cache=cache,
        cache_argument=cache_argument,
        columns=CacheColumns(valid, [len(prompt) for prompt in prompts], contiguous=windowed), layer_ids=layer_ids,
        context=None if features is None else TargetContext.of(features, left_padded_positions(valid),
                                                               valid if padded else None),
        started=started,
    )
    first_tokens = pick_block(outputs.logits[:, -1:], state.active, settings)[:, 0].tolist()
    del outputs
    synchronize(device)
    state.first_token_time = time.perf_counter()
    state.generated = [[token] for token in first_tokens]
    state.finished = [token in settings.stop_token_ids or settings.max_new_tokens == 1 for token in first_tokens]
    for token, streamer in zip(first_tokens, settings.streamers or ()):
        streamer.put(torch.tensor([token]))
    return state


def drop_finished(state: DecodeState, proposer: Proposer | None) -> bool:
    """Finished rows leave the batch, its caches and the proposer; whether any row is still active."""
    still_active = [row for row in state.active if not state.finished[row]]
    if still_active and len(still_active) < len(state.active):
        keep = [state.active.index(row) for row in still_active]
        index = host_to_device(keep, state.device)
        select_cache_rows(state.cache, index)
        state.columns.select_rows(keep, index)
        if state.context is not None:
            state.context = state.context.select_rows(index)
        if hasattr(proposer, "select_rows"):
            proposer.select_rows(keep)
    state.active = still_active
    return bool(still_active)


def compact_caches(state: DecodeState) -> None:
    """Bounded memory: drop the target cache's holes once they pass the budget (the proposer compacts its own)."""
    order = state.columns.compaction()
    if order is not None:
        reorder_cache_columns(state.cache, order)


def plan_step(state: DecodeState, settings: GenerationSettings) -> StepPlan:
    """The step's block: as wide as the block size, or what the longest active row still needs."""
    remaining = [settings.max_new_tokens - len(state.generated[row]) for row in state.active]
    width = min(settings.block_size, max(remaining))
    starts = [len(state.prompts[row]) + len(state.generated[row]) - 1 for row in state.active]
    return StepPlan(
        width=width,
        counts=[min(width, left) for left in remaining],
        positions=host_to_device(starts, state.device)[:, None] + torch.arange(width, device=state.device),
        pending=host_to_device([[state.generated[row][-1]] for row in state.active], state.device),
    )


def propose(proposer: Proposer | None, state: DecodeState, step: StepPlan, settings: GenerationSettings) -> Proposal:
    """The proposer's tokens [n, b - 1] for the step (and their q, if it sampled them); it gets the new features."""
    if step.width == 1:
        return Proposal(step.pending[:, :0])
    context = state.context
    draft_step = DraftStep(
        prompts=[state.prompts[row] for row in state.active],
        generated=[state.generated[row] for row in state.active],
        target_hidden=None if context is None else context.hidden,
        context_position_ids=None if context is None else context.position_ids,
        context_valid=None if context is None else context.valid,
        block_size=step.width,
        row_ids=list(state.active),
        block_position_ids=step.positions,
        pending_ids=step.pending[:, 0],
        temperature=settings.temperature,
        top_k=settings.top_k,
        top_p=settings.top_p,
        generators=tuple(settings.generators[row] for row in state.active),
        score_proposals=settings.step_costs is not None,
    )
    state.context = None  # handed over
    proposal = proposer.propose(draft_step)
    proposal = proposal if isinstance(proposal, Proposal) else Proposal(proposal)
    tokens = proposal.tokens.to(device=state.device, dtype=torch.long).reshape(len(state.active), step.width - 1)
    return Proposal(tokens, proposal.draft_probabilities, proposal.confidences)


def worthwhile_width(confidences: torch.Tensor, counts: list[int], costs: StepCosts) -> int:
    """The verify width w (1 .. b) with the most expected tokens per second for draft confidences [n, b - 1].

    A row expects 1 + the sum over k < w of the draft's cumulative confidence in its first k proposals (at most its
    count); a step costs the draft pass and a w-token verify. The width never changes which tokens are committed.
    """
    num_rows, width = confidences.shape[0], confidences.shape[1] + 1
    survival = confidences.float().cumprod(dim=1)  # [n, b - 1]: P(the first k proposals are all accepted)
    usable = torch.arange(1, width, device=survival.device)[None, :] < host_to_device(counts, survival.device)[:, None]
    expected = torch.cat((survival.new_ones(num_rows, 1), (survival * usable).cumsum(dim=1) + 1), dim=1)  # [n, b]
    seconds = torch.tensor(costs.verify[:width], device=survival.device) + costs.draft  # [b]
    return int((expected.sum(dim=0) / seconds).argmax()) + 1


def shorten_step(step: StepPlan, proposal: Proposal, settings: GenerationSettings) -> tuple[StepPlan, Proposal]:
    """With step costs: the step cut to `worthwhile_width` (the pending token and that many - 1 proposals)."""
    confidences = proposal.proposal_confidences()
    if settings.step_costs is None or confidences is None or step.width == 1:
        return step, proposal
    width = worthwhile_width(confidences, step.counts, settings.step_costs)
    if width == step.width:
        return step, proposal
    probabilities = proposal.draft_probabilities
    return (StepPlan(width, [min(width, count) for count in step.counts], step.positions[:, :width], step.pending),
            Proposal(proposal.tokens[:, : width - 1], None if probabilities is None else probabilities[:, : width - 1]))


def verify(target: torch.nn.Module, state: DecodeState, step: StepPlan, proposal: Proposal,
           settings: GenerationSettings) -> torch.Tensor:
    """One target pass over [pending, proposals]: the target's tokens [n, b]; the features of every verified column
    become `state.context` (`keep_context` keeps the accepted ones). The cache grows in place.

    Positions are passed only where columns are not positions (padding, holes): without them, Transformers'
    flash-attention path checks the position ids for packed sequences in every layer, which waits for the device.
    """
    mask = state.columns.attention_mask(step.width)
    holes = {} if mask is None else {"attention_mask": mask.long(), "position_ids": step.positions}
    capture = FeatureCapture(target, state.layer_ids, state.device)
    logits, outputs = verify_forward(
        target, capture,
        input_ids=torch.cat((step.pending, proposal.tokens), dim=1),  # [n, b]
        use_cache=True, **holes, **{state.cache_argument: state.cache},
    )
    features = capture.result(outputs)  # [n, b, L*H] or None
    del outputs  # its cache is state.cache; nothing else of it is kept
    state.context = None if features is None else TargetContext(features, step.positions, None)
    return target_tokens(logits.to(state.device), proposal, state, step, settings)


def target_tokens(logits: torch.Tensor, proposal: Proposal, state: DecodeState, step: StepPlan,
                  settings: GenerationSettings) -> torch.Tensor:
    """The target's token at each verified position [n, b], from its logits [n, b, V].

    Without q: its argmax or its sample at every position (a proposal is kept when it equals it). With q: speculative
    sampling, so the row holds the accepted proposals, then the residual's (or p's) sample, then -1.
    """
    if proposal.draft_probabilities is None:
        return pick_block(logits, state.active, settings)
    probabilities = process_logits(logits.flatten(0, 1), settings.temperature, settings.top_k, settings.top_p)
    probabilities = probabilities.softmax(dim=-1).view(logits.shape)  # [n, b, V]: p
    uniforms = draw_uniforms([settings.generators[row] for row in state.active], step.width, logits.device)
    limits = host_to_device([count - 1 for count in step.counts], logits.device)  # what max_new_tokens lets a row keep
    accepted, tokens = speculative_sample(proposal.tokens, proposal.draft_probabilities, probabilities, uniforms, limits)
    columns = torch.arange(step.width, device=logits.device)[None, :]  # [1, b]
    proposals = torch.nn.functional.pad(proposal.tokens, (0, 1), value=-1)  # [n, b]
    picked = torch.where(columns < accepted[:, None], proposals, -1)
    return torch.where(columns == accepted[:, None], tokens[:, None], picked)


def commit(state: DecodeState, step: StepPlan, proposal: Proposal, tokens_of_target: torch.Tensor,
           settings: GenerationSettings) -> list[int]:
    """Append each row's accepted proposals and the target's token; mark finished rows; the accepted counts."""
    proposed_and_target = torch.cat((proposal.tokens, tokens_of_target), dim=1).tolist()  # one device sync
    accepted_counts = []
    for index, row in enumerate(state.active):
        tokens = proposed_and_target[index]
        accepted, new_tokens, stopped = commit_block(tokens[: step.width - 1], tokens[step.width - 1 :],
                                                     step.counts[index], settings.stop_token_ids)
        state.acceptance_lengths[row].append(accepted + 1)
        state.verified_lengths[row].append(step.width)
        state.generated[row].extend(new_tokens)
        state.finished[row] = stopped or len(state.generated[row]) >= settings.max_new_tokens
        accepted_counts.append(accepted)
        if settings.streamers:
            settings.streamers[row].put(torch.tensor(new_tokens))
    return accepted_counts


def keep_context(state: DecodeState, step: StepPlan, accepted_counts: list[int]) -> None:
    """Keep the verify columns of each row's pending token and accepted proposals: in the cache, and as new features."""
    kept_width = max(accepted_counts) + 1
    accepted = host_to_device(accepted_counts, state.device)
    kept = torch.arange(kept_width, device=state.device)[None, :] <= accepted[:, None]  # [n, kept_width]
    state.columns.append(kept, [count + 1 for count in accepted_counts])
    crop_cache(state.cache, state.columns.width)
    if state.context is None:
        return  # no proposer reads features, or this was the last step
    holes = kept_width * len(accepted_counts) != sum(accepted_counts) + len(accepted_counts)
    state.context = TargetContext.of(state.context.hidden[:, :kept_width], step.positions[:, :kept_width],
                                     kept if holes else None)


def finish(state: DecodeState, settings: GenerationSettings) -> SpecGenerateOutput:
    """The output ids (prompts as passed, then each row's tokens right-padded) and the statistics."""
    for streamer in settings.streamers or ():
        streamer.end()
    synchronize(state.device)
    ended = time.perf_counter()
    num_new_tokens = [len(tokens) for tokens in state.generated]
    width = max(num_new_tokens)
    new_ids = host_to_device([tokens + [settings.pad_token_id] * (width - len(tokens)) for tokens in state.generated],
                             state.device, state.input_ids.dtype)  # [N, W]
    return SpecGenerateOutput(
        output_ids=torch.cat((state.input_ids, new_ids), dim=1),
        num_prompt_tokens=state.input_ids.shape[1],
        num_new_tokens=num_new_tokens,
        acceptance_lengths=state.acceptance_lengths,
        verified_lengths=state.verified_lengths,
        time_to_first_token=state.first_token_time - state.started,
        total_time=ended - state.started,
        block_size=settings.block_size,
    )


# --- The loop ----------------------------------------------------------------------------------------------------------


@torch.no_grad()
def speculative_decode(
    target: torch.nn.Module,
    proposer: Proposer | None,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    block_size: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_token_ids: list[int] | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    attention_mask: torch.Tensor | None = None,
    streamers: Sequence[Any] | None = None,
    pad_token_id: int = 0,
    step_costs: StepCosts | None = None,
) -> SpecGenerateOutput:
    """Draft-and-verify decoding of N left-padded prompts [N, T] (design doc section 3); exact for any proposer.

    `generator` is one generator for the batch or one per row; `streamers` has one streamer per row. `step_costs`
    (widths 1 .. block_size): each step verifies only the prefix of proposals worth its cost (`shorten_step`).
    """
    if step_costs is not None and len(step_costs.verify) < block_size:
        raise ValueError(f"step_costs times verify widths 1 .. {len(step_costs.verify)} but block_size is {block_size}; "
                         "measure them at this block size (dflash_hf.evaluation.measure_verify_costs).")
    device = target_device(target)
    settings = GenerationSettings(
        max_new_tokens=max_new_tokens, block_size=block_size, temperature=temperature, top_k=top_k, top_p=top_p,
        stop_token_ids=frozenset(stop_token_ids or ()), pad_token_id=pad_token_id,
        generators=row_generators(generator, input_ids.shape[0], device),
        streamers=None if streamers is None else tuple(streamers), step_costs=step_costs,
    )
    layer_ids = proposer.target_layer_ids if proposer is not None and block_size > 1 else None
    drop_changed_packed_weights()  # a weight changed through `.data` since the last call is packed again
    with grouped_query_attention(target):  # CPU: a verify's attention without copies of the key/value heads
        state = prefill(target, input_ids, attention_mask, layer_ids, settings)
        while drop_finished(state, proposer):
            compact_caches(state)
            step = plan_step(state, settings)
            proposal = propose(proposer, state, step, settings)
            step, proposal = shorten_step(step, proposal, settings)
            tokens_of_target = verify(target, state, step, proposal, settings)
            accepted_counts = commit(state, step, proposal, tokens_of_target, settings)
            keep_context(state, step, accepted_counts)
    return finish(state, settings)


# --- spec_generate: the loop with a DFlash draft ----------------------------------------------------------------------


def _as_streamers(streamer: Any, num_rows: int) -> list[Any] | None:
    """One streamer per row: a streamer for a batch of one, or a list of N streamers."""
    if streamer is None:
        return None
    streamers = list(streamer) if isinstance(streamer, (list, tuple)) else [streamer]
    if len(streamers) != num_rows:
        raise ValueError(
            f"Got {len(streamers)} streamer(s) for a batch of {num_rows}: a streamer receives one row; "
            "pass a list with one streamer per row."
        )
    for item in streamers:
        if not (callable(getattr(item, "put", None)) and callable(getattr(item, "end", None))):
            raise TypeError(f"streamer {type(item).__name__} lacks put()/end() (Transformers' streamer protocol).")
    return streamers


def row_generators(generator: torch.Generator | Sequence[torch.Generator] | None, num_rows: int,
                   device: torch.device, seed: int | None = None) -> tuple[torch.Generator | None, ...]:
    """One sampling generator per row: the given one shared, one per row as given, or a new one seeded with `seed`."""
    if generator is None and seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    if isinstance(generator, (list, tuple)) and len(generator) != num_rows:
        raise ValueError(f"Got {len(generator)} generators for a batch of {num_rows}: pass one, or one per row.")
    generators = tuple(generator) if isinstance(generator, (list, tuple)) else (generator,) * num_rows
    for item in generators:
        if item is not None and item.device.type != device.type:
            raise ValueError(f"generator is on {item.device} but the target runs on {device}.")
    return generators


def dflash_proposer(draft: DFlashDraftModel, target: torch.nn.Module, mask_token_id: int,
                    acceptance: str = "rejection", draft_vocab: bool | Sequence[int] | torch.Tensor | None = None
                    ) -> DFlashProposer:
    """The proposer `spec_generate` runs: the draft with its mask id, acceptance rule and draft vocabulary (None: the
    config's)."""
    vocab_size = target.get_output_embeddings().weight.shape[0]
    return DFlashProposer(draft, target, mask_token_id, sample_proposals=acceptance == "rejection",
                          draft_vocab=draft_vocab_ids(draft, draft_vocab, vocab_size))


@torch.no_grad()
def spec_generate(
    draft: DFlashDraftModel,
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_token_ids: list[int] | int | None = None,
    block_size: int | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    seed: int | None = None,
    mask_token_id: int | None = None,
    attention_mask: torch.Tensor | None = None,
    streamer: Any = None,
    pad_token_id: int | None = None,
    return_stats: bool = False,
    acceptance: str = "rejection",
    draft_vocab: bool | Sequence[int] | torch.Tensor | None = None,
    step_costs: StepCosts | None = None,
    do_sample: bool | None = None,
    generation_config: Any = None,
    **generation_settings: Any,
) -> torch.Tensor | SpecGenerateOutput:
    """Generate with `target`, drafting blocks with `draft`; returns ids [N, prompt + new] (or stats too).

    Settings not passed come from `generation_config` (default: `target.generation_config`) as in `generate`: length,
    sampling, every EOS id as a stop token, padding. Each row equals the target's own greedy decode of its prompt
    (greedy) or follows its sampling distribution. Batches are left-padded (`attention_mask`); see `SpecGenerateOutput`.
    When sampling, `acceptance="rejection"` samples the draft's proposals and keeps them by speculative sampling;
    `"equality"` proposes the draft's argmax and keeps a proposal when the target samples the same token.
    `draft_vocab`: the token ids the draft proposes from (None: its config's `draft_vocab` if any; False: every token);
    verification is unchanged, so the output stays the target's own. `step_costs` (this machine's, from
    `dflash_hf.evaluation.measure_verify_costs`): each step verifies only the prefix of the drafted block whose expected
    tokens pay for its verify time; the output is the same, only the verified lengths change.
    """
    if acceptance not in ("rejection", "equality"):
        raise ValueError(f"acceptance must be 'rejection' or 'equality', got {acceptance!r}.")
    choices = resolve_generation_choices(
        target, input_ids.shape[-1] if isinstance(input_ids, torch.Tensor) else 0, generation_config,
        max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
        stop_token_ids=stop_token_ids, pad_token_id=pad_token_id, **generation_settings)
    check_generation_inputs(target, input_ids, choices.max_new_tokens, choices.temperature, choices.top_k,
                            choices.top_p, attention_mask)
    mask_token_id = check_draft_target(draft, target, mask_token_id, input_ids.shape[1] + choices.max_new_tokens)
    block_size = draft.block_size if block_size is None else block_size
    if not isinstance(block_size, int) or not 1 <= block_size <= draft.block_size:
        raise ValueError(f"block_size must be an integer from 1 to the draft's trained size {draft.block_size}, got {block_size!r}.")
    num_rows = input_ids.shape[0]
    device = target_device(target)
    result = speculative_decode(
        target, dflash_proposer(draft, target, mask_token_id, acceptance, draft_vocab), input_ids,
        max_new_tokens=choices.max_new_tokens, block_size=block_size, temperature=choices.temperature,
        top_k=choices.top_k, top_p=choices.top_p, stop_token_ids=choices.stop_token_ids,
        generator=row_generators(generator, num_rows, device, seed if choices.temperature > 0 else None),
        attention_mask=attention_mask, streamers=_as_streamers(streamer, num_rows), pad_token_id=choices.pad_token_id,
        step_costs=step_costs,
    )
    return result if return_stats else result.output_ids
