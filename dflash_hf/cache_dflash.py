"""The target cache's layout and edits: which columns of a batch's shared KV caches hold each row's positions, and
the edits of a `DynamicCache`.

N left-padded rows share the columns of the target's and the draft's caches. Each row accepts its
own number of tokens per step, so rows leave unused columns ("holes"); an attention mask hides
them, and the caches are compacted once the holes pass `CACHE_HOLE_BUDGET`. This module holds the columns
(`CacheColumns`), the live rows of a compiled batch (`FixedRows`), the copies between host and device, and the edits
of a `DynamicCache`'s key/value layers (crop, row selection, compaction; Transformers 4.57 and 5.x alike). A verify's
layout and masks are `masks_dflash`'s, the draft's context caches `draft_backends_dflash`'s, and which targets are
refused and why `support_dflash`'s; `recurrent_dflash` snapshots and restores recurrent layers, and `static_dflash`
rewinds its `StaticCache`, each through the cache's own methods and attributes.

Every verify step cuts the target's cache back to the accepted prefix, so a target must keep per-position keys and
values: sliding-window layers get a cache layer that keeps every position (the model's own masks still apply the
window). Layers whose cache holds a recurrent state (Gated DeltaNet in Qwen3-Next and Qwen3.5, Mamba-2, ...) are
rolled back instead (`recurrent_dflash`; compile=True: `static_recurrent_dflash`), in the families of
`families_dflash.ROLLBACK_MODEL_TYPES`; other recurrent targets are refused (`support_dflash`).

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .support_dflash import (
    check_croppable_target,
    config_cache,
    is_recurrent_layer,
    is_windowed_layer,
    recurrent_cache_layers,
)

# A cache is compacted when its width exceeds the longest row's real positions by more than this.
CACHE_HOLE_BUDGET = 32
CAPACITY_STEP = 256  # a static cache's columns are rounded up to this, so calls of similar lengths share one graph


def static_capacity(columns: int) -> int:
    """The columns of a static cache that must hold `columns`: rounded up to CAPACITY_STEP."""
    return -(-columns // CAPACITY_STEP) * CAPACITY_STEP


def left_pad(
    sequences: Sequence[Sequence[int]], pad_token_id: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as a left-padded batch: (input_ids [N, T], attention_mask [N, T])."""
    width = max(len(sequence) for sequence in sequences)
    input_ids = torch.tensor([[pad_token_id] * (width - len(s)) + list(s) for s in sequences], device=device)
    attention_mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], device=device)
    return input_ids, attention_mask


