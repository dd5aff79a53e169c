"""One draft-and-verify step over the live rows, and its two strategies: a chain and a tree.

A step runs `plan_step` (the block's positions), `propose` (the proposer's tokens for it), then its strategy's
`arrange` (a chain: cut where the proposer cut its rows, then to a worthwhile width when step costs are given; a
tree: planted from the draft's candidates) and `verify` (one target pass; what it judged, as a `Verdict`), then
`commit` (the committed tokens) and `keep_context` (the cache columns and features of what was committed).

Two seams meet here (docs/architecture.md, "The target backend"). The proposer (`proposer_dflash.Proposer`; a DFlash
draft's reaches its draft through `draft_backends_dflash.DraftBackend`) drafts; the target's side is the call's
backend (`backends_dflash.TargetBackend`, `DecodeState.backend`: eager or compiled, either wrapped in a hybrid
target's recurrent rollback), whose methods the stages call without asking which it is. A strategy hands the backend
a `masks_dflash.VerifyLayout` (positions, what each column sees, a tree's paths), never its tree. Every stage sees
the live rows only (`DecodeState.active`): a row that ended leaves them before the next step, on every backend. What
the loop records (tokens, lengths, which rows ended) changes in `commit`; the backend's cache grows in `verify`, and
`keep_context` tells it which columns to keep (the eager cache is cropped to them there; the compiled one overwrites
the rest at its next verify); `propose` hands the unseen features to the proposer.

`ChainStep` and `TreeStep` are the strategies (`StepStrategy`), as `CandidateGenerator`s are in Transformers'
assisted decoding: each has its own arrange and verify, and a tree's one-token block (the last) is a tree of the root
alone. One shared stage still reads a tree: `position_prefixes` (the prefix of each verify column, for the call's
processors) follows `StepPlan.tree`'s paths. `generation_dflash.DecodeSession` runs the steps.

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Protocol

import torch

from .backends_dflash import TargetBackend
from .cache_dflash import host_to_device, to_host
from .masks_dflash import VerifyLayout
from .processors_dflash import PositionRules
from .proposer_dflash import DraftStep, Proposal, Proposer, SampledProposal
from .sampling_dflash import commit_block, draw_uniforms, process_logits, sample_from, speculative_sample
from .settings_dflash import DecodingSettings, StepCosts
from .tree_dflash import (
    MAX_CANDIDATES,
    DraftTree,
    build_trees,
    column_paths,
    tree_sees,
    walk_greedy,
    walk_sampled,
)

# --- What a step reads and changes -----------------------------------------------------------------------------------


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
    finished: list[bool]  # per row: it ended (a stop, a criterion, its length); it leaves `active` next step
    active: list[int]  # the live rows, in the order of every stage's batch: the backend's, the proposer's, a verdict's
    backend: TargetBackend  # the target's cache and verify (backends_dflash)
    layer_ids: list[int] | None  # target layers the proposer reads (None: it needs no features)
    context: TargetContext | None  # features the proposer has not seen yet
    started: float  # perf_counter() at the prefill
    first_token_time: float = 0.0
    scores: list[list[torch.Tensor]] = field(default_factory=list)  # per row: [k, V] processed scores per commit
    logits: list[list[torch.Tensor]] = field(default_factory=list)  # per row: [k, V] raw logits per commit

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


@dataclass
class Verdict:
    """What one verify judged, per active row: the proposals in the order the target judged them, the target's token
    at each of those positions and one after, and the verify columns they sit in."""

    proposed: list[list[int]]  # per row: a chain's b - 1 proposals, or a tree's path to the accepted leaf
    target_tokens: list[list[int]]  # per row: the target's token after the pending one and after each of `proposed`
    columns: list[list[int]]  # per row: the verify column of each of `proposed` (a chain: 1 .. b - 1)
    features: torch.Tensor | None  # [n, b, L*H]: the target features of every verified column (None: not read)
    scores: torch.Tensor | None = None  # [n, b, V]: processed scores, kept for criteria and outputs (rules)
    logits: torch.Tensor | None = None  # [n, b, V]: raw logits, kept when the call returns them


# --- The stages every strategy shares --------------------------------------------------------------------------------


def target_scores(logits: torch.Tensor, prefixes: Callable[[], list[list[torch.Tensor | None]]], rows: list[int],
                  settings: DecodingSettings) -> torch.Tensor:
    """`generate`'s scores [n, b, V] at each verified position from the target's logits [n, b, V] (rows: the call's
    rows): the call's processors and warpers at each position, given its prefix (`prefixes()`: per row, the ids
    before each column); without processors, the logits (greedy) or temperature, top-k and top-p at once."""
    if settings.rules is not None:
        return settings.rules.scores(logits, prefixes(), rows)
    if settings.greedy:
        return logits
    return process_logits(logits.flatten(0, 1), settings.temperature, settings.top_k, settings.top_p
                          ).view(logits.shape)


def pick_block(scores: torch.Tensor, rows: list[int], settings: DecodingSettings) -> torch.Tensor:
    """The target's tokens [n, b] for its scores [n, b, V] (`target_scores`): their argmax, or a sample per position
    (row i drawn with the generator of row rows[i])."""
    if settings.greedy:
        return scores.argmax(dim=-1)
    uniforms = draw_uniforms([settings.generators[row] for row in rows], scores.shape[1], scores.device)  # [n, b]
    return sample_from(scores.softmax(dim=-1), uniforms)


def committed_ids(state: DecodeState, row: int) -> torch.Tensor:
    """Row `row`'s ids [L] as `generate` would hold them before its next position: the prompt as passed (left padding
    kept), then its committed tokens (the pending one last)."""
    return torch.cat((state.input_ids[row], host_to_device(state.generated[row], state.device)))


def position_prefixes(state: DecodeState, step: StepPlan, nodes: torch.Tensor) -> list[list[torch.Tensor | None]]:
    """Per active row, the ids [L] before each verify column, as `generate` would hold them: the prompt as passed,
    the committed tokens (the pending one last), then a chain's proposals before the column, or a tree node's path
    (nodes [n, b - 1]: the proposals or the tree's nodes). None for a column whose token the row cannot commit
    (past what max_new_tokens leaves it, `StepPlan.counts`): no processor is asked about a position `generate`
    never reaches, however wide the backend's verify (a compiled one keeps its width)."""
    prefixes = []
    for index, row in enumerate(state.active):
        committed, count = committed_ids(state, row), step.counts[index]  # [L]
        if step.tree is None:
            sequence = torch.cat((committed, nodes[index]))
            prefixes.append([sequence[: committed.shape[0] + column] if column < count else None
                             for column in range(step.width)])
            continue
        paths = column_paths(step.tree.tokens[index], step.tree.parents[index])
        prefixes.append([torch.cat((committed, host_to_device(path, state.device))) if len(path) < count else None
                         for path in paths])
    return prefixes


def plan_step(state: DecodeState, settings: DecodingSettings) -> StepPlan:
    """The step's block: as wide as the backend verifies, given the block size and the longest active row's need."""
    remaining = [settings.max_new_tokens - len(state.generated[row]) for row in state.active]
    width = state.backend.step_width(settings.block_size, max(remaining))
    starts = [len(state.prompts[row]) + len(state.generated[row]) - 1 for row in state.active]
    return StepPlan(
        width=width,
        counts=[min(width, left) for left in remaining],
        positions=host_to_device(starts, state.device)[:, None] + torch.arange(width, device=state.device),
        pending=host_to_device([[state.generated[row][-1]] for row in state.active], state.device),
    )


def propose(proposer: Proposer | None, state: DecodeState, step: StepPlan, settings: DecodingSettings,
            num_candidates: int = 0) -> Proposal:
    """The proposer's tokens [n, b - 1] for the step (with q if it sampled them, and `num_candidates` candidates per
    position for a tree); it is handed the features it has not seen."""
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
        num_candidates=num_candidates,
        rules=None if settings.rules is None else settings.rules.draft,
    )
    state.context = None if context is None else context.seen()  # handed over
    proposal = proposer.propose(draft_step)
    proposal = proposal if isinstance(proposal, Proposal) else Proposal(proposal)
    tokens = proposal.tokens.to(device=state.device, dtype=torch.long).reshape(len(state.active), step.width - 1)
    return replace(proposal, tokens=tokens)


