"""Hybrid targets: roll the recurrent state of linear-attention layers back to each row's accepted prefix.

A verify runs the target over b columns, so each Gated DeltaNet (or other recurrent) layer leaves the state after all
b. Keys and values per position can be cut back; a recurrent state cannot. So around every verify:

1. `recording()` keeps everything each recurrent cache layer holds as it was before the verify (`snapshot`: every
   attribute, so convolution and recurrent states, token counters and whatever a later Transformers adds), and,
   through a forward pre-hook, the hidden states the layer's mixer receives for the verified columns [n, b, H];
2. `advance(kept_columns, num_columns)` puts the layers back and runs only the mixers again over each row's kept
   columns, through the mixer's own forward and the cache API of the installed Transformers (no copy of their code);
   rows that keep different counts are advanced in one chain of calls: columns [0, c1), then [c1, c2), ..., each
   row's state taken where its count ends. Rows that kept every column of a chain keep the verify's state. A token
   count is then set to the cache's columns (`versions_dflash.align_token_count`); positions never come from it.

A tree verify (`recording(tree_paths=...)`) also needs each column's mixer output to depend on its ancestors only,
which a recurrence over the columns in order does not give. So the mixer runs along every root-to-leaf path of the
tree instead: a forward pre-hook hands it the paths as the rows of one batch (the cache layer's states repeated for
them), and a forward hook gives each column the output of the first path through it. After acceptance the kept
columns are the root and the accepted path, replayed as above.

Why inputs and not per-column states: a column's input is H numbers per layer, its state Hv * Dk * Dv (about 16,000
times more at Qwen3.5-27B's shapes), and Transformers' chunked kernel yields only the final state. The price is the
mixers' projections over the accepted columns once more (see README, "Hybrid targets").

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

import copy
import inspect
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from .cache_dflash import host_to_device, recurrent_cache_layers
from .devices_dflash import compiled_call
from .target_dflash import decoder_layers
from .versions_dflash import (
    align_token_count,
    gated_delta_functions,
    kernel_replacements,
    shared_gated_delta_functions,
)


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


class RecurrentStates:
    """The recurrent layers of one call's target cache and the rollback around each verify (see the module doc)."""

    def __init__(self, cache: Any, mixers: list[Mixer]) -> None:
        self.cache, self.mixers = cache, mixers
        # layer -> everything its cache layer held before the last verify (`snapshot`): kept until the next verify, so
        # that one can still be discarded
        self.before: dict[int, dict[str, Any]] = {}
        self.inputs: dict[int, torch.Tensor] = {}  # layer -> its mixer's input over the verified columns [n, b, H]
        self.tree = False  # whether the last verify was a tree's (then no row keeps its states as they are)
        # layer -> the (function, args, kwargs) of each convolution and rule call of a Gated DeltaNet mixer in a
        # chain's verify: the rollback replays the recurrence from them, without the mixer's projections
        self.calls: dict[int, list[tuple[torch.nn.Module, tuple, dict]]] = {}

    def layer(self, layer_idx: int) -> Any:
        """The cache layer of recurrent layer `layer_idx`."""
        return self.cache.layers[layer_idx]

    @contextmanager
    def recording(self, tree_paths: PathPlan | None = None) -> Iterator[None]:
        """Around a verify forward: keep the states it starts from and the mixers' inputs it feeds them. `tree_paths`
        (a tree verify): each mixer runs along the tree's root-to-leaf paths instead of its columns."""
        self.before = {mixer.layer_idx: snapshot(self.layer(mixer.layer_idx)) for mixer in self.mixers}
        self.inputs, self.tree = {}, tree_paths is not None
        thread = threading.get_ident()
        # first of the pre-hooks: the input as the layer passed it, which a user's pre-hook sees again at the replay
        handles = [mixer.module.register_forward_pre_hook(self._recorder(mixer.layer_idx, thread), with_kwargs=True,
                                                          prepend=True) for mixer in self.mixers]
        self.calls = {}
        if tree_paths is None:  # a tree's mixers run along paths: its rollback replays the whole mixer
            for mixer in self.mixers:
                for function in (mixer.gated_delta or ())[:2]:
                    handles.append(function.register_forward_pre_hook(self._call_recorder(mixer.layer_idx, thread),
                                                                      with_kwargs=True))
        if tree_paths is not None:
            for mixer in self.mixers:
                # the last pre-hook (after a user's) turns the columns into paths; the first forward hook turns the
                # paths' outputs back into columns, which a user's forward hook then sees
                handles.append(mixer.module.register_forward_pre_hook(self._into_paths(mixer, tree_paths, thread),
                                                                      with_kwargs=True))
                handles.append(mixer.module.register_forward_hook(self._from_paths(mixer, tree_paths, thread),
                                                                  with_kwargs=True, prepend=True))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _recorder(self, layer_idx: int, thread: int) -> Any:
        def record(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if threading.get_ident() == thread:  # another thread's forward of the same model is not this verify
                self.inputs[layer_idx] = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return record

    def _call_recorder(self, layer_idx: int, thread: int) -> Any:
        def record(function: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            if threading.get_ident() == thread:
                self.calls.setdefault(layer_idx, []).append((function, args, kwargs))
        return record

    def _into_paths(self, mixer: Mixer, plan: PathPlan, thread: int) -> Any:
        def into_paths(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
            if threading.get_ident() != thread:
                return None
            call = mixer.signature.bind_partial(*args, **kwargs)
            name = next(iter(mixer.signature.parameters))  # its first: the hidden states
            hidden = call.arguments[name]  # [n, b, H]
            num_rows, _, size = hidden.shape
            scratch = hidden.new_zeros(num_rows, 1, size)  # column b: what padding reads
            call.arguments[name] = columns_of(torch.cat((hidden, scratch), dim=1)[plan.rows], plan.reads)
            if "attention_mask" in call.arguments:
                call.arguments["attention_mask"] = None  # the verified columns are never padding
            self.cache.layers[mixer.layer_idx].reorder_cache(plan.rows)  # each path starts from its row's states
            return call.args, call.kwargs
        return into_paths

    def _from_paths(self, mixer: Mixer, plan: PathPlan, thread: int) -> Any:
        def from_paths(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            if threading.get_ident() != thread:
                return None
            along = output[0] if isinstance(output, tuple) else output  # [n * P, D, H']
            self.cache.layers[mixer.layer_idx].reorder_cache(plan.first_paths)  # n rows again
            self.put_back(mixer.layer_idx)  # the states before the verify, until `advance`
            num_rows = plan.first_paths.shape[0]
            along = along.reshape(num_rows, -1, along.shape[2])  # [n, P * D, H']: each row's paths side by side
            columns = along.new_zeros(num_rows, plan.width + 1, along.shape[2])  # [n, b + 1, H'] (b: padding's)
            columns.scatter_(1, plan.writes.reshape(num_rows, -1)[..., None].expand(-1, -1, along.shape[2]), along)
            return (columns[:, :-1], *output[1:]) if isinstance(output, tuple) else columns[:, :-1]
        return from_paths

    def put_back(self, layer_idx: int) -> None:
        """The layer's cache layer as it was before the last verify: every attribute it holds."""
        put_back(self.layer(layer_idx), self.before[layer_idx])

    def restore(self) -> None:
        """Put every recurrent state back as it was before the last verify (that verify is discarded)."""
        for layer_idx in self.before:
            self.put_back(layer_idx)
        self.inputs, self.calls = {}, {}

    @torch.no_grad()
    def advance(self, kept_columns: list[list[int]], num_columns: int) -> None:
        """Leave each row's states after its kept verify columns (the rows in cache order; a chain: 0 .. c - 1, a
        tree: the root and the accepted path); `num_columns`: the cache's columns after the step, holes included,
        which each layer's token count (if its Transformers keeps one) then says."""
        missing = [mixer.layer_idx for mixer in self.mixers if mixer.layer_idx not in self.inputs]
        if missing:
            raise RuntimeError(f"The verify did not run the recurrent mixers of layers {missing} (a patched "
                               "forward?): their states cannot be rolled back. See README, \"Hybrid targets\".")
        verified = next(iter(self.inputs.values()))  # [n, b, H]
        kept_counts = [len(columns) for columns in kept_columns]
        complete = None if self.tree else verified.shape[1]  # rows keeping that many columns keep the verify's states
        prefixes = all(columns == list(range(len(columns))) for columns in kept_columns)
        if any(count != complete for count in kept_counts):
            index = None if prefixes else host_to_device(
                [columns + [0] * (max(kept_counts) - len(columns)) for columns in kept_columns],
                verified.device)  # [n, c]
            for mixer in self.mixers:
                inputs = self.inputs[mixer.layer_idx]  # [n, b, H]
                inputs = inputs if index is None else columns_of(inputs, index)
                self._advance_layer(mixer, inputs, kept_counts, complete)
        for mixer in self.mixers:
            align_token_count(self.layer(mixer.layer_idx), num_columns)
        self.inputs, self.calls = {}, {}

    def _advance_layer(self, mixer: Mixer, inputs: torch.Tensor, kept_counts: list[int], complete: int | None
                       ) -> None:
        """Replay the mixer over `inputs` [n, c, H] (each row's kept columns first); rows keeping `complete` columns
        keep the verify's states."""
        replay = self._replayer(mixer, inputs)
        counts = sorted(set(kept_counts))
        if len(counts) == 1:  # every row keeps the same count (one row, say): put back, replay them
            self.put_back(mixer.layer_idx)
            replay(0, counts[0])
            return
        layer = self.layer(mixer.layer_idx)
        results = snapshot(layer)  # rows keeping `complete`: as verified
        rows_keeping = {count: host_to_device([row for row, kept in enumerate(kept_counts) if kept == count],
                                              inputs.device) for count in counts}
        self.put_back(mixer.layer_idx)
        start = 0
        for count in (count for count in counts if count != complete):
            replay(start, count)
            take_rows(results, vars(layer), rows_keeping[count], len(kept_counts))
            start = count
        put_back(layer, results)

    def _replayer(self, mixer: Mixer, inputs: torch.Tensor) -> Any:
        """replay(start, end): advance the layer's states over verify columns [start, end). A chain's Gated DeltaNet
        layer replays only its convolution's state update and its recurrence, from the arguments they had in the
        verify (the projections are not run again); any other layer runs its whole mixer over `inputs` [n, c, H]."""
        calls = self.calls.get(mixer.layer_idx, [])
        width = self.inputs[mixer.layer_idx].shape[1]  # b: the verify's columns
        convolution, chunked, token_by_token = mixer.gated_delta or (None, None, None)
        convolutions = [call for call in calls if call[0] is convolution]
        rules = [call for call in calls if call[0] is chunked]
        usable = (not self.tree and len(rules) == 1 and convolutions
                  and all(call_length(call, -1) == width for call in convolutions)
                  and call_length(rules[0], 1) == width)
        if not usable:
            return lambda start, end: mixer.module(hidden_states=inputs[:, start:end], attention_mask=None,
                                                   **{mixer.cache_argument: self.cache})

        def replay(start: int, end: int) -> None:
            for function, args, kwargs in convolutions:  # updates the cache's convolution state as in the verify
                function(*sliced(args, -1, width, start, end), **sliced(kwargs, -1, width, start, end))
            _, args, kwargs = rules[0]
            kwargs = {**sliced(kwargs, 1, width, start, end), "output_final_state": True,
                      "initial_state": self.cache.get_recurrent_state(mixer.layer_idx)}
            rule = token_by_token if end - start <= TOKEN_BY_TOKEN_REPLAY else chunked
            _, state = rule(*sliced(args, 1, width, start, end), **kwargs)
            self.cache.update_recurrent_state(state, mixer.layer_idx)
        return replay


# Replays of at most this many columns run the token-by-token gated delta rule (the one `generate` runs), longer ones
# the chunked rule the verify ran: on a CPU, Transformers' reference chunked rule pads every call to 64 positions
# (3 ms a layer at Qwen3.5-27B's head shapes, against 0.65 ms for one token and 1.4 ms for four token by token).
TOKEN_BY_TOKEN_REPLAY = 8


def call_length(call: tuple[torch.nn.Module, tuple, dict], dim: int) -> int | None:
    """The sequence length of a recorded call: its first tensor argument's size along `dim`."""
    _, args, kwargs = call
    tensor = next((value for value in (*args, *kwargs.values()) if isinstance(value, torch.Tensor)), None)
    return None if tensor is None else tensor.shape[dim]


def sliced(values: Any, dim: int, width: int, start: int, end: int) -> Any:
    """`values` (a call's args tuple or kwargs dict) with every tensor of `width` along `dim` cut to [start, end)."""
    def cut(value: Any) -> Any:
        if isinstance(value, torch.Tensor) and value.dim() >= 2 and value.shape[dim] == width:
            return value.narrow(dim, start, end - start)
        return value
    if isinstance(values, dict):
        return {key: cut(value) for key, value in values.items()}
    return tuple(cut(value) for value in values)


# --- A cache layer's whole state: every attribute, so that nothing it keeps (counters included) can be missed ------


def snapshot(layer: Any) -> dict[str, Any]:
    """Everything a cache layer holds, as a copy that later changes cannot reach: each attribute, tensors cloned."""
    return {name: copied(value) for name, value in vars(layer).items()}


def copied(value: Any) -> Any:
    """`value` with its tensors cloned and its containers copied (any other object deep-copied)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {key: copied(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(copied(item) for item in value)
    return copy.deepcopy(value)


def restored(live: Any, saved: Any) -> Any:
    """`saved` (from a `snapshot`) as a value to hold again; a tensor of the same shape is copied into the live one in
    place, so that it keeps its address (compiled graphs and static caches read it there)."""
    if isinstance(saved, torch.Tensor):
        if (isinstance(live, torch.Tensor) and live.shape == saved.shape and live.dtype == saved.dtype
                and live.device == saved.device):
            return live.copy_(saved)
        return saved.clone()  # the snapshot stays usable for another put-back
    if isinstance(saved, dict):
        live_items = live if isinstance(live, dict) else {}
        return {key: restored(live_items.get(key), item) for key, item in saved.items()}
    if isinstance(saved, (list, tuple)):
        live_items = list(live) if isinstance(live, (list, tuple)) and len(live) == len(saved) else [None] * len(saved)
        return type(saved)(restored(old, item) for old, item in zip(live_items, saved))
    return copy.deepcopy(saved)


def put_back(layer: Any, saved: dict[str, Any]) -> None:
    """Make a cache layer hold exactly what `saved` (`snapshot(layer)`) held: every attribute set back, attributes
    added since removed."""
    for name in set(vars(layer)) - set(saved):
        delattr(layer, name)
    for name, value in saved.items():
        setattr(layer, name, restored(getattr(layer, name, None), value))


def take_rows(results: Any, live: Any, rows: torch.Tensor, num_rows: int) -> Any:
    """Copy rows `rows` of every per-row tensor of `live` (a cache layer's attributes) into `results` (their snapshot,
    the same structure) in place; a tensor without a batch dimension of `num_rows` rows is taken whole."""
    if isinstance(live, torch.Tensor) and isinstance(results, torch.Tensor):
        if live.dim() and live.shape[0] == num_rows and live.shape == results.shape:
            results[rows] = live[rows]
            return results
        return live.clone()
    if isinstance(live, dict) and isinstance(results, dict):
        for key in results:
            results[key] = take_rows(results[key], live.get(key), rows, num_rows)
    elif isinstance(live, list) and isinstance(results, list) and len(live) == len(results):
        results[:] = [take_rows(result, item, rows, num_rows) for result, item in zip(results, live)]
    return results


def columns_of(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """values [n, b, H] at the columns `index` [n, c] of each row: [n, c, H]."""
    return values.gather(1, index[..., None].expand(-1, -1, values.shape[2]))


@dataclass
class PathPlan:
    """A tree verify's mixer call: every row's P root-to-leaf paths (its last again when it has fewer) as rows of one
    batch, row r's paths at r * P .. r * P + P - 1. rows [n * P]: the cache row each path starts from;
    reads [n * P, D]: the verify column of each place (b: padding); writes [n * P, D]: the column that takes its
    output (b where padding, or where an earlier path of the row already gave it); first_paths [n]: each row's first
    path."""

    width: int  # b: the verify's columns
    rows: torch.Tensor
    reads: torch.Tensor
    writes: torch.Tensor
    first_paths: torch.Tensor

    @staticmethod
    def of(tree_paths: list[list[list[int]]], width: int, device: torch.device, fixed: bool = False) -> PathPlan:
        """The call for `tree_paths` (per row, the columns of each root-to-leaf path, all starting at column 0) in a
        verify of `width` columns; `fixed`: as many paths and places as any tree of `width` columns can have (width - 1
        paths of width places), so that every tree's call has the same shapes (a compiled verify)."""
        num_paths = max(width - 1, 1) if fixed else max(len(paths) for paths in tree_paths)
        depth = width if fixed else max(len(path) for paths in tree_paths for path in paths)
        rows, reads, writes = [], [], []
        for row, paths in enumerate(tree_paths):
            owned: set[int] = set()
            for index in range(num_paths):
                path = paths[min(index, len(paths) - 1)]
                rows.append(row)
                padding = [width] * (depth - len(path))
                reads.append(path + padding)
                writes.append([width if column in owned else column for column in path] + padding)
                owned.update(path)
        return PathPlan(width, *(host_to_device(value, device) for value in (rows, reads, writes)),
                        host_to_device(list(range(0, len(rows), num_paths)), device))


def rollback_mixers(target: torch.nn.Module, cache: Any) -> list[Mixer]:
    """The mixers of the recurrent layers of `cache` (the target's, or a fresh one from its config before any forward)
    that the rollback replays; a ValueError naming the reason where it could not be exact (empty: no such layers)."""
    layer_ids = recurrent_cache_layers(cache)
    if not layer_ids:
        return []
    mixers = find_mixers(target, layer_ids)
    if isinstance(mixers, str):
        raise ValueError(f"Target {type(target).__name__} has recurrent layers {layer_ids}, but {mixers}: dflash-hf "
                         "cannot roll their state back after a verify. See README, \"Hybrid targets\".")
    kernels = sorted({name for mixer in mixers for name in kernel_replacements(mixer.module)})
    if kernels:
        raise ValueError(f"Target {type(target).__name__} runs Hub kernels in its recurrent layers that are handed "
                         f"the cache ({', '.join(kernels)}): they may keep state outside the cache, where dflash-hf "
                         "cannot roll it back after a verify. Load the target with `use_kernels=False` (or call "
                         "`target.reset_kernels()`). See README, \"Hybrid targets\".")
    return mixers


def recurrent_states(target: torch.nn.Module, cache: Any) -> RecurrentStates | None:
    """The rollback of a hybrid target's cache after its prefill (None: the cache holds no recurrent layer)."""
    mixers = rollback_mixers(target, cache)
    return RecurrentStates(cache, mixers) if mixers else None


# --- compile=True: the rollback in fixed buffers, with fixed shapes -------------------------------------------------


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
    columns, and the states they start from, into fixed buffers (inside the compiled graph). `keep` then runs one
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
        functions = {shared_gated_delta_functions(mixer.module) for mixer in mixers}
        if len(functions) != 1 or None in functions:
            raise ValueError("compile=True rolls back Gated DeltaNet layers through the functions their class "
                             "calls, which this target's recurrent layers do not share; pass compile=False. See "
                             "README, \"Compiled decoding\".")
        self.convolution, self.chunked = functions.pop()
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
                               "forward?): compile=True cannot roll their states back. See README, \"Hybrid "
                               "targets\".")
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
