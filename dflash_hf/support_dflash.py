"""Where a target is refused, and why: the support matrix (`families_dflash`) applied to a loaded target's config
and cache, before any forward, and to the cache its prefill returns.

Every verify cuts the target's cache back to the accepted prefix, so a target must keep keys and values per position.
This module says what a target's cache layers are (recurrent: `recurrent_layers`, `recurrent_cache_layers`; sliding
window: `has_windowed_layers`, `sliding_window`), refuses a target whose cache cannot be cut back (`target_refusal`,
`check_croppable_target`; recurrent layers pass in the families of `families_dflash.ROLLBACK_MODEL_TYPES`, which
`recurrent_dflash` and `static_recurrent_dflash` roll back) or whose prefill returned such a cache (`check_cache`),
and refuses masks by position where a windowed target's layers take other masks (`windowed_mask_refusal`). The
refusals a call's options add are beside the code that decides them: a hybrid target's mixers
(`mixers_dflash.rollback_mixers`), trees (`tree_dflash.tree_refusal`), `compile=True`
(`static_dflash.compile_refusal`).

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

from typing import Any

import torch

from .families_dflash import (
    HYBRID_TRANSFORMERS,
    RECURRENT_LAYER_WORDS,
    RECURRENT_MODEL_TYPES,
    RECURRENT_REFUSALS,
    ROLLBACK_MODEL_TYPES,
)
from .versions_dflash import TRANSFORMERS_VERSION, is_linear_attention_layer, refuses_crop


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
    """The DynamicCache a model builds from its config (Transformers picks each layer's class), or None where
    Transformers cannot lay one out from the config (the model then makes its own)."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=config)
    # Transformers 5.25 over its 800 config classes: a layer kind it has no cache layer for (KeyError), a config
    # without the fields a cache needs (AttributeError: no `num_hidden_layers`), a field of another type (TypeError);
    # ValueError: a config it refuses (e.g. no single text config)
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def has_windowed_layers(config: Any) -> bool:
    """Whether the target's cache (from its decoder config) has sliding-window layers, which count their window in
    cache columns."""
    return any(is_windowed_layer(layer) for layer in getattr(config_cache(config), "layers", None) or ())


def is_windowed_layer(layer: Any) -> bool:
    """A plain sliding-window (or chunked) layer: it drops positions older than its window."""
    from transformers.cache_utils import DynamicSlidingWindowLayer

    return type(layer) is DynamicSlidingWindowLayer


def is_recurrent_layer(layer: Any) -> bool:
    """A cache layer that holds a linear-attention (recurrent and convolution) state and no keys or values."""
    return is_linear_attention_layer(layer) and not hasattr(layer, "keys")


def recurrent_cache_layers(cache: Any) -> list[int]:
    """Indices of the layers of a cache that hold a recurrent state (rolled back, not cropped)."""
    return [index for index, layer in enumerate(getattr(cache, "layers", ())) if is_recurrent_layer(layer)]


def sliding_window(config: Any) -> int | None:
    """The attention window (in positions) of a decoder config with sliding-window layers, or None."""
    return getattr(config, "sliding_window", None) if has_windowed_layers(config) else None


def recurrent_refusal(config: Any, cache: Any) -> str | None:
    """Why a target with recurrent layers cannot run (None: it has none, or they can be rolled back)."""
    recurrent = recurrent_layers(config)
    uncroppable = sorted({type(layer).__name__ for layer in getattr(cache, "layers", ())
                          if not is_windowed_layer(layer) and not is_recurrent_layer(layer)
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
            "loads fine. See docs/hybrid.md.")


def check_cache(cache: Any, target: torch.nn.Module, num_rows: int) -> None:
    """Raise a ValueError unless the target's cache can be cropped (and, for a batch, have rows selected)."""
    if cache is None or not hasattr(cache, "crop"):
        raise ValueError(f"Target {type(target).__name__} returned no croppable KV cache; "
                         "DFlash needs a DynamicCache.")
    layers = [type(layer).__name__ for layer in getattr(cache, "layers", ()) if is_windowed_layer(layer)
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


def windowed_mask_refusal(config: Any) -> str | None:
    """Why masks by position cannot be given to this windowed target's layers (layer types other than full and
    sliding attention), or None."""
    types = set(getattr(config, "layer_types", None) or ())
    other = sorted(types - {"full_attention", "sliding_attention"})
    if sliding_window(config) is None or not other:
        return None
    return f"its layer types {other} take masks dflash-hf does not build"
