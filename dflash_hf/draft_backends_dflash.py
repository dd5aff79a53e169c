"""The draft's side of one call, behind one seam: `DraftBackend`.

A draft backend owns what the draft holds during a call: its context cache (the keys and values of the target
features it has seen: `DraftContextCache`, or a compiled draft's `StaticDraftContextCache`, both defined here) and the
columns each row's context sits in (`cache_dflash.CacheColumns`), the draft's forward over the block after that
context, the compaction of the cache's holes, and which rows it keeps. The proposer
(`proposer_dflash.DFlashProposer`) embeds the block and turns the forward's hidden states into proposals; it never
asks which backend runs. `draft_backend` chooses one per call, as `backends_dflash.target_backend` chooses the
target's.

- `EagerDraftBackend`: the draft's own forward over a `DraftContextCache` that grows with the context; finished rows
  leave it.
- `CompiledDraftBackend` (`compile=True`): the draft's forward under `torch.compile` over a fixed-size
  `StaticDraftContextCache` laid out for all of the call's rows; each context after the first (the kept columns: at
  most the call's block size, which a DeepSpec draft's shifted block of one row fewer also keeps) is padded to the
  block size, so the compiled forward sees one shape. Finished rows stay in its tensors; its methods take and return
  the live rows (`cache_dflash.FixedRows`).

See docs/architecture.md, "The draft backend". Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Protocol

import torch

from .cache_dflash import CacheColumns, FixedRows, gather_columns, host_to_device, static_capacity
from .devices_dflash import compiled_call


class DraftContextCache:
    """Per-layer K/V of the draft's CONTEXT rows (post k_norm and rope), and their positions; block rows are never
    stored. Each layer's K/V live in a buffer with room to spare (grown by doubling): a step writes its new context
    columns and, after them, the block's K/V in place, so the attention reads one buffer and nothing is copied."""

    def __init__(self, num_layers: int) -> None:
        self.key_buffers: list[torch.Tensor | None] = [None] * num_layers  # [B, kv_heads, capacity, D]
        self.value_buffers: list[torch.Tensor | None] = [None] * num_layers
        self.lengths = [0] * num_layers  # context columns stored per layer
        self.positions: torch.Tensor | None = None  # [B, C]: the position id of every cached column

    @property
    def keys(self) -> list[torch.Tensor | None]:
        """Each layer's cached context keys [B, kv_heads, C, D] (views)."""
        return [None if buffer is None else buffer[:, :, :length]
                for buffer, length in zip(self.key_buffers, self.lengths)]

    @property
    def values(self) -> list[torch.Tensor | None]:
        """Each layer's cached context values [B, kv_heads, C, D] (views)."""
        return [None if buffer is None else buffer[:, :, :length]
                for buffer, length in zip(self.value_buffers, self.lengths)]

    def append_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Record the position ids [B, T_new] of the context columns this call adds; all of them [B, C]."""
        if self.positions is not None:
            position_ids = torch.cat((self.positions, position_ids), dim=1)
        self.positions = position_ids
        return position_ids

    def attention_inputs(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, block_key: torch.Tensor,
                         block_value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's new context K/V [B, kv_heads, n, D]; return the keys and values of all context columns
        followed by the block's [B, kv_heads, C + n + T, D] (the block's are overwritten by the next call)."""
        length, added, block_length = self.lengths[layer_idx], key.shape[2], block_key.shape[2]
        self._reserve(layer_idx, key, length + added + block_length)
        keys, values = self.key_buffers[layer_idx], self.value_buffers[layer_idx]
        keys[:, :, length:length + added] = key
        values[:, :, length:length + added] = value
        end = length + added + block_length
        keys[:, :, length + added:end] = block_key
        values[:, :, length + added:end] = block_value
        self.lengths[layer_idx] = length + added
        return keys[:, :, :end], values[:, :, :end]

    def _reserve(self, layer_idx: int, like: torch.Tensor, needed: int) -> None:
        """Make the layer's buffers hold at least `needed` columns (twice the old capacity when they must grow)."""
        buffer = self.key_buffers[layer_idx]
        if buffer is not None and buffer.shape[2] >= needed:
            return
        capacity = max(needed, 2 * (0 if buffer is None else buffer.shape[2]))
        self.key_buffers[layer_idx], self.value_buffers[layer_idx] = (
            self._moved(old, like, capacity, self.lengths[layer_idx])
            for old in (buffer, self.value_buffers[layer_idx]))

    @staticmethod
    def _moved(old: torch.Tensor | None, like: torch.Tensor, capacity: int, length: int) -> torch.Tensor:
        """A buffer of `capacity` columns shaped like `like` [B, kv_heads, *, D] holding old's first `length`."""
        buffer = like.new_empty(like.shape[0], like.shape[1], capacity, like.shape[3])
        if old is not None and length:
            buffer[:, :, :length] = old[:, :, :length]
        return buffer

    def get_seq_length(self) -> int:
        """Number of context positions stored."""
        return self.lengths[0]

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the batch rows `index` [n] (rows that finished leave the batch)."""
        self.key_buffers = [None if buffer is None else buffer[index] for buffer in self.key_buffers]
        self.value_buffers = [None if buffer is None else buffer[index] for buffer in self.value_buffers]
        self.positions = None if self.positions is None else self.positions[index]

    def reorder_columns(self, index: torch.Tensor) -> None:
        """Per-row column order [N, W'] (compaction: drop unused columns, keep each row's positions in order)."""
        keys, values = self.keys, self.values
        self.key_buffers = [None if key is None else gather_columns(key, index) for key in keys]
        self.value_buffers = [None if value is None else gather_columns(value, index) for value in values]
        self.lengths = [index.shape[1] if key is not None else 0 for key in keys]
        self.positions = None if self.positions is None else self.positions.gather(1, index)


def fixed_address(tensor: torch.Tensor) -> torch.Tensor:
    """Tell torch.compile that `tensor` keeps its address from call to call (as Transformers' `StaticCache` does for
    its tensors), so a compiled forward that writes into it still runs as a CUDA graph: inductor skips CUDA graphs
    for a graph that mutates an input it must copy in. Returns `tensor`."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(tensor)
    return tensor


