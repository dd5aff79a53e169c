"""The draft's side of one call, behind one seam: `DraftBackend`.

A draft backend owns what the draft holds during a call: its context cache (the keys and values of the target
features it has seen) and the columns each row's context sits in (`cache_dflash.CacheColumns`), the draft's forward
over the block after that context, the compaction of the cache's holes, and which rows it keeps. The proposer
(`proposer_dflash.DFlashProposer`) embeds the block and turns the forward's hidden states into proposals; it never
asks which backend runs. `draft_backend` chooses one per call, as `backends_dflash.target_backend` chooses the
target's.

- `EagerDraftBackend`: the draft's own forward over a `DraftContextCache` that grows with the context; finished rows
  leave it.
- `CompiledDraftBackend` (`compile=True`): the draft's forward under `torch.compile` over a fixed-size
  `StaticDraftContextCache` laid out for all of the call's rows; each context after the first (at most a block: the
  kept columns) is padded to the block's width, so the compiled forward sees one shape. Finished rows stay in its
  tensors; its methods take and return the live rows (`cache_dflash.FixedRows`).

See docs/architecture.md, "The draft backend". Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Protocol

import torch

from .cache_dflash import CacheColumns, FixedRows, StaticDraftContextCache, host_to_device, static_capacity
from .devices_dflash import compiled_call


class DraftBackend(Protocol):
    """The draft's side of one call: its context cache and columns, the forward over them, its rows."""

    def forward(self, block_embeddings: torch.Tensor, block_position_ids: torch.Tensor, context: torch.Tensor,
                context_position_ids: torch.Tensor, context_valid: torch.Tensor | None,
                context_counts: list[int]) -> torch.Tensor:
        """The draft over the block embeddings [n, B, H] at block_position_ids [n, B], after each row's context: the
        new context columns (target features [n, c, L*H] at context_position_ids [n, c]; context_valid [n, c]: which
        are real positions, None: all) join the cache, and context_counts[i] is the number of positions before row
        i's block. Returns the block's hidden states [n, B, H]; the cache's holes are compacted when its budget says
        so."""

    def select_rows(self, keep: list[int]) -> None:
        """Rows finished: later forwards take the rows `keep` (indices among the current ones) only."""


def new_columns(columns: CacheColumns, valid: torch.Tensor, counts: list[int]) -> None:
    """Record a forward's new context columns valid [N, c] in `columns`, given each row's count of positions before
    its block (what it has not seen is new)."""
    columns.append(valid, [count - seen for count, seen in zip(counts, columns.real_counts)])


class EagerDraftBackend:
    """The draft's own forward; its context cache (`draft.new_cache()`) grows with the context, and finished rows
    leave it."""

    def __init__(self, draft: torch.nn.Module) -> None:
        self.draft = draft
        self.cache = draft.new_cache()
        self.columns: CacheColumns | None = None  # real context positions among the cache's columns

    def forward(self, block_embeddings: torch.Tensor, block_position_ids: torch.Tensor, context: torch.Tensor,
                context_position_ids: torch.Tensor, context_valid: torch.Tensor | None,
                context_counts: list[int]) -> torch.Tensor:
        """The draft's forward; a 2-D mask over context and block only where some column is a hole."""
        num_rows, block_size, device = block_embeddings.shape[0], block_embeddings.shape[1], block_embeddings.device
        if self.columns is None:
            self.columns = CacheColumns(torch.ones(num_rows, 0, dtype=torch.bool, device=device), [0] * num_rows)
        valid = context_valid
        if valid is None:
            valid = torch.ones(num_rows, context.shape[1], dtype=torch.bool, device=device)
        new_columns(self.columns, valid, context_counts)
        seen = self.columns.attention_mask(block_size)  # [n, C + B] or None
        hidden = self.draft(block_embeddings, context, block_position_ids, context_position_ids, cache=self.cache,
                            attention_mask=None if seen is None else seen[:, None, None, :])
        order = self.columns.compaction()
        if order is not None:
            self.cache.reorder_columns(order)
        return hidden

    def select_rows(self, keep: list[int]) -> None:
        """The rows `keep` stay in the cache."""
        if self.columns is None:
            return
        index = host_to_device(keep, self.columns.valid.device)
        self.cache.select_rows(index)
        self.columns.select_rows(keep, index)


def draft_forward(draft: torch.nn.Module, *args: Any, **kwargs: Any) -> torch.Tensor:
    """The draft's forward, as a function of the draft: what `compiled_draft` compiles (it holds no draft)."""
    return draft(*args, **kwargs)


# draft -> {its options: draft_forward compiled for it}
_COMPILED_DRAFT_FORWARDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_COMPILED_DRAFTS_GUARD = threading.Lock()


