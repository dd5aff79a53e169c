"""Hybrid targets, eager backend: roll the recurrent states of linear-attention layers back to the accepted prefix.

A verify runs the target over b columns, so each Gated DeltaNet (or other recurrent) layer leaves the state after all
b. Keys and values per position can be cut back; a recurrent state cannot. So around every verify
(`backends_dflash.RecurrentRollback` hands `recording` to the eager backend, which enters it around the forward):

1. `recording()` keeps everything each recurrent cache layer holds as it was before the verify (`snapshot`: every
   attribute, so convolution and recurrent states, token counters and whatever a later Transformers adds), and,
   through a forward pre-hook, the hidden states the layer's mixer receives for the verified columns [n, b, H]; in a
   chain, a Gated DeltaNet mixer's convolution and chunked rule calls are recorded too (their arguments);
2. `advance(kept_columns, num_columns)` puts the layers back and advances each over every row's kept columns. A
   chain's Gated DeltaNet layer replays only its convolution's state update and its gated delta rule, from the
   recorded arguments (the mixer's projections do not run again); any other layer, and every layer after a tree,
   runs its mixer's own forward again over the recorded inputs, through the cache API of the installed Transformers
   (no copy of their code). Rows that keep different counts are advanced in one chain of calls: columns [0, c1),
   then [c1, c2), ..., each row's state taken where its count ends. Rows that kept every column of a chain keep the
   verify's state. A token count is then set to the cache's columns (`versions_dflash.align_token_count`); positions
   never come from it.

A tree verify (`recording(plan)`, a `tree_dflash.PathPlan`) also needs each column's mixer output to depend on its
ancestors only, which a recurrence over the columns in order does not give. So the mixer runs along every
root-to-leaf path of the tree instead: a forward pre-hook hands it the paths as the rows of one batch (the cache
layer's states repeated for them), and a forward hook gives each column the output of the first path through it.
After acceptance the kept columns are the root and the accepted path, replayed through the mixer as above.

Why inputs and not per-column states: a column's input is H numbers per layer, its state Hv * Dk * Dv (about 16,000
times more at Qwen3.5-27B's shapes), and Transformers' chunked kernel yields only the final state. The price is the
recurrence over the accepted columns once more (a whole mixer, projections included, for other layers and after a
tree; see docs/hybrid.md). compile=True rolls back at fixed shapes instead: `static_recurrent_dflash`.

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

import copy
import threading
from contextlib import contextmanager
from typing import Any, Iterator

import torch

from .cache_dflash import CacheColumns, host_to_device
from .mixers_dflash import Mixer
from .tree_dflash import PathPlan
from .versions_dflash import align_token_count


class RollbackWrapper:
    """What a hybrid target's backend forwards to the backend it wraps (`inner`) unchanged, in both of them
    (`backends_dflash.RecurrentRollback`, eager; `static_recurrent_dflash.StaticRecurrentRollback`, compiled): the
    cache, its columns, the step width and the compaction (recurrent states have no columns)."""

    inner: Any

    @property
    def columns(self) -> CacheColumns:
        """The inner backend's columns."""
        return self.inner.columns

    @property
    def cache(self) -> Any:
        """The target's cache (attention and recurrent layers)."""
        return self.inner.cache

    def step_width(self, block_size: int, longest_remaining: int) -> int:
        """The inner backend's."""
        return self.inner.step_width(block_size, longest_remaining)

    def compact(self) -> None:
        """The inner compaction."""
        self.inner.compact()


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
    def recording(self, plan: PathPlan | None = None) -> Iterator[None]:
        """Around a verify forward: keep the states it starts from and the mixers' inputs it feeds them. `plan` (a
        tree verify): each mixer runs along the tree's root-to-leaf paths instead of its columns."""
        self.before = {mixer.layer_idx: snapshot(self.layer(mixer.layer_idx)) for mixer in self.mixers}
        self.inputs, self.tree, self.calls = {}, plan is not None, {}
        thread = threading.get_ident()
        # first of the pre-hooks: the input as the layer passed it, which a user's pre-hook sees again at the replay
        handles = [mixer.module.register_forward_pre_hook(self._recorder(mixer.layer_idx, thread), with_kwargs=True,
                                                          prepend=True) for mixer in self.mixers]
        for mixer in self.mixers:
            if plan is None:  # a chain: the Gated DeltaNet calls its rollback replays (a tree's replays the mixer)
                handles += [function.register_forward_pre_hook(self._call_recorder(mixer.layer_idx, thread),
                                                               with_kwargs=True)
                            for function in (mixer.gated_delta or ())[:2]]
                continue
            # the last pre-hook (after a user's) turns the columns into paths; the first forward hook turns the
            # paths' outputs back into columns, which a user's forward hook then sees
            handles.append(mixer.module.register_forward_pre_hook(self._into_paths(mixer, plan, thread),
                                                                  with_kwargs=True))
            handles.append(mixer.module.register_forward_hook(self._from_paths(mixer, plan, thread),
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
                               "forward?): their states cannot be rolled back. See docs/hybrid.md.")
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