def commit(state: DecodeState, step: StepPlan, verdict: Verdict, settings: DecodingSettings) -> list[int]:
    """Per live row, `commit_block` of its judged proposals and the target's tokens: append what it commits, record
    the step, mark the rows that ended; the accepted proposals of each."""
    accepted_counts = []
    for index, row in enumerate(state.active):
        accepted, new_tokens, stopped = commit_block(verdict.proposed[index], verdict.target_tokens[index],
                                                     step.counts[index], settings.stop_token_ids)
        if settings.rules is not None:
            accepted, new_tokens, stopped = apply_rules(state, row, index, verdict, accepted, new_tokens, stopped,
                                                        settings.rules)
        state.acceptance_lengths[row].append(accepted + 1)
        state.verified_lengths[row].append(step.width)
        state.generated[row].extend(new_tokens)
        state.finished[row] = stopped or len(state.generated[row]) >= settings.max_new_tokens
        accepted_counts.append(accepted)
        if settings.streamers:
            settings.streamers[row].put(torch.tensor(new_tokens))
    return accepted_counts


def apply_rules(state: DecodeState, row: int, index: int, verdict: Verdict, accepted: int, new_tokens: list[int],
                stopped: bool, rules: PositionRules) -> tuple[int, list[int], bool]:
    """One row's commit under the call's rules (row: its index in the call; index: in the verify): cut at the first
    new token after which a stopping criterion ends the row, as `generate` checks after every token; the scores and
    logits the call returns recorded. (accepted proposals, tokens committed, whether the row ended)"""
    columns = ([0] + verdict.columns[index])[: len(new_tokens)]  # the verify column that chose each new token
    if rules.stopping is not None:
        sequence = torch.cat((state.input_ids[row], host_to_device(state.generated[row] + new_tokens, state.device)))
        stop = rules.first_stop(sequence, len(new_tokens), verdict.scores[index, columns])
        if stop is not None:
            accepted, new_tokens, stopped = min(accepted, stop), new_tokens[: stop + 1], True
            columns = columns[: stop + 1]
    if rules.output_scores:
        state.scores[row].append(verdict.scores[index, columns])
    if rules.output_logits:
        state.logits[row].append(verdict.logits[index, columns])
    return accepted, new_tokens, stopped


