"""A hybrid target's recurrent mixers: where they are, and whether their states can be rolled back exactly.

The support matrix's tables (`families_dflash`) say which families' recurrent layers are rolled back; this module
finds those layers' mixers in a loaded target (the one child of each decoder layer whose forward takes the cache) and
refuses, before any forward, a target whose mixers cannot be found or run a Hub kernel that is handed the cache. The
rollbacks themselves are `recurrent_dflash` (eager) and `static_recurrent_dflash` (compile=True).

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch

from .support_dflash import recurrent_cache_layers
from .target_dflash import decoder_layers
from .versions_dflash import gated_delta_functions, kernel_replacements


@dataclass
class Mixer:
    """The module of one decoder layer that reads and writes a recurrent state, and how to call it."""

    layer_idx: int
    module: torch.nn.Module
    cache_argument: str  # the forward keyword that takes the cache (`cache`, or `cache_params` on older versions)
    signature: inspect.Signature  # of its forward: a tree verify rebinds its arguments
    # a Gated DeltaNet mixer's (convolution, chunked rule, token-by-token rule) function modules: a chain's rollback
    # replays only them
    gated_delta: tuple[torch.nn.Module, torch.nn.Module, torch.nn.Module] | None = None


def cache_argument_of(module: torch.nn.Module) -> str | None:
    """The keyword of `module.forward` that takes a cache, or None when it takes none."""
    parameters = inspect.signature(module.forward).parameters
    return next((name for name in ("cache", "cache_params", "past_key_values") if name in parameters), None)


def find_mixers(target: torch.nn.Module, layer_ids: list[int]) -> list[Mixer] | str:
    """The mixer of each recurrent layer `layer_ids` (the one child of the decoder layer whose forward takes the
    cache), or a sentence saying why they cannot be found."""
    layers = decoder_layers(target)
    if layers is None:
        return "its decoder layers cannot be found"
    mixers = []
    for layer_idx in layer_ids:
        found = [(module, argument) for module in layers[layer_idx].children()
                 if (argument := cache_argument_of(module)) is not None]
        if len(found) != 1:
            return (f"decoder layer {layer_idx} has {len(found)} modules that take the cache (one recurrent mixer "
                    "expected)")
        module, argument = found[0]
        mixers.append(Mixer(layer_idx, module, argument, inspect.signature(module.forward),
                            gated_delta_functions(module)))
    return mixers


def rollback_mixers(target: torch.nn.Module, cache: Any) -> list[Mixer]:
    """The mixers of the recurrent layers of `cache` (the target's, or a fresh one from its config before any forward)
    that a rollback replays; a ValueError naming the reason where it could not be exact (empty: no such layers)."""
    layer_ids = recurrent_cache_layers(cache)
    if not layer_ids:
        return []
    mixers = find_mixers(target, layer_ids)
    if isinstance(mixers, str):
        raise ValueError(f"Target {type(target).__name__} has recurrent layers {layer_ids}, but {mixers}: dflash-hf "
                         "cannot roll their state back after a verify. See docs/hybrid.md.")
    kernels = sorted({name for mixer in mixers for name in kernel_replacements(mixer.module)})
    if kernels:
        raise ValueError(f"Target {type(target).__name__} runs Hub kernels in its recurrent layers that are handed "
                         f"the cache ({', '.join(kernels)}): they may keep state outside the cache, where dflash-hf "
                         "cannot roll it back after a verify. Load the target with `use_kernels=False` (or call "
                         "`target.reset_kernels()`). See docs/hybrid.md.")
    return mixers
