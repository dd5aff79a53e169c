"""A verify's layout and masks: where a strategy's verify columns sit (`VerifyLayout`: their positions, which verify
columns each sees, a tree's paths) and the attention masks built from it by position (`verify_attention_mask`,
`position_attention`), which the eager and the compiled backends hand the target.

A mask by position counts a sliding window in positions, not cache columns, so neither the holes of a batch's cache
(`cache_dflash.CacheColumns`) nor a tree's branches shift it.

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .cache_dflash import CacheColumns


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