def host_to_device(values: Sequence[Any], device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """Python numbers (or nested lists) as a tensor on `device`. To a CUDA device the copy goes from pinned memory,
    queued behind the device's work: from pageable memory CUDA would first wait for that work."""
    tensor = torch.tensor(values, dtype=dtype)
    if torch.device(device).type == "cuda":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The tensors on the host, read from their device at once: one copy of them all, flattened as float64 (which
    holds every token id and every float32 or bfloat16 value exactly); integer tensors come back as int64."""
    if tensors[0].device.type == "mps":  # no float64 there: one read each
        return tuple(tensor.cpu() for tensor in tensors)
    device = tensors[0].device
    flat = torch.cat([tensor.reshape(-1).to(device, torch.float64) for tensor in tensors]).cpu()
    parts, start = [], 0
    for tensor in tensors:
        part = flat[start : start + tensor.numel()].view(tensor.shape)
        parts.append(part if tensor.dtype.is_floating_point else part.long())
        start += tensor.numel()
    return tuple(parts)


def left_padded_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids [N, T] of left-padded rows: 0 at each row's first real token (pads get 0 too)."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def compaction_index(valid: torch.Tensor, width: int) -> torch.Tensor:
    """Column order [N, width] that moves each row's real columns (valid [N, W]) to the right end, in order."""
    order = torch.argsort(valid.to(torch.int8), dim=1, stable=True)  # holes first, real columns last, order kept
    return order[:, valid.shape[1] - width :]


def gather_columns(states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Per-row choice of sequence columns: states [N, heads, W, D], index [N, W'] -> [N, heads, W', D]."""
    batch, heads, _, head_dim = states.shape
    return states.gather(2, index[:, None, :, None].expand(batch, heads, index.shape[1], head_dim))


class CacheColumns:
    """Which columns of a cache shared by N rows hold each row's real positions; decides compaction.

    Counts are kept on the host, so asking whether there are holes never waits for the device.
    """

    def __init__(self, valid: torch.Tensor, real_counts: list[int], contiguous: bool = False) -> None:
        self.valid = valid  # [N, W] bool
        self.real_counts = real_counts  # per row: number of True in `valid`
        # contiguous: each row's positions must sit in adjacent columns (holes only before them), because the model
        # counts its attention window in columns; then any hole after a row's first position is compacted away.
        self.contiguous = contiguous
        self.gapped = False  # some row may have a hole after its first position (host-side, conservative)

    @property
    def width(self) -> int:
        """Number of columns (the cache's sequence length)."""
        return self.valid.shape[1]

    @property
    def has_holes(self) -> bool:
        """Whether some row has columns that are not its positions (padding or rejected tokens)."""
        return any(count < self.width for count in self.real_counts)

    def append(self, kept: torch.Tensor, kept_counts: list[int]) -> None:
        """Add columns kept [N, w] (True where the row keeps that column) with their per-row counts."""
        self.valid = torch.cat((self.valid, kept), dim=1)
        self.real_counts = [count + added for count, added in zip(self.real_counts, kept_counts)]
        self.gapped = self.gapped or any(added < kept.shape[1] for added in kept_counts)

    def copy(self) -> CacheColumns:
        """The columns as they are now (a later `append` or compaction does not change the copy)."""
        copied = CacheColumns(self.valid, list(self.real_counts), self.contiguous)
        copied.gapped = self.gapped
        return copied

    def positions(self) -> torch.Tensor:
        """The position of every column [N, W]: rows count their real columns from 0 (left-padded prompts); a hole
        repeats the position before it (it is masked anyway)."""
        return self.valid.long().cumsum(dim=1) - 1

    def attention_mask(self, new_columns: int) -> torch.Tensor | None:
        """2-D mask [N, W + new] over cached and new columns, or None when every column is real."""
        if not self.has_holes:
            return None
        return torch.cat((self.valid, self.valid.new_ones(self.valid.shape[0], new_columns)), dim=1)

    def select_rows(self, keep: list[int], index: torch.Tensor) -> None:
        """Keep rows `keep` (index: the same as a tensor on the cache's device)."""
        self.valid = self.valid[index]
        self.real_counts = [self.real_counts[row] for row in keep]

    def compaction(self, room: int | None = None) -> torch.Tensor | None:
        """The column order [N, W'] that removes the holes once they exceed CACHE_HOLE_BUDGET, or (contiguous) once a
        row has a hole after its first position, or (`room`: a static cache's free columns before a step) only once
        the columns pass `room` (else None)."""
        longest = max(self.real_counts)
        if room is not None and self.width <= room:
            return None
        if room is None and self.width - longest <= CACHE_HOLE_BUDGET and not (self.contiguous and self.gapped):
            return None
        index = compaction_index(self.valid, longest)
        self.valid = self.valid.gather(1, index)
        self.gapped = False
        return index


class FixedRows:
    """The live rows of a batch whose tensors keep all N rows (a compiled call: another row count would compile
    anew). Its owner's methods take and return the live rows only: `fill` puts them in their places among the N
    (finished rows get a filler), `take` reads them back."""

    def __init__(self, num_rows: int, device: torch.device) -> None:
        self.num_rows, self.device = num_rows, device
        self.rows = list(range(num_rows))  # the live rows' places among the N, in the live order
        self.index: torch.Tensor | None = None  # the same on `device`; None while every row is live

    def select_rows(self, keep: list[int]) -> None:
        """Rows finished: `keep` indexes the live rows that stay."""
        self.rows = [self.rows[position] for position in keep]
        self.index = host_to_device(self.rows, self.device)

    def fill(self, live: torch.Tensor, filler: Any = 0) -> torch.Tensor:
        """live [n, ...] -> [N, ...]: each live row in its place, `filler` in the finished rows."""
        if self.index is None:
            return live
        full = live.new_full((self.num_rows, *live.shape[1:]), filler)
        return full.index_copy_(0, self.index.to(live.device), live)

    def fill_list(self, live: list[Any], filler: Any) -> list[Any]:
        """The same for a list of n per-row values."""
        full = [filler] * self.num_rows
        for row, value in zip(self.rows, live):
            full[row] = value
        return full

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """full [N, ...] -> the live rows [n, ...]."""
        return full if self.index is None else full[self.index.to(full.device)]


# --- The target's KV cache: a Transformers DynamicCache ---------------------------------------------------------


def full_history_cache(target: torch.nn.Module, config: Any) -> Any:
    """A fresh cache for the target's prefill that keeps every position, or None where the target's own already does.

    Transformers' sliding-window cache layers drop positions older than the window, so they cannot be cropped back
    once the window is full. Here those layers are plain `DynamicLayer`s that keep every position; the model's masks
    still apply the window (they count it in cache columns: see `CacheColumns.contiguous`). A ValueError for a target
    whose cache cannot be cut back (`check_croppable_target`: recurrent layers pass where they can be rolled back).
    """
    from transformers.cache_utils import DynamicLayer

    cache = config_cache(config)
    check_croppable_target(target, config, cache)
    layers = getattr(cache, "layers", None)
    if not layers or not any(is_windowed_layer(layer) for layer in layers):
        return None
    cache.layers = [DynamicLayer() if is_windowed_layer(layer) else layer for layer in layers]
    return cache


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first `length` positions of a Transformers KV cache (4.x and 5.x `crop` semantics)."""
    if not recurrent_cache_layers(cache):
        excess = cache.get_seq_length() - length
        if excess > 0:
            cache.crop(-excess)  # a negative count removes that many positions on 4.57 and 5.x alike
        return
    for layer in cache.layers:  # a hybrid cache: recurrent layers are rolled back (`recurrent_dflash`), not cropped
        if is_recurrent_layer(layer) or not hasattr(layer, "get_seq_length"):
            continue
        excess = layer.get_seq_length() - length
        if excess > 0:
            layer.crop(-excess)


def select_cache_rows(cache: Any, index: torch.Tensor) -> None:
    """Keep the batch rows `index` [n] of a Transformers KV cache (its layers may sit on several devices)."""
    for layer in cache.layers:
        if is_recurrent_layer(layer):
            layer.reorder_cache(index)  # selects the rows of its convolution and recurrent states
            continue
        if getattr(layer, "keys", None) is None or layer.keys.dim() != 4:
            continue  # a layer that stores nothing (Gemma 4's K/V-sharing layers: `DummyLayer`; not yet initialised)
        rows = index.to(layer.keys.device)
        layer.keys, layer.values = layer.keys[rows], layer.values[rows]


def reorder_cache_columns(cache: Any, index: torch.Tensor) -> None:
    """Apply a per-row column order [N, W'] to every layer of a Transformers DynamicCache (4.57 and 5.x)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.dim() != 4:
            continue  # a layer that stores nothing (Gemma 4's K/V-sharing layers: `DummyLayer`; not yet initialised)
        columns = index.to(layer.keys.device)
        layer.keys = gather_columns(layer.keys, columns)
        layer.values = gather_columns(layer.values, columns)