class StaticDraftContextCache:
    """The draft's context cache at a fixed size, for a compiled draft (`spec_generate(compile=True)`): per layer one
    buffer [N, kv_heads, C + B, D], whose first C columns hold context K/V in the target cache's column layout (holes
    masked by the caller) and whose last B hold the block's; the positions [N, C] of the context columns. A call
    writes its new context at the columns `slots` [c] (a tensor: a compiled draft sees no new number), so no shape or
    address changes from call to call."""

    def __init__(self, num_layers: int, capacity: int, block_size: int) -> None:
        self.capacity, self.block_size = capacity, block_size  # C, B
        self.key_buffers: list[torch.Tensor | None] = [None] * num_layers
        self.value_buffers: list[torch.Tensor | None] = [None] * num_layers
        self.positions: torch.Tensor | None = None  # [N, C]
        self.slots: torch.Tensor | None = None  # [c]: where the next call's context columns go

    def append_positions(self, position_ids: torch.Tensor) -> torch.Tensor:
        """Record the position ids [N, c] of this call's context columns at `slots`; all of them [N, C]."""
        if self.positions is None:
            self.positions = fixed_address(position_ids.new_zeros(position_ids.shape[0], self.capacity))
        self.positions.index_copy_(1, self.slots, position_ids)
        return self.positions

    def attention_inputs(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor, block_key: torch.Tensor,
                         block_value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store a layer's new context K/V [N, kv_heads, c, D] at `slots` and the block's [N, kv_heads, B, D] after
        the context columns; return both buffers [N, kv_heads, C + B, D]."""
        if self.key_buffers[layer_idx] is None:
            shape = (key.shape[0], key.shape[1], self.capacity + self.block_size, key.shape[3])
            self.key_buffers[layer_idx] = fixed_address(key.new_zeros(shape))
            self.value_buffers[layer_idx] = fixed_address(value.new_zeros(shape))
        keys, values = self.key_buffers[layer_idx], self.value_buffers[layer_idx]
        keys.index_copy_(2, self.slots, key)
        values.index_copy_(2, self.slots, value)
        keys[:, :, self.capacity :].copy_(block_key)
        values[:, :, self.capacity :].copy_(block_value)
        return keys, values

    def reorder_columns(self, index: torch.Tensor) -> None:
        """Compaction in place: the first W' context columns become the per-row columns index [N, W']."""
        width = index.shape[1]
        for buffer in (*self.key_buffers, *self.value_buffers):
            if buffer is not None:
                buffer[:, :, :width].copy_(gather_columns(buffer[:, :, : self.capacity], index))
        if self.positions is not None:
            self.positions[:, :width].copy_(self.positions.gather(1, index))



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
    buffers; each later context (the kept columns: at most `block_size`, the call's tokens verified per step, whether
    the draft's block has as many rows or, shifted (DeepSpec), one fewer) is padded to `block_size` columns and written
    after the cache's columns, masked past the kept ones and overwritten by the next forward. Finished rows stay in
    the tensors (another row count would compile anew); they add no context."""

    def __init__(self, draft: torch.nn.Module, options: dict[str, Any], num_rows: int, context_columns: int,
                 device: torch.device, block_size: int) -> None:
        self.draft = draft
        self.compiled = compiled_draft(draft, options)
        self.capacity = static_capacity(context_columns)
        self.context_width = block_size  # the columns of every context after the prompts'
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
            padding = self.context_width - context.shape[1]
            if padding < 0:
                raise ValueError(f"This compiled draft backend takes at most {self.context_width} new context columns "
                                 f"a step (the call's block size); this step brings {context.shape[1]}. Make it with "
                                 "the call's block size (generation_dflash.dflash_proposer).")
            context = torch.nn.functional.pad(context, (0, 0, 0, padding))
            context_position_ids = torch.nn.functional.pad(context_position_ids, (0, padding))
        self.cache.slots = torch.arange(start, start + context.shape[1], device=context.device)
        width = self.columns.width
        mask = torch.nn.functional.pad(self.columns.valid, (0, self.capacity - width + block_size), value=True)
        mask[:, width : self.capacity] = False  # [N, C + B]: the rows' context columns, then the block
        hidden = forward(rows.fill(block_embeddings), rows.fill(context), rows.fill(block_position_ids),
                         rows.fill(context_position_ids), cache=self.cache, attention_mask=mask[:, None, None, :])
        order = self.columns.compaction(room=self.capacity - self.context_width)  # the next context must fit
        if order is not None:
            self.cache.reorder_columns(order)
        return rows.take(hidden)

    def select_rows(self, keep: list[int]) -> None:
        """Later forwards take the rows `keep` only; the finished rows stay in the tensors."""
        self.rows.select_rows(keep)


def draft_backend(draft: torch.nn.Module, compile: dict[str, Any] | None, num_rows: int, context_columns: int,
                  device: torch.device, block_size: int) -> DraftBackend:
    """The call's draft backend: compiled with `compile`'s `torch.compile` options (`settings.compile`; a cache of
    `num_rows` rows and `context_columns` columns on `device`, the draft's execution device, taking at most
    `block_size` new context columns a step: the call's block size), else eager."""
    if compile is None:
        return EagerDraftBackend(draft)
    return CompiledDraftBackend(draft, compile, num_rows, context_columns, device, block_size)
