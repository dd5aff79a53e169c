"""The token ids a generation needs besides the prompt: stop ids, the pad id and the draft's mask id, read from the
target's generation config, the tokenizer and the draft (`generation_tokens`: the commands and users share it), and
`token_id_list`, which reads ids given as an int, a list, a tensor or a numpy array.

Hub remote code: imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any

import torch

from .proposer_dflash import DFlashDraft


def token_id_list(value: Any, name: str) -> list[int]:
    """Token ids given as an int, a numpy or 0-d/1-d torch integer, or a flat list/tuple of those: a list of ints."""
    if value is None:
        return []
    if hasattr(value, "__array__") and getattr(value, "ndim", 0) >= 1 and not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)  # a numpy (or other array library's) array of ids
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool or value.dim() > 1:
            raise TypeError(f"{name} must hold integer token ids (an int, a list of ints or a 1-d integer tensor), "
                            f"got a {value.dim()}-d {value.dtype} tensor.")
        return [int(item) for item in value.reshape(-1).tolist()]
    items = list(value) if isinstance(value, (list, tuple, set, frozenset)) else [value]
    ids = []
    for item in items:
        if isinstance(item, torch.Tensor) and item.dim() == 0 and not item.dtype.is_floating_point:
            item = item.item()
        if isinstance(item, str):
            raise TypeError(f"{name} holds the string {item!r}: pass token ids, e.g. "
                            f"tokenizer.convert_tokens_to_ids({item!r}).")
        if isinstance(item, (list, tuple, torch.Tensor)):
            raise TypeError(f"{name} must be a flat list of token ids, got {value!r}; DFlash stops on single tokens "
                            "(a stop sequence of several tokens is not supported).")
        if isinstance(item, bool) or not isinstance(item, numbers.Integral):
            raise TypeError(f"{name} must hold integer token ids, got {item!r} ({type(item).__name__}).")
        ids.append(int(item))
    return ids


@dataclass(frozen=True)
class GenerationTokens:
    """The ids a generation needs besides the prompt."""

    stop_token_ids: list[int]  # every EOS id of the target's generation config and of the tokenizer
    pad_token_id: int  # fills rows that ended early
    mask_token_id: int | None  # the draft's mask id (None without a draft)


def stop_token_ids_of(target: torch.nn.Module, tokenizer: Any = None) -> list[int]:
    """Every id that ends a response: the target generation config's EOS ids and the tokenizer's EOS, sorted."""
    ids: set[int] = set()
    for source in (getattr(target, "generation_config", None), tokenizer):
        ids.update(token_id_list(getattr(source, "eos_token_id", None), "eos_token_id"))
    return sorted(ids)


def default_pad_token_id(target: torch.nn.Module, stop_token_ids: list[int] | None, tokenizer: Any = None) -> int:
    """Padding for rows that end early: the target's pad id, else the tokenizer's,
    else the first stop token, else 0."""
    for source in (getattr(target, "generation_config", None), tokenizer):
        configured = token_id_list(getattr(source, "pad_token_id", None), "pad_token_id")
        if configured:
            return configured[0]
    return stop_token_ids[0] if stop_token_ids else 0


def resolve_mask_token_id(draft: DFlashDraft, tokenizer: Any = None) -> int | None:
    """The draft's mask id; looked up in the tokenizer when the config names the mask token only as a string."""
    if draft.mask_token_id is not None or tokenizer is None:
        return draft.mask_token_id
    name = draft.config.dflash_config.get("mask_token")
    mask_token_id = tokenizer.convert_tokens_to_ids(name) if name is not None else None
    if mask_token_id is None or mask_token_id == tokenizer.unk_token_id:
        raise ValueError(f"The draft's mask token {name!r} is not in the target tokenizer's vocabulary.")
    return int(mask_token_id)


def generation_tokens(target: torch.nn.Module, tokenizer: Any = None, draft: DFlashDraft | None = None
                      ) -> GenerationTokens:
    """Stop, pad and mask ids for generating with `target` (and `draft`): bench, train, demo and users share it."""
    stop_token_ids = stop_token_ids_of(target, tokenizer)
    return GenerationTokens(
        stop_token_ids=stop_token_ids,
        pad_token_id=default_pad_token_id(target, stop_token_ids, tokenizer),
        mask_token_id=None if draft is None else resolve_mask_token_id(draft, tokenizer),
    )
