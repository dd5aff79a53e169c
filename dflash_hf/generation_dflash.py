"""The DFlash decoding loop: draft a block, verify it in one target pass, keep the longest match.

`speculative_decode` takes any proposer and reads as named stages: `prefill`, then per step `drop_finished`,
`compact_caches`, `plan_step`, `propose`, `shorten_step`, `verify`, `commit` and `keep_context`, then `finish` (a tree
step, `tree_size`: `plant_tree`, `verify_tree` and `commit_tree` in place of the middle three). A
`DecodeState` holds what one call changes; `DecodingSettings` (settings_dflash) what it was asked. `DecodeSession`
runs the stages one at a time (the cost model times them through it); `spec_generate` wires the loop to a DFlash
draft, and `DFlashGenerationMixin` gives a draft model its `spec_generate` method. See docs/architecture.md.

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

import threading
import time
import weakref
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Sequence

import torch

from .cache_dflash import (
    CacheColumns,
    check_cache,
    config_cache,
    crop_cache,
    full_history_cache,
    host_to_device,
    left_padded_positions,
    reorder_cache_columns,
    select_cache_rows,
    to_host,
)
from .devices_dflash import target_device, target_text_config
from .kernels_dflash import cpu_kernels
from .proposer_dflash import DFlashDraft, DFlashProposer, DraftStep, Proposal, Proposer
from .recurrent_dflash import PathPlan, RecurrentStates, recurrent_states, rollback_mixers
from .sampling_dflash import (
    commit_block,
    draw_uniforms,
    mean_acceptance_length,
    process_logits,
    sample_from,
    speculative_sample,
)
from .settings_dflash import DecodingSettings, StepCosts, resolve_settings
from .static_dflash import StaticVerifier, static_verifier
from .target_dflash import FeatureCapture, last_logits_only, verify_forward
from .tree_dflash import (
    MAX_CANDIDATES,
    DraftTree,
    build_trees,
    tree_attention_mask,
    walk_greedy,
    walk_sampled,
)
from .versions_dflash import cache_keyword, returned_cache


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

    def seen(self) -> TargetContext:
        """No new features: an empty context of the same rows (a copy, so the handed-over features can be freed)."""
        hidden = self.hidden.new_empty((self.hidden.shape[0], 0, self.hidden.shape[2]))
        return TargetContext(hidden, self.position_ids[:, :0].clone(), None)

    def select_rows(self, index: torch.Tensor) -> TargetContext:
        """The rows `index` [n'] of this context."""
        return TargetContext(self.hidden[index], self.position_ids[index],
                             None if self.valid is None else self.valid[index])


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
    recurrent: RecurrentStates | None = None  # a hybrid target's recurrent layers (rolled back after each verify)
    static: StaticVerifier | None = None  # compile=True: the compiled verify and its static cache (static_dflash)
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
    positions: torch.Tensor  # [n, b]: absolute positions s .. s + b - 1 (a tree: s + each column's depth)
    pending: torch.Tensor  # [n, 1]: the pending token of each row
    tree: DraftTree | None = None  # a tree step: the b - 1 drafted nodes of each row (tree_dflash)


# --- The stages -----------------------------------------------------------------------------------------------------


def pick_block(logits: torch.Tensor, rows: list[int], settings: DecodingSettings) -> torch.Tensor:
    """The target's tokens [n, b] for logits [n, b, V]: its argmax, or a sample per position (row i drawn with the
    generator of row rows[i])."""
    if settings.temperature == 0.0:
        return logits.argmax(dim=-1)
    probabilities = process_logits(logits.flatten(0, 1), settings.temperature, settings.top_k, settings.top_p)
    uniforms = draw_uniforms([settings.generators[row] for row in rows], logits.shape[1], logits.device)  # [n, b]
    return sample_from(probabilities.softmax(dim=-1).view(logits.shape), uniforms)


def prefill(target: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            layer_ids: list[int] | None, settings: DecodingSettings) -> DecodeState:
    """Run the target over the prompts [N, T]: its cache, the first token of every row, the features of the prompts."""
    config = target_text_config(target)
    rollback_mixers(target, config_cache(config))  # refuses, before any forward, a target it could not roll back
    cache_argument = cache_keyword(target)
    device = target_device(target)
    input_ids = input_ids.to(device)
    num_rows, width = input_ids.shape
    static = None if settings.compile is None else static_verifier(target, num_rows, layer_ids, settings.compile)
    if static is None:
        cache = full_history_cache(target, config)  # None: the target's own cache can be cropped
        cache_arguments = {} if cache is None else {cache_argument: cache}
    else:  # room for the prompts, every new token and one verify past the last
        cache = static.new_cache(width + settings.max_new_tokens + settings.block_size)
        cache_arguments = static.prefill_arguments(width)
    padded = attention_mask is not None and not bool(attention_mask.bool().all())
    valid = attention_mask.to(device).bool() if padded else torch.ones_like(input_ids, dtype=torch.bool)  # [N, T]
    prompts = [ids[-length:].tolist() for ids, length in zip(input_ids, valid.sum(dim=1).tolist())]
    for prompt, streamer in zip(prompts, settings.streamers or ()):
        streamer.put(torch.tensor([prompt]))
    synchronize(device)
    started = time.perf_counter()
    positions = {"position_ids": left_padded_positions(valid), **({"attention_mask": valid.long()} if padded else {})}
    with FeatureCapture(target, layer_ids, device) as capture:
        outputs = target(input_ids=input_ids, use_cache=True, **positions, **last_logits_only(target),
                         **capture.forward_arguments(), **cache_arguments)
    windowed = cache is not None and static is None  # the target counts its attention window in cache columns
    cache = returned_cache(outputs)
    if static is None:
        check_cache(cache, target, num_rows)
    features = capture.result(outputs)  # [N, T, L*H] or None
    state = DecodeState(
        input_ids=input_ids, prompts=prompts, generated=[], acceptance_lengths=[[] for _ in prompts],
        verified_lengths=[[] for _ in prompts], finished=[], active=list(range(num_rows)), cache=cache,
        cache_argument=cache_argument,
        columns=CacheColumns(valid, [len(prompt) for prompt in prompts], contiguous=windowed), layer_ids=layer_ids,
        context=None if features is None else TargetContext.of(features, left_padded_positions(valid),
                                                               valid if padded else None),
        started=started, recurrent=recurrent_states(target, cache), static=static,
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
    """Finished rows leave the batch, its caches and the proposer (a compiled verify's batch keeps its rows: their
    tokens are not committed); whether any row is still active."""
    still_active = [row for row in state.active if not state.finished[row]]
    if state.static is not None:
        return bool(still_active)
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


def compact_caches(state: DecodeState, settings: DecodingSettings) -> None:
    """Bounded memory: drop the target cache's holes once they pass the budget, or (a static cache) once the next
    verify would not fit; the proposer compacts its own."""
    if state.static is None:
        order = state.columns.compaction()
        if order is not None:
            reorder_cache_columns(state.cache, order)
        return
    order = state.columns.compaction(room=state.static.capacity - settings.block_size)
    if order is not None:
        state.static.reorder_columns(order)


def plan_step(state: DecodeState, settings: DecodingSettings) -> StepPlan:
    """The step's block: as wide as the block size, or what the longest active row still needs (a compiled verify:
    always the block size)."""
    remaining = [settings.max_new_tokens - len(state.generated[row]) for row in state.active]
    width = settings.block_size if state.static is not None else min(settings.block_size, max(remaining))
    starts = [len(state.prompts[row]) + len(state.generated[row]) - 1 for row in state.active]
    return StepPlan(
        width=width,
        counts=[max(min(width, left), 1) for left in remaining],  # 1: a finished row kept in a compiled batch
        positions=host_to_device(starts, state.device)[:, None] + torch.arange(width, device=state.device),
        pending=host_to_device([[state.generated[row][-1]] for row in state.active], state.device),
    )


def propose(proposer: Proposer | None, state: DecodeState, step: StepPlan, settings: DecodingSettings) -> Proposal:
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
        num_candidates=0 if settings.tree_size is None else min(MAX_CANDIDATES, settings.tree_size),
    )
    state.context = None if context is None else context.seen()  # handed over
    proposal = proposer.propose(draft_step)
    proposal = proposal if isinstance(proposal, Proposal) else Proposal(proposal)
    tokens = proposal.tokens.to(device=state.device, dtype=torch.long).reshape(len(state.active), step.width - 1)
    return Proposal(tokens, proposal.draft_probabilities, proposal.confidences, proposal.candidate_tokens,
                    proposal.candidate_probabilities)


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


def shorten_step(step: StepPlan, proposal: Proposal, settings: DecodingSettings) -> tuple[StepPlan, Proposal]:
    """With step costs: the step cut to `worthwhile_width` (the pending token and that many - 1 proposals)."""
    confidences = proposal.proposal_confidences()
    if settings.step_costs is None or confidences is None or step.width == 1:
        return step, proposal
    width = worthwhile_width(confidences, step.counts, settings.step_costs)
    if width == step.width:
        return step, proposal
    probabilities = proposal.draft_probabilities
    return (StepPlan(width, [min(width, count) for count in step.counts], step.positions[:, :width], step.pending),
            Proposal(proposal.tokens[:, : width - 1],
                     None if probabilities is None else probabilities[:, : width - 1]))


def verify(target: torch.nn.Module, state: DecodeState, step: StepPlan, proposal: Proposal,
           settings: DecodingSettings) -> torch.Tensor:
    """One target pass over [pending, proposals]: the target's tokens [n, b]; the features of every verified column
    become `state.context` (`keep_context` keeps the accepted ones). The cache grows in place.

    Positions are always passed: a cache's token counter is no source of positions (Transformers 5.25 reports a
    recurrent layer's count for the whole cache). The mask is passed only where columns are not positions (padding,
    holes).
    """
    mask = None if state.static is not None else state.columns.attention_mask(step.width)  # static: its own mask
    attention = {"position_ids": step.positions} if mask is None else {"attention_mask": mask.long(),
                                                                        "position_ids": step.positions}
    logits = target_pass(target, state, step, proposal, attention)
    return target_tokens(logits, proposal, state, step, settings)


def target_pass(target: torch.nn.Module, state: DecodeState, step: StepPlan, proposal: Proposal,
                attention: dict[str, torch.Tensor]) -> torch.Tensor:
    """The target over [pending, proposals] [n, b] with `attention` (mask and positions, or none): its logits
    [n, b, V]; the features of every verified column become `state.context`. The cache grows in place."""
    input_ids = torch.cat((step.pending, proposal.tokens), dim=1)  # [n, b]
    if state.static is not None:  # compile=True: the static-shape verify (static_dflash)
        logits, features = state.static.verify(input_ids, step.positions, state.columns.valid)
        state.context = None if features is None else TargetContext(features, step.positions, None)
        return logits
    capture = FeatureCapture(target, state.layer_ids, state.device)
    recording = nullcontext()
    if state.recurrent is not None:  # a hybrid target: its mixers run along a tree's paths
        tree_paths = None if step.tree is None else PathPlan.of(
            [step.tree.paths(row) for row in range(len(state.active))], step.width, state.device)
        recording = state.recurrent.recording(tree_paths)
    with recording:
        logits, outputs = verify_forward(
            target, capture,
            input_ids=input_ids,
            use_cache=True, **attention, **{state.cache_argument: state.cache},
        )
    features = capture.result(outputs)  # [n, b, L*H] or None
    del outputs  # its cache is state.cache; nothing else of it is kept
    state.context = None if features is None else TargetContext(features, step.positions, None)
    return logits.to(state.device)


# --- Tree steps (tree_dflash): the same stages with a tree of drafted tokens in place of a chain ---------------------


@dataclass
class TreeOutcome:
    """What a tree verify accepted: per row the path's columns (root excluded) and the target's token after it."""

    paths: list[list[int]]
    final_tokens: list[int]


def plant_tree(state: DecodeState, step: StepPlan, proposal: Proposal, settings: DecodingSettings
               ) -> tuple[StepPlan, Proposal]:
    """The step as a tree: the `tree_size` nodes of highest draft path probability per row (from the proposal's
    candidates), verified as columns 1 .. tree_size at the positions of their depths."""
    if proposal.candidate_tokens is None or proposal.candidate_probabilities is None:
        raise ValueError("tree_size needs the proposer's top tokens per position (Proposal.candidate_tokens and "
                         "candidate_probabilities, asked for by DraftStep.num_candidates); this proposer gave none.")
    transitions = proposal.candidate_transitions  # [n, b - 1, k, k] (DFlash2) or None
    candidates = to_host(proposal.candidate_tokens, proposal.candidate_probabilities, step.pending[:, 0],
                         *(() if transitions is None else (transitions,)))  # one device read: [n, b - 1, k], ...
    trees = build_trees(candidates[0].tolist(), candidates[1].tolist(), settings.tree_size,
                        [min(step.width - 1, count - 1) for count in step.counts], candidates[2].tolist(),
                        None if transitions is None else candidates[3].tolist())
    depths = host_to_device([[0] + depths for depths in trees.depths], state.device)  # [n, 1 + N]
    tree_step = StepPlan(1 + trees.size, step.counts, step.positions[:, :1] + depths, step.pending, trees)
    return tree_step, Proposal(host_to_device(trees.tokens, state.device), proposal.draft_probabilities)


def verify_tree(target: torch.nn.Module, state: DecodeState, step: StepPlan, proposal: Proposal,
                settings: DecodingSettings) -> TreeOutcome:
    """One target pass over the root and the tree's nodes (each sees its ancestors); the accepted path per row."""
    dtype = target.get_input_embeddings().weight.dtype
    mask = tree_attention_mask(step.tree, state.columns.valid if state.columns.has_holes else None,
                               state.columns.width, dtype if dtype.is_floating_point else torch.float32)
    logits = target_pass(target, state, step, proposal, {"attention_mask": mask, "position_ids": step.positions})
    trees, rows = step.tree, range(len(state.active))
    if settings.greedy:
        argmax = to_host(logits.argmax(dim=-1))[0].tolist()  # [n, 1 + N]: the step's one read after the verify
        paths = [walk_greedy(trees, row, argmax[row]) for row in rows]
        return TreeOutcome(paths, [argmax[row][path[-1] if path else 0] for row, path in zip(rows, paths)])
    probabilities = process_logits(logits.flatten(0, 1), settings.temperature, settings.top_k, settings.top_p)
    probabilities = probabilities.softmax(dim=-1).view(logits.shape)  # [n, 1 + N, V]: p at every column
    generators = [settings.generators[row] for row in state.active]
    child_uniforms = draw_uniforms(generators, trees.size, logits.device)  # [n, N]
    final_uniforms = draw_uniforms(generators, step.width, logits.device)  # [n, 1 + N]
    draft_probabilities = proposal.draft_probabilities  # [n, b - 1, V]: q the candidates were drawn from, or None
    # one device read; the walks then run on the host copies
    p, child_uniforms, final_uniforms, *q = to_host(probabilities, child_uniforms, final_uniforms,
                                                    *(() if draft_probabilities is None else (draft_probabilities,)))
    walks = [walk_sampled(trees, row, p[row], q[0][row] if q else None, child_uniforms[row].tolist(),
                          final_uniforms[row].tolist()) for row in rows]
    return TreeOutcome([path for path, _ in walks], [final for _, final in walks])


def commit_tree(state: DecodeState, step: StepPlan, outcome: TreeOutcome, settings: DecodingSettings) -> list[int]:
    """Append each row's accepted path and the target's token after it; mark finished rows; the accepted counts."""
    paths = [[step.tree.tokens[index][column - 1] for column in path] for index, path in enumerate(outcome.paths)]
    return commit_rows(state, step, paths, [path + [final] for path, final in zip(paths, outcome.final_tokens)],
                       settings)


def target_tokens(logits: torch.Tensor, proposal: Proposal, state: DecodeState, step: StepPlan,
                  settings: DecodingSettings) -> torch.Tensor:
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
    accepted, tokens = speculative_sample(proposal.tokens, proposal.draft_probabilities, probabilities, uniforms,
                                          limits)
    columns = torch.arange(step.width, device=logits.device)[None, :]  # [1, b]
    proposals = torch.nn.functional.pad(proposal.tokens, (0, 1), value=-1)  # [n, b]
    picked = torch.where(columns < accepted[:, None], proposals, -1)
    return torch.where(columns == accepted[:, None], tokens[:, None], picked)


def commit(state: DecodeState, step: StepPlan, proposal: Proposal, tokens_of_target: torch.Tensor,
           settings: DecodingSettings) -> list[int]:
    """Append each row's accepted proposals and the target's token; mark finished rows; the accepted counts."""
    proposed_and_target = torch.cat((proposal.tokens, tokens_of_target), dim=1).tolist()  # one device sync
    return commit_rows(state, step, [tokens[: step.width - 1] for tokens in proposed_and_target],
                       [tokens[step.width - 1 :] for tokens in proposed_and_target], settings)


def commit_rows(state: DecodeState, step: StepPlan, proposed: list[list[int]], target_tokens: list[list[int]],
                settings: DecodingSettings) -> list[int]:
    """Per active row, `commit_block` of its proposals and the target's tokens (a chain's, or a tree's accepted
    path): append what it commits, record the step, mark finished rows; the accepted counts (-1: a row that had
    finished before the step, which a compiled batch keeps; it keeps no column)."""
    accepted_counts = []
    for index, row in enumerate(state.active):
        if state.finished[row]:  # a compiled verify's batch keeps finished rows: they commit and keep nothing
            accepted_counts.append(-1)
            continue
        accepted, new_tokens, stopped = commit_block(proposed[index], target_tokens[index], step.counts[index],
                                                     settings.stop_token_ids)
        state.acceptance_lengths[row].append(accepted + 1)
        state.verified_lengths[row].append(step.width)
        state.generated[row].extend(new_tokens)
        state.finished[row] = stopped or len(state.generated[row]) >= settings.max_new_tokens
        accepted_counts.append(accepted)
        if settings.streamers:
            settings.streamers[row].put(torch.tensor(new_tokens))
    return accepted_counts


def keep_context(state: DecodeState, step: StepPlan, accepted_counts: list[int],
                 tree_paths: list[list[int]] | None = None) -> None:
    """Keep the verify columns of each row's pending token and accepted proposals: in the cache (a hybrid target's
    recurrent states advance over exactly those columns), and as new features. `tree_paths`: a tree's accepted
    columns per row (root excluded; default: a chain's, each row's first accepted + 1 columns)."""
    if tree_paths is None:
        accepted = host_to_device(accepted_counts, state.device)
        kept = torch.arange(max(accepted_counts) + 1, device=state.device)[None, :] <= accepted[:, None]  # [n, w]
    else:
        kept_rows = torch.zeros(len(tree_paths), step.width, dtype=torch.bool)
        kept_rows[:, 0] = True
        for row, path in enumerate(tree_paths):
            kept_rows[row, path] = True
        kept = kept_rows[:, : max((max(path, default=0) for path in tree_paths), default=0) + 1]
        kept = kept.to(state.device)  # [n, w]
    kept_width = kept.shape[1]
    state.columns.append(kept, [count + 1 for count in accepted_counts])
    if state.static is None:  # a static cache is cut back by its next verify
        crop_cache(state.cache, state.columns.width)
    if state.recurrent is not None:
        state.recurrent.advance([list(range(count + 1)) for count in accepted_counts] if tree_paths is None
                                else [[0] + path for path in tree_paths], state.columns.width)
    if state.context is None:
        return  # no proposer reads features, or this was the last step
    holes = kept_width * len(accepted_counts) != sum(accepted_counts) + len(accepted_counts)
    state.context = TargetContext.of(state.context.hidden[:, :kept_width], step.positions[:, :kept_width],
                                     kept if holes else None)


def finish(state: DecodeState, settings: DecodingSettings) -> SpecGenerateOutput:
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


# --- The loop --------------------------------------------------------------------------------------------------------

_CALL_LOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> the lock its calls hold
_CALL_LOCKS_GUARD = threading.Lock()


def call_lock(target: torch.nn.Module) -> threading.RLock:
    """The lock a generation call holds on its target: calls on one target from several threads run one at a time
    (a call hooks its layers for their features); other targets run concurrently."""
    with _CALL_LOCKS_GUARD:
        lock = _CALL_LOCKS.get(target)
        if lock is None:
            lock = _CALL_LOCKS[target] = threading.RLock()
        return lock


class DecodeSession:
    """One call of the loop, stage by stage, over one target: what `speculative_decode` runs, and what the cost model
    (`dflash_hf.cost_model`) times. Use inside `with session.running():`."""

    def __init__(self, target: torch.nn.Module, proposer: Proposer | None, settings: DecodingSettings) -> None:
        self.target, self.proposer, self.settings = target, proposer, settings
        self.layer_ids = proposer.target_layer_ids if proposer is not None and settings.block_size > 1 else None
        self.state: DecodeState | None = None

    @contextmanager
    def running(self) -> Iterator[DecodeSession]:
        """The call's scope: its target's lock and the CPU kernels (if on); both released when it ends, also after an
        exception."""
        with ExitStack() as scope:
            scope.enter_context(call_lock(self.target))
            scope.enter_context(cpu_kernels(self.settings.cpu_kernels))
            yield self

    @property
    def cache(self) -> Any:
        """The target's cache after the committed tokens (and the last verify's columns until `discard_verify`)."""
        return self.state.cache

    @property
    def cache_argument(self) -> str:
        """The target forward's keyword for the cache."""
        return self.state.cache_argument

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """The prompts' pass: the cache, the first token of every row, the prompts' features."""
        self.state = prefill(self.target, input_ids, attention_mask, self.layer_ids, self.settings)

    def plan(self, width: int | None = None) -> StepPlan:
        """The next step's block (at most `width` tokens per row; default: the call's block size)."""
        settings = self.settings if width is None else replace(self.settings, block_size=width)
        return plan_step(self.state, settings)

    def propose(self, step: StepPlan, tree_size: int | None = None) -> Proposal:
        """The proposer's tokens for the step (with each position's candidates for a tree of `tree_size`, default:
        the call's); it reads the features it has not seen (none after a draft pass)."""
        settings = self.settings if tree_size is None else replace(self.settings, tree_size=tree_size)
        return propose(self.proposer, self.state, step, settings)

    def verify(self, step: StepPlan, proposal: Proposal) -> torch.Tensor:
        """The target's tokens [n, b] over [pending, proposals]; the cache holds the verified columns meanwhile."""
        return verify(self.target, self.state, step, proposal, self.settings)

    def plant_tree(self, step: StepPlan, proposal: Proposal, tree_size: int) -> tuple[StepPlan, Proposal]:
        """The step as a tree of `tree_size` nodes from the proposal's candidates (`propose(step, tree_size)`)."""
        return plant_tree(self.state, step, proposal, replace(self.settings, tree_size=tree_size))

    def verify_tree(self, step: StepPlan, proposal: Proposal) -> TreeOutcome:
        """One target pass over a planted tree and each row's accepted path; the cache holds its columns meanwhile."""
        return verify_tree(self.target, self.state, step, proposal, self.settings)

    def discard_verify(self) -> None:
        """Forget the last verify (or any forward over the cache): the cache holds the committed columns again."""
        if self.state.static is None:  # a static cache is cut back by its next verify
            crop_cache(self.state.cache, self.state.columns.width)
        if self.state.recurrent is not None:
            self.state.recurrent.restore()
        context = self.state.context
        self.state.context = None if context is None else context.seen()

    def step(self) -> bool:
        """One draft-and-verify step over the active rows; False once every row has finished."""
        state, settings = self.state, self.settings
        if not drop_finished(state, self.proposer):
            return False
        compact_caches(state, settings)
        step = plan_step(state, settings)
        proposal = propose(self.proposer, state, step, settings)
        if settings.tree_size is not None and step.width > 1:
            step, proposal = plant_tree(state, step, proposal, settings)
            outcome = verify_tree(self.target, state, step, proposal, settings)
            accepted_counts = commit_tree(state, step, outcome, settings)
            keep_context(state, step, accepted_counts, outcome.paths)
            return True
        step, proposal = shorten_step(step, proposal, settings)
        tokens_of_target = verify(self.target, state, step, proposal, settings)
        accepted_counts = commit(state, step, proposal, tokens_of_target, settings)
        keep_context(state, step, accepted_counts)
        return True

    def finish(self) -> SpecGenerateOutput:
        """The output ids and statistics of the call."""
        return finish(self.state, self.settings)


@torch.no_grad()
def speculative_decode(
    target: torch.nn.Module,
    proposer: Proposer | None,
    input_ids: torch.Tensor,
    max_new_tokens: int | None = None,
    block_size: int | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    settings: DecodingSettings | None = None,
    **arguments: Any,
) -> SpecGenerateOutput:
    """Draft-and-verify decoding of N left-padded prompts [N, T] with any proposer; exact for every proposer.

    `settings`: as resolved by `settings_dflash.resolve_settings`; else it is resolved here from `max_new_tokens`,
    `block_size` and `arguments` (temperature, top_k, top_p, stop_token_ids, generator, seed, streamer, pad_token_id,
    step_costs, cpu_kernels, generation_config, ...) over the target's generation config.
    """
    if settings is None:
        settings = resolve_settings(target, input_ids, None, attention_mask=attention_mask,
                                    max_new_tokens=max_new_tokens, block_size=block_size, **arguments)
    session = DecodeSession(target, proposer, settings)
    with session.running():
        session.prefill(input_ids, attention_mask)
        while session.step():
            pass
    return session.finish()


# --- spec_generate: the loop with a DFlash draft ---------------------------------------------------------------------


def dflash_proposer(draft: DFlashDraft, target: torch.nn.Module, settings: DecodingSettings,
                    prompt_width: int = 0) -> DFlashProposer:
    """The proposer `spec_generate` runs: the draft with the call's mask id, acceptance rule and draft vocabulary
    (compiled: with a static context cache for prompts `prompt_width` wide)."""
    return DFlashProposer(draft, target, settings.mask_token_id, sample_proposals=settings.acceptance == "rejection",
                          draft_vocab=settings.draft_vocab, compile=settings.compile,
                          context_columns=prompt_width + settings.max_new_tokens + settings.block_size)


@torch.no_grad()
def spec_generate(
    draft: DFlashDraft,
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    *,
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
    cpu_kernels: bool | None = None,
    do_sample: bool | None = None,
    generation_config: Any = None,
    tree_size: int | None = None,
    compile: bool | dict[str, Any] = False,
    **generation_settings: Any,
) -> torch.Tensor | SpecGenerateOutput:
    """Generate with `target`, drafting blocks with `draft`; returns ids [N, prompt + new] (or stats too).

    Every setting is keyword-only and described once, in README "Reference: `spec_generate` arguments"; settings not
    passed come from `generation_config` (default: `target.generation_config`) as in `generate`. Each row equals the
    target's own greedy decode of its prompt (greedy) or follows its sampling distribution; batches are left-padded
    (`attention_mask`); see `SpecGenerateOutput`.
    """
    settings = resolve_settings(
        target, input_ids, draft, attention_mask=attention_mask, generation_config=generation_config,
        block_size=block_size, mask_token_id=mask_token_id, acceptance=acceptance, cpu_kernels=cpu_kernels,
        generator=generator, seed=seed, streamer=streamer, step_costs=step_costs, draft_vocab=draft_vocab,
        max_new_tokens=max_new_tokens, do_sample=do_sample, temperature=temperature, top_k=top_k, top_p=top_p,
        stop_token_ids=stop_token_ids, pad_token_id=pad_token_id, tree_size=tree_size, compile=compile,
        **generation_settings)
    result = speculative_decode(target, dflash_proposer(draft, target, settings, input_ids.shape[1]), input_ids,
                                attention_mask=attention_mask, settings=settings)
    return result if return_stats else result.output_ids


class DFlashGenerationMixin:
    """Gives a DFlash draft model its `spec_generate` method, as Transformers' models get `generate` from
    `GenerationMixin`."""

    def spec_generate(self, target: torch.nn.Module, input_ids: torch.Tensor,
                      **generation_kwargs: Any) -> torch.Tensor | SpecGenerateOutput:
        """Lossless speculative decoding with `target`: ids [N, prompt + new], or `SpecGenerateOutput` with stats.
        Every setting is a keyword argument of `generation_dflash.spec_generate` (documented there); what is not
        passed comes from the target's generation config, as in `generate`."""
        return spec_generate(self, target, input_ids, **generation_kwargs)
