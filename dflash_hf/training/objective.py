"""The DFlash training objective (docs/training.md): random anchors, sparse block mask, decayed loss.

All blocks of a sequence train in one draft forward: the context rows (target features of every
position) are computed once, and a boolean mask lets each block see only the context strictly
before its anchor plus its own block.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Callable

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..modeling_dflash import DFlashDraftModel
from ..target_dflash import FeatureCapture, plain_head_parts

DECAY_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # the paper's gamma per block size
# LM-head rows per chunk, in the loss and the teacher's top-k: peak logits memory is about this x V x 4 B x a few
# (Qwen3-8B: 1024 x 151,936 x 4 B = 0.6 GiB per copy), whatever the number of blocks.
LOSS_CHUNK_ROWS = 1024


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
    """Inputs and labels of all blocks of one sequence."""

    block_ids: torch.Tensor  # [K*B]: [token at anchor, MASK, ...] per block
    block_position_ids: torch.Tensor  # [K*B]: anchor .. anchor + B - 1
    labels: torch.Tensor  # [K, B-1]: tokens at anchor + 1 .. anchor + B - 1 (0 where invalid)
    label_mask: torch.Tensor  # [K, B-1]: label exists and is a response token
    attention_mask: torch.Tensor  # [K*B, T + K*B] bool: context before the anchor + own block


def build_blocks(
    input_ids: torch.Tensor, loss_mask: torch.Tensor, anchors: torch.Tensor, block_size: int, mask_token_id: int
) -> BlockBatch:
    """Block inputs, labels and the sparse attention mask for anchors [K] in one sequence [T]."""
    length, num_blocks = input_ids.shape[0], anchors.shape[0]
    device = input_ids.device
    offsets = torch.arange(block_size, device=device)
    positions = anchors[:, None] + offsets  # [K, B]
    block_ids = torch.full((num_blocks, block_size), mask_token_id, dtype=torch.long, device=device)
    block_ids[:, 0] = input_ids[anchors]
    label_positions = positions[:, 1:]  # [K, B-1]
    in_range = label_positions < length
    clamped = label_positions.clamp(max=length - 1)
    labels = torch.where(in_range, input_ids[clamped], torch.zeros_like(clamped))
    label_mask = in_range & loss_mask.bool()[clamped]

    context_visible = torch.arange(length, device=device)[None, :] < anchors[:, None]  # [K, T]
    block_of_row = torch.arange(num_blocks, device=device).repeat_interleave(block_size)  # [K*B]
    own_block = block_of_row[:, None] == block_of_row[None, :]  # [K*B, K*B]
    attention_mask = torch.cat((context_visible[block_of_row], own_block), dim=1)
    return BlockBatch(block_ids.flatten(), positions.flatten(), labels, label_mask, attention_mask)


@dataclass
class StepResult:
    """Loss and per-position accuracy of one sequence."""

    loss: torch.Tensor  # scalar, differentiable
    correct: torch.Tensor  # [B-1]: correct argmax predictions per block position
    counted: torch.Tensor  # [B-1]: labels per block position
    leading_correct: torch.Tensor  # [K]: correct predictions before the first miss, per block (its tau - 1)


@dataclass
class TargetSignals:
    """What the frozen target gives a training sequence: features, and its top-k next-token distribution."""

    hidden: torch.Tensor  # [T, L*H]: concatenated outputs of the target layers feeding the draft
    teacher_probs: torch.Tensor | None = None  # [T, k]: top-k probabilities of the token at p + 1 (renormalised)
    teacher_ids: torch.Tensor | None = None  # [T, k]

    def apply(self, function: Callable[[torch.Tensor], torch.Tensor]) -> TargetSignals:
        """The same signals with `function` applied to each tensor."""
        return replace(self, **{f.name: function(getattr(self, f.name)) for f in fields(self)
                                if getattr(self, f.name) is not None})

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
) -> TargetSignals:
    """Run the frozen target once over a sequence [T]; keep the features and, if asked, its top-k.

    needed_rows [T] (bool, e.g. `teacher_rows(loss_mask)`): positions whose top-k the loss reads (default: all);
    the others get zero probabilities. The LM head runs on those rows only, `chunk_rows` at a time, wherever the
    target's logits are exactly its head's (`plain_head_parts`); otherwise the target's own forward gives them.
    """
    hidden, final, logits = target_features(target, input_ids, target_layer_ids)
    if teacher_top_k is None:
        return TargetSignals(hidden)
    rows = torch.ones_like(input_ids, dtype=torch.bool) if needed_rows is None else needed_rows.to(input_ids.device)
    positions = rows.nonzero().flatten()  # [P]
    probs = torch.zeros(len(input_ids), teacher_top_k, device=input_ids.device)  # [T, k]
    ids = torch.zeros(len(input_ids), teacher_top_k, dtype=torch.long, device=input_ids.device)
    lm_head = target.get_output_embeddings()
    for chunk in positions.split(chunk_rows):
        chunk_logits = lm_head(final[chunk]) if logits is None else logits[chunk]  # [c, V]
        top = chunk_logits.float().topk(teacher_top_k, dim=-1)
        probs[chunk], ids[chunk] = top.values.softmax(-1), top.indices
    return TargetSignals(hidden, probs, ids)


def _supervised_row_losses(
    model: DFlashDraftModel, lm_head: torch.nn.Module, rows: torch.Tensor, labels: torch.Tensor,
    teacher_probs: torch.Tensor | None, teacher_ids: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss [n], argmax prediction [n]) of supervised rows [n, H]: cross-entropy to labels [n], or to the teacher."""
    logits = model.scale_logits(lm_head(rows.to(lm_head.weight.dtype))).float()  # [n, V]
    if teacher_probs is None:
        return F.cross_entropy(logits, labels, reduction="none"), logits.argmax(-1)
    return -(teacher_probs * logits.log_softmax(-1).gather(-1, teacher_ids)).sum(-1), logits.argmax(-1)