def compiled_draft(draft: torch.nn.Module, options: dict[str, Any]) -> Callable[..., torch.Tensor]:
    """`draft_forward` under `torch.compile(**options)` for `draft`, made once per draft and options: later calls with
    it reuse its graphs, and another draft's are counted apart (`isolate_recompiles`), so drafts tried one after
    another in a process do not add up to torch.compile's recompile limit. Held weakly: it lives as the draft does."""
    key = repr(sorted(options.items()))
    with _COMPILED_DRAFTS_GUARD:
        compiled = _COMPILED_DRAFT_FORWARDS.setdefault(draft, {})
        if key not in compiled:
            compiled[key] = torch.compile(draft_forward, **options)
        return compiled[key]


class CompiledDraftBackend:
    """The draft's forward under `torch.compile` (`options`) over a `StaticDraftContextCache` of all `num_rows` rows,
    with room for `context_columns` (the prompts' width, every new token and one block), in the target cache's column
    layout. The first forward, whose context is the prompts' (of any width), runs eagerly and makes the cache's
    buffers; each later context (the kept columns: at most a block) is padded to the block's width and written after
    the cache's columns, masked past the kept ones and overwritten by the next forward. Finished rows stay in the
    tensors (another row count would compile anew); they add no context."""

    def __init__(self, draft: torch.nn.Module, options: dict[str, Any], num_rows: int, context_columns: int,
                 device: torch.device) -> None:
        self.draft = draft
        self.compiled = compiled_draft(draft, options)
        self.capacity = static_capacity(context_columns)
        self.rows = FixedRows(num_rows, device)
        self.cache: StaticDraftContextCache | None = None
        self.columns = CacheColumns(torch.ones(num_rows, 0, dtype=torch.bool, device=device), [0] * num_rows)

    def _compiled_forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return compiled_call(self.compiled, "the draft's forward", self.draft, *args, **kwargs)

    def forward(self, block_embeddings: torch.Tensor, block_position_ids: torch.Tensor, context: torch.Tensor,
                context_position_ids: torch.Tensor, context_valid: torch.Tensor | None,
                context_counts: list[int]) -> torch.Tensor:
        """The forward over all rows under a 4-D mask over the cache's capacity and the block; the live rows'
        hidden states."""
        rows, block_size = self.rows, block_embeddings.shape[1]
        if block_embeddings.shape[0] != len(rows.rows):
            raise ValueError(f"This compiled draft backend holds {rows.num_rows} rows, {len(rows.rows)} of them live; "
                             f"the step has {block_embeddings.shape[0]}. Make it with the call's row count "
                             "(generation_dflash.dflash_proposer's num_rows).")
        valid = context_valid
        if valid is None:
            valid = torch.ones(context.shape[:2], dtype=torch.bool, device=context.device)
        counts = rows.fill_list(context_counts, None)
        new_columns(self.columns, rows.fill(valid, False),
                    [seen if count is None else count for count, seen in zip(counts, self.columns.real_counts)])
        start, forward = self.columns.width - valid.shape[1], self._compiled_forward
        if self.cache is None:  # the prompts' context: eagerly, at its own width
            self.cache = StaticDraftContextCache(len(self.draft.layers), self.capacity, block_size)
            forward = self.draft
        else:  # block-wide: the columns past the kept ones are masked, and overwritten by the next forward
            padding = block_size - context.shape[1]
            context = torch.nn.functional.pad(context, (0, 0, 0, padding))
            context_position_ids = torch.nn.functional.pad(context_position_ids, (0, padding))
        self.cache.slots = torch.arange(start, start + context.shape[1], device=context.device)
        width = self.columns.width
        mask = torch.nn.functional.pad(self.columns.valid, (0, self.capacity - width + block_size), value=True)
        mask[:, width : self.capacity] = False  # [N, C + B]: the rows' context columns, then the block
        hidden = forward(rows.fill(block_embeddings), rows.fill(context), rows.fill(block_position_ids),
                         rows.fill(context_position_ids), cache=self.cache, attention_mask=mask[:, None, None, :])
        order = self.columns.compaction(room=self.capacity - block_size)  # the next forward's columns must fit
        if order is not None:
            self.cache.reorder_columns(order)
        return rows.take(hidden)

    def select_rows(self, keep: list[int]) -> None:
        """Later forwards take the rows `keep` only; the finished rows stay in the tensors."""
        self.rows.select_rows(keep)


def draft_backend(draft: torch.nn.Module, compile: dict[str, Any] | None, num_rows: int, context_columns: int,
                  device: torch.device) -> DraftBackend:
    """The call's draft backend: compiled with `compile`'s `torch.compile` options (`settings.compile`; a cache of
    `num_rows` rows and `context_columns` columns on `device`, the draft's execution device), else eager."""
    if compile is None:
        return EagerDraftBackend(draft)
    return CompiledDraftBackend(draft, compile, num_rows, context_columns, device)