def kept_mask(kept_columns: list[list[int]], device: torch.device) -> torch.Tensor:
    """[n, w] bool: where each row keeps a verify column (w: one past the last column any row keeps); from pinned
    memory, queued (no wait on a GPU)."""
    width = max(max(columns, default=0) for columns in kept_columns) + 1
    return host_to_device([[column in columns for column in range(width)] for columns in kept_columns], device,
                          torch.bool)


def keep_context(state: DecodeState, step: StepPlan, verdict: Verdict, accepted_counts: list[int]) -> None:
    """Keep the verify columns of each row's pending token and committed proposals: in the backend's cache (the rest
    leaves it), and as new features for the proposer (each row's kept columns in order, left-aligned)."""
    kept_columns = [[0] + columns[:count] for columns, count in zip(verdict.columns, accepted_counts)]
    kept = kept_mask(kept_columns, state.device)  # [n, w]
    state.backend.keep(kept_columns, kept)
    if verdict.features is None or state.context is None:
        return  # no proposer reads features
    longest = max(len(columns) for columns in kept_columns)
    if all(columns == list(range(len(columns))) for columns in kept_columns):  # prefixes (a chain): the first columns
        features, positions = verdict.features[:, :longest], step.positions[:, :longest]
        valid = None if all(len(columns) == longest for columns in kept_columns) else kept[:, :longest]
    else:  # a tree's paths: each row's kept columns gathered to the left
        index = host_to_device([columns + [0] * (longest - len(columns)) for columns in kept_columns],
                               state.device)  # [n, c]
        features = verdict.features.gather(1, index[..., None].expand(-1, -1, verdict.features.shape[2]))
        positions = step.positions.gather(1, index)
        valid = host_to_device([[True] * len(columns) + [False] * (longest - len(columns))
                                for columns in kept_columns], state.device, torch.bool)
    state.context = TargetContext.of(features, positions, valid)


