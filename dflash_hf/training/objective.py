"""The DFlash training objective (design doc section 4): random anchors, sparse block mask, decayed loss.

All blocks of a sequence train in one draft forward: the context rows (target features of every
position) are computed once, and a boolean mask lets each block see only the context strictly
before its anchor plus its own block.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..target_dflash import select_features
from ..modeling_dflash import DFlashDraftModel

DECAY_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}  # the paper's gamma per block size


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


@torch.no_grad()
def target_signals(
    target: torch.nn.Module, input_ids: torch.Tensor, target_layer_ids: list[int], teacher_top_k: int | None = None
) -> TargetSignals:
    """Run the frozen target once over a sequence [T]; keep the features and, if asked, its top-k."""
    outputs = target(input_ids[None], output_hidden_states=True)
    hidden = select_features(outputs.hidden_states, target_layer_ids)[0]
    if teacher_top_k is None:
        return TargetSignals(hidden)
    top = outputs.logits[0].float().topk(teacher_top_k, dim=-1)
    return TargetSignals(hidden, top.values.softmax(-1), top.indices)


def dflash_loss(
    draft: DFlashDraftModel | torch.nn.Module,
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    num_anchors: int,
    generator: torch.Generator | None = None,
    signals: TargetSignals | None = None,
) -> StepResult:
    """Position-decayed loss of the draft on one sequence [T], all blocks in one forward.

    `signals` (from `target_signals`, possibly cached) default to one target forward without a teacher.
    With a teacher the loss is the cross-entropy to the target's top-k distribution (distillation);
    without, to the sequence's own tokens.
    """
    model = getattr(draft, "module", draft)  # the draft itself under a DistributedDataParallel wrapper
    if model.candidate_selector is not None:
        raise ValueError("Training DFlash2 drafts (candidate selector) is not supported; train a DFlashDraftModel.")
    block_size, mask_token_id = model.block_size, model.mask_token_id
    if signals is None:
        signals = target_signals(target, input_ids, model.target_layer_ids)
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
        torch.arange(input_ids.shape[0], device=input_ids.device)[None],
        attention_mask=blocks.attention_mask[None, None],
        block_length=block_size,
    )  # [1, K*B, H]; causal / sliding layers add their restriction by position
    hidden = hidden.view(len(anchors), block_size, -1)[:, 1:]  # [K, B-1, H]: positions that predict
    # a contiguous 2-D input keeps the LM head on one matrix multiply (a strided 3-D one falls back to bmm)
    logits = model.scale_logits(lm_head(hidden.reshape(-1, hidden.shape[-1]).to(lm_head.weight.dtype))).float()
    logits = logits.view(len(anchors), block_size - 1, -1)  # [K, B-1, V]
    if signals.teacher_probs is not None:
        # the target's distribution for the token at p + 1 is its output at position p
        positions = blocks.block_position_ids.view(len(anchors), block_size)[:, :-1].clamp(max=input_ids.shape[0] - 1)
        log_probs = logits.log_softmax(-1).gather(-1, signals.teacher_ids[positions])  # [K, B-1, k]
        token_loss = -(signals.teacher_probs[positions] * log_probs).sum(-1)
    else:
        token_loss = F.cross_entropy(logits.flatten(0, 1), blocks.labels.flatten(), reduction="none").view_as(blocks.labels)
    weights = position_weights(block_size).to(logits.device)[None, :] * blocks.label_mask  # [K, B-1]
    loss = (token_loss * weights).sum() / weights.sum().clamp(min=1e-8)
    hits = (logits.argmax(-1) == blocks.labels) & blocks.label_mask  # [K, B-1]
    leading_correct = hits.long().cumprod(dim=1).sum(dim=1)  # what greedy verification would accept
    return StepResult(loss=loss, correct=hits.sum(0).detach(), counted=blocks.label_mask.sum(0),
                      leading_correct=leading_correct.detach())
