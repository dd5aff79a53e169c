"""The DFlash decoding loop: draft a block, verify it in one target pass, keep the longest match.

`speculative_decode` takes any proposer and runs a `DecodeSession`: `prefill` (through the call's target backend,
`backends_dflash`), then per step `drop_finished`, the backend's `compact` and one step of the call's strategy
(`steps_dflash`: `plan_step`, `propose`, the strategy's `arrange` and `verify`, `commit`, `keep_context`), then
`finish`. A `DecodeState` holds what one call changes; `DecodingSettings` (settings_dflash) what it was asked.
`spec_generate` wires the loop to a DFlash draft, and `DFlashGenerationMixin` gives a draft model its `spec_generate`
method. See docs/architecture.md.

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

import threading
import time
import weakref
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Sequence

import torch

from .backends_dflash import target_backend
from .cache_dflash import host_to_device, left_padded_positions
from .devices_dflash import execution_device, target_device
from .draft_backends_dflash import draft_backend
from .kernels_dflash import cpu_kernels
from .proposer_dflash import (
    SCHEDULE_NEEDS_COSTS,
    SCHEDULED,
    DFlashDraft,
    DFlashProposer,
    Proposal,
    Proposer,
    check_confidence_threshold,
    deepspec_refusal,
)
from .sampling_dflash import mean_acceptance_length
from .settings_dflash import DecodingSettings, StepCosts, resolve_settings
from .steps_dflash import (
    DecodeState,
    StepPlan,
    StepStrategy,
    TargetContext,
    Verdict,
    apply_rules,
    commit,
    keep_context,
    kept_scores,
    pick_block,
    plan_step,
    propose,
    step_strategy,
    target_scores,
)
from .target_dflash import FeatureCapture


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
    # generate's `scores` and `logits` (output_scores / output_logits with return_dict_in_generate): per new-token
    # index, [N, V] float32, processed and raw; a row's entries after it ended are -inf (generate computes them from
    # the padding it feeds an ended row)
    scores: tuple[torch.Tensor, ...] | None = None
    logits: tuple[torch.Tensor, ...] | None = None

    @property
    def sequences(self) -> torch.Tensor:
        """The output ids [N, T + W], under the name `generate`'s outputs give them."""
        return self.output_ids

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
        """Mean tokens verified per step over every row's steps: the block size (a chain; less where steps were
        shortened, by `step_costs` or at the end), or 1 + tree_size (a tree)."""
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


# --- The stages around the steps (steps_dflash) -----------------------------------------------------------------


def prefill(target: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            layer_ids: list[int] | None, settings: DecodingSettings) -> DecodeState:
    """Run the target over the prompts [N, T] through the call's backend: its cache, the first token of every row,
    the features of the prompts."""
    device = target_device(target)
    input_ids = input_ids.to(device)
    backend = target_backend(target, settings, layer_ids, *input_ids.shape)  # refuses, before any forward
    padded = attention_mask is not None and not bool(attention_mask.bool().all())
    valid = attention_mask.to(device).bool() if padded else torch.ones_like(input_ids, dtype=torch.bool)  # [N, T]
    prompts = [ids[-length:].tolist() for ids, length in zip(input_ids, valid.sum(dim=1).tolist())]
    for prompt, streamer in zip(prompts, settings.streamers or ()):
        streamer.put(torch.tensor([prompt]))
    synchronize(device)
    started = time.perf_counter()
    positions = {"position_ids": left_padded_positions(valid), **({"attention_mask": valid.long()} if padded else {})}
    capture = FeatureCapture(target, layer_ids, device)
    outputs = backend.prefill(input_ids, positions, valid, capture)
    features = capture.result(outputs)  # [N, T, L*H] or None
    state = DecodeState(
        input_ids=input_ids, prompts=prompts, generated=[], acceptance_lengths=[[] for _ in prompts],
        verified_lengths=[[] for _ in prompts], finished=[], active=list(range(len(prompts))), backend=backend,
        layer_ids=layer_ids,
        context=None if features is None else TargetContext.of(features, left_padded_positions(valid),
                                                               valid if padded else None),
        started=started,
    )
    logits = outputs.logits[:, -1:]  # [N, 1, V]
    del outputs
    scores = target_scores(logits, lambda: [[ids] for ids in input_ids], state.active, settings)  # [N, 1, V]
    first_tokens = pick_block(scores, state.active, settings)[:, 0].tolist()
    synchronize(device)
    state.first_token_time = time.perf_counter()
    first = Verdict([[]] * len(prompts), [[token] for token in first_tokens], [[]] * len(prompts), None,
                    *kept_scores(scores, logits, settings))
    state.generated, state.scores, state.logits = ([[] for _ in prompts] for _ in range(3))
    for row, token in enumerate(first_tokens):
        stopped = token in settings.stop_token_ids
        if settings.rules is not None:
            stopped = apply_rules(state, row, row, first, 0, [token], stopped, settings.rules)[2]
        state.generated[row] = [token]
        state.finished.append(stopped or settings.max_new_tokens == 1)
    for token, streamer in zip(first_tokens, settings.streamers or ()):
        streamer.put(torch.tensor([token]))
    return state


