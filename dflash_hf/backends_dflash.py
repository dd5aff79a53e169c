"""The target's side of one call, behind one seam: `TargetBackend`.

A backend owns what the target holds from the prefill on: the cache it creates and the columns each row's positions
sit in (`cache_dflash.CacheColumns`), the verify forward with its mask and positions, and what follows a verify:
`keep` (the accepted columns), `discard` (the verify), `compact` (the holes), `drop_rows` (finished rows). The steps
(`steps_dflash`) call these methods and never ask which backend runs; the strategies (chain, tree) are orthogonal to
it: `verify` takes the `masks_dflash.VerifyLayout` a strategy built (positions, which columns each sees, the paths).

- `EagerBackend`: a DynamicCache cropped after every verify; finished rows leave the batch; a chain's verify passes
  a 2-D mask only where columns are not positions.
- `static_dflash.StaticBackend` (`compile=True`): a fixed-address StaticCache, a fixed verify width under
  `torch.compile` (CUDA graphs on a GPU). Its batch keeps every row; `static_dflash.FixedRowBatch` around it (and
  around its rollback) gives the steps the live rows only.
- A hybrid target's backend is one of those wrapped in its rollback, which hands the inner backend a hook around each
  verify (`around`) and rolls each recurrent layer back to the kept columns after `keep`: `RecurrentRollback` (eager,
  `recurrent_dflash`), `static_recurrent_dflash.StaticRecurrentRollback` (compiled, Gated DeltaNet layers).

As vLLM's model runner sits beside its proposer: the proposer (`proposer_dflash`) drafts, the backend verifies.
See docs/architecture.md, "The target backend". Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Protocol, runtime_checkable

import torch

from .cache_dflash import CacheColumns, crop_cache, full_history_cache, reorder_cache_columns, select_cache_rows
from .devices_dflash import mask_dtype, target_device, target_text_config
from .masks_dflash import VerifyLayout, position_attention
from .mixers_dflash import rollback_mixers
from .recurrent_dflash import RecurrentStates, RollbackWrapper
from .settings_dflash import DecodingSettings
from .static_dflash import FixedRowBatch, StaticBackend
from .static_recurrent_dflash import StaticRecurrentRollback, check_compiled_rollback
from .support_dflash import check_cache, config_cache, sliding_window
from .target_dflash import NO_HOOK, FeatureCapture, last_logits_only, prefill_forward, verify_forward
from .tree_dflash import PathPlan
from .versions_dflash import cache_keyword, returned_cache


class TargetBackend(Protocol):
    """The target's side of one call: its cache and columns, the verify, and what follows it."""

    columns: CacheColumns  # which cache columns hold each row's positions (set by `prefill`)

    def prefill(self, input_ids: torch.Tensor, attention: dict[str, torch.Tensor], valid: torch.Tensor,
                capture: FeatureCapture) -> Any:
        """The prompts' forward [N, T] (`attention`: positions, and a mask where rows are padded; valid [N, T]) into
        a new cache, the features captured by `capture`: the forward's outputs (logits of the last column)."""

    def step_width(self, block_size: int, longest_remaining: int) -> int:
        """The next step's block width, given the call's block size and the most tokens a row still needs."""

    def verify(self, input_ids: torch.Tensor, layout: VerifyLayout) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target over input_ids [n, b] after the cache's columns, at `layout`'s positions, each column seeing the
        verify columns `layout` says (a chain: those before it; a tree: its ancestors): (logits [n, b, V], the
        features [n, b, L*H] of every column, or None). The cache holds the columns until `keep` or `discard`."""

    def keep(self, kept_columns: list[list[int]], kept: torch.Tensor) -> None:
        """After a verify: each row keeps its verify columns `kept_columns` (kept [n, w] as a mask over the first w);
        the rest leaves the cache (recurrent states: rolled back to them)."""

    def discard(self) -> None:
        """Forget the last verify, before any keep of it: the cache as it was before the verify."""

    def compact(self) -> None:
        """Drop the cache's holes when the backend's budget says so."""

    def drop_rows(self, keep: list[int], index: torch.Tensor) -> None:
        """Rows finished: every later call takes and returns the rows `keep` (index: the same on the device) only."""


@runtime_checkable
class TimedBackend(TargetBackend, Protocol):
    """A backend whose single stages the cost model times (the eager ones: compile=True refuses step costs): one
    token of plain decoding too, and a `discard` that also forgets a keep after the verify."""

    def decode_token(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        """One token of plain decoding [n, 1] over the cache (the cost model's unit); undone by `discard`."""

    def discard(self) -> None:
        """Forget the last verify (or decode_token) and any keep after it: the cache as it was before."""


class EagerBackend:
    """The target's own forward over a DynamicCache (a full-history one where layers have a sliding window), cropped
    to the kept columns after every verify."""

    def __init__(self, target: torch.nn.Module, layer_ids: list[int] | None) -> None:
        self.target, self.layer_ids = target, layer_ids
        self.config = target_text_config(target)
        self.device = target_device(target)
        self.cache_argument = cache_keyword(target)
        self.window = sliding_window(self.config)
        self.cache: Any = None
        self.columns: CacheColumns | None = None
        self.before: CacheColumns | None = None  # the columns before the last verify (what `discard` restores)

    def prefill(self, input_ids: torch.Tensor, attention: dict[str, torch.Tensor], valid: torch.Tensor,
                capture: FeatureCapture) -> Any:
        """The prompts' forward into a new DynamicCache."""
        cache = full_history_cache(self.target, self.config)  # None: the target's own cache can be cropped
        outputs = prefill_forward(self.target, input_ids, attention, capture,
                                  {} if cache is None else {self.cache_argument: cache})
        self.cache = returned_cache(outputs)
        check_cache(self.cache, self.target, input_ids.shape[0])
        # the model counts its window in columns: each row's positions must stay adjacent (see CacheColumns)
        self.columns = CacheColumns(valid, valid.sum(dim=1).tolist(), contiguous=cache is not None)
        return outputs

    def step_width(self, block_size: int, longest_remaining: int) -> int:
        """The block size, or what the longest row still needs."""
        return min(block_size, longest_remaining)

    def attention(self, layout: VerifyLayout) -> dict[str, Any]:
        """A verify's positions and mask: where each column sees those before it (a chain), 2-D and only where
        columns are not positions (the model adds causality and its window); else 4-D (each column sees what
        `layout.sees` says: a tree's, its ancestors), per layer type where layers have a window, which it counts in
        positions."""
        positions = layout.positions
        if layout.sees is None:
            mask = self.columns.attention_mask(positions.shape[1])
            return {"position_ids": positions, **({} if mask is None else {"attention_mask": mask.long()})}
        mask = position_attention(self.columns, layout.sees, positions, mask_dtype(self.target), self.config,
                                  self.window)
        return {"position_ids": positions, "attention_mask": mask}

    def verify(self, input_ids: torch.Tensor, layout: VerifyLayout, around: AbstractContextManager[None] = NO_HOOK
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The target's forward over the verify columns; the cache grows in place. `around` (a wrapper's hooks) is
        entered around the forward only."""
        self.before = self.columns.copy()
        capture = FeatureCapture(self.target, self.layer_ids, self.device)
        logits, outputs = verify_forward(self.target, capture, around, input_ids=input_ids, use_cache=True,
                                         **self.attention(layout), **{self.cache_argument: self.cache})
        features = capture.result(outputs)  # [n, b, L*H] or None
        del outputs  # its cache is self.cache; nothing else of it is kept
        return logits.to(self.device), features

    def keep(self, kept_columns: list[list[int]], kept: torch.Tensor) -> None:
        """The kept columns join the cache's; it is cropped to them (holes where a row kept fewer)."""
        self.columns.append(kept, [len(columns) for columns in kept_columns])
        crop_cache(self.cache, self.columns.width)

    def discard(self) -> None:
        """The columns and the cache as before the last verify (or decode_token), a keep after it included."""
        if self.before is not None:
            self.columns = self.before
        crop_cache(self.cache, self.columns.width)

    def compact(self) -> None:
        """Drop the holes once they pass the budget (or, windowed, once a row's positions are not adjacent)."""
        order = self.columns.compaction()
        if order is not None:
            reorder_cache_columns(self.cache, order)

    def drop_rows(self, keep: list[int], index: torch.Tensor) -> None:
        """Finished rows leave the cache."""
        select_cache_rows(self.cache, index)
        self.columns.select_rows(keep, index)

    def decode_token(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        """The target's own one-token forward, its LM head over that token."""
        self.before = self.columns.copy()
        return self.target(input_ids=input_ids, position_ids=positions, use_cache=True,
                           **last_logits_only(self.target), **{self.cache_argument: self.cache})


class RecurrentRollback(RollbackWrapper):
    """A hybrid target's eager backend: the `EagerBackend`, with each recurrent layer's state recorded around every
    verify and rolled back to the kept columns after it (`recurrent_dflash.RecurrentStates`); a tree's mixers run
    along its root-to-leaf paths. Its compiled counterpart: `static_recurrent_dflash.StaticRecurrentRollback`."""

    def __init__(self, inner: EagerBackend) -> None:
        self.inner = inner
        self.states: RecurrentStates | None = None

    def prefill(self, input_ids: torch.Tensor, attention: dict[str, torch.Tensor], valid: torch.Tensor,
                capture: FeatureCapture) -> Any:
        """The inner prefill; then the recurrent layers of its cache."""
        outputs = self.inner.prefill(input_ids, attention, valid, capture)
        self.states = RecurrentStates(self.inner.cache, rollback_mixers(self.inner.target, self.inner.cache))
        return outputs

    def verify(self, input_ids: torch.Tensor, layout: VerifyLayout) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The inner verify, recording the states it starts from and the mixers' inputs (a tree's mixers: run along
        `layout.paths`)."""
        plan = None if layout.paths is None else PathPlan.of(layout.paths, input_ids.shape[1], input_ids.device)
        return self.inner.verify(input_ids, layout, around=self.states.recording(plan))

    def keep(self, kept_columns: list[list[int]], kept: torch.Tensor) -> None:
        """The inner keep; each recurrent layer advanced over exactly the kept columns."""
        self.inner.keep(kept_columns, kept)
        self.states.advance(kept_columns, self.inner.columns.width)

    def discard(self) -> None:
        """The recurrent states and the inner backend as before the last verify (or decode_token), a keep after it
        included."""
        self.states.restore()
        self.inner.discard()

    def drop_rows(self, keep: list[int], index: torch.Tensor) -> None:
        """The inner row selection (recurrent layers select their rows too)."""
        self.inner.drop_rows(keep, index)

    def decode_token(self, input_ids: torch.Tensor, positions: torch.Tensor) -> Any:
        """The inner one-token forward, recorded so that `discard` undoes it."""
        with self.states.recording():
            return self.inner.decode_token(input_ids, positions)


def target_backend(target: torch.nn.Module, settings: DecodingSettings, layer_ids: list[int] | None, num_rows: int,
                   prompt_width: int) -> TargetBackend:
    """The call's backend: compiled (`settings.compile`), else eager, wrapped in its recurrent rollback where the
    target has recurrent layers (refused here, before any forward, where they could not be rolled back)."""
    mixers = rollback_mixers(target, config_cache(target_text_config(target)))
    if settings.compile is None:
        backend = EagerBackend(target, layer_ids)
        return RecurrentRollback(backend) if mixers else backend
    verify_width = settings.block_size if settings.tree_size is None else 1 + settings.tree_size
    if mixers:
        check_compiled_rollback(mixers, verify_width)
    static = StaticBackend(target, layer_ids, num_rows, settings.compile,
                           prompt_width + settings.max_new_tokens + verify_width, verify_width)
    inner = StaticRecurrentRollback(static, mixers) if mixers else static
    return FixedRowBatch(inner, num_rows, target_device(target))
