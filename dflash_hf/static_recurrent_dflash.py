"""Hybrid targets, compiled backend (`compile=True`): Gated DeltaNet states rolled back at fixed shapes.

`StaticRecurrentRollback` is the compiled backend's recurrent rollback: a `recurrent_dflash.RollbackWrapper` (which
forwards the target backend's methods, `backends_dflash.TargetBackend`, to the backend it wraps; the eager
`backends_dflash.RecurrentRollback` is the other) around `static_dflash.StaticBackend`, and like it a
`static_dflash.FixedRowBackend` that `FixedRowBatch` wraps (`backends_dflash.target_backend` builds the stack). It
hands the backend a hook around the prefill (`StaticRecurrentStates.allocating`: fixed buffers shaped from the
prefill's calls) and around each verify (`recording`: the verified columns' convolution and rule inputs copied into
them, a tree's calls run along its root-to-leaf paths), and after `keep` runs the rollback, one more compiled call.
The states live as long as the target's `StaticVerifier` (one per verifier, `static_states`), so the hooks its
compiled graph's guards saw and the rollback's graph are reused by later calls. docs/compiled.md.

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

import inspect
import threading
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from .cache_dflash import host_to_device
from .devices_dflash import compiled_call
from .masks_dflash import VerifyLayout
from .mixers_dflash import Mixer
from .recurrent_dflash import RollbackWrapper
from .static_dflash import StaticBackend, StaticVerifier
from .target_dflash import FeatureCapture
from .tree_dflash import PathPlan
from .versions_dflash import align_token_count, shared_gated_delta_functions


@dataclass
class ConvolutionRecord:
    """One convolution call of a Gated DeltaNet layer in the last verify: its input [N, C, b] and the cache's state
    before it [N, C, K] (both fixed buffers)."""

    inputs: torch.Tensor
    before: torch.Tensor


@dataclass
class RuleRecord:
    """The gated delta rule call of a Gated DeltaNet layer in the last verify: its per-column inputs (query, key, value
    [N, b, heads, dim], g and beta [N, b, heads]), the recurrent state before it [N, Hv, Dk, Dv] (fixed buffers), and
    its other arguments (the same every call)."""

    inputs: dict[str, torch.Tensor]
    before: torch.Tensor
    options: dict[str, Any]


RULE_INPUTS = ("query", "key", "value", "g", "beta")


def call_argument(names: list[str], args: tuple, kwargs: dict, name: str, default: Any = None) -> Any:
    """The argument `name` of a call (args, kwargs) to a function whose parameters are `names`."""
    place = names.index(name)
    return args[place] if place < len(args) else kwargs.get(name, default)


def with_argument(names: list[str], args: tuple, kwargs: dict, name: str, value: Any) -> tuple[tuple, dict]:
    """The call (args, kwargs) with argument `name` replaced by `value`."""
    place = names.index(name)
    if place < len(args):
        return (*args[:place], value, *args[place + 1:]), kwargs
    return args, {**kwargs, name: value}


def parameter_names(function: torch.nn.Module) -> list[str]:
    """The parameters of a function module's forward, in order."""
    return list(inspect.signature(function.forward).parameters)