def chunked_row_losses(
    model: DFlashDraftModel, lm_head: torch.nn.Module, rows: torch.Tensor, labels: torch.Tensor,
    teacher_probs: torch.Tensor | None = None, teacher_ids: torch.Tensor | None = None,
    chunk_rows: int = LOSS_CHUNK_ROWS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`_supervised_row_losses` of rows [N, H], `chunk_rows` at a time; with gradients each chunk is checkpointed,
    so the backward recomputes one chunk's logits at a time instead of keeping all of them."""
    if rows.shape[0] == 0:  # nothing supervised: empty losses and predictions
        return rows.new_zeros(0, dtype=torch.float32), labels.new_zeros(0)
    recompute = torch.is_grad_enabled() and rows.requires_grad
    losses, predictions = [], []
    for start in range(0, rows.shape[0], chunk_rows):
        piece = slice(start, start + chunk_rows)
        args = (rows[piece], labels[piece], None if teacher_probs is None else teacher_probs[piece],
                None if teacher_ids is None else teacher_ids[piece])
        if recompute:
            loss, prediction = checkpoint(_supervised_row_losses, model, lm_head, *args, use_reentrant=False)
        else:
            loss, prediction = _supervised_row_losses(model, lm_head, *args)
        losses.append(loss)
        predictions.append(prediction)
    return torch.cat(losses), torch.cat(predictions)


def dflash_loss(
    draft: DFlashDraftModel | torch.nn.Module,
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator | None = None,
    signals: TargetSignals | None = None,
    chunk_rows: int = LOSS_CHUNK_ROWS,
) -> StepResult:
    """Position-decayed loss of the draft on one sequence [T], all blocks in one forward.

    `signals` (from `target_signals`, possibly cached on the host) default to one target forward without a teacher.
    With a teacher the loss is the cross-entropy to the target's top-k distribution (distillation); without, to the
    sequence's own tokens. Logits are computed for supervised rows only, `chunk_rows` at a time.
    """
    model = getattr(draft, "module", draft)  # the draft itself under a DistributedDataParallel wrapper
    if model.candidate_selector is not None:
        raise ValueError("Training DFlash2 drafts (candidate selector) is not supported; train a DFlashDraftModel.")
    block_size, mask_token_id = model.block_size, model.mask_token_id
    device = input_ids.device
    signals = target_signals(target, input_ids, model.target_layer_ids) if signals is None else signals.to(device)
    anchors = sample_anchors(loss_mask, num_anchors, generator)
    if len(anchors) == 0:
        raise ValueError("The sequence has no response token to train on (loss_mask is empty after position 0).")
    blocks = build_blocks(input_ids, loss_mask, anchors, block_size, mask_token_id)
    embed_tokens, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    with torch.no_grad():
        block_embeddings = model.embed_block(blocks.block_ids, embed_tokens.weight)[None]  # [1, K*B, H]
    hidden = draft(
        block_embeddings,
        signals.hidden[None],
        blocks.block_position_ids[None],
        torch.arange(input_ids.shape[0], device=device)[None],
        attention_mask=blocks.attention_mask[None, None],
        block_length=block_size,
    )  # [1, K*B, H]; causal / sliding layers add their restriction by position
    hidden = hidden.view(len(anchors), block_size, -1)[:, 1:]  # [K, B-1, H]: positions that predict
    supervised = blocks.label_mask  # [K, B-1]
    teacher_probs = teacher_ids = None
    if signals.teacher_probs is not None:
        # the target's distribution for the token at p + 1 is its output at position p
        positions = blocks.block_position_ids.view(len(anchors), block_size)[:, :-1][supervised]  # [N]
        teacher_probs, teacher_ids = signals.teacher_probs[positions], signals.teacher_ids[positions]  # [N, k]
    token_loss, predictions = chunked_row_losses(model, lm_head, hidden[supervised], blocks.labels[supervised],
                                                 teacher_probs, teacher_ids, chunk_rows)  # [N], [N]
    weights = position_weights(block_size).to(device)[None, :].expand_as(supervised)[supervised]  # [N]
    loss = (token_loss * weights).sum() / weights.sum().clamp(min=1e-8)
    hits = torch.zeros_like(supervised)  # [K, B-1]
    hits[supervised] = predictions == blocks.labels[supervised]
    leading_correct = hits.long().cumprod(dim=1).sum(dim=1)  # what greedy verification would accept
    return StepResult(loss=loss, correct=hits.sum(0).detach(), counted=supervised.sum(0),
                      leading_correct=leading_correct.detach())