def drop_finished(state: DecodeState, proposer: Proposer | None) -> bool:
    """Finished rows leave the live rows (`state.active`), and so every stage after: the backend (`drop_rows`), the
    unseen features and the proposer (`select_rows`); whether any row is still live."""
    still_active = [row for row in state.active if not state.finished[row]]
    if still_active and len(still_active) < len(state.active):
        keep = [state.active.index(row) for row in still_active]
        index = host_to_device(keep, state.device)
        state.backend.drop_rows(keep, index)
        if state.context is not None:
            state.context = state.context.select_rows(index)
        if hasattr(proposer, "select_rows"):
            proposer.select_rows(keep)
        state.active = still_active
    return bool(still_active)


def finish(state: DecodeState, settings: DecodingSettings) -> SpecGenerateOutput:
    """The output ids (prompts as passed, then each row's tokens right-padded) and the statistics."""
    for streamer in settings.streamers or ():
        streamer.end()
    synchronize(state.device)
    ended = time.perf_counter()
    num_new_tokens = [len(tokens) for tokens in state.generated]
    rules = settings.rules
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
        scores=per_new_token(state.scores) if rules is not None and rules.output_scores else None,
        logits=per_new_token(state.logits) if rules is not None and rules.output_logits else None,
    )


def per_new_token(rows: list[list[torch.Tensor]]) -> tuple[torch.Tensor, ...]:
    """`generate`'s layout of per-token vectors: rows[i] holds row i's [k, V] blocks in order; one [N, V] per new-token
    index, -inf where a row had ended."""
    per_row = [torch.cat(blocks) for blocks in rows]  # [n_i, V]
    width = max(blocks.shape[0] for blocks in per_row)
    padded = torch.full((len(per_row), width, per_row[0].shape[1]), float("-inf"), device=per_row[0].device)
    for row, blocks in enumerate(per_row):
        padded[row, : blocks.shape[0]] = blocks
    return tuple(padded.unbind(dim=1))


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
    """One call of the loop over one target: `prefill`, then `step` until it returns False, then `finish`, inside
    `with session.running():`. Each step runs the stages of `steps_dflash` with the call's strategy (a chain, or a
    tree of `tree_size`); the cost model (`dflash_hf.cost_model`) times single stages through `plan`, `propose`,
    `arrange`, `verify` and `discard_verify`, with any strategy."""

    def __init__(self, target: torch.nn.Module, proposer: Proposer | None, settings: DecodingSettings) -> None:
        self.target, self.proposer, self.settings = target, proposer, settings
        self.layer_ids = proposer.target_layer_ids if proposer is not None and settings.block_size > 1 else None
        self.strategy = step_strategy(settings)
        self.state: DecodeState | None = None

    @contextmanager
    def running(self) -> Iterator[DecodeSession]:
        """The call's scope: its target's lock, the CPU kernels (if on) and inference mode (no autograd bookkeeping:
        fewer ops per step); all released when it ends, also after an exception. What an eager call creates in it
        (caches, features) ends with it; a compiled call's target verifier (graph and static cache) and draft graphs
        outlive it, for later calls, and are written only inside calls. `finish`, outside it, returns ordinary tensors
        the caller may change in place."""
        with ExitStack() as scope:
            scope.enter_context(call_lock(self.target))
            scope.enter_context(cpu_kernels(self.settings.cpu_kernels))
            scope.enter_context(torch.inference_mode())
            yield self

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> None:
        """The prompts' pass: the cache, the first token of every row, the prompts' features."""
        self.state = prefill(self.target, input_ids, attention_mask, self.layer_ids, self.settings)

    def step(self) -> bool:
        """One draft-and-verify step over the active rows; False once every row has finished."""
        state, settings, strategy = self.state, self.settings, self.strategy
        if not drop_finished(state, self.proposer):
            return False
        state.backend.compact()
        step = plan_step(state, settings)
        proposal = propose(self.proposer, state, step, settings, strategy.num_candidates)
        step, proposal = strategy.arrange(state, step, proposal, settings)
        verdict = strategy.verify(state, step, proposal, settings)
        accepted_counts = commit(state, step, verdict, settings)
        keep_context(state, step, verdict, accepted_counts)
        return True

    def finish(self) -> SpecGenerateOutput:
        """The output ids and statistics of the call."""
        return finish(self.state, self.settings)

    # Single stages, for the cost model: each leaves the state as `discard_verify` finds it

    def plan(self, width: int | None = None) -> StepPlan:
        """The next step's block (at most `width` tokens per row; default: the call's block size)."""
        settings = self.settings if width is None else replace(self.settings, block_size=width)
        return plan_step(self.state, settings)

    def propose(self, step: StepPlan, strategy: StepStrategy | None = None) -> Proposal:
        """The proposer's tokens for the step (with the candidates `strategy` asks for; default: the call's); it reads
        the features it has not seen (none after a draft pass)."""
        return propose(self.proposer, self.state, step, self.settings, (strategy or self.strategy).num_candidates)

    def arrange(self, step: StepPlan, proposal: Proposal, strategy: StepStrategy | None = None
                ) -> tuple[StepPlan, Proposal]:
        """What `strategy` (default: the call's) verifies of the step and its proposal."""
        return (strategy or self.strategy).arrange(self.state, step, proposal, self.settings)

    def verify(self, step: StepPlan, proposal: Proposal, strategy: StepStrategy | None = None) -> Verdict:
        """One verify by `strategy` (default: the call's); the cache holds its columns until `discard_verify`."""
        return (strategy or self.strategy).verify(self.state, step, proposal, self.settings)

    def discard_verify(self) -> None:
        """Forget the last verify: the backend's cache and columns as before it (`discard`; the eager backends, which
        the cost model times, also forget a keep after it)."""
        self.state.backend.discard()