def kept_scores(scores: torch.Tensor, logits: torch.Tensor, settings: DecodingSettings
                ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What a verdict keeps of a verify's processed scores and raw logits [n, b, V]: what the call's criteria and
    outputs read, else nothing."""
    rules = settings.rules
    if rules is None:
        return None, None
    return (scores if rules.keeps_scores else None), (logits.float() if rules.output_logits else None)


# --- The strategies --------------------------------------------------------------------------------------------------


class StepStrategy(Protocol):
    """How a step turns the proposer's block into what the target verifies, and reads the verdict."""

    num_candidates: int  # top tokens per position the proposer is asked for (0: none)

    def arrange(self, state: DecodeState, step: StepPlan, proposal: Proposal, settings: DecodingSettings
                ) -> tuple[StepPlan, Proposal]:
        """The step and the proposal to verify, made from the planned block and the proposer's output."""

    def verify(self, state: DecodeState, step: StepPlan, proposal: Proposal, settings: DecodingSettings) -> Verdict:
        """One target pass over the arranged step (the cache holds its columns until `keep_context`)."""


def worthwhile_width(confidences: torch.Tensor, counts: list[int], costs: StepCosts, early_stop: bool = False) -> int:
    """The verify width w (1 .. b) with the most expected tokens per second for draft confidences [n, b - 1].

    A row expects 1 + the sum over k < w of the draft's cumulative confidence in its first k proposals (at most its
    count); a step costs the draft pass and a w-token verify (the batch verifies one rectangle, as wide as its widest
    row, so every row verifies up to w). Greedy, the width never changes which tokens are committed; sampling, a
    narrower verify draws fewer uniforms, so the draws (not their distribution) differ.

    `early_stop` (the DSpark paper's Algorithm 1; needed where a position's confidence depends on the token drafted
    before it): widen one column at a time and stop at the first widening that does not raise the expected tokens
    per second, so whether proposal k is verified never depends on a confidence that proposal k itself shaped.
    Without it, the best of all widths: a retrospective search, exact only for confidences no drawn token shapes.
    """
    num_rows, width = confidences.shape[0], confidences.shape[1] + 1
    survival = confidences.float().cumprod(dim=1)  # [n, b - 1]: P(the first k proposals are all accepted)
    usable = torch.arange(1, width, device=survival.device)[None, :] < host_to_device(counts, survival.device)[:, None]
    expected = torch.cat((survival.new_ones(num_rows, 1), (survival * usable).cumsum(dim=1) + 1), dim=1)  # [n, b]
    seconds = torch.tensor(costs.verify[:width], device=survival.device) + costs.draft  # [b]
    rates = expected.sum(dim=0) / seconds  # [b]: expected tokens per second of each width
    if not early_stop:
        return int(rates.argmax()) + 1
    rising = (rates[1:] > rates[:-1]).int()  # [b - 1]: widening from w to w + 1 pays
    return int(rising.cumprod(dim=0).sum()) + 1  # the widenings that pay before the first that does not


def target_tokens(scores: torch.Tensor, proposal: Proposal, rows: list[int], step: StepPlan,
                  settings: DecodingSettings) -> torch.Tensor:
    """The target's token at each verified position [n, b], from its scores [n, b, V] (`target_scores`; rows: the
    active rows).

    Without q: its argmax or its sample at every position (a proposal is kept when it equals it). With q: speculative
    sampling, so the row holds the accepted proposals, then the residual's (or p's) sample, then -1.
    """
    if not isinstance(proposal, SampledProposal):
        return pick_block(scores, rows, settings)
    probabilities = scores.softmax(dim=-1)  # [n, b, V]: p
    uniforms = draw_uniforms([settings.generators[row] for row in rows], step.width, scores.device)
    limits = host_to_device([count - 1 for count in step.counts], scores.device)  # what max_new_tokens lets a row keep
    accepted, tokens = speculative_sample(proposal.tokens, proposal.draft_probabilities, probabilities, uniforms,
                                          limits)
    columns = torch.arange(step.width, device=scores.device)[None, :]  # [1, b]
    proposals = torch.nn.functional.pad(proposal.tokens, (0, 1), value=-1)  # [n, b]
    picked = torch.where(columns < accepted[:, None], proposals, -1)
    return torch.where(columns == accepted[:, None], tokens[:, None], picked)


class ChainStep:
    """The target verifies the pending token and the b - 1 proposals in a row; the longest matching prefix is kept.
    With step costs (`settings.step_costs`), the block is first cut to `worthwhile_width` (with its early stop where
    the proposal's confidences follow its own tokens: `Proposal.sequential_confidences`)."""

    num_candidates = 0

    def arrange(self, state: DecodeState, step: StepPlan, proposal: Proposal, settings: DecodingSettings
                ) -> tuple[StepPlan, Proposal]:
        """The step as planned, cut where the proposer cut its rows (`Proposal.lengths`), then to the worthwhile
        width when step costs are given."""
        if proposal.lengths is not None:
            step, proposal = cut_to_lengths(step, proposal, state.backend)
        confidences = proposal.proposal_confidences()
        if settings.step_costs is None or confidences is None or step.width == 1:
            return step, proposal
        width = worthwhile_width(confidences, step.counts, settings.step_costs,
                                 early_stop=proposal.sequential_confidences)
        if width == step.width:
            return step, proposal
        tokens = proposal.tokens[:, : width - 1]
        shortened = (SampledProposal(tokens, draft_probabilities=proposal.draft_probabilities[:, : width - 1])
                     if isinstance(proposal, SampledProposal) else Proposal(tokens))
        return StepPlan(width, [min(width, count) for count in step.counts], step.positions[:, :width],
                        step.pending), shortened

    def verify(self, state: DecodeState, step: StepPlan, proposal: Proposal, settings: DecodingSettings) -> Verdict:
        """One pass over [pending, proposals]; the target's token at each of them, read to the host at once.
        Positions are always passed: a cache's token counter is no source of positions (Transformers 5.25 reports a
        recurrent layer's count for the whole cache)."""
        logits, features = state.backend.verify(torch.cat((step.pending, proposal.tokens), dim=1),
                                                VerifyLayout(step.positions))
        scores = target_scores(logits, lambda: position_prefixes(state, step, proposal.tokens), state.active,
                               settings)
        tokens_of_target = target_tokens(scores, proposal, state.active, step, settings)
        judged = torch.cat((proposal.tokens, tokens_of_target), dim=1).tolist()  # the verdict's one device read
        columns = list(range(1, step.width))
        return Verdict([tokens[: step.width - 1] for tokens in judged],
                       [tokens[step.width - 1 :] for tokens in judged], [columns] * len(judged), features,
                       *kept_scores(scores, logits, settings))


CHAIN = ChainStep()


def cut_to_lengths(step: StepPlan, proposal: Proposal, backend: TargetBackend) -> tuple[StepPlan, Proposal]:
    """A chain step whose row i verifies at most `proposal.lengths[i]` proposals (its count: later ones are never
    accepted, and its next token follows the last one it may keep), as wide as the longest row needs where the
    backend's verify width may change (`step_width`; a compiled verify keeps its width and the counts cut)."""
    lengths = proposal.lengths.tolist()  # one device read
    width = backend.step_width(step.width, max(lengths) + 1)
    counts = [min(count, length + 1) for count, length in zip(step.counts, lengths)]
    confidences = None if proposal.confidences is None else proposal.confidences[:, : width - 1]
    cut = dict(tokens=proposal.tokens[:, : width - 1], confidences=confidences, lengths=None)
    if isinstance(proposal, SampledProposal):
        cut["draft_probabilities"] = proposal.draft_probabilities[:, : width - 1]
    return StepPlan(width, counts, step.positions[:, :width], step.pending), replace(proposal, **cut)


class TreeStep:
    """The target verifies a tree of `size` drafted nodes per row, planted from the draft's top candidates at each
    position (`tree_dflash`); each node attends to its ancestors, and the longest accepted root-to-leaf path is kept.
    A block of one token (the last) is a tree of the root alone."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.num_candidates = min(MAX_CANDIDATES, size)

    def arrange(self, state: DecodeState, step: StepPlan, proposal: Proposal, settings: DecodingSettings
                ) -> tuple[StepPlan, Proposal]:
        """The `size` nodes of highest draft path probability per row (from the proposal's candidates), as verify
        columns 1 .. size at the positions of their depths."""
        if step.width == 1:  # nothing drafted: the root alone
            return replace(step, tree=DraftTree(*([[] for _ in state.active] for _ in range(4)))), proposal
        if proposal.candidates is None:
            raise ValueError("tree_size needs the proposer's top tokens per position (Proposal.candidates, asked for "
                             "by DraftStep.num_candidates); this proposer gave none.")
        transitions = proposal.candidates.transitions  # [n, b - 1, k, k] (DFlash2) or None
        candidates = to_host(proposal.candidates.tokens, proposal.candidates.probabilities, step.pending[:, 0],
                             *(() if transitions is None else (transitions,)))  # one device read: [n, b - 1, k], ...
        trees = build_trees(candidates[0].tolist(), candidates[1].tolist(), self.size,
                            [min(step.width - 1, count - 1) for count in step.counts], candidates[2].tolist(),
                            None if transitions is None else candidates[3].tolist(), forbidden_nodes(state, settings),
                            proposal.candidates.after_path)
        depths = host_to_device([[0] + depths for depths in trees.depths], state.device)  # [n, 1 + N]
        tree_step = StepPlan(1 + trees.size, step.counts, step.positions[:, :1] + depths, step.pending, trees)
        tokens = host_to_device(trees.tokens, state.device)  # [n, N]: the nodes; q stays per block position
        return tree_step, (SampledProposal(tokens, draft_probabilities=proposal.draft_probabilities)
                           if isinstance(proposal, SampledProposal) else Proposal(tokens))

    def verify(self, state: DecodeState, step: StepPlan, proposal: Proposal, settings: DecodingSettings) -> Verdict:
        """One pass over the root and the tree's nodes; per row the accepted path, walked on the host after one
        device read (greedy: the argmax; sampling: p, q and the uniforms)."""
        trees, rows = step.tree, range(len(state.active))
        layout = VerifyLayout(step.positions, tree_sees(trees, state.device), [trees.paths(row) for row in rows])
        logits, features = state.backend.verify(torch.cat((step.pending, proposal.tokens), dim=1), layout)
        scores = target_scores(logits, lambda: position_prefixes(state, step, proposal.tokens), state.active,
                               settings)
        if settings.greedy:
            argmax = to_host(scores.argmax(dim=-1))[0].tolist()  # [n, 1 + N]: the walk's one device read
            walks = [walk_greedy(trees, row, argmax[row]) for row in rows]
            finals = [argmax[row][path[-1] if path else 0] for row, path in zip(rows, walks)]
        else:
            probabilities = scores.softmax(dim=-1)  # [n, 1 + N, V]: p at every column
            generators = [settings.generators[row] for row in state.active]
            child_uniforms = draw_uniforms(generators, trees.size, scores.device)  # [n, N]
            final_uniforms = draw_uniforms(generators, step.width, scores.device)  # [n, 1 + N]
            # [n, b - 1, V]: q the candidates were drawn from, or None (chosen, not drawn)
            draft_probabilities = proposal.draft_probabilities if isinstance(proposal, SampledProposal) else None
            # one device read; the walks then run on the host copies
            p, child_uniforms, final_uniforms, *q = to_host(
                probabilities, child_uniforms, final_uniforms,
                *(() if draft_probabilities is None else (draft_probabilities,)))
            sampled = [walk_sampled(trees, row, p[row], q[0][row] if q else None, child_uniforms[row].tolist(),
                                    final_uniforms[row].tolist()) for row in rows]
            walks, finals = [path for path, _ in sampled], [final for _, final in sampled]
        proposed = [[trees.tokens[row][column - 1] for column in path] for row, path in zip(rows, walks)]
        return Verdict(proposed, [path + [final] for path, final in zip(proposed, finals)], walks, features,
                       *kept_scores(scores, logits, settings))


def forbidden_nodes(state: DecodeState, settings: DecodingSettings
                    ) -> Callable[[int, list[list[int]], list[int]], list[bool]] | None:
    """Under the call's processors: which of a row's tree nodes hold a token they rule out after the node's parent
    path (`build_trees`' `forbidden`; its row: an index among the live rows), so that such a token is never verified
    (a sampled walk still tries it in its place, refused for certain: the target's p is 0 there). None: no processor
    to ask."""
    rules = None if settings.rules is None else settings.rules.draft
    if rules is None:
        return None

    def forbidden(index: int, paths: list[list[int]], tokens: list[int]) -> list[bool]:
        committed = committed_ids(state, state.active[index])  # [L]
        prefixes = [torch.cat((committed, host_to_device(path, state.device))) for path in paths]
        return rules.forbidden(state.active[index], prefixes, tokens)

    return forbidden


def step_strategy(settings: DecodingSettings) -> StepStrategy:
    """The call's strategy: a tree of `settings.tree_size` nodes, or a chain."""
    return CHAIN if settings.tree_size is None else TreeStep(settings.tree_size)
