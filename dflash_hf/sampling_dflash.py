"""Sampling and verification as small pure functions: process logits, pick tokens, count what is accepted.

Hub remote code: imports only torch.
"""

from __future__ import annotations

from typing import Iterable

import torch


def process_logits(
    logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Temperature, then top-k, then top-p filtering (as Transformers' warpers), in float32: [N, V]."""
    scores = logits.float() / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth_best = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # [N, 1]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, sorted_indices = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cumulative <= (1.0 - top_p)
        sorted_remove[..., -1:] = False  # always keep the best token
        remove = sorted_remove.scatter(-1, sorted_indices, sorted_remove)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def pick_tokens(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row of logits [N, V]: argmax at temperature 0, else a sample of the processed distribution."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probabilities = process_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(-1)  # [N]


def count_accepted(proposals: list[int], target_tokens: list[int]) -> int:
    """Number of leading proposals (B-1) equal to the target's tokens (B) at the same positions."""
    accepted = 0
    while accepted < len(proposals) and proposals[accepted] == target_tokens[accepted]:
        accepted += 1
    return accepted


def first_stop_index(tokens: list[int], stop_token_ids: set[int] | frozenset[int]) -> int | None:
    """Index of the first stop token in `tokens`, or None."""
    for index, token in enumerate(tokens):
        if token in stop_token_ids:
            return index
    return None


def cut_after_stop(tokens: list[int], stop_token_ids: set[int] | frozenset[int]) -> list[int]:
    """`tokens` up to and including the first stop token (all of them when there is none)."""
    stop_at = first_stop_index(tokens, stop_token_ids)
    return tokens if stop_at is None else tokens[: stop_at + 1]


def commit_block(
    proposed: list[int], target_tokens: list[int], limit: int, stop_token_ids: set[int] | frozenset[int]
) -> tuple[int, list[int], bool]:
    """One row's verify: (accepted proposals, tokens committed, whether a stop token ended the row).

    The first `limit` positions at most are committed (what max_new_tokens still allows), cut after a stop token.
    """
    accepted = count_accepted(proposed[: limit - 1], target_tokens[:limit])
    committed = proposed[:accepted] + [target_tokens[accepted]]
    kept = cut_after_stop(committed, stop_token_ids)
    return accepted, kept, kept[-1] in stop_token_ids


def mean_acceptance_length(acceptance_lengths: Iterable[int]) -> float:
    """tau: the mean number of tokens committed per draft/verify step (0.0 when no step ran)."""
    lengths = list(acceptance_lengths)
    return sum(lengths) / len(lengths) if lengths else 0.0


def speculative_sample(
    proposals: torch.Tensor,
    draft_probabilities: torch.Tensor,
    target_probabilities: torch.Tensor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Standard speculative sampling of one row: (accepted proposals, the token that follows them).

    proposals [k] were sampled from draft_probabilities [k, V]; target_probabilities [k + 1, V] are the target's
    (processed) distributions at the same positions and one past them. Proposal i is kept with probability
    min(1, p_i / q_i) while all before it were kept; at the first rejection the token is sampled from the normalised
    residual max(p - q, 0), and after k acceptances from p at position k. Every token then follows p exactly.
    """
    num_proposals = proposals.shape[0]
    positions = torch.arange(num_proposals, device=proposals.device)
    uniforms = torch.rand(num_proposals, generator=generator, device=proposals.device)
    kept = uniforms * draft_probabilities[positions, proposals] < target_probabilities[positions, proposals]  # [k]
    accepted = int(kept.long().cumprod(dim=0).sum())  # one device sync
    distribution = target_probabilities[accepted]  # [V]
    if accepted < num_proposals:
        residual = (distribution - draft_probabilities[accepted]).clamp(min=0.0)
        if bool(residual.sum() > 0):
            distribution = residual
        else:  # p <= q everywhere yet p != q: rounding only (p == q keeps with probability 1), so keep the proposal
            accepted += 1
            distribution = target_probabilities[accepted]
    token = torch.multinomial(distribution / distribution.sum(), 1, generator=generator)
    return accepted, int(token)
