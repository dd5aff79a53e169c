"""The compiled target backend (`spec_generate(compile=True)`): the target verifies at a fixed width into a
fixed-address cache under `torch.compile`, so that after the first verify no shape, address or guard changes and
nothing recompiles; on a GPU the verify then runs as a CUDA graph (`mode="reduce-overhead"`). README, "Compiled
decoding"; `backends_dflash` holds the seam and the eager backend.

- The cache is a Transformers `StaticCache` of `capacity` columns, laid out as the eager loop lays out its
  DynamicCache: the prompts (left padding as holes), then each step's verified columns, rejected ones left as
  masked holes. A verify writes after the last kept column; holes are compacted in place, and only when the next
  verify would not fit. Sliding-window layers get a full-length layer too: the window is applied by the mask.
- Every verify is as wide as the call's (a chain's block, or a tree's root and nodes) and reads a 4-D mask over all
  `capacity` columns, built from positions (`masks_dflash.verify_attention_mask`): a chain's and a tree's verify are
  the same graph, and a window is counted in positions, which holes do not shift.
- The backend knows nothing of recurrent layers: a wrapper hands it hooks around the prefill and each verify (the
  `around` arguments) and acts after `keep` and `discard` (a hybrid target's Gated DeltaNet layers:
  `static_recurrent_dflash.StaticRecurrentRollback`).
- The draft's features are the outputs of the chosen layers, stored by forward hooks that do nothing else and
  concatenated inside the compiled graph. The hooks are on the target only during a verify (`capturing`).
- Rows that finish stay in the batch (another row count would compile anew): `FixedRowBatch` around the backend
  fills them in and gives the steps the live rows only.
- One `StaticVerifier` per target is kept and reused by later calls with the same rows, layers and options, so its
  compiled graph and cache are reused too. It holds the target and its layers weakly (the table of verifiers is keyed
  by the target), so it is dropped with the target.
- Whether a call can run compiled is decided here, before any forward (`compile_refusal`), with the check of
  `compile=` (`check_compile`) and the `torch.compile` options it gives (`compile_options`).

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Iterator, Protocol

import torch
from transformers.utils import logging

from .cache_dflash import CacheColumns, FixedRows, gather_columns, static_capacity
from .devices_dflash import MASKED_ATTENTION, compiled_call, mask_dtype, target_device, target_text_config
from .masks_dflash import VerifyLayout, position_attention
from .mixers_dflash import rollback_mixers
from .support_dflash import config_cache, recurrent_layers, sliding_window, target_refusal, windowed_mask_refusal
from .target_dflash import NO_HOOK, FeatureCapture, feature_modules, module_hidden_states, prefill_forward
from .versions_dflash import cache_keyword, rewind_static_cache, static_write_arguments, torch_refusal

logger = logging.get_logger(__name__)


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
        self.mask_dtype = mask_dtype(target)
        self.cache: Any = None
        self.capacity = 0  # the cache's columns
        self.written = 0  # columns of the cache up to the last forward's end (host-side; the cache is not asked)
        self.compiled = torch.compile(self._forward, **options)

    def _hook(self, slot: int) -> Any:
        def store_output(module: torch.nn.Module, args: Any, output: Any) -> None:
            self.captured[slot] = module_hidden_states(output)
        return store_output

    @contextmanager
    def capturing(self, around: AbstractContextManager[None] = NO_HOOK) -> Iterator[StaticVerifier]:
        """One verify's scope: the feature hooks (the same functions every time, so the compiled graph's guards
        hold) are on the target's layers, and removed after it; `around` (a wrapper's hooks) is entered inside."""
        handles = [module().register_forward_hook(hook) for module, hook in zip(self._modules, self.hooks)]
        try:
            with around:
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
        from transformers.cache_utils import StaticLayer

        if self.cache is not None and self.capacity >= columns:
            self.cache.reset()
        else:
            self.capacity = static_capacity(columns)
            self.cache = StaticCache(config=target_text_config(self.target), max_cache_len=self.capacity)
            # every position kept (a sliding-window layer's own would drop old ones); the mask applies the window
            self.cache.layers = [StaticLayer(max_cache_len=self.capacity) if getattr(layer, "is_sliding", False)
                                 else layer for layer in self.cache.layers]
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

    def verify(self, input_ids: torch.Tensor, position_ids: torch.Tensor, mask: Any, kept: int,
               around: AbstractContextManager[None] = NO_HOOK) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The compiled verify of input_ids [N, b] at position_ids [N, b] under `mask` ([N, 1, b, capacity], or one
        per layer type), written after the cache's `kept` columns: (logits [N, b, V], features [N, b, L*H] or
        None). `around`: entered around the compiled call only (a wrapper's hooks: its graph captures them)."""
        width = input_ids.shape[1]
        self.rewind(kept)  # drop what the last verify wrote but did not keep
        if kept + width > self.capacity:
            raise ValueError(f"The static cache holds {self.capacity} columns; this step needs {kept + width}.")
        write = static_write_arguments(self.target, kept, width, input_ids.device)
        self.written = kept + width
        with self.capturing(around):
            return compiled_call(self.compiled, f"{type(self.target).__name__}'s verify", self.target, input_ids,
                                 position_ids, mask, self.cache, write)

    def rewind(self, kept: int) -> None:
        """Cut the cache back to its first `kept` columns (the tensors keep their addresses)."""
        rewind_static_cache(self.cache, self.written - kept)
        self.written = kept

    def reorder_columns(self, index: torch.Tensor) -> None:
        """Compaction in place: every layer's first W' columns become the per-row columns index [N, W'] (the
        tensors keep their addresses); the write counter follows."""
        for layer in self.cache.layers:
            for states in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if states is None:
                    continue  # a recurrent layer: no columns
                states[:, :, : index.shape[1]].copy_(gather_columns(states[:, :, : self.written], index))
        self.rewind(index.shape[1])


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
            logger.warning(
                "dflash-hf compile=True: this call compiles the target's verify and the draft's forward "
                "(torch.compile; minutes the first time, less once torch's compile caches hold them); later calls "
                "with this target and %d rows reuse them. See README, \"Compiled decoding\".", num_rows)
            verifier = _VERIFIERS[target] = StaticVerifier(target, num_rows, layer_ids, options)
        return verifier


