"""Cache layout: which columns of a batch's shared KV caches hold each row's positions, and the cache edits.

N left-padded rows share the columns of the target's and the draft's caches. Each row accepts its
own number of tokens per step, so rows leave unused columns ("holes"); an attention mask hides
them, and the caches are compacted once the holes pass `CACHE_HOLE_BUDGET`. This module holds the edits of a
`DynamicCache`'s key/value layers (crop, row selection, compaction; Transformers 4.57 and 5.x alike), the draft's
context caches, the live rows of a compiled batch (`FixedRows`), and a verify's layout (`VerifyLayout`) and masks;
`recurrent_dflash` snapshots and restores recurrent layers, and `static_dflash` rewinds its `StaticCache`, each through
the cache's own methods and attributes.

Every verify step cuts the target's cache back to the accepted prefix, so a target must keep per-position keys and
values: sliding-window layers get a cache layer that keeps every position (the model's own masks still apply the
window). Layers whose cache holds a recurrent state (Gated DeltaNet in Qwen3-Next and Qwen3.5, Mamba-2, ...) are
rolled back instead (`recurrent_dflash`; compile=True: `static_recurrent_dflash`), in the families of
`families_dflash.ROLLBACK_MODEL_TYPES`; other recurrent targets are refused.

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .families_dflash import (
    HYBRID_TRANSFORMERS,
    RECURRENT_LAYER_WORDS,
    RECURRENT_MODEL_TYPES,
    RECURRENT_REFUSALS,
    ROLLBACK_MODEL_TYPES,
)
from .versions_dflash import TRANSFORMERS_VERSION, is_linear_attention_layer, refuses_crop

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


def verify_attention_mask(columns: CacheColumns, sees: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
                          window: int | None = None, width: int | None = None) -> torch.Tensor:
    """Additive mask [N, 1, b, width] of a verify of b columns at `positions` [N, b] after the cache's columns: a
    verify column sees the row's cached positions and the verify columns `sees` [N, b, b] (bool) allows; with a
    `window`, only keys less than `window` positions before it (counted in positions, not columns, so holes and a
    tree's branches do not shift it; as Transformers' sliding_window_overlay); columns past the verify's (a static
    cache's free room, up to `width`) are hidden. 0 where it attends, the dtype's minimum elsewhere."""
    num_rows, cached_width = columns.valid.shape
    verify_width = sees.shape[1]
    cached = columns.valid[:, None, :].expand(num_rows, verify_width, cached_width)  # [N, b, W]
    if window is not None:
        cached = cached & (positions[:, :, None] - columns.positions()[:, None, :] < window)
        sees = sees & (positions[:, :, None] - positions[:, None, :] < window)
    allowed = torch.cat((cached, sees), dim=2)  # [N, b, W + b]
    if width is not None:
        allowed = torch.nn.functional.pad(allowed, (0, width - cached_width - verify_width), value=False)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(dtype).min)[:, None]


def causal_sees(num_rows: int, width: int, device: torch.device) -> torch.Tensor:
    """A chain's verify columns [N, b, b]: each sees itself and the columns before it."""
    return torch.ones(width, width, dtype=torch.bool, device=device).tril().expand(num_rows, width, width)


@dataclass(frozen=True)
class VerifyLayout:
    """What a backend needs of a verify's b columns, as the step's strategy arranged them (a chain, a tree, ...):
    their positions, which verify columns each one sees, and the root-to-leaf paths a recurrent layer runs along."""

    positions: torch.Tensor  # [n, b]: each column's position (a tree: the root's plus the column's depth)
    sees: torch.Tensor | None = None  # [n, b, b] bool: the verify columns each sees (None: itself and those before)
    paths: list[list[list[int]]] | None = None  # per row, each path's columns from column 0 (None: one, in order)

    def visible(self) -> torch.Tensor:
        """Which verify columns each column sees [n, b, b] (bool)."""
        if self.sees is not None:
            return self.sees
        return causal_sees(self.positions.shape[0], self.positions.shape[1], self.positions.device)


