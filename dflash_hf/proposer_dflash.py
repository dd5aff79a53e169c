"""Proposers: what drafts the next tokens of each row for one step of the loop.

`speculative_decode` takes any object with `propose(step) -> [N, block_size - 1]` (the `Proposer` protocol);
`DFlashProposer` drafts with a DFlash draft (anything shaped as the `DFlashDraft` protocol) through a draft backend
(`draft_backends_dflash`: eager or compiled, the draft's context cache and rows). See docs/architecture.md, "The
proposer seam".

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol, Sequence

import torch

from .cache_dflash import host_to_device
from .devices_dflash import execution_device, materialized_weight
from .draft_backends_dflash import DraftBackend, DraftContextCache, EagerDraftBackend
from .kernels_dflash import few_row_kernels, few_row_logits, few_row_product, is_plain_linear
from .processors_dflash import DraftRules
from .sampling_dflash import draw_uniforms, process_logits, sample_from

# confidence_threshold's scheduled mode (the DSpark paper's confidence-scheduled verification): the confidence head
# scores each proposal and the call's step costs choose each step's verify width (steps_dflash.worthwhile_width)
SCHEDULED = "auto"
SCHEDULE_NEEDS_COSTS = (
    "confidence_threshold='auto' chooses each step's verify width by this machine's step costs: pass step_costs="
    "dflash_hf.cost_model.measure_verify_costs(draft, target, context_ids, mask_token_id, batch_size=N), or a number "
    "for DeepSpec's fixed cut (docs/formats.md, \"Confidence-scheduled verification\").")


class CandidateSelector(Protocol):
    """DFlash2's candidate selector, as the proposer uses it (`modeling_dflash.DFlashCandidateSelector`)."""

    def walk(self, logits: torch.Tensor, hidden_states: torch.Tensor, anchor_tokens: torch.Tensor,
             choose: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Chosen tokens [N, P] along the block (see `DFlashCandidateSelector.walk`)."""
        ...

    def transitions(self, logits: torch.Tensor, hidden_states: torch.Tensor, anchor_tokens: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Candidates [N, P, K] and the scores of each after each [N, P, K, K] (see `transitions` there)."""
        ...

    def path(self, candidates: torch.Tensor, scores: torch.Tensor,
             choose: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Chosen tokens [N, P] along `transitions`' candidates and scores (see `path` there)."""
        ...


class MarkovHead(Protocol):
    """DSpark's Markov head, as the proposer uses it (`modeling_dflash.DFlashMarkovHead`)."""

    def initial_state(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The state before a block's first position [M, r], or None."""
        ...

    def previous_embedding(self, previous_tokens: torch.Tensor) -> torch.Tensor:
        """W1[prev] [M, r]."""
        ...

    def step(self, previous_tokens: torch.Tensor, hidden_states: torch.Tensor, state: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(bias [M, V], the next state) of one position (see `DFlashMarkovHead.step`)."""
        ...


class DFlashDraft(Protocol):
    """What the loop needs of a DFlash draft (`modeling_dflash.DFlashDraftModel` is one)."""

    config: Any
    candidate_selector: CandidateSelector | None
    markov_head: MarkovHead | None  # DSpark's (DeepSpec): a bias from the token before each position
    confidence_head: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None  # DSpark's: logits [M]
    lm_head: torch.nn.Module | None  # its own LM head over its draft vocabulary (None: it borrows the target's)

    @property
    def block_size(self) -> int: ...  # noqa: D102 - see DFlashDraftModel

    @property
    def target_layer_ids(self) -> list[int]: ...  # noqa: D102

    @property
    def shifted_labels(self) -> bool: ...  # noqa: D102

    @property
    def mask_token_id(self) -> int | None: ...  # noqa: D102

    @property
    def draft_vocab(self) -> list[int] | None: ...  # noqa: D102

    def parameters(self) -> Any: ...  # noqa: D102

    @property
    def layers(self) -> Any: ...  # noqa: D102

    def new_cache(self) -> DraftContextCache: ...  # noqa: D102

    def embed_block(self, block_ids: torch.Tensor, embedding_weight: torch.Tensor) -> torch.Tensor: ...  # noqa: D102

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor: ...  # noqa: D102

    def __call__(self, block_embeddings: torch.Tensor, target_hidden: torch.Tensor, block_position_ids: torch.Tensor,
                 context_position_ids: torch.Tensor, cache: DraftContextCache | None = None,
                 attention_mask: torch.Tensor | None = None) -> torch.Tensor: ...  # noqa: D102


@dataclass
class DraftStep:
    """What a proposer gets for one step of N active rows."""

    prompts: list[list[int]]  # per row: the prompt without padding (shared with the loop, not copied)
    generated: list[list[int]]  # per row: committed tokens; the last one is pending (not yet verified)
    target_hidden: torch.Tensor | None  # [N, C_new, L*H]: features of positions the proposer has not seen
    context_position_ids: torch.Tensor | None  # [N, C_new]
    context_valid: torch.Tensor | None  # [N, C_new] bool: which columns are real positions (None: all)
    block_size: int  # propose block_size - 1 tokens for positions s+1 .. s+block_size-1 of each row
    row_ids: list[int]  # each row's index in the caller's batch (finished rows leave it)
    temperature: float = 0.0  # the target's sampling: a proposer may sample its proposals the same way
    top_k: int | None = None
    top_p: float | None = None
    generators: tuple[torch.Generator | None, ...] = ()  # one per row of this step
    block_position_ids: torch.Tensor | None = None  # [N, block_size]: positions s .. s + B - 1 on the target's device
    pending_ids: torch.Tensor | None = None  # [N]: the pending tokens on the target's device
    score_proposals: bool = False  # the loop wants the draft's confidence in each proposal (Proposal.confidences)
    num_candidates: int = 0  # > 0: the loop wants each position's top tokens too (Proposal.candidates: trees)
    rules: DraftRules | None = None  # generate's processors, to apply at each block position (None: none)

    @property
    def pending_tokens(self) -> list[int]:
        """Per row: the last committed token t0, which opens the block."""
        return [tokens[-1] for tokens in self.generated]

    @property
    def pending_positions(self) -> list[int]:
        """Per row: the absolute position s of the pending token (= the number of positions before it)."""
        return [len(prompt) + len(tokens) - 1 for prompt, tokens in zip(self.prompts, self.generated)]

    @property
    def sequences(self) -> list[list[int]]:
        """Per row: prompt and committed tokens (built on demand: a proposer that needs whole histories)."""
        return [prompt + tokens for prompt, tokens in zip(self.prompts, self.generated)]


@dataclass
class Candidates:
    """Each position's k candidates, for a tree (`tree_size`): in the order a node tries them, the k most probable
    tokens, or (a `SampledProposal`) a draw of k distinct tokens from q without replacement."""

    tokens: torch.Tensor  # [N, B-1, k]
    # [N, B-1, k]: the scores that shape the tree, never the sampled tokens' own (so which candidates a node
    # verifies does not depend on what was drawn): a DFlash draft's k largest probabilities, descending; a DFlash2
    # draft's selector probabilities of its k candidates after the first candidate of the position before, in the
    # selector's order (not sorted)
    probabilities: torch.Tensor
    # [N, B-1, k, k] (DFlash2's selector): the probability of candidate j at position p after candidate i at position
    # p - 1; a node's children are then ranked by it (position 0 by `probabilities`, after the pending token)
    transitions: torch.Tensor | None = None
    # (row, a node's path as its candidates' ranks from position 0) -> the probability of each candidate of the next
    # position after that path: a recurrent (rnn) Markov head, whose q follows the whole path (`MarkovPaths`)
    after_path: Callable[[int, tuple[int, ...]], list[float]] | None = None


@dataclass
class Proposal:
    """Tokens proposed without sampling (an argmax, a reference, any fixed rule): a proposal is kept when it equals
    the target's own pick (greedy: its argmax; sampling: its sample). Every field after `tokens` is named."""

    tokens: torch.Tensor  # [N, B-1]
    # [N, B-1]: the draft's confidence at each position (a DSpark draft's under confidence_threshold="auto": its
    # confidence head's), a function of its distributions only, never of a sampled token (with
    # `sequential_confidences`, of the tokens proposed before the position only): a width chosen from a token's own
    # draw would bias which proposals get verified (None: not scored)
    confidences: torch.Tensor | None = field(default=None, kw_only=True)
    candidates: Candidates | None = field(default=None, kw_only=True)  # asked for by a tree (DraftStep.num_candidates)
    # [N]: how many proposals each row asks to have verified (DeepSpec's confidence cut: a row's proposals after its
    # length are not part of its proposal); None: all of them. A length depends only on the proposals before the cut
    lengths: torch.Tensor | None = field(default=None, kw_only=True)
    # each position's confidence depends on the tokens proposed before it (a DSpark draft's Markov walk): a width
    # chosen from them must stop early (steps_dflash.worthwhile_width), never search past the first position it drops
    sequential_confidences: bool = field(default=False, kw_only=True)

    def proposal_confidences(self) -> torch.Tensor | None:
        """The draft's confidence at each position [N, B-1], as scored (None: unknown)."""
        return self.confidences


@dataclass
class SampledProposal(Proposal):
    """Tokens drawn from the draft's distributions q: the loop accepts them by speculative (rejection) sampling."""

    draft_probabilities: torch.Tensor = field(kw_only=True)  # [N, B-1, V]: q, after p's temperature / top-k / top-p

    def proposal_confidences(self) -> torch.Tensor | None:
        """The draft's confidence at each position [N, B-1]: as scored, else the largest probability of q."""
        return self.draft_probabilities.amax(dim=-1) if self.confidences is None else self.confidences


class Proposer(Protocol):
    """Anything that proposes the next tokens; `target_layer_ids` None means it needs no target features.

    A proposer that keeps per-row state may also define `select_rows(keep: list[int])`: the loop calls it when
    rows finish, with the indices (in the current order) of the rows that stay.
    """

    target_layer_ids: list[int] | None

    def propose(self, step: DraftStep) -> torch.Tensor | Proposal:
        """Proposed token ids [N, step.block_size - 1], or a `Proposal` (with scores or a tree's `Candidates`), or a
        `SampledProposal` that also gives the distributions q the tokens were drawn from.

        A `SampledProposal` is accepted by speculative (rejection) sampling; any other proposal is kept when it equals
        the target's own sample (greedy: its argmax). Both keep the target's distribution exactly.
        """
        ...


class DFlashProposer:
    """Proposes blocks with a DFlash draft through a draft backend (`draft_backends_dflash`: the draft's context
    cache, forward and rows for one generation; default: the eager one); it embeds each block and turns the
    forward's hidden states into proposals."""

    def __init__(self, draft: DFlashDraft, target: torch.nn.Module, mask_token_id: int,
                 sample_proposals: bool = True, draft_vocab: torch.Tensor | None = None,
                 backend: DraftBackend | None = None, confidence_threshold: float | str | None = None) -> None:
        check_confidence_threshold(draft, confidence_threshold)
        self.draft = draft
        # DeepSpec's cut: a row's proposal ends before its first position whose confidence is under it (None: no cut);
        # SCHEDULED: the confidence head scores the proposals and the call's step costs choose the verify width
        self.confidence_threshold = confidence_threshold or None
        self.sample_proposals = sample_proposals  # at temperature > 0: sample from q (else propose the argmax)
        self.target_layer_ids = draft.target_layer_ids
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.device = execution_device(self.embed_tokens)
        self.vocab = (None if draft_vocab is None
                      else draft_vocabulary(draft, self.lm_head, draft_vocab.to(self.device)))
        self.mask_token_id = mask_token_id
        self.backend = EagerDraftBackend(draft) if backend is None else backend

    def select_rows(self, keep: list[int]) -> None:
        """Rows left the batch; `keep` indexes the rows that stay."""
        self.backend.select_rows(keep)

    def propose(self, step: DraftStep) -> torch.Tensor | Proposal:
        """The draft's proposals [N, B-1] for positions s+1 .. s+B-1: its argmax, or samples of q when sampling."""
        if isinstance(self.confidence_threshold, str) and not step.score_proposals:  # SCHEDULED (checked)
            raise ValueError(SCHEDULE_NEEDS_COSTS)
        device, block_size = self.device, step.block_size
        block_position_ids = step.block_position_ids  # [N, B]
        if block_position_ids is None:
            block_position_ids = (host_to_device(step.pending_positions, device)[:, None]
                                  + torch.arange(block_size, device=device))
        pending_ids = host_to_device(step.pending_tokens, device) if step.pending_ids is None else step.pending_ids
        # the draft's rows: [t0, MASK x (B-1)] at s .. s+B-1, or with shifted labels (DeepSpec) [t0, MASK x (B-2)]
        rows = max(block_size - 1, 1) if self.draft.shifted_labels else block_size
        block_ids = torch.full((len(step.row_ids), rows), self.mask_token_id, dtype=torch.long, device=device)
        block_ids[:, 0] = pending_ids
        with materialized_weight(self.embed_tokens) as embedding_weight:
            block_embeddings = self.draft.embed_block(block_ids, embedding_weight)  # [N, rows, H]
        with few_row_kernels(self.draft, rows):  # on a CPU, its few-row products by the fastest kernel timed here
            hidden = self.backend.forward(block_embeddings, block_position_ids[:, :rows], step.target_hidden,
                                          step.context_position_ids, step.context_valid,
                                          step.pending_positions)  # [N, rows, H]; position s: the positions before it
        # [N, B-1, H]: the rows that predict positions s+1 .. s+B-1
        hidden = hidden[:, : block_size - 1] if self.draft.shifted_labels else hidden[:, 1:]
        proposal_states = hidden.reshape(-1, hidden.shape[-1])  # [N * (B-1), H]
        head = self.lm_head if self.vocab is None else self.vocab.head
        proposal_states = proposal_states.contiguous().to(head.weight.dtype)
        sample = step.temperature > 0.0 and self.sample_proposals
        selector = self.draft.candidate_selector
        shape = (len(step.row_ids), block_size - 1)
        markov = self.draft.markov_head is not None or self.confidence_threshold is not None
        if self.vocab is not None and not sample and selector is None and not step.num_candidates \
                and step.rules is None and not markov:
            # greedy: the argmax over the draft's vocabulary
            logits = self.draft.scale_logits(self.vocab.logits(proposal_states))  # [N * (B-1), K]
            tokens = self.vocab.ids[logits.argmax(dim=-1).to(device)].view(shape)
            return (Proposal(tokens, confidences=greedy_confidences(logits).view(shape)) if step.score_proposals
                    else tokens)
        if self.vocab is not None:
            logits = self.vocab.full_logits(self.draft.scale_logits(self.vocab.logits(proposal_states)))
        else:
            logits = self.draft.scale_logits(few_row_logits(self.lm_head, proposal_states))  # [N * (B-1), V]
        logits = logits.view(len(step.row_ids), block_size - 1, -1)  # [N, B-1, V]
        if markov:  # each position after the token drafted before it (DSpark), with the call's processors
            return markov_proposals(logits, hidden, pending_ids, step, sample, self.draft, self.confidence_threshold)
        if step.rules is not None and (not sample or selector is not None or step.num_candidates):
            # the call's processors along the argmax path (a sampled chain: along its draws, in sample_proposals)
            logits = processed_block(logits, step, lambda position, scores: scores.argmax(dim=-1))[0]
        if selector is not None and step.num_candidates:
            return selector_candidates(selector, logits, hidden, block_ids[:, 0], step)
        if selector is not None:
            return select_candidates(selector, logits, hidden, block_ids[:, 0], step, sample)
        if step.num_candidates:
            return top_candidates(logits, step, sample)
        if sample:
            return sample_proposals(logits, step)
        tokens = logits.argmax(dim=-1)
        return Proposal(tokens, confidences=greedy_confidences(logits)) if step.score_proposals else tokens


def processed_block(logits: torch.Tensor, step: DraftStep, pick: Callable[[int, torch.Tensor], torch.Tensor],
                    markov: MarkovStage | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The draft's logits [N, P, V], one block position after another: with `markov`, each position's after the token
    picked before it (`MarkovStage.logits`); then the call's processors (`step.rules`, if any), position p's prefix
    being the row's prompt as passed, its committed tokens and the tokens `pick(p, scores [N, V])` chose at the
    positions before it, as the verify will see them. (scores [N, P, V] float32, tokens [N, P])"""
    rules = step.rules
    device = logits.device
    committed = [] if rules is None else [  # per row: [L]
        torch.cat((rules.input_ids[row].to(device), host_to_device(generated, device)))
        for row, generated in zip(step.row_ids, step.generated)]
    scores = torch.empty(logits.shape, dtype=torch.float32, device=device)
    tokens = torch.empty(logits.shape[:2], dtype=torch.long, device=device)
    for position in range(logits.shape[1]):
        raw = logits[:, position] if markov is None else markov.logits(position, tokens)  # [N, V]
        if rules is None:
            scores[:, position] = raw.float()
        else:
            prefixes = [torch.cat((ids, tokens[row, :position])) for row, ids in enumerate(committed)]
            scores[:, position] = rules.scores(raw, step.row_ids, prefixes)
        tokens[:, position] = pick(position, scores[:, position])
    return scores, tokens


class MarkovStage:
    """One block of a DSpark draft (DeepSpec), walked left to right: each position's logits are the LM head's plus the
    Markov head's bias from the token picked before it (the pending token before the first), so the q a token is
    drawn from is the one the verify judges it by; and, where asked, the confidence head's logit at each position
    (from its hidden state and, `confidence_head_with_markov`, the token before it)."""

    def __init__(self, draft: DFlashDraft, logits: torch.Tensor, hidden_states: torch.Tensor, anchors: torch.Tensor,
                 score_confidence: bool) -> None:
        self.head, self.confidence_head = draft.markov_head, draft.confidence_head if score_confidence else None
        self.base, self.hidden_states, self.anchors = logits, hidden_states, anchors  # [N, P, V], [N, P, H], [N]
        self.state = None if self.head is None else self.head.initial_state(hidden_states[:, 0])
        self.confidence_logits: list[torch.Tensor] = []  # per position walked: [N]

    def logits(self, position: int, tokens: torch.Tensor) -> torch.Tensor:
        """Position `position`'s logits [N, V], after the tokens [N, P] picked at the positions before it."""
        previous = self.anchors if position == 0 else tokens[:, position - 1]  # [N]
        hidden = self.hidden_states[:, position]  # [N, H]
        if self.confidence_head is not None:
            embedding = (self.head.previous_embedding(previous) if self.confidence_head.with_markov else None)
            self.confidence_logits.append(self.confidence_head(hidden, embedding))
        if self.head is None:
            return self.base[:, position]
        logits, self.state = self.after(self.base[:, position], previous, hidden, self.state)
        return logits

    def after(self, base: torch.Tensor, previous: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logits [*S, V], the states they leave) of positions whose LM-head logits `base` broadcast to [*S, V],
        after the tokens `previous` [*S] (hidden states [*S, H], states before them [*S, r] or None): the base plus
        the Markov head's bias, in the base's dtype."""
        bias, state = self.head.step(previous.reshape(-1), hidden.reshape(previous.numel(), -1),
                                     None if state is None else state.reshape(previous.numel(), -1))
        return base + bias.view(*previous.shape, -1).to(base.dtype), state

    def confidences(self) -> torch.Tensor:
        """Each walked position's own confidence sigmoid(c) [N, P]: the probability the confidence head gives its
        proposal of being accepted once every proposal before it is."""
        return torch.stack(self.confidence_logits, dim=1).sigmoid()

    def lengths(self, threshold: float) -> torch.Tensor:
        """Per row [N], the proposals before the first position whose own confidence sigmoid(c) is under
        `threshold` (all P where none is): DeepSpec's cut, not a running product."""
        below = self.confidences() < threshold  # [N, P]
        positions = torch.arange(below.shape[1], device=below.device).expand_as(below)
        return torch.where(below, positions, below.shape[1]).amin(dim=1)


def markov_proposals(logits: torch.Tensor, hidden_states: torch.Tensor, anchors: torch.Tensor, step: DraftStep,
                     sample: bool, draft: DFlashDraft, confidence_threshold: float | str | None
                     ) -> torch.Tensor | Proposal:
    """A DSpark draft's proposals [N, B-1] from its LM head's logits [N, B-1, V] and hidden states [N, B-1, H]: each
    position's logits get the Markov bias of the token drafted before it (`MarkovStage`) and the call's processors,
    then the argmax, or a draw from that position's q (returned for the verify: exact). With a confidence
    threshold, each row's proposal is cut where DeepSpec cuts it (`Proposal.lengths`); with SCHEDULED, the
    confidence head's values are the proposal's confidences, by which the call's step costs choose the width. Every
    confidence here follows the tokens drafted before it (`Proposal.sequential_confidences`)."""
    markov = MarkovStage(draft, logits, hidden_states, anchors, confidence_threshold is not None)
    if step.num_candidates:
        return markov_candidates(markov, step)
    if sample:
        proposal = sample_proposals(logits, step, markov)
    else:
        scores, tokens = processed_block(logits, step, lambda position, scores: scores.argmax(dim=-1), markov)
        proposal = Proposal(tokens, confidences=greedy_confidences(scores) if step.score_proposals else None)
    if confidence_threshold is None and not sample and not step.score_proposals:
        return proposal.tokens
    proposal = replace(proposal, sequential_confidences=True)
    if confidence_threshold is None:
        return proposal
    if isinstance(confidence_threshold, str):  # SCHEDULED (checked)
        return replace(proposal, confidences=markov.confidences())
    return replace(proposal, lengths=markov.lengths(confidence_threshold))


def markov_candidates(markov: MarkovStage, step: DraftStep) -> Proposal:
    """A DSpark draft's candidates for a tree: at each position the k most probable tokens of q after the greedy
    path, and how a node ranks its children among the next position's: for a head whose bias reads the token before
    only (vanilla, gated), by the probability of each candidate after each candidate of the position before (its q
    given that token); for a recurrent head (rnn), by q after the node's whole path (`MarkovPaths`, each node's state
    from its parent's). Chosen, not drawn: each node is verified with a one-hot q, so greedy and sampling stay
    exact."""
    logits, hidden_states = markov.base, markov.hidden_states  # [N, P, V], [N, P, H]
    scores, tokens = processed_block(logits, step, lambda position, scores: scores.argmax(dim=-1), markov)
    probabilities = draft_distribution(scores, step)  # [N, P, V]: q along the greedy path
    count = min(step.num_candidates, logits.shape[-1])
    largest, candidates = probabilities.topk(count, dim=-1)  # [N, P, k]
    if markov.head.initial_state(hidden_states[:1, 0]) is not None:  # a state that follows the whole path
        paths = MarkovPaths(markov, candidates, step)
        return Proposal(tokens, candidates=Candidates(candidates, largest, after_path=paths.probabilities))
    rows, positions, vocabulary = logits.shape
    transitions = [largest[:, :1, None, :].expand(-1, 1, count, -1)]  # position 0: after the pending token (not read)
    if positions > 1:
        previous = candidates[:, :-1]  # [N, P-1, k]: each candidate as the token before the next
        hidden = hidden_states[:, 1:, None].expand(-1, -1, count, -1)  # [N, P-1, k, H]
        after, _ = markov.after(logits[:, 1:, None], previous, hidden, None)  # [N, P-1, k, V]
        q_after = draft_distribution(after.flatten(1, 2), step).view(rows, positions - 1, count, vocabulary)
        transitions.append(q_after.gather(-1, candidates[:, 1:, None, :].expand(-1, -1, count, -1)))  # [N,P-1,k,k]
    return Proposal(tokens, candidates=Candidates(candidates, largest, torch.cat(transitions, dim=1)))


class MarkovPaths:
    """A recurrent (rnn) Markov head's q along a tree's paths: a node's children's q reads the state its path left
    (its parent's state stepped over the parent's token), so each node's state is computed from its parent's, when
    the tree first asks for the children of the node or of one of its siblings (`probabilities`: the siblings are
    stepped together, in one batch); memoised per row and parent path."""

    def __init__(self, markov: MarkovStage, candidates: torch.Tensor, step: DraftStep) -> None:
        self.markov, self.candidates, self.step = markov, candidates, step  # candidates [N, P, k]
        # (row, parent path) -> (per candidate j of position len(parent path): the probability of each candidate of
        # the next position after parent path + (j,) [k][k]; the states those paths leave [k, r])
        self.siblings: dict[tuple[int, tuple[int, ...]], tuple[list[list[float]], torch.Tensor]] = {}

    def _state(self, row: int, path: tuple[int, ...]) -> torch.Tensor:
        """The state [1, r] before position len(path) + 1 of `row` after the candidates `path` (ranks at positions
        0 .. len(path) - 1; the pending token before position 0)."""
        if path:
            return self._siblings(row, path[:-1])[1][path[-1] : path[-1] + 1]
        markov = self.markov
        hidden = markov.hidden_states[row : row + 1, 0]  # [1, H]
        return markov.head.step(markov.anchors[row].view(1), hidden, markov.head.initial_state(hidden))[1]

    def _siblings(self, row: int, parent: tuple[int, ...]) -> tuple[list[list[float]], torch.Tensor]:
        """For every candidate of position len(parent) under the node of `parent`: q of the next position's
        candidates after it [k][k], and the state it leaves [k, r]."""
        key = (row, parent)
        if key not in self.siblings:
            markov, position = self.markov, len(parent) + 1  # the position of the siblings' children
            tokens = self.candidates[row, position - 1]  # [k]: the siblings
            count = tokens.shape[0]
            hidden = markov.hidden_states[row, position].expand(count, -1)  # [k, H]
            logits, states = markov.after(markov.base[row, position], tokens, hidden,
                                          self._state(row, parent).expand(count, -1))  # [k, V], [k, r]
            q = draft_distribution(logits[:, None], self.step)[:, 0]  # [k, V]
            self.siblings[key] = q[:, self.candidates[row, position]].tolist(), states
        return self.siblings[key]

    def probabilities(self, row: int, path: tuple[int, ...]) -> list[float]:
        """The probability of each candidate of position len(path) after the node of `path` (its candidates' ranks
        from position 0, at least one): q after that path, at the step's temperature, top-k and top-p."""
        return self._siblings(row, path[:-1])[0][path[-1]]


def check_confidence_threshold(draft: DFlashDraft, threshold: float | str | None) -> None:
    """Refuse a confidence threshold other than a number in [0, 1] or SCHEDULED, or for a draft without a confidence
    head."""
    if threshold is None:
        return
    scheduled = isinstance(threshold, str) and threshold == SCHEDULED
    if not scheduled and (isinstance(threshold, bool) or not isinstance(threshold, (int, float))
                          or not 0.0 <= threshold <= 1.0):
        raise ValueError(f"confidence_threshold must be a number from 0 to 1 (0: no cut, as DeepSpec's default) or "
                         f"{SCHEDULED!r} (the verify width scheduled from the confidences and step_costs), got "
                         f"{threshold!r}.")
    if threshold and draft.confidence_head is None:
        raise ValueError("confidence_threshold needs a draft with a confidence head (a DeepSpec DSpark draft whose "
                         "config has `enable_confidence_head`); this draft has none: leave it out.")


def deepspec_refusal(draft: DFlashDraft, tree_size: int | None, confidence_threshold: float | str | None
                     ) -> str | None:
    """Why a call cannot run with this draft's DSpark parts (a Markov head, a confidence cut), or None: trees with a
    confidence cut are not built yet."""
    if tree_size is not None and confidence_threshold:
        return ("tree_size does not run with a DSpark draft's confidence cut or confidence_threshold='auto' yet; "
                "verify a chain (leave tree_size out) or leave confidence_threshold out (docs/formats.md, \"DeepSeek "
                "DeepSpec drafts\").")
    return None


def top_candidates(logits: torch.Tensor, step: DraftStep, sample: bool) -> Proposal:
    """Each position's `step.num_candidates` candidates for a tree (logits [N, B-1, V], at the step's temperature,
    top-k and top-p when sampling): the most probable tokens, or with `sample` distinct tokens drawn from q in turn
    (each row with its generator; q is returned for the verify); the shape probabilities are q's largest."""
    probabilities = draft_distribution(logits, step)  # [N, B-1, V]: q
    count = min(step.num_candidates, logits.shape[-1])
    largest, tokens = probabilities.topk(count, dim=-1)  # [N, B-1, k]
    if not sample:
        return Proposal(tokens[..., 0], candidates=Candidates(tokens, largest))
    uniforms = draw_uniforms(step.generators, logits.shape[1] * count, logits.device).view(*logits.shape[:2], count)
    remaining, drawn = probabilities.clone(), []
    for rank in range(count):  # ranks past a position's support are drawn from nothing; their shape probability is 0
        token = sample_from(remaining, uniforms[..., rank])  # [N, B-1]
        remaining.scatter_(-1, token[..., None], 0.0)
        drawn.append(token)
    tokens = torch.stack(drawn, dim=-1)  # [N, B-1, k]
    return SampledProposal(tokens[..., 0], candidates=Candidates(tokens, largest), draft_probabilities=probabilities)


def draft_distribution(logits: torch.Tensor, step: DraftStep) -> torch.Tensor:
    """The draft's q [N, B-1, V] (float32) for its logits [N, B-1, V]: the softmax after the step's temperature, top-k
    and top-p (a plain softmax when greedy)."""
    flat = logits.flatten(0, 1).float()
    if step.temperature > 0.0:
        flat = process_logits(flat, step.temperature, step.top_k, step.top_p)
    return flat.softmax(dim=-1).view(logits.shape)


def greedy_confidences(logits: torch.Tensor) -> torch.Tensor:
    """The draft's probability of its argmax at each position: logits [..., V] -> [...]."""
    return logits.float().softmax(dim=-1).amax(dim=-1)


def draft_vocab_ids(draft: DFlashDraft, choice: bool | Sequence[int] | torch.Tensor | None,
                    target_vocab_size: int) -> torch.Tensor | None:
    """The ids [K] the draft proposes from for a call's `draft_vocab` choice (None: every token).

    None: the draft's own (`draft.draft_vocab`, if any); False: every token; True: the draft's own (refused when it
    has none); a list or tensor of ids: those. A draft with its own LM head proposes from its own vocabulary only.
    """
    if draft.lm_head is not None and choice is not None and choice is not True:
        raise ValueError("This draft has its own LM head over its own vocabulary (config `draft_vocab_size`): leave "
                         "draft_vocab out (or True); it cannot propose from other token ids.")
    if choice is None or choice is True:
        if choice is True and draft.draft_vocab is None:
            raise ValueError("draft_vocab=True but the draft's config has no `draft_vocab`; pass the token ids, or "
                             "train with `dflash-hf train --draft-vocab-size K`.")
        choice = draft.draft_vocab
    if choice is None or choice is False:
        return None
    ids = torch.as_tensor(choice, dtype=torch.long).flatten()
    if ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= target_vocab_size or len(ids.unique()) != len(ids):
        raise ValueError(f"draft_vocab must hold distinct token ids of the target's vocabulary (0 to "
                         f"{target_vocab_size - 1}); got {ids.numel()} ids from "
                         f"{int(ids.min()) if ids.numel() else None} "
                         f"to {int(ids.max()) if ids.numel() else None}.")
    return ids


def draft_vocabulary(draft: DFlashDraft, target_head: torch.nn.Module, ids: torch.Tensor) -> DraftVocabulary:
    """The vocabulary a draft proposes from, K ids [K] (`draft_vocab_ids`): its own LM head's, or the target head's
    rows of those ids."""
    if draft.lm_head is None:
        return DraftVocabulary(target_head, ids, target_head.weight.shape[0])
    return DraftVocabulary(draft.lm_head, ids, target_head.weight.shape[0], own_head=True)


class DraftVocabulary:
    """The draft's vocabulary: K token ids of the target's and the LM head rows that score them, so each draft pass
    computes K logits per position instead of V. The rows are the target head's rows of those ids (copied once per
    generation), or with `own_head` the draft's own head, whose K rows are the ids in order. Verification is
    unchanged: still exact."""

    def __init__(self, lm_head: torch.nn.Module, ids: torch.Tensor, vocab_size: int, own_head: bool = False) -> None:
        self.ids = ids  # [K]
        self.vocab_size = vocab_size  # V: the target's vocabulary
        self.head = lm_head
        self.called_head = None if is_plain_linear(lm_head) else lm_head  # an unknown head is called (then indexed)
        if self.called_head is None:
            self.weight = lm_head.weight if own_head else lm_head.weight[ids]  # [K, H]
            self.bias = lm_head.bias if own_head or lm_head.bias is None else lm_head.bias[ids]
        self.rows = None if own_head else ids  # which rows of the head's output are the K logits (None: all)

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """Logits [M, K] of states [M, H] over the draft's vocabulary."""
        if self.called_head is not None:
            logits = self.called_head(states)
            return logits if self.rows is None else logits[:, self.rows.to(states.device)]
        return few_row_product(self.weight, self.bias, states)

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits [M, V] over the target's vocabulary from the draft's [M, K]: -inf outside the draft's vocabulary."""
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return full.scatter_(1, self.ids.to(logits.device).expand(logits.shape[0], -1), logits)


def select_candidates(selector: CandidateSelector, logits: torch.Tensor, hidden_states: torch.Tensor,
                      anchor_tokens: torch.Tensor, step: DraftStep, sample: bool) -> torch.Tensor | Proposal:
    """DFlash2 proposals [N, B-1]: the selector's greedy path, or a path sampled from softmax(score / T) after the
    step's top-k / top-p, whose distribution over the candidates is the draft's q (logits [N, B-1, V])."""
    if not sample:
        return selector.walk(logits, hidden_states, anchor_tokens, lambda scores, candidates: scores.argmax(dim=-1))
    distributions = []  # per position: q over the vocabulary [N, V], zero outside the K candidates
    step = replace(step, rules=None)  # the logits were processed already; the selector's scores are not logits

    def sample_choice(scores: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        vocabulary_scores = torch.full_like(logits[:, 0], float("-inf"), dtype=torch.float32)
        vocabulary_scores.scatter_(1, candidates, scores)  # [N, V]
        sampled = sample_proposals(vocabulary_scores[:, None], step)  # one position: tokens [N, 1], q [N, 1, V]
        distributions.append(sampled.draft_probabilities[:, 0])
        return (candidates == sampled.tokens).int().argmax(dim=-1)  # its index among the candidates

    tokens = selector.walk(logits, hidden_states, anchor_tokens, sample_choice)
    return SampledProposal(tokens, draft_probabilities=torch.stack(distributions, dim=1))


def selector_candidates(selector: CandidateSelector, logits: torch.Tensor, hidden_states: torch.Tensor,
                        anchor_tokens: torch.Tensor, step: DraftStep) -> Proposal:
    """DFlash2's candidates for a tree: each position's K candidates, the selector's probability of each after each
    candidate of the position before (softmax of its scores, at the step's temperature when sampling), and its
    greedy path as the proposal. Chosen, not drawn: a node tries its children in that order, each with a one-hot q."""
    candidates, scores = selector.transitions(logits, hidden_states, anchor_tokens)  # [N, P, K], [N, P, K, K]
    transitions = (scores / (step.temperature if step.temperature > 0.0 else 1.0)).softmax(dim=-1)
    tokens = selector.path(candidates, scores, lambda row_scores, row_candidates: row_scores.argmax(dim=-1))
    return Proposal(tokens, candidates=Candidates(candidates, transitions[:, :, 0], transitions))


def sample_proposals(logits: torch.Tensor, step: DraftStep, markov: MarkovStage | None = None) -> SampledProposal:
    """Proposals sampled from the draft's q (logits [N, B-1, V], with `markov` each position's after the token drawn
    before it, after the call's processors, if any, along the row's draws, then the step's temperature, top-k, top-p),
    per row with that row's generator."""
    uniforms = draw_uniforms(step.generators, logits.shape[1], logits.device)  # [N, B-1]
    if step.rules is None and markov is None:
        probabilities = draft_distribution(logits, step)  # [N, B-1, V]
        return SampledProposal(sample_from(probabilities, uniforms), draft_probabilities=probabilities)
    distributions = []  # per position: q [N, V] after the call's processors along the row's draws

    def draw(position: int, scores: torch.Tensor) -> torch.Tensor:
        distributions.append(draft_distribution(scores[:, None], step)[:, 0])
        return sample_from(distributions[-1], uniforms[:, position])

    tokens = processed_block(logits, step, draw, markov)[1]
    return SampledProposal(tokens, draft_probabilities=torch.stack(distributions, dim=1))
