"""Cache layout: which columns of a batch's shared KV caches hold each row's positions, and the cache edits.

N left-padded rows share the columns of the target's and the draft's caches. Each row accepts its
own number of tokens per step, so rows leave unused columns ("holes"); an attention mask hides
them, and the caches are compacted once the holes pass `CACHE_HOLE_BUDGET`. This is the only
module that touches a cache's internal layout (Transformers 4.57 and 5.x `DynamicCache` alike).

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

import inspect
from typing import Any, Sequence

import torch

# A cache is compacted when its width exceeds the longest row's real positions by more than this.
CACHE_HOLE_BUDGET = 32


def left_pad(
    sequences: Sequence[Sequence[int]], pad_token_id: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as a left-padded batch: (input_ids [N, T], attention_mask [N, T])."""
    width = max(len(sequence) for sequence in sequences)
    input_ids = torch.tensor([[pad_token_id] * (width - len(s)) + list(s) for s in sequences], device=device)
    attention_mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], device=device)
    return input_ids, attention_mask


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

    def __init__(self, valid: torch.Tensor, real_counts: list[int]) -> None:
        self.valid = valid  # [N, W] bool
        self.real_counts = real_counts  # per row: number of True in `valid`

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

    def attention_mask(self, new_columns: int) -> torch.Tensor | None:
        """2-D mask [N, W + new] over cached and new columns, or None when every column is real."""
        if not self.has_holes:
            return None
        return torch.cat((self.valid, self.valid.new_ones(self.valid.shape[0], new_columns)), dim=1)

    def select_rows(self, keep: list[int], index: torch.Tensor) -> None:
        """Keep rows `keep` (index: the same as a tensor on the cache's device)."""
        self.valid = self.valid[index]
        self.real_counts = [self.real_counts[row] for row in keep]

    def compaction(self) -> torch.Tensor | None:
        """The column order [N, W'] that removes the holes once they exceed CACHE_HOLE_BUDGET (else None)."""
        longest = max(self.real_counts)
        if self.width - longest <= CACHE_HOLE_BUDGET:
            return None
        index = compaction_index(self.valid, longest)
        self.valid = self.valid.gather(1, index)
        return index


# --- The target's KV cache: a Transformers DynamicCache ---------------------------------------------------------


def cache_keyword(target: torch.nn.Module) -> str:
    """The forward argument that takes the KV cache: `cache` on Transformers 5.x, `past_key_values` on 4.x."""
    decoder = target.get_decoder() if hasattr(target, "get_decoder") else target
    forwards = (target.forward, decoder.forward)  # a subclass may take **kwargs; its decoder names the argument
    return "cache" if any("cache" in inspect.signature(forward).parameters for forward in forwards) else "past_key_values"


def returned_cache(outputs: Any) -> Any:
    """The KV cache of a forward's outputs (`cache` on 5.x, `past_key_values` on 4.x)."""
    cache = getattr(outputs, "cache", None)
    return outputs.past_key_values if cache is None else cache


def check_cache(cache: Any, target: torch.nn.Module, num_rows: int) -> None:
    """Raise a ValueError unless the target's cache can be cropped (and, for a batch, have rows selected)."""
    if cache is None or not hasattr(cache, "crop"):
        raise ValueError(f"Target {type(target).__name__} returned no croppable KV cache; DFlash needs a DynamicCache.")
    if num_rows > 1 and not (hasattr(cache, "layers") and hasattr(cache, "batch_select_indices")):
        raise ValueError(f"Target {type(target).__name__} returned a {type(cache).__name__}; batches need a DynamicCache.")


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first `length` positions of a Transformers KV cache (4.x and 5.x `crop` semantics)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)  # a negative count removes that many positions on 4.57 and 5.x alike


def select_cache_rows(cache: Any, index: torch.Tensor) -> None:
    """Keep the batch rows `index` [n] of a Transformers KV cache."""
    cache.batch_select_indices(index)


def reorder_cache_columns(cache: Any, index: torch.Tensor) -> None:
    """Apply a per-row column order [N, W'] to every layer of a Transformers DynamicCache (4.57 and 5.x)."""
    for layer in cache.layers:
        layer.keys = gather_columns(layer.keys, index)
        layer.values = gather_columns(layer.values, index)


# --- The draft's context cache ------------------------------------------------------------------------------------


class DraftContextCache:
    """Per-layer K/V of the draft's CONTEXT rows (post k_norm and rope); block rows are never stored."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    def append(self, layer_idx: int, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store new context K/V [B, kv_heads, T_new, D] for a layer and return all of them."""
        if self.keys[layer_idx] is not None:
            key = torch.cat((self.keys[layer_idx], key), dim=2)
            value = torch.cat((self.values[layer_idx], value), dim=2)
        self.keys[layer_idx], self.values[layer_idx] = key, value
        return key, value

    def get_seq_length(self) -> int:
        """Number of context positions stored."""
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def select_rows(self, index: torch.Tensor) -> None:
        """Keep the batch rows `index` [n] (rows that finished leave the batch)."""
        self.keys = [None if key is None else key[index] for key in self.keys]
        self.values = [None if value is None else value[index] for value in self.values]

    def reorder_columns(self, index: torch.Tensor) -> None:
        """Per-row column order [N, W'] (compaction: drop unused columns, keep each row's positions in order)."""
        self.keys = [None if key is None else gather_columns(key, index) for key in self.keys]
        self.values = [None if value is None else gather_columns(value, index) for value in self.values]