class StaticRecurrentStates:
    """The Gated DeltaNet layers of a static cache (`static_dflash`, compile=True), rolled back with fixed shapes.

    During a verify, hooks on the convolution and gated delta rule functions copy their inputs over the b verified
    columns into fixed buffers (inside the compiled graph); the states they start from are in fixed buffers too,
    written by the prefill (`allocating`) and by each rollback, never by the verify graph. `keep` then runs one
    compiled rollback: each row's convolution state is the K columns that end at its last kept column (gathered from
    the state before and the inputs), and its recurrent state is the rule replayed over the b columns from the state
    before, with g and beta set to 0 past the row's kept count (a step of the rule with both 0 leaves the state as it
    is, so every row replays its own prefix at one shape). The results are copied into the cache's own tensors, which
    keep their addresses. A tree's kept columns (the root and the accepted path) are gathered to the left first.

    A tree verify runs each convolution and rule along the tree's root-to-leaf paths instead of its columns, at a fixed
    number of paths and places (`PathPlan.of(..., fixed=True)`): the mixer's projections are per column, so only those
    two functions mix columns.

    The hooks are on the module-level functions every mixer of the class calls (`shared_gated_delta_functions`: a
    compiled forward calls no mixer's private copy); a convolution call names its layer and cache, and calls for
    another cache are left alone.
    """

    def __init__(self, mixers: list[Mixer], options: dict[str, Any]) -> None:
        self.mixers = mixers
        self.convolution, self.chunked = shared_functions(mixers)
        self.names = (parameter_names(self.convolution), parameter_names(self.chunked))
        self.convolutions: dict[tuple[int, int], ConvolutionRecord] = {}  # (layer, state index) -> buffers
        self.rules: dict[int, RuleRecord] = {}  # layer -> buffers
        self.cache: Any = None
        self.layer: int | None = None  # the layer whose convolution ran last (its rule runs next)
        self.plan: PathPlan | None = None  # the tree of the verify running (None: a chain)
        self.recorded = False  # whether a verify ran since the states were last kept (`restore` undoes it)
        self.kept = False  # whether a keep ran after the last verify (`restore` cannot undo it)
        # made once, so that a compiled graph's guards on the functions' hooks hold from one verify to the next
        self.hooks = (self._record_convolution, self._record_rule, self._convolution_paths, self._rule_paths)
        self.compiled_rollback = torch.compile(self._rollback, **options)

    # -- buffers, from the prefill's calls ----------------------------------------------------------------------------

    @contextmanager
    def allocating(self, cache: Any, width: int) -> Iterator[None]:
        """Around the prefill forward into `cache`: each layer's convolution and rule calls give the buffers' shapes
        (their batch, `width` columns) and the rule's other arguments; buffers of the right shapes are kept (their
        addresses are the compiled graphs')."""
        self.cache, self.recorded, self.kept, self.plan, self.layer = cache, False, False, None, None
        handles = [self.convolution.register_forward_pre_hook(self._convolution_allocator(width), with_kwargs=True),
                   self.chunked.register_forward_pre_hook(self._rule_allocator(width), with_kwargs=True)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
        missing = [mixer.layer_idx for mixer in self.mixers if mixer.layer_idx not in self.rules]
        if missing:
            raise RuntimeError(f"The prefill did not run the gated delta rule of layers {missing} (a patched "
                               "forward?): compile=True cannot roll their states back. See docs/hybrid.md.")
        for (layer_idx, state_idx), record in self.convolutions.items():
            state = cache.get_conv_state(layer_idx, state_idx=state_idx)  # [N, C, K]
            if record.before is None or record.before.shape != state.shape:
                record.before = static_buffer(state.shape, state.dtype, state.device)
            record.before.copy_(state)
        for layer_idx, record in self.rules.items():
            state = cache.get_recurrent_state(layer_idx)  # [N, Hv, Dk, Dv]
            if record.before is None or record.before.shape != state.shape:
                record.before = static_buffer(state.shape, state.dtype, state.device)
            record.before.copy_(state)

    def _convolution_allocator(self, width: int) -> Any:
        names = self.names[0]

        def allocate(function: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if call_argument(names, args, kwargs, "cache") is not self.cache:
                return
            self.layer = layer_idx = call_argument(names, args, kwargs, "layer_idx")
            state_idx = call_argument(names, args, kwargs, "state_idx", 0)
            inputs = call_argument(names, args, kwargs, "hidden_states")  # [N, C, T]
            shape = (*inputs.shape[:-1], width)
            record = self.convolutions.get((layer_idx, state_idx))
            if record is None or record.inputs.shape != shape or record.inputs.dtype != inputs.dtype:
                self.convolutions[layer_idx, state_idx] = ConvolutionRecord(
                    static_buffer(shape, inputs.dtype, inputs.device), None)
        return allocate

    def _rule_allocator(self, width: int) -> Any:
        names = self.names[1]

        def allocate(function: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if self.layer is None:
                return  # another cache's forward
            layer_idx, self.layer = self.layer, None
            values = {name: call_argument(names, args, kwargs, name) for name in RULE_INPUTS}
            options = {name: value for name, value in kwargs.items()
                       if name not in RULE_INPUTS and name not in ("initial_state", "output_final_state")
                       and not isinstance(value, torch.Tensor)}
            record = self.rules.get(layer_idx)
            shapes = {name: (value.shape[0], width, *value.shape[2:]) for name, value in values.items()}
            if record is None or any(record.inputs[name].shape != shape or record.inputs[name].dtype !=
                                     values[name].dtype for name, shape in shapes.items()):
                record = self.rules[layer_idx] = RuleRecord(
                    {name: static_buffer(shapes[name], values[name].dtype, values[name].device)
                     for name in RULE_INPUTS}, None, options)
            record.options = options
        return allocate

    # -- the verify: recording (chain), paths (tree) ------------------------------------------------------------------

    @contextmanager
    def recording(self, plan: PathPlan | None) -> Iterator[None]:
        """Around a compiled verify: the hooks that record each layer's calls (and run a tree's along its paths)."""
        self.plan, self.layer = plan, None
        record_convolution, record_rule, convolution_paths, rule_paths = self.hooks
        handles = [self.convolution.register_forward_pre_hook(record_convolution, with_kwargs=True),
                   self.chunked.register_forward_pre_hook(record_rule, with_kwargs=True)]
        if plan is not None:
            handles += [self.convolution.register_forward_hook(convolution_paths, with_kwargs=True),
                        self.chunked.register_forward_hook(rule_paths, with_kwargs=True)]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()
            self.plan, self.layer = None, None
        self.recorded, self.kept = True, False

    def _record_convolution(self, function: torch.nn.Module, args: tuple, kwargs: dict
                            ) -> tuple[tuple, dict] | None:
        names = self.names[0]
        cache = call_argument(names, args, kwargs, "cache")
        if cache is not self.cache:
            return None
        self.layer = layer_idx = call_argument(names, args, kwargs, "layer_idx")
        state_idx = call_argument(names, args, kwargs, "state_idx", 0)
        inputs = call_argument(names, args, kwargs, "hidden_states")  # [N, C, b]
        record = self.convolutions[layer_idx, state_idx]
        record.inputs.copy_(inputs)
        if self.plan is None:
            return None
        # a tree: the K columns before the verify, then each path's columns [N * P, C, K + D], without the cache
        # (which keeps its state until the rollback); the forward hook takes the last D columns back
        plan = self.plan
        columns = torch.cat((inputs, inputs.new_zeros(*inputs.shape[:2], 1)), dim=2)  # [N, C, b + 1]
        along = columns[plan.rows].gather(2, plan.reads[:, None, :].expand(-1, columns.shape[1], -1))
        args, kwargs = with_argument(names, args, kwargs, "hidden_states",
                                     torch.cat((record.before[plan.rows], along), dim=2))
        return with_argument(names, args, kwargs, "cache", None)

    def _convolution_paths(self, function: torch.nn.Module, args: tuple, kwargs: dict, output: torch.Tensor
                           ) -> torch.Tensor | None:
        if self.layer is None:
            return None
        plan = self.plan
        depth = plan.reads.shape[1]
        along = output[..., -depth:]  # [N * P, C, D]
        num_rows, channels = plan.first_paths.shape[0], along.shape[1]
        along = along.reshape(num_rows, -1, channels, depth).transpose(1, 2).reshape(num_rows, channels, -1)
        columns = along.new_zeros(num_rows, channels, plan.width + 1)  # [N, C, b + 1] (b: padding's)
        columns.scatter_(2, plan.writes.reshape(num_rows, 1, -1).expand(-1, channels, -1), along)
        return columns[..., :-1]

    def _record_rule(self, function: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if self.layer is None:
            return None  # another cache's forward
        names = self.names[1]
        record = self.rules[self.layer]
        values = {name: call_argument(names, args, kwargs, name) for name in RULE_INPUTS}
        for name, value in values.items():
            record.inputs[name].copy_(value)
        if self.plan is None:
            self.layer = None
            return None
        plan = self.plan  # a tree: each path a row [N * P, D, ...], from its row's state
        for name, value in values.items():
            columns = torch.cat((value, value.new_zeros(value.shape[0], 1, *value.shape[2:])), dim=1)
            index = plan.reads.reshape(*plan.reads.shape, *([1] * (value.dim() - 2)))
            args, kwargs = with_argument(names, args, kwargs, name,
                                         columns[plan.rows].gather(1, index.expand(-1, -1, *value.shape[2:])))
        return with_argument(names, args, kwargs, "initial_state", record.before[plan.rows])

    def _rule_paths(self, function: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        if self.layer is None:
            return None
        plan = self.plan
        along, _ = output  # [N * P, D, Hv, Dv]
        num_rows = plan.first_paths.shape[0]
        along = along.reshape(num_rows, -1, *along.shape[2:])  # [N, P * D, Hv, Dv]
        columns = along.new_zeros(num_rows, plan.width + 1, *along.shape[2:])  # [N, b + 1, Hv, Dv]
        columns.scatter_(1, plan.writes.reshape(num_rows, -1, 1, 1).expand(-1, -1, *along.shape[2:]), along)
        before = self.rules[self.layer].before  # the state stays as it was before the verify until the rollback
        self.layer = None
        return columns[:, :-1], before

    # -- after the verify ---------------------------------------------------------------------------------------------

    def keep(self, kept_columns: list[list[int]], num_columns: int) -> None:
        """Leave each row's states after its kept verify columns (a chain: 0 .. c - 1; a tree: the root and the
        accepted path): one compiled call; `num_columns`: the cache's columns after the step (the layers' token
        counts)."""
        width = next(iter(self.rules.values())).inputs["query"].shape[1]
        device = next(iter(self.rules.values())).before.device
        index = host_to_device([columns + [0] * (width - len(columns)) for columns in kept_columns], device)  # [N, b]
        counts = host_to_device([len(columns) for columns in kept_columns], device)  # [N]
        compiled_call(self.compiled_rollback, "the recurrent layers' rollback", index, counts,
                      host_to_device(num_columns, device))
        self.recorded, self.kept = False, True  # the states before the verify are gone: the kept ones replace them

    def _rollback(self, index: torch.Tensor, counts: torch.Tensor, num_columns: torch.Tensor) -> None:
        width = index.shape[1]
        keeps = torch.arange(width, device=index.device)[None, :] < counts[:, None]  # [N, b]
        for (layer_idx, state_idx), record in self.convolutions.items():
            channels, kernel = record.before.shape[1:]
            inputs = record.inputs.gather(2, index[:, None, :].expand(-1, channels, -1))  # [N, C, b]
            window = torch.cat((record.before, inputs), dim=2)  # [N, C, K + b]
            ends = (counts[:, None] + torch.arange(kernel, device=index.device))[:, None, :]  # [N, 1, K]
            state = window.gather(2, ends.expand(-1, channels, -1))  # [N, C, K]
            self.cache.get_conv_state(layer_idx, state_idx=state_idx).copy_(state)
            record.before.copy_(state)
        for mixer in self.mixers:
            record = self.rules[mixer.layer_idx]
            values = {}
            for name in RULE_INPUTS:
                value = record.inputs[name]  # [N, b, ...]
                shape = (*index.shape, *([1] * (value.dim() - 2)))
                value = value.gather(1, index.reshape(shape).expand(-1, -1, *value.shape[2:]))
                if name in ("g", "beta"):  # past the kept count: no decay, no update
                    value = torch.where(keeps.reshape(shape), value, torch.zeros_like(value))
                values[name] = value
            _, state = mixer.gated_delta[1](**values, initial_state=record.before, output_final_state=True,
                                            **record.options)
            self.cache.get_recurrent_state(mixer.layer_idx).copy_(state)
            record.before.copy_(state)
            count = getattr(self.cache.layers[mixer.layer_idx], "cumulative_length_linear", None)
            if isinstance(count, torch.Tensor):
                count.copy_(num_columns)

    def restore(self, num_columns: int) -> None:
        """Every state as it was before the last verify (that verify is discarded), the token counts the cache's
        `num_columns` columns; not after a `keep`, which replaced them (a RuntimeError)."""
        if not self.recorded:
            if self.kept:
                raise RuntimeError("compile=True rolls a hybrid target's recurrent states forward in place when a "
                                   "verify's columns are kept: a keep cannot be discarded. Discard before keeping, "
                                   "or time with compile=False (README, \"Compiled decoding\").")
            return
        for (layer_idx, state_idx), record in self.convolutions.items():
            self.cache.get_conv_state(layer_idx, state_idx=state_idx).copy_(record.before)
        for layer_idx, record in self.rules.items():
            self.cache.get_recurrent_state(layer_idx).copy_(record.before)
            align_token_count(self.cache.layers[layer_idx], num_columns)


def static_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed tensor at a fixed address (compiled graphs and CUDA graphs read and write it there)."""
    buffer = torch.zeros(shape, dtype=dtype, device=device)
    torch._dynamo.mark_static_address(buffer)
    return buffer


def shared_functions(mixers: list[Mixer]) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The module-level (convolution, chunked rule) function modules every mixer calls, or a ValueError naming why
    compile=True cannot roll these layers back."""
    functions = {shared_gated_delta_functions(mixer.module) for mixer in mixers}
    if len(functions) != 1 or None in functions:
        raise ValueError("compile=True rolls back Gated DeltaNet layers through the functions their class calls, "
                         "which this target's recurrent layers do not share; pass compile=False. See README, "
                         "\"Compiled decoding\".")
    return functions.pop()


def check_compiled_rollback(mixers: list[Mixer], verify_width: int) -> None:
    """A ValueError, before anything is built, where compile=True cannot roll these recurrent layers back."""
    shared_functions(mixers)
    if verify_width < 2:  # one column runs the token-by-token rule, whose inputs are not recorded
        raise ValueError("compile=True on a hybrid target verifies at least 2 columns a step (its recurrent layers "
                         "are rolled back from the chunked rule's inputs): pass block_size >= 2, or compile=False. "
                         "See README, \"Compiled decoding\".")


_STATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # StaticVerifier -> its StaticRecurrentStates
_STATES_GUARD = threading.Lock()


def static_states(verifier: StaticVerifier, mixers: list[Mixer]) -> StaticRecurrentStates:
    """The recurrent states of the verifier's target: made with the verifier and reused as long as it is (its
    compiled graph's guards hold the hooks of these states); they hold the mixers, nothing holds the verifier."""
    with _STATES_GUARD:
        states = _STATES.get(verifier)
        if states is None:
            states = _STATES[verifier] = StaticRecurrentStates(mixers, verifier.options)
        return states


class StaticRecurrentRollback(RollbackWrapper):
    """A hybrid target's compiled backend: the `StaticBackend` (its cache a StaticCache), with its Gated DeltaNet
    layers recorded around every verify and rolled back to the kept columns after it (`StaticRecurrentStates`)."""

    def __init__(self, inner: StaticBackend, mixers: list[Mixer]) -> None:
        self.inner = inner
        self.states = static_states(inner.verifier, mixers)

    def prefill(self, input_ids: torch.Tensor, attention: dict[str, torch.Tensor], valid: torch.Tensor,
                capture: FeatureCapture) -> Any:
        """The inner prefill, its Gated DeltaNet calls giving the buffers' shapes."""
        return self.inner.prefill(input_ids, attention, valid, capture,
                                  around=lambda cache: self.states.allocating(cache, self.inner.verify_width))

    def verify(self, input_ids: torch.Tensor, layout: VerifyLayout) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The inner verify, recording the Gated DeltaNet calls' inputs (a tree's: run along its paths, at the fixed
        count of `PathPlan.of(..., fixed=True)`)."""
        plan = None if layout.paths is None else PathPlan.of(layout.paths, input_ids.shape[1], input_ids.device,
                                                             fixed=True)
        return self.inner.verify(input_ids, layout, around=self.states.recording(plan))

    def keep(self, kept_columns: list[list[int]], kept: torch.Tensor) -> None:
        """The inner keep; each row's states rolled back to its kept columns in place."""
        self.inner.keep(kept_columns, kept)
        self.states.keep(kept_columns, self.inner.columns.width)

    def discard(self) -> None:
        """The inner discard; the recurrent states as before the last verify (refused after a keep)."""
        self.inner.discard()
        self.states.restore(self.inner.columns.width)
