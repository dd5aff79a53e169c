"""The compiled path (`spec_generate(compile=True)`): the target verifies at a fixed width into a fixed-address cache
under `torch.compile`, so that after the first verify no shape, address or guard changes and nothing recompiles; on
a GPU the verify then runs as a CUDA graph (`mode="reduce-overhead"`). README, "Compiled decoding".

- The cache is a Transformers `StaticCache` of `capacity` columns, laid out as the eager loop lays out its
  DynamicCache: the prompts (left padding as holes), then each step's verified columns, rejected ones left as
  masked holes. A verify writes after the last kept column; holes are compacted in place, and only when the next
  verify would not fit.
- Every verify is `block_size` columns wide and reads a 2-D mask over all `capacity` columns.
- The draft's features are the outputs of the chosen layers, stored by forward hooks that do nothing else and
  concatenated inside the compiled graph. The hooks are on the target only during a verify (`capturing`).
- One `StaticVerifier` per target is kept and reused by later calls with the same rows, layers and options, so its
  compiled graph and cache are reused too. It holds the target and its layers weakly: it lives as long as the target
  does, and no longer.

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

import threading
import weakref
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from .cache_dflash import gather_columns, static_capacity
from .devices_dflash import target_device, target_text_config
from .target_dflash import feature_modules, module_hidden_states
from .versions_dflash import cache_keyword, rewind_static_cache, static_write_arguments


class StaticVerifier:
    """A target's compiled verify over its static cache (one per target and call shape; reused across calls)."""

    def __init__(self, target: torch.nn.Module, num_rows: int, layer_ids: list[int] | None,
                 options: dict[str, Any]) -> None:
        self._target = weakref.ref(target)  # the table of verifiers is keyed by the target: no strong reference back
        self.num_rows, self.layer_ids, self.options = num_rows, layer_ids, options
        self._modules = [weakref.ref(module) for module in (feature_modules(target, layer_ids) if layer_ids else [])]
        self.captured: list[torch.Tensor | None] = [None] * len(self._modules)  # [N, b, H] per chosen layer
        self.hooks = [self._hook(slot) for slot in range(len(self._modules))]
        self.cache_argument = cache_keyword(target)
        self.cache: Any = None
        self.capacity = 0  # the cache's columns
        self.written = 0  # columns of the cache up to the last forward's end (host-side; the cache is not asked)
        self.compiled = torch.compile(self._forward, **options)

    def _hook(self, slot: int) -> Any:
        def store_output(module: torch.nn.Module, args: Any, output: Any) -> None:
            self.captured[slot] = module_hidden_states(output)
        return store_output

    @contextmanager
    def capturing(self) -> Iterator[StaticVerifier]:
        """One verify's scope: the feature hooks (the same functions every time, so the compiled graph's guards
        hold) are on the target's layers, and removed after it."""
        handles = [module().register_forward_hook(hook) for module, hook in zip(self._modules, self.hooks)]
        try:
            yield self
        finally:
            for handle in handles:
                handle.remove()
            self.captured = [None] * len(self._modules)

    @property
    def target(self) -> torch.nn.Module:
        """The target this verifier compiles (alive while a call runs on it)."""
        return self._target()

    def new_cache(self, columns: int) -> Any:
        """An empty static cache with room for `columns` columns: the last one's, reset, where it is large enough
        (the same tensors, so a CUDA graph stays valid), else a new one (`static_capacity`)."""
        from transformers import StaticCache

        if self.cache is not None and self.capacity >= columns:
            self.cache.reset()
        else:
            self.capacity = static_capacity(columns)
            self.cache = StaticCache(config=target_text_config(self.target), max_cache_len=self.capacity)
        self.written = 0
        return self.cache

    def prefill_arguments(self, width: int) -> dict[str, Any]:
        """The cache and write position for an eager forward over the first `width` columns (the prompts)."""
        self.written = width
        return {self.cache_argument: self.cache,
                **static_write_arguments(self.target, 0, width, target_device(self.target))}

    def _forward(self, target: torch.nn.Module, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 attention_mask: torch.Tensor, cache: Any, write: dict[str, Any]
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        outputs = target(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask, use_cache=True,
                         **{self.cache_argument: cache}, **write)
        features = torch.cat(self.captured, dim=-1) if self.captured else None  # [N, b, L*H]
        return outputs.logits, features

    def verify(self, input_ids: torch.Tensor, position_ids: torch.Tensor, valid: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The compiled verify of input_ids [N, b] at position_ids [N, b] after the cache's kept columns valid [N, W]
        (W: the columns kept so far): (logits [N, b, V], features [N, b, L*H] or None)."""
        kept, width = valid.shape[1], input_ids.shape[1]
        rewind_static_cache(self.cache, self.written - kept)  # drop what the last verify wrote but did not keep
        if kept + width > self.capacity:
            raise ValueError(f"The static cache holds {self.capacity} columns; this step needs {kept + width}.")
        mask = torch.nn.functional.pad(valid, (0, self.capacity - kept), value=False)  # [N, capacity]
        mask[:, kept : kept + width] = True
        write = static_write_arguments(self.target, kept, width, input_ids.device)
        self.written = kept + width
        with self.capturing():
            return self.compiled(self.target, input_ids, position_ids, mask, self.cache, write)

    def reorder_columns(self, index: torch.Tensor) -> None:
        """Compaction in place: every layer's first W' columns become the per-row columns index [N, W'] (the
        tensors keep their addresses); the write counter follows."""
        for layer in self.cache.layers:
            for states in (layer.keys, layer.values):
                states[:, :, : index.shape[1]].copy_(gather_columns(states[:, :, : self.written], index))
        rewind_static_cache(self.cache, self.written - index.shape[1])
        self.written = index.shape[1]


_VERIFIERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # target -> its last StaticVerifier
_VERIFIERS_GUARD = threading.Lock()


def static_verifier(target: torch.nn.Module, num_rows: int, layer_ids: list[int] | None,
                    options: dict[str, Any]) -> StaticVerifier:
    """The target's verifier for calls of `num_rows` rows reading `layer_ids` with these compile options: the last
    one made for it when those match (its compiled graph is reused), else a new one."""
    with _VERIFIERS_GUARD:
        verifier = _VERIFIERS.get(target)
        if verifier is None or (verifier.num_rows, verifier.layer_ids, verifier.options) != (num_rows, layer_ids,
                                                                                             options):
            verifier = _VERIFIERS[target] = StaticVerifier(target, num_rows, layer_ids, options)
        return verifier