@torch.no_grad()
def speculative_decode(
    target: torch.nn.Module,
    proposer: Proposer | None,
    input_ids: torch.Tensor,
    *,
    max_new_tokens: int | None = None,
    block_size: int | None = None,
    attention_mask: torch.Tensor | None = None,
    settings: DecodingSettings | None = None,
    **arguments: Any,
) -> SpecGenerateOutput:
    """Draft-and-verify decoding of N left-padded prompts [N, T] with any proposer; exact for every proposer.

    `settings`: as resolved by `settings_dflash.resolve_settings`; else it is resolved here from the keyword
    arguments, `spec_generate`'s (docs/api.md, "`spec_generate` arguments"), over the target's generation
    config.
    """
    if settings is None:
        settings = resolve_settings(target, input_ids, None, attention_mask=attention_mask,
                                    max_new_tokens=max_new_tokens, block_size=block_size, **arguments)
    session = DecodeSession(target, proposer, settings)
    with session.running():
        session.prefill(input_ids, settings.attention_mask if attention_mask is None else attention_mask)
        while session.step():
            pass
    return session.finish()


# --- spec_generate: the loop with a DFlash draft ---------------------------------------------------------------------


def dflash_proposer(draft: DFlashDraft, target: torch.nn.Module, settings: DecodingSettings, prompt_width: int = 0,
                    num_rows: int = 1, confidence_threshold: float | str | None = None) -> DFlashProposer:
    """The proposer `spec_generate` runs: the draft with the call's mask id, acceptance rule, draft vocabulary and
    draft backend (`draft_backend`; compiled: a context cache of `num_rows` rows for prompts `prompt_width` wide), and
    a DSpark draft's confidence cut (`confidence_threshold`, DeepSpec's: None or 0 for none; "auto": the verify width
    scheduled from its confidences and `settings.step_costs`)."""
    check_confidence_threshold(draft, confidence_threshold)
    refusal = deepspec_refusal(draft, settings.tree_size, confidence_threshold)
    if refusal is not None:
        raise ValueError(refusal)
    if confidence_threshold == SCHEDULED and settings.step_costs is None:
        raise ValueError(SCHEDULE_NEEDS_COSTS)
    backend = draft_backend(draft, settings.compile, num_rows,
                            prompt_width + settings.max_new_tokens + settings.block_size,
                            execution_device(target.get_input_embeddings()), settings.block_size)
    return DFlashProposer(draft, target, settings.mask_token_id, sample_proposals=settings.acceptance == "rejection",
                          draft_vocab=settings.draft_vocab, backend=backend, confidence_threshold=confidence_threshold)


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
    cpu_kernels: bool | str | None = None,
    do_sample: bool | None = None,
    generation_config: Any = None,
    tree_size: int | None = None,
    compile: bool | dict[str, Any] = False,
    logits_processor: Any = None,
    stopping_criteria: Any = None,
    prefix_allowed_tokens_fn: Any = None,
    tokenizer: Any = None,
    draft_processors: str = "built",
    confidence_threshold: float | str | None = None,
    **generation_settings: Any,
) -> torch.Tensor | SpecGenerateOutput:
    """Generate with `target`, drafting blocks with `draft`; returns ids [N, prompt + new] (or stats too).

    Every setting is keyword-only and described once, in docs/api.md, "`spec_generate` arguments"; settings not
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
        logits_processor=logits_processor, stopping_criteria=stopping_criteria,
        prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, tokenizer=tokenizer, draft_processors=draft_processors,
        **generation_settings)
    proposer = dflash_proposer(draft, target, settings, prompt_width=input_ids.shape[1], num_rows=input_ids.shape[0],
                               confidence_threshold=confidence_threshold)
    result = speculative_decode(target, proposer, input_ids, attention_mask=attention_mask, settings=settings)
    return result if return_stats or settings.return_dict else result.output_ids


class DFlashGenerationMixin:
    """Gives a DFlash draft model its `spec_generate` method, as Transformers' models get `generate` from
    `GenerationMixin`."""

    def spec_generate(self, target: torch.nn.Module, input_ids: torch.Tensor,
                      **generation_kwargs: Any) -> torch.Tensor | SpecGenerateOutput:
        """Lossless speculative decoding with `target`: ids [N, prompt + new], or `SpecGenerateOutput` with stats.
        Every setting is a keyword argument, described in docs/api.md, "`spec_generate` arguments"; what is not
        passed comes from the target's generation config, as in `generate`."""
        return spec_generate(self, target, input_ids, **generation_kwargs)