class StaticBackend:
    """The compiled target backend of one call (a `FixedRowBackend`): its target's `StaticVerifier` (graph and cache,
    reused across calls), the columns of this call, every verify `verify_width` wide. Finished rows stay in the batch
    (a new row count would compile anew): `FixedRowBatch` around it hides them. A wrapper (a hybrid target's
    `static_recurrent_dflash.StaticRecurrentRollback`) hands its hooks to `prefill` and `verify`."""

    def __init__(self, target: torch.nn.Module, layer_ids: list[int] | None, num_rows: int, options: dict[str, Any],
                 columns_needed: int, verify_width: int) -> None:
        self.target, self.verify_width = target, verify_width
        self.verifier = static_verifier(target, num_rows, layer_ids, options)
        self.columns_needed = columns_needed  # the prompts, every new token and one verify past the last
        self.config = target_text_config(target)
        self.window = sliding_window(self.config)
        self.columns: CacheColumns | None = None
        self.before: CacheColumns | None = None  # the columns before the last verify (what `discard` restores)

    @property
    def cache(self) -> Any:
        """The target's StaticCache."""
        return self.verifier.cache

    def prefill(self, input_ids: torch.Tensor, attention: dict[str, torch.Tensor], valid: torch.Tensor,
                capture: FeatureCapture, around: Callable[[Any], AbstractContextManager[None]] = lambda cache: NO_HOOK
                ) -> Any:
        """The prompts' pass (eager) into the static cache, from its first column; `around(cache)` is entered around
        the forward."""
        cache = self.verifier.new_cache(self.columns_needed)
        with around(cache):
            outputs = prefill_forward(self.target, input_ids, attention, capture,
                                      self.verifier.prefill_arguments(input_ids.shape[1]))
        self.columns = CacheColumns(valid, valid.sum(dim=1).tolist())
        return outputs

    def step_width(self, block_size: int, longest_remaining: int) -> int:
        """Always the whole block: the verify's width never changes."""
        return block_size

    def verify(self, input_ids: torch.Tensor, layout: VerifyLayout, around: AbstractContextManager[None] = NO_HOOK
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The compiled verify of input_ids [N, b] as `layout` arranges them (a chain's and a tree's alike), under a
        4-D mask over the cache's capacity; `around` is entered around the compiled call."""
        width = input_ids.shape[1]
        if width != self.verify_width:
            raise ValueError(f"A compiled verify is {self.verify_width} columns wide; this step verifies {width}.")
        mask = position_attention(self.columns, layout.visible(), layout.positions, self.verifier.mask_dtype,
                                  self.config, self.window, width=self.verifier.capacity)
        self.before = self.columns.copy()
        return self.verifier.verify(input_ids, layout.positions, mask, self.columns.width, around)

    def keep(self, kept_columns: list[list[int]], kept: torch.Tensor) -> None:
        """The verify's kept columns [N, w] join the cache's; the rest is overwritten by the next verify."""
        self.columns.append(kept, [len(columns) for columns in kept_columns])

    def discard(self) -> None:
        """The columns, and the cache's write counter, as before the last verify (a keep after it included)."""
        if self.before is not None:
            self.columns = self.before
        self.verifier.rewind(self.columns.width)

    def compact(self) -> None:
        """Compaction in place, only once the next verify would not fit."""
        order = self.columns.compaction(room=self.verifier.capacity - self.verify_width)
        if order is not None:
            self.verifier.reorder_columns(order)



class FixedRowBackend(Protocol):
    """A compiled backend whose batch keeps every row (`StaticBackend`, or a hybrid target's
    `static_recurrent_dflash.StaticRecurrentRollback` around it): the target backend's methods but `drop_rows`, over
    all N rows. `FixedRowBatch` around one is the call's `backends_dflash.TargetBackend`."""

    columns: CacheColumns
    cache: Any

    def prefill(self, input_ids: torch.Tensor, attention: dict[str, torch.Tensor], valid: torch.Tensor,
                capture: FeatureCapture) -> Any:
        """The prompts' pass over every row."""

    def step_width(self, block_size: int, longest_remaining: int) -> int:
        """The verify's width."""

    def verify(self, input_ids: torch.Tensor, layout: VerifyLayout) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A verify of every row [N, b]: (logits [N, b, V], features [N, b, L*H] or None)."""

    def keep(self, kept_columns: list[list[int]], kept: torch.Tensor) -> None:
        """Keep each row's accepted columns of the last verify."""

    def discard(self) -> None:
        """Forget the last verify (before any keep of it)."""

    def compact(self) -> None:
        """Drop the cache's holes when the backend's budget says so."""


class FixedRowBatch:
    """The compiled backend as the steps see it (`backends_dflash.TargetBackend`): its live rows only. Finished rows
    stay in the inner backend's batch, so no shape changes (`cache_dflash.FixedRows`): a verify gives them a filler
    (token 0 at position 0; in a tree, every node a child of the root, on the root's path only) and returns the live
    rows' logits and features; they keep no column."""

    def __init__(self, inner: FixedRowBackend, num_rows: int, device: torch.device) -> None:
        self.inner = inner
        self.rows = FixedRows(num_rows, device)

    @property
    def columns(self) -> CacheColumns:
        """The inner backend's columns (every row of the batch)."""
        return self.inner.columns

    @property
    def cache(self) -> Any:
        """The target's StaticCache."""
        return self.inner.cache

    def prefill(self, input_ids: torch.Tensor, attention: dict[str, torch.Tensor], valid: torch.Tensor,
                capture: FeatureCapture) -> Any:
        """The inner prefill (every row is live)."""
        return self.inner.prefill(input_ids, attention, valid, capture)

    def step_width(self, block_size: int, longest_remaining: int) -> int:
        """The inner backend's."""
        return self.inner.step_width(block_size, longest_remaining)

    def verify(self, input_ids: torch.Tensor, layout: VerifyLayout) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The inner verify of the live rows [n, b] among fillers: (logits [n, b, V], features [n, b, L*H] or None)."""
        logits, features = self.inner.verify(self.rows.fill(input_ids), self.filled(layout))
        return self.rows.take(logits), None if features is None else self.rows.take(features)

    def filled(self, layout: VerifyLayout) -> VerifyLayout:
        """The live rows' layout [n, b] in their places among the N, finished rows given the filler's."""
        rows = self.rows
        if rows.index is None:
            return layout
        sees = layout.sees
        if sees is not None:  # a tree: a filler's nodes each see the root and themselves
            width = sees.shape[-1]
            star = torch.eye(width, dtype=torch.bool, device=sees.device)
            star[:, 0] = True
            live = rows.fill(torch.ones(sees.shape[0], dtype=torch.bool, device=sees.device), False)  # [N]
            sees = torch.where(live[:, None, None], rows.fill(sees, False), star)  # [N, b, b]
        paths = None if layout.paths is None else rows.fill_list(layout.paths, [[0]])
        return VerifyLayout(rows.fill(layout.positions), sees, paths)

    def keep(self, kept_columns: list[list[int]], kept: torch.Tensor) -> None:
        """The inner keep; finished rows keep nothing."""
        self.inner.keep(self.rows.fill_list(kept_columns, []), self.rows.fill(kept, False))

    def discard(self) -> None:
        """The inner discard."""
        self.inner.discard()

    def compact(self) -> None:
        """The inner compaction."""
        self.inner.compact()

    def drop_rows(self, keep: list[int], index: torch.Tensor) -> None:
        """Later calls take and return the rows `keep` only; the finished rows stay in the inner batch."""
        self.rows.select_rows(keep)


# --- Whether a call can run compiled --------------------------------------------------------------------------


def compile_refusal(target: torch.nn.Module, step_costs: Any, cpu_kernels: bool | str | None,
                    layer_ids: list[int] | None) -> str | None:
    """Why `compile=True` cannot run this call (`spec_generate` raises it), or None."""
    config = target_text_config(target)
    implementation = getattr(config, "_attn_implementation", None)
    if step_costs is not None:
        return ("compile=True verifies at one fixed width, and step_costs chooses a width per step: pass "
                "step_costs=None (a tree, tree_size=N, verifies more candidates at a fixed width).")
    if cpu_kernels:
        return ("compile=True runs Transformers' own kernels inside the compiled graph: pass cpu_kernels=False (or "
                "leave it unset).")
    if recurrent_layers(config):
        refusal = target_refusal(target, config)  # what the eager loop refuses too (a family, Transformers 4.57)
        if refusal is not None:
            return refusal
        mixers = rollback_mixers(target, config_cache(config))  # a ValueError where no rollback could be exact
        others = sorted({type(mixer.module).__name__ for mixer in mixers if mixer.gated_delta is None})
        if others:
            return (f"compile=True is not supported with {type(target).__name__}: it rolls back Gated DeltaNet "
                    f"layers (Transformers >= 5.25) at fixed shapes, and this target's recurrent layers are "
                    f"{', '.join(others)}; pass compile=False (the eager loop runs it exactly, chains and trees; "
                    "docs/hybrid.md).")
    refusal = windowed_mask_refusal(config)
    if refusal is not None:
        return (f"compile=True is not supported with {type(target).__name__}: {refusal}; pass compile=False.")
    if implementation not in MASKED_ATTENTION:
        return (f"compile=True needs the target's attention to be one of {', '.join(MASKED_ATTENTION)}; this "
                f"target uses {implementation!r}: load it with attn_implementation=\"sdpa\".")
    if layer_ids and feature_modules(target, layer_ids) is None:
        return (f"compile=True takes the draft's features from the target's decoder layers, which "
                f"{type(target).__name__} does not expose as a list of num_hidden_layers modules.")
    return torch_refusal("compile=True")


def check_compile(option: Any) -> bool | dict[str, Any]:
    """`compile=option` checked: True, False (None reads as False) or a dict of `torch.compile` keyword arguments
    whose names and backend torch knows; anything else is refused by name, before any forward."""
    if option is None or isinstance(option, bool):
        return bool(option)
    if not isinstance(option, dict):
        raise TypeError(f"compile must be True, False or a dict of torch.compile options, got {option!r}.")
    parameters = inspect.signature(torch.compile).parameters.values()
    accepted = [parameter.name for parameter in parameters if parameter.name != "model"]
    unknown = sorted(set(option) - set(accepted))
    if unknown and not any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        raise ValueError(f"compile={{...}} is passed to torch.compile, which takes no {', '.join(unknown)}; its "
                         f"options are {', '.join(accepted)}.")
    backend = option.get("backend")
    if isinstance(backend, str) and backend not in torch.compiler.list_backends(exclude_tags=()):
        raise ValueError(f"compile={{'backend': {backend!r}}} names no backend of this torch; it has "
                         f"{', '.join(torch.compiler.list_backends())} (torch.compiler.list_backends()).")
    return option


def compile_options(option: bool | dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The `torch.compile` options of `compile=option`: True gives inductor, with CUDA graphs on a GPU
    (`mode="reduce-overhead"`); a dict is passed to `torch.compile` with `fullgraph=True` unless it sets `fullgraph`
    itself (a whole graph by default: a graph break would run part of every verify eagerly, without a word). Each
    compiled function's graphs count apart against the recompile limit (`isolate_recompiles`, unless the dict sets it):
    the targets and drafts of one process do not add up."""
    if isinstance(option, dict):
        return {"fullgraph": True, "isolate_recompiles": True, **option}
    on_gpu = {"mode": "reduce-overhead"} if device.type == "cuda" else {}
    return {**on_gpu, "fullgraph": True, "isolate_recompiles": True}
