"""The DFlash training objective (docs/training.md): random anchors, sparse block mask, decayed loss.

All blocks of a sequence train in one draft forward: the context rows (target features of every
position) are computed once, and a boolean mask lets each block see only the context strictly
before its anchor plus its own block.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..modeling_dflash import DFlashDraftModel, layer_attention_mask
from ..target_dflash import FeatureCapture, plain_head_parts

DECAY_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # the paper's gamma per block size
# LM-head rows per chunk, in the loss and the teacher's top-k: peak logits memory is about this x V x 4 B x a few
# (Qwen3-8B: 1024 x 151,936 x 4 B = 0.6 GiB per copy), whatever the number of blocks.
LOSS_CHUNK_ROWS = 1024
# Query rows per tile of the block-sparse training mask (`tiled_block_mask`): each tile computes its blocks' context
# range and its own rows only, instead of every block against every other block's rows (docs/training.md).
TILE_ROWS = 512


def loss_decay_gamma(block_size: int) -> float:
    """Gamma of the position-decayed loss: the paper's value for B = 16/10/8, else B / 2 - 1 (at least 1)."""
    return DECAY_GAMMA.get(block_size, max(block_size / 2 - 1, 1.0))


def position_weights(block_size: int, gamma: float | None = None) -> torch.Tensor:
    """Loss weight of block positions k = 1..B-1: exp(-(k - 1) / gamma), shape [B-1]."""
    gamma = loss_decay_gamma(block_size) if gamma is None else gamma
    return torch.exp(-torch.arange(block_size - 1, dtype=torch.float32) / gamma)


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Random distinct anchor positions [K] (sorted) whose next token counts in the loss; K <= num_anchors.

    loss_mask [T] marks the positions whose token is a training label (the response).
    """
    candidates = torch.nonzero(loss_mask[1:].bool()).flatten()  # anchor a is useful when a + 1 is a label
    if len(candidates) == 0:
        return candidates
    order = torch.randperm(len(candidates), generator=generator)[:num_anchors]
    return candidates[order].sort().values


@dataclass
class BlockBatch:
    """Inputs and labels of all blocks of one sequence, or of several packed into one row (`pack_blocks`)."""

    # [K*R]: [token at anchor, MASK, ...] per block, R = B rows (R = B - 1 with shifted labels, DeepSpec's block)
    block_ids: torch.Tensor
    block_position_ids: torch.Tensor  # [K*R]: anchor .. anchor + R - 1, positions within the block's own sequence
    labels: torch.Tensor  # [K, B-1]: tokens at anchor + 1 .. anchor + B - 1 (0 where invalid)
    label_mask: torch.Tensor  # [K, B-1]: label exists and is a response token
    context_start: torch.Tensor  # [K]: first context column of the block's sequence in the row
    context_end: torch.Tensor  # [K]: the block's anchor in the row; it sees context columns [start, end)
    context_length: int  # T: context columns of the row (the tokens of its sequences)
    sequence_index: torch.Tensor  # [K]: which sequence of the row each block belongs to

    @property
    def block_size(self) -> int:
        """Rows per block (R: B, or B - 1 with shifted labels)."""
        return self.block_ids.shape[0] // self.labels.shape[0]

    @property
    def attention_mask(self) -> torch.Tensor:
        """The dense mask [K*B, T + K*B] (bool): each block sees its context range and its own block."""
        block_of_row = torch.arange(len(self.context_end), device=self.block_ids.device).repeat_interleave(
            self.block_size)  # [K*B]
        columns = torch.arange(self.context_length, device=self.block_ids.device)[None, :]  # [1, T]
        context_visible = (columns >= self.context_start[:, None]) & (columns < self.context_end[:, None])  # [K, T]
        own_block = block_of_row[:, None] == block_of_row[None, :]  # [K*B, K*B]
        return torch.cat((context_visible[block_of_row], own_block), dim=1)


def build_blocks(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int,
    shifted_labels: bool = False,
) -> BlockBatch:
    """Block inputs, labels and context ranges (the sparse attention mask) for anchors [K] in one sequence [T].

    The labels are the tokens at anchor + 1 .. anchor + B - 1 either way; the block is [t0, MASK x (B-1)] (rows 1 ..
    B-1 predict them), or with `shifted_labels` DeepSpec's [t0, MASK x (B-2)] (rows 0 .. B-2 predict them), whose
    labels count only up to the first one that is not a response token (DeepSpec's `eval_mask`, a prefix)."""
    length, num_blocks = input_ids.shape[0], anchors.shape[0]
    device = input_ids.device
    rows = block_size - 1 if shifted_labels else block_size
    positions = anchors[:, None] + torch.arange(rows, device=device)  # [K, R]
    block_ids = torch.full((num_blocks, rows), mask_token_id, dtype=torch.long, device=device)
    block_ids[:, 0] = input_ids[anchors]
    label_positions = anchors[:, None] + torch.arange(1, block_size, device=device)  # [K, B-1]
    in_range = label_positions < length
    clamped = label_positions.clamp(max=length - 1)
    labels = torch.where(in_range, input_ids[clamped], torch.zeros_like(clamped))
    label_mask = in_range & loss_mask.bool()[clamped]
    if shifted_labels:
        label_mask = label_mask.long().cumprod(dim=1).bool()
    zeros = torch.zeros_like(anchors)
    return BlockBatch(block_ids.flatten(), positions.flatten(), labels, label_mask, zeros, anchors.clone(), length,
                      zeros)


def pack_blocks(batches: list[BlockBatch]) -> BlockBatch:
    """The blocks of several sequences in one row: their contexts side by side, each block's range shifted to its
    own sequence's columns, so that no block sees another sequence (positions stay those within each sequence)."""
    offsets = [0]
    for batch in batches[:-1]:
        offsets.append(offsets[-1] + batch.context_length)
    return BlockBatch(
        torch.cat([batch.block_ids for batch in batches]),
        torch.cat([batch.block_position_ids for batch in batches]),
        torch.cat([batch.labels for batch in batches]),
        torch.cat([batch.label_mask for batch in batches]),
        torch.cat([batch.context_start + offset for batch, offset in zip(batches, offsets)]),
        torch.cat([batch.context_end + offset for batch, offset in zip(batches, offsets)]),
        sum(batch.context_length for batch in batches),
        torch.cat([batch.sequence_index + index for index, batch in enumerate(batches)]),
    )


@dataclass
class TiledBlockMask:
    """Training's block-sparse attention mask: the query rows in tiles, each seeing one context range and its own rows.

    A tile (row start, row end, context start, context end, mask [N, 1, rows, context columns + rows], bool) attends
    to the context keys [context start, context end) and to the keys of its own rows; every other key is hidden from
    all its rows, so it is never computed. Exactly the dense mask's attention wherever the tiles' masks agree with it
    (docs/training.md, "Blocks and the mask"). Keys are [context ; block], context_length C columns of context first.
    The draft's forward takes it as its attention mask (a `modeling_dflash.TiledMask`).
    """

    context_length: int
    tiles: list[tuple[int, int, int, int, torch.Tensor]]

    def restricted(self, query_positions: torch.Tensor, key_positions: torch.Tensor, causal: bool,
                   window: int | None) -> TiledBlockMask:
        """The same tiles with one layer kind's causal / sliding restriction (`modeling_dflash.layer_attention_mask`)
        added, over query positions [N, T] and key positions [N, C + T]."""
        if not causal and window is None:
            return self
        tiles = []
        for rows_start, rows_end, context_start, context_end, mask in self.tiles:
            keys = torch.cat((key_positions[:, context_start:context_end],
                              key_positions[:, self.context_length + rows_start:self.context_length + rows_end]), 1)
            tiles.append((rows_start, rows_end, context_start, context_end,
                          layer_attention_mask(mask, query_positions[:, rows_start:rows_end], keys, causal, window)))
        return replace(self, tiles=tiles)

    def attend(self, attention: Callable[..., tuple[torch.Tensor, Any]], module: torch.nn.Module,
               query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """`attention` tile by tile over query [N, heads, T, D] and key, value [N, kv_heads, C + T, D]; the output
        [N, T, heads, D] in row order."""
        # split once (a split's backward is one concatenation; a slice's would fill a zero tensor of the whole input)
        rows = [rows_end - rows_start for rows_start, rows_end, *_ in self.tiles]
        block_length = query.shape[2]
        context_key, block_key = key.split((self.context_length, block_length), dim=2)
        context_value, block_value = value.split((self.context_length, block_length), dim=2)
        outputs = []
        for (*_, context_start, context_end, mask), tile_query, own_key, own_value in zip(
                self.tiles, query.split(rows, dim=2), block_key.split(rows, dim=2), block_value.split(rows, dim=2)):
            tile_key = torch.cat((context_key[:, :, context_start:context_end], own_key), dim=2)
            tile_value = torch.cat((context_value[:, :, context_start:context_end], own_value), dim=2)
            output, _ = attention(module, tile_query, tile_key, tile_value, mask, **kwargs)
            outputs.append(output)
        return torch.cat(outputs, dim=1)


def tiled_block_mask(blocks: BlockBatch, tile_rows: int = TILE_ROWS) -> TiledBlockMask:
    """The block-sparse form of `blocks.attention_mask`: whole blocks in tiles of about `tile_rows` rows, each tile
    attending to the context columns its blocks see (from the lowest start to the highest end) and to its own rows."""
    block_size, num_blocks = blocks.block_size, len(blocks.context_end)
    per_tile = max(1, tile_rows // block_size)
    device = blocks.block_ids.device
    all_starts, all_ends = blocks.context_start.tolist(), blocks.context_end.tolist()  # one device sync, not per tile
    tiles = []
    for first in range(0, num_blocks, per_tile):
        last = min(first + per_tile, num_blocks)
        starts, ends = blocks.context_start[first:last], blocks.context_end[first:last]  # [k]
        context_start, context_end = min(all_starts[first:last]), max(all_ends[first:last])
        columns = torch.arange(context_start, context_end, device=device)[None, :]  # [1, c]
        context_visible = (columns >= starts[:, None]) & (columns < ends[:, None])  # [k, c]
        block_of_row = torch.arange(last - first, device=device).repeat_interleave(block_size)  # [k*B]
        own_block = block_of_row[:, None] == block_of_row[None, :]  # [k*B, k*B]
        mask = torch.cat((context_visible[block_of_row], own_block), dim=1)[None, None]  # [1, 1, k*B, c + k*B]
        tiles.append((first * block_size, last * block_size, context_start, context_end, mask))
    return TiledBlockMask(blocks.context_length, tiles)


@dataclass
class StepResult:
    """Loss and per-position accuracy of one sequence, or of several packed together (their mean loss)."""

    loss: torch.Tensor  # scalar, differentiable
    correct: torch.Tensor  # [B-1]: correct argmax predictions per block position
    counted: torch.Tensor  # [B-1]: labels per block position
    leading_correct: torch.Tensor  # [K]: correct predictions before the first miss, per block (its tau - 1)
    # [K]: drafts a temperature-1 chain is expected to accept per block, sum_k prod_{j<=k} (1 - L1_j / 2) with the
    # teacher's distribution (DeepSpec's "tau_probabilistic" - 1)
    expected_accepted: torch.Tensor
    outside: torch.Tensor  # scalar: labels the draft's own vocabulary leaves out of the loss (0 without one)
    sequences: int = 1  # sequences the loss averages over


@dataclass
class TargetSignals:
    """What the frozen target gives a training sequence: features, and its top-k next-token distribution."""

    hidden: torch.Tensor  # [T, L*H]: concatenated outputs of the target layers feeding the draft
    teacher_probs: torch.Tensor | None = None  # [T, k]: top-k probabilities of the token at p + 1 (renormalised)
    teacher_ids: torch.Tensor | None = None  # [T, k]
    teacher_logits: torch.Tensor | None = None  # [T, k]: the target's raw logits of those ids (`LossWeights.logits`)

    def apply(self, function: Callable[[torch.Tensor], torch.Tensor]) -> TargetSignals:
        """The same signals with `function` applied to each tensor."""
        return replace(self, **{f.name: function(getattr(self, f.name)) for f in fields(self)
                                if getattr(self, f.name) is not None})

    @staticmethod
    def concatenate(signals: list[TargetSignals]) -> TargetSignals:
        """The signals of several sequences, one after the other along the positions (all with a teacher or none)."""
        return replace(signals[0], **{f.name: torch.cat([getattr(one, f.name) for one in signals])
                                      for f in fields(TargetSignals) if getattr(signals[0], f.name) is not None})

    def to(self, device: torch.device | str, non_blocking: bool = False) -> TargetSignals:
        """The same signals on `device` (no copy where they already are)."""
        return self.apply(lambda tensor: tensor.to(device, non_blocking=non_blocking))


def teacher_rows(loss_mask: torch.Tensor) -> torch.Tensor:
    """Positions [T] (bool) whose next-token distribution a loss over `loss_mask` [T] can use: p with p + 1 a label."""
    rows = torch.zeros_like(loss_mask, dtype=torch.bool)
    rows[:-1] = loss_mask[1:].bool()
    return rows


@torch.no_grad()
def target_features(target: torch.nn.Module, input_ids: torch.Tensor, target_layer_ids: list[int]
                    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(features [T, L*H], final normalised hidden states [T, H], logits [T, V]) of one sequence [T].

    The features are captured by `FeatureCapture` (no other layer's hidden states kept). Where the target's logits
    are exactly its head's (`plain_head_parts`) only the base model runs (no logits: None); otherwise the target's
    own forward gives its logits (and no final states: None).
    """
    parts = plain_head_parts(target)
    with FeatureCapture(target, target_layer_ids, input_ids.device) as capture:
        model = target if parts is None else parts[0]
        outputs = model(input_ids=input_ids[None], use_cache=False, **capture.forward_arguments())
    features = capture.result(outputs)[0]
    if parts is None:
        return features, None, outputs.logits[0]
    return features, outputs.last_hidden_state[0], None


@torch.no_grad()
def target_signals(
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    target_layer_ids: list[int],
    teacher_top_k: int | None = None,
    needed_rows: torch.Tensor | None = None,
    chunk_rows: int = LOSS_CHUNK_ROWS,
    keep_logits: bool = False,
) -> TargetSignals:
    """Run the frozen target once over a sequence [T]; keep the features and, if asked, its top-k.

    needed_rows [T] (bool, e.g. `teacher_rows(loss_mask)`): positions whose top-k the loss reads (default: all);
    the others get zero probabilities. The LM head runs on those rows only, `chunk_rows` at a time, wherever the
    target's logits are exactly its head's (`plain_head_parts`); otherwise the target's own forward gives them.
    `keep_logits`: also keep the top-k's raw logit values (the raw-logit loss term, `LossWeights.logits`).
    """
    hidden, final, logits = target_features(target, input_ids, target_layer_ids)
    if teacher_top_k is None:
        return TargetSignals(hidden)
    rows = torch.ones_like(input_ids, dtype=torch.bool) if needed_rows is None else needed_rows.to(input_ids.device)
    positions = rows.nonzero().flatten()  # [P]
    probs = torch.zeros(len(input_ids), teacher_top_k, device=input_ids.device)  # [T, k]
    ids = torch.zeros(len(input_ids), teacher_top_k, dtype=torch.long, device=input_ids.device)
    values = torch.zeros(len(input_ids), teacher_top_k, device=input_ids.device) if keep_logits else None  # [T, k]
    lm_head = target.get_output_embeddings()
    for chunk in positions.split(chunk_rows):
        chunk_logits = lm_head(final[chunk]) if logits is None else logits[chunk]  # [c, V]
        top = chunk_logits.float().topk(teacher_top_k, dim=-1)
        probs[chunk], ids[chunk] = top.values.softmax(-1), top.indices
        if values is not None:
            values[chunk] = top.values
    return TargetSignals(hidden, probs, ids, values)


@dataclass(frozen=True)
class LossWeights:
    """The terms of the per-token loss (docs/training.md, "Loss terms"): `(1 - l1) x cross-entropy + l1 x L1 +
    logits x raw-logit error`.

    - cross-entropy: to the teacher's top-k distribution (distillation) or to the sequence's token;
    - L1 (DeepSpec's distribution-matching term, `l1_loss_alpha`): sum |q - p| between the draft's distribution q and
      the teacher's p (its top-k, the rest of q counted as error), or the token's one-hot; at temperature 1 a
      position is accepted with probability 1 - L1 / 2, so this term aims at sampled acceptance directly;
    - raw-logit error: mean over the teacher's top-k ids of (draft logit - target logit)^2, so the draft's logits
      sit at the target's level and a value-dependent processor (a repetition penalty) moves both alike.

    `token_cross_entropy`: the cross-entropy to the sequence's token even where a teacher gives L1 its distribution
    (DeepSpec's loss: its CE reads the token, its L1 the target). A draft with a confidence head adds `confidence` x
    its binary cross-entropy to the position's acceptance 1 - L1 / 2 (DeepSpec's `confidence_head_alpha`, 1.0).
    """

    l1: float = 0.0
    logits: float = 0.0
    token_cross_entropy: bool = False
    confidence: float = 1.0

    def __post_init__(self) -> None:
        """Refuse weights outside their ranges, by flag."""
        if not 0.0 <= self.l1 <= 1.0:
            raise ValueError(f"l1 weight {self.l1} (--l1-weight): expected 0 to 1 (the cross-entropy gets 1 - it)")
        if self.logits < 0.0:
            raise ValueError(f"logit weight {self.logits} (--logit-weight): expected >= 0")
        if self.confidence < 0.0:
            raise ValueError(f"confidence weight {self.confidence}: expected >= 0")


IGNORED_LABEL = -100  # F.cross_entropy's ignore_index: a label outside the draft's own vocabulary adds no loss


def draft_vocabulary_targets(
    model: DFlashDraftModel, labels: torch.Tensor, teacher_probs: torch.Tensor | None,
    teacher_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Labels [N] and the teacher's top-k ([N, k] probabilities and ids) in the rows of the draft's own LM head: a
    target id's row is its rank among the draft's ids (`t2d`, ascending, as `d2t` has them). A label outside the
    vocabulary becomes IGNORED_LABEL; a teacher id outside it gets probability 0 (the rest renormalised; the raw-logit
    term leaves it out too), and a row whose teacher ids are all outside becomes IGNORED_LABEL (nothing to distil)."""
    rows = model.t2d.long().cumsum(0) - 1  # [V]: each target id's row where t2d is True
    inside = model.t2d[labels]
    draft_labels = torch.where(inside, rows[labels], torch.full_like(labels, IGNORED_LABEL))
    if teacher_probs is None:
        return draft_labels, None, None
    teacher_inside = model.t2d[teacher_ids]  # [N, k]
    draft_labels = torch.where(teacher_inside.any(-1), draft_labels, torch.full_like(labels, IGNORED_LABEL))
    kept = teacher_probs * teacher_inside
    kept = kept / kept.sum(-1, keepdim=True).clamp(min=1e-12)
    return draft_labels, kept, torch.where(teacher_inside, rows[teacher_ids], torch.zeros_like(teacher_ids))


def _supervised_row_losses(
    model: DFlashDraftModel, lm_head: torch.nn.Module, rows: torch.Tensor, labels: torch.Tensor,
    teacher_probs: torch.Tensor | None, teacher_ids: torch.Tensor | None, teacher_logits: torch.Tensor | None,
    weights: LossWeights, markov_latent: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss [n], argmax prediction [n], acceptance [n]) of supervised rows [n, H] (`LossWeights`' terms): to labels
    [n] (0 where a label is IGNORED_LABEL), or to the teacher; logits, labels and predictions index `lm_head`'s rows.
    markov_latent [n, r]: the Markov head's W2 input at each row (`DFlashMarkovHead.latent`), its bias added to the
    logits as the proposer adds it. The acceptance is 1 - L1 / 2: the probability that a token sampled from the draft
    is accepted at temperature 1."""
    logits = model.scale_logits(lm_head(rows.to(lm_head.weight.dtype))).float()  # [n, V]
    if markov_latent is not None:
        logits = logits + model.markov_head.markov_w2(markov_latent).float()
    log_q = logits.log_softmax(-1)  # [n, V]
    if teacher_probs is None:
        known = labels != IGNORED_LABEL
        ids, probs = labels.clamp(min=0)[:, None], known.float()[:, None]  # [n, 1]: the one-hot of the label
        loss = F.cross_entropy(logits, labels, reduction="none", ignore_index=IGNORED_LABEL)
    else:
        ids, probs = teacher_ids, teacher_probs  # [n, k]
        if weights.token_cross_entropy:
            loss = F.cross_entropy(logits, labels, reduction="none", ignore_index=IGNORED_LABEL)
        else:
            loss = -(probs * log_q.gather(-1, ids)).sum(-1)
    # [n, k]: the draft's probability of the teacher's ids; an id where p is 0 (outside the draft's own vocabulary)
    # counts with the draft's mass outside the teacher's ids, which is the same L1
    q = log_q.gather(-1, ids).exp() * (probs > 0)
    l1 = ((q - probs).abs().sum(-1) + (1.0 - q.sum(-1)).clamp(min=0.0)) * (probs.sum(-1) > 0)  # [n]
    if weights.l1 > 0:
        loss = (1.0 - weights.l1) * loss + weights.l1 * l1
    if weights.logits > 0 and teacher_logits is not None:
        counted = (probs > 0).float()  # [n, k]: ids inside the draft's vocabulary
        error = (logits.gather(-1, ids) - teacher_logits).square() * counted
        loss = loss + weights.logits * error.sum(-1) / counted.sum(-1).clamp(min=1.0)
    return loss, logits.argmax(-1), (1.0 - l1 / 2).clamp(0.0, 1.0).detach()


def chunked_row_losses(
    model: DFlashDraftModel, lm_head: torch.nn.Module, rows: torch.Tensor, labels: torch.Tensor,
    teacher_probs: torch.Tensor | None = None, teacher_ids: torch.Tensor | None = None,
    chunk_rows: int = LOSS_CHUNK_ROWS, teacher_logits: torch.Tensor | None = None,
    weights: LossWeights = LossWeights(), markov_latent: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_supervised_row_losses` of rows [N, H], `chunk_rows` at a time; with gradients each chunk is checkpointed,
    so the backward recomputes one chunk's logits at a time instead of keeping all of them."""
    if rows.shape[0] == 0:  # nothing supervised: empty losses, predictions and acceptances
        return rows.new_zeros(0, dtype=torch.float32), labels.new_zeros(0), rows.new_zeros(0, dtype=torch.float32)
    recompute = torch.is_grad_enabled() and rows.requires_grad
    losses, predictions, acceptances = [], [], []
    for start in range(0, rows.shape[0], chunk_rows):
        piece = slice(start, start + chunk_rows)
        args = [rows[piece], labels[piece]] + [None if tensor is None else tensor[piece]
                                               for tensor in (teacher_probs, teacher_ids, teacher_logits)]
        latent = None if markov_latent is None else markov_latent[piece]
        if recompute:
            loss, prediction, acceptance = checkpoint(_supervised_row_losses, model, lm_head, *args, weights, latent,
                                                      use_reentrant=False)
        else:
            loss, prediction, acceptance = _supervised_row_losses(model, lm_head, *args, weights, latent)
        losses.append(loss)
        predictions.append(prediction)
        acceptances.append(acceptance)
    return torch.cat(losses), torch.cat(predictions), torch.cat(acceptances)


def markov_latents(model: DFlashDraftModel, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """The Markov head's W2 input [K, P, r] at each block position, from the tokens before them [K, P] and their
    hidden states [K, P, H], position after position (the rnn kind's state starts at zero in each block)."""
    head = model.markov_head
    state = head.initial_state(hidden[:, 0])
    latents = []
    for position in range(hidden.shape[1]):
        latent, state = head.latent(previous[:, position], hidden[:, position], state)  # [K, r]
        latents.append(latent)
    return torch.stack(latents, dim=1)


def confidence_losses(model: DFlashDraftModel, hidden: torch.Tensor, previous: torch.Tensor,
                      acceptance: torch.Tensor) -> torch.Tensor:
    """The confidence head's binary cross-entropy [N] at supervised rows (hidden [N, H], tokens before them [N]) to
    their acceptance [N] (1 - L1 / 2, detached): DeepSpec's target for it."""
    head = model.confidence_head
    embedding = model.markov_head.previous_embedding(previous) if head.with_markov else None
    return F.binary_cross_entropy_with_logits(head(hidden, embedding), acceptance.float(), reduction="none")


def dflash_loss(
    draft: DFlashDraftModel | torch.nn.Module,
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator | None = None,
    signals: TargetSignals | None = None,
    chunk_rows: int = LOSS_CHUNK_ROWS,
    tile_rows: int | None = TILE_ROWS,
    loss_weights: LossWeights = LossWeights(),
) -> StepResult:
    """Position-decayed loss of the draft on one sequence [T], all blocks in one forward (`packed_dflash_loss`)."""
    return packed_dflash_loss(draft, target, [(input_ids, loss_mask)], num_anchors, generator,
                              None if signals is None else [signals], chunk_rows, tile_rows, loss_weights)


def packed_dflash_loss(
    draft: DFlashDraftModel | torch.nn.Module,
    target: torch.nn.Module,
    sequences: list[tuple[torch.Tensor, torch.Tensor]],
    num_anchors: int,
    generator: torch.Generator | None = None,
    signals: list[TargetSignals] | None = None,
    chunk_rows: int = LOSS_CHUNK_ROWS,
    tile_rows: int | None = TILE_ROWS,
    loss_weights: LossWeights = LossWeights(),
) -> StepResult:
    """Mean over `sequences` (input ids [T_i], loss mask [T_i]) of each one's position-decayed loss, all packed into
    one row and one draft forward.

    Each sequence draws its anchors from `generator` in turn (as one call per sequence would) and its blocks see only
    its own context (`pack_blocks`). `signals` (from `target_signals`, one per sequence, possibly cached on the host)
    default to one target forward per sequence without a teacher. With a teacher the loss is the cross-entropy to the
    target's top-k distribution (distillation); without, to the sequence's own tokens; `loss_weights` adds the L1 and
    raw-logit terms (`LossWeights`; the latter needs signals with the teacher's logits). The attention runs under the
    block-sparse mask, `tile_rows` query rows per tile (`tiled_block_mask`), or with None under the dense mask (the
    reference; the same loss). Logits are computed for supervised rows only, `chunk_rows` at a time.

    A draft with its own LM head (config `draft_vocab_size`) is scored by it, over its K tokens: labels (and teacher
    ids) map to its rows (`draft_vocabulary_targets`), a label outside its vocabulary is left out of the loss and
    counted (`StepResult.outside`), and its predictions map back to target ids through `d2t`, so the accuracy counts
    every response label (one outside the vocabulary as a miss).

    A DSpark draft (DeepSpec; docs/training.md, "A Markov head"): with shifted labels each block is [t0, MASK x
    (B-2)] and its every row predicts; a Markov head adds its bias from the token before each position, teacher-forced
    (the anchor's token, then the labels); a confidence head adds `loss_weights.confidence` x its binary cross-entropy
    to each position's acceptance 1 - L1 / 2 (detached), under the same position weights.
    """
    model = getattr(draft, "module", draft)  # the draft itself under a DistributedDataParallel wrapper
    if model.candidate_selector is not None:
        raise ValueError("Training DFlash2 drafts (candidate selector) is not supported; train a DFlashDraftModel.")
    if model.markov_head is not None and model.lm_head is not None:
        raise ValueError("A Markov head biases the target's whole vocabulary; a draft with its own LM head "
                         "(draft_vocab_size) cannot have one: drop --markov-rank or --draft-vocab-size.")
    block_size, mask_token_id = model.block_size, model.mask_token_id
    device = sequences[0][0].device
    if signals is None:
        signals = [target_signals(target, input_ids, model.target_layer_ids) for input_ids, _ in sequences]
    batches = []
    for input_ids, loss_mask in sequences:
        anchors = sample_anchors(loss_mask, num_anchors, generator)
        if len(anchors) == 0:
            raise ValueError("The sequence has no response token to train on (loss_mask is empty after position 0).")
        batches.append(build_blocks(input_ids, loss_mask, anchors, block_size, mask_token_id, model.shifted_labels))
    blocks = pack_blocks(batches)
    num_blocks, rows = len(blocks.context_end), blocks.block_size
    packed = TargetSignals.concatenate([one.to(device) for one in signals])  # [T, ...]: the sequences side by side
    context_positions = torch.cat([torch.arange(len(input_ids), device=device) for input_ids, _ in sequences])  # [T]
    embed_tokens, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        block_embeddings = model.embed_block(blocks.block_ids, embed_tokens.weight)[None]  # [1, K*B, H]
    hidden = draft(
        block_embeddings,
        packed.hidden[None],
        blocks.block_position_ids[None],
        context_positions[None],
        attention_mask=blocks.attention_mask[None, None] if tile_rows is None else tiled_block_mask(blocks, tile_rows),
        block_length=rows,
    )  # [1, K*R, H]; causal / sliding layers add their restriction by position
    hidden = hidden.view(num_blocks, rows, -1)  # [K, R, H]
    hidden = hidden if model.shifted_labels else hidden[:, 1:]  # [K, B-1, H]: positions that predict
    supervised = blocks.label_mask  # [K, B-1]
    # [K, B-1]: the token before each predicted position (the anchor's, then the labels), for the DSpark heads
    previous = torch.cat((blocks.block_ids.view(num_blocks, rows)[:, :1], blocks.labels[:, :-1]), dim=1)
    markov_latent = None if model.markov_head is None else markov_latents(model, previous, hidden)[supervised]
    teacher_probs = teacher_ids = teacher_logits = None
    if packed.teacher_probs is not None:
        # the target's distribution for the token at p + 1 is its output at position p (a column of the row)
        anchors = blocks.block_position_ids.view(num_blocks, rows)[:, :1]  # [K, 1]
        columns = anchors + torch.arange(block_size - 1, device=device) + blocks.context_start[:, None]
        teacher_probs, teacher_ids = packed.teacher_probs[columns[supervised]], packed.teacher_ids[columns[supervised]]
        if packed.teacher_logits is not None:
            teacher_logits = packed.teacher_logits[columns[supervised]]
    if loss_weights.logits > 0 and teacher_logits is None:
        raise ValueError("The raw-logit loss term (--logit-weight) needs the teacher's logits: distillation on "
                         "(--distill) and target signals taken with keep_logits=True.")
    labels = blocks.labels[supervised]  # [N]: target ids
    if model.lm_head is not None:  # its own head: its rows, labels outside its vocabulary left out
        lm_head = model.lm_head
        head_labels, teacher_probs, teacher_ids = draft_vocabulary_targets(model, labels, teacher_probs, teacher_ids)
    else:
        head_labels = labels
    token_loss, predictions, acceptance = chunked_row_losses(model, lm_head, hidden[supervised], head_labels,
                                                             teacher_probs, teacher_ids, chunk_rows, teacher_logits,
                                                             loss_weights, markov_latent)  # [N], [N], [N]
    if model.confidence_head is not None and loss_weights.confidence > 0:
        token_loss = token_loss + loss_weights.confidence * confidence_losses(model, hidden[supervised],
                                                                              previous[supervised], acceptance)
    inside = head_labels != IGNORED_LABEL  # [N]
    if model.lm_head is not None:
        predictions = predictions + model.d2t[predictions]  # the head's rows -> target ids
    weights = position_weights(block_size).to(device)[None, :].expand_as(supervised)[supervised] * inside  # [N]
    row_sequence = blocks.sequence_index[:, None].expand_as(supervised)[supervised]  # [N]
    weighted = torch.zeros(len(sequences), device=device).index_add(0, row_sequence, token_loss * weights)  # [S]
    total_weight = torch.zeros(len(sequences), device=device).index_add(0, row_sequence, weights)  # [S]
    loss = (weighted / total_weight.clamp(min=1e-8)).mean()
    hits = torch.zeros_like(supervised)  # [K, B-1]
    hits[supervised] = predictions == labels
    leading_correct = hits.long().cumprod(dim=1).sum(dim=1)  # what greedy verification would accept
    accepted = torch.zeros(supervised.shape, device=device)  # [K, B-1]
    accepted[supervised] = acceptance.float()
    return StepResult(loss=loss, correct=hits.sum(0).detach(), counted=supervised.sum(0),
                      leading_correct=leading_correct.detach(), expected_accepted=accepted.cumprod(dim=1).sum(dim=1),
                      outside=(~inside).sum(), sequences=len(sequences))