def sliding_window(config: Any) -> int | None:
    """The attention window (in positions) of a decoder config with sliding-window layers, or None."""
    return getattr(config, "sliding_window", None) if has_windowed_layers(config) else None


def position_attention(columns: CacheColumns, sees: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype,
                       config: Any, window: int | None, width: int | None = None
                       ) -> torch.Tensor | dict[str, torch.Tensor]:
    """The `attention_mask` argument of a verify by position (`verify_attention_mask`) that gives each layer of the
    target (decoder `config`, its `sliding_window(config)` as `window`) its mask: one mask without a window; else per
    layer type (`full_attention`, `sliding_attention`: the mapping Transformers' models take in place of the masks
    they would build), or the windowed mask alone where every layer has the window (no `layer_types`)."""
    full = verify_attention_mask(columns, sees, positions, dtype, width=width)
    if window is None:
        return full
    windowed = verify_attention_mask(columns, sees, positions, dtype, window=window, width=width)
    if not getattr(config, "layer_types", None):
        return windowed
    return {"full_attention": full, "sliding_attention": windowed}


def windowed_mask_refusal(config: Any) -> str | None:
    """Why masks by position cannot be given to this windowed target's layers (layer types other than full and
    sliding attention), or None."""
    types = set(getattr(config, "layer_types", None) or ())
    other = sorted(types - {"full_attention", "sliding_attention"})
    if sliding_window(config) is None or not other:
        return None
    return f"its layer types {other} take masks dflash-hf does not build"


# --- The target's KV cache: a Transformers DynamicCache ---------------------------------------------------------


def recurrent_layers(config: Any) -> dict[str, list[int]]:
    """The layer types of a decoder config whose cache is a recurrent state, each with its layer indices (maybe [])."""
    for name in ("layer_types", "layers_block_type"):
        types = getattr(config, name, None)
        found: dict[str, list[int]] = {}
        for index, layer_type in enumerate(types if isinstance(types, (list, tuple)) else ()):
            if isinstance(layer_type, str) and any(word in layer_type.lower() for word in RECURRENT_LAYER_WORDS):
                found.setdefault(layer_type, []).append(index)
        if found:
            return found
    model_type = str(getattr(config, "model_type", "")).removesuffix("_text")
    return {RECURRENT_MODEL_TYPES[model_type]: []} if model_type in RECURRENT_MODEL_TYPES else {}


def config_cache(config: Any) -> Any:
    """The DynamicCache a model builds from its config (Transformers picks each layer's class), or None."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=config)
    except Exception:  # a config Transformers cannot lay a cache out for: the model makes its own
        return None


def has_windowed_layers(config: Any) -> bool:
    """Whether the target's cache (from its decoder config) has sliding-window layers, which count their window in
    cache columns."""
    return any(_is_windowed(layer) for layer in getattr(config_cache(config), "layers", None) or ())


def _is_windowed(layer: Any) -> bool:
    """A plain sliding-window (or chunked) layer: it drops positions older than its window."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    return type(layer) is DynamicSlidingWindowLayer


def is_recurrent_layer(layer: Any) -> bool:
    """A cache layer that holds a linear-attention (recurrent and convolution) state and no keys or values."""
    return is_linear_attention_layer(layer) and not hasattr(layer, "keys")


def recurrent_cache_layers(cache: Any) -> list[int]:
    """Indices of the layers of a cache that hold a recurrent state (rolled back, not cropped)."""
    return [index for index, layer in enumerate(getattr(cache, "layers", ())) if is_recurrent_layer(layer)]


