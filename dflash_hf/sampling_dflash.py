"""Sampling and verification as small pure functions: process logits, pick tokens, count what is accepted.

Hub remote code: imports only torch.
"""

from __future__ import annotations

from typing import Iterable

import torch


def process_logits(
    logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Temperature, then top-k, then top-p filtering (as Transformers' warpers), in float32: [N, V].

    The logits are shifted by their maximum before the division, which changes no softmax: a tiny temperature then
    gives the limit it tends to (all weight on the best tokens), never the NaN that infinite scores would give."""
    scores = logits.float()
    scores = (scores - scores.amax(dim=-1, keepdim=True)) / temperature
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


def draw_uniforms(generators: tuple[torch.Generator | None, ...] | list[torch.Generator | None], count: int,
                  device: torch.device) -> torch.Tensor:
    """Uniform numbers in [0, 1) [n, count] in float64, row i drawn with generators[i] (None: torch's global one)."""
    return torch.stack([torch.rand(count, generator=generator, device=device, dtype=torch.float64)
                        for generator in generators])


def sample_from(probabilities: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per distribution [..., V] (weights: need not sum to 1) by inverse CDF with uniforms [...] in [0, 1).

    Exact in float64, and nothing waits for the device (unlike `torch.multinomial`); tokens of zero weight are never
    drawn.
    """
    cumulative = probabilities.double().cumsum(dim=-1)  # [..., V]
    thresholds = uniforms.to(cumulative.device, torch.float64)[..., None] * cumulative[..., -1:]  # [..., 1]
    tokens = torch.searchsorted(cumulative, thresholds, right=True).squeeze(-1)
    return tokens.clamp(max=probabilities.shape[-1] - 1)


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
    uniforms: torch.Tensor,
    limits: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Standard speculative sampling of n rows at once: (accepted proposals [n], the token that follows them [n]).

    proposals [n, k] were sampled from draft_probabilities [n, k, V]; target_probabilities [n, k + 1, V] are the
    target's (processed) distributions at the same positions and one past them; uniforms [n, k + 1] in [0, 1): k for
    the acceptance tests, one for the token; limits [n]: how many proposals row i may keep (default k). Proposal i is
    kept with probability min(1, p_i / q_i) while all before it were kept; at the first rejection the token is drawn
    from the normalised residual max(p - q, 0), after all allowed acceptances from p. Every token then follows p
    exactly. Pure tensor code: nothing waits for the device.
    """
    num_rows, num_proposals = proposals.shape
    rows = torch.arange(num_rows, device=proposals.device)
    limits = torch.full_like(rows, num_proposals) if limits is None else limits.to(proposals.device)
    q_of_proposals = draft_probabilities.gather(-1, proposals[..., None]).squeeze(-1)  # [n, k]
    p_of_proposals = target_probabilities[:, :num_proposals].gather(-1, proposals[..., None]).squeeze(-1)
    allowed = torch.arange(num_proposals, device=proposals.device) < limits[:, None]  # [n, k]
    kept = (uniforms[:, :num_proposals] * q_of_proposals.double() < p_of_proposals.double()) & allowed  # in float64
    accepted = kept.long().cumprod(dim=1).sum(dim=1)  # [n]
    rejected = accepted < limits  # a proposal was turned down (else: the bonus token, from p)
    if num_proposals > 0:
        residual = (target_probabilities[rows, accepted]
                    - draft_probabilities[rows, accepted.clamp(max=num_proposals - 1)]).clamp(min=0.0)  # [n, V]
        has_residual = residual.sum(dim=-1) > 0
        # p <= q everywhere yet p != q: rounding only (p == q keeps with probability 1), so keep the proposal
        accepted = accepted + (rejected & ~has_residual).long()
        use_residual = rejected & has_residual
    else:
        residual, use_residual = target_probabilities[:, 0], torch.zeros_like(rejected)
    distribution = torch.where(use_residual[:, None], residual, target_probabilities[rows, accepted])  # [n, V]
    return accepted, sample_from(distribution, uniforms[:, num_proposals])