def recurrent_refusal(config: Any, cache: Any) -> str | None:
    """Why a target with recurrent layers cannot run (None: it has none, or they can be rolled back)."""
    recurrent = recurrent_layers(config)
    uncroppable = sorted({type(layer).__name__ for layer in getattr(cache, "layers", ())
                          if not _is_windowed(layer) and not is_recurrent_layer(layer)
                          and refuses_crop(layer)})
    if not recurrent and not uncroppable:
        return None
    model_type = str(getattr(config, "model_type", "")).removesuffix("_text")
    named = ", ".join(f"{layer_type} (layers {', '.join(map(str, indices))})" if indices else layer_type
                      for layer_type, indices in recurrent.items()) or ", ".join(uncroppable)
    layers = getattr(cache, "layers", ())
    indices = [index for layer_indices in recurrent.values() for index in layer_indices if index < len(layers)]
    rolled_back = bool(recurrent_cache_layers(cache)) and not uncroppable and all(
        is_recurrent_layer(layers[index]) for index in indices)
    if model_type in ROLLBACK_MODEL_TYPES and rolled_back:
        return None
    if model_type in RECURRENT_REFUSALS:
        return f"its layers of type {named} keep a recurrent state, and {RECURRENT_REFUSALS[model_type]}"
    if model_type in ROLLBACK_MODEL_TYPES:
        return (f"its layers of type {named} keep a recurrent state, which Transformers {TRANSFORMERS_VERSION} "
                f"holds in a model-specific cache that dflash-hf cannot roll back; install {HYBRID_TRANSFORMERS}")
    return (f"its layers of type {named} keep a recurrent state that dflash-hf does not roll back for "
            f"{model_type or 'this architecture'} (hybrid targets run for {', '.join(ROLLBACK_MODEL_TYPES)})")


def check_croppable_target(target: torch.nn.Module, config: Any, cache: Any = None) -> None:
    """Raise a ValueError, before any forward, when the target's cache cannot be cut back to a prefix.

    `config`: the target's decoder config. Recurrent layers are found by their layer type (Transformers 4.57 and 5.x)
    and, where Transformers says so (`versions_dflash.refuses_crop`), by the cache layer class it would use (`cache`:
    the one `config_cache` built, if at hand). Those of `ROLLBACK_MODEL_TYPES` pass where they can be rolled back.
    """
    refusal = target_refusal(target, config, cache)
    if refusal is not None:
        raise ValueError(refusal)


def target_refusal(target: torch.nn.Module, config: Any, cache: Any = None) -> str | None:
    """Why the target's cache cannot be cut back to a prefix (`check_croppable_target` raises it), or None."""
    cache = config_cache(config) if cache is None else cache
    refusal = recurrent_refusal(config, cache)
    if refusal is None:
        return None
    return (f"Target {type(target).__name__} ({getattr(config, 'model_type', '?')}) is not supported: {refusal}. "
            "DFlash cuts the target's cache back to the accepted prefix of every verified block; the draft itself "
            "loads fine. See README, \"Hybrid targets\".")


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
    if not layers or not any(_is_windowed(layer) for layer in layers):
        return None
    cache.layers = [DynamicLayer() if _is_windowed(layer) else layer for layer in layers]
    return cache


def check_cache(cache: Any, target: torch.nn.Module, num_rows: int) -> None:
    """Raise a ValueError unless the target's cache can be cropped (and, for a batch, have rows selected)."""
    if cache is None or not hasattr(cache, "crop"):
        raise ValueError(f"Target {type(target).__name__} returned no croppable KV cache; "
                         "DFlash needs a DynamicCache.")
    layers = [type(layer).__name__ for layer in getattr(cache, "layers", ()) if _is_windowed(layer)
              or (refuses_crop(layer) and not is_recurrent_layer(layer))]
    if layers:
        raise ValueError(f"Target {type(target).__name__} returned a cache with {', '.join(sorted(set(layers)))} "
                         "layers, which cannot be cut back to the accepted prefix.")
    indexed = sorted({type(layer).__name__ for layer in getattr(cache, "layers", ())
                      if hasattr(layer, "indexer_keys")})
    if num_rows > 1 and indexed:  # compaction moves keys and values, not an indexer's own keys
        raise ValueError(f"Target {type(target).__name__} keeps an attention indexer cache ({', '.join(indexed)}); "
                         "dflash-hf runs it one prompt at a time: pass one row.")
    if num_rows > 1 and not (hasattr(cache, "layers") and hasattr(cache, "batch_select_indices")):
        raise ValueError(f"Target {type(target).__name__} returned a {type(cache).__name__}; "
                         "batches need a DynamicCache.")


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


# --- The draft's context cache ------------------------------------------------------------------------------------


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
