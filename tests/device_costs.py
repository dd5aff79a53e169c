"""What a run would cost on an accelerator, measured on any device (CPU included): host synchronisations, peak memory.

Host synchronisations: the calls that make the host wait for an accelerator.
On CUDA these calls wait for the queued work: reading a value (`.item()`, `.tolist()`, `bool(t)`, `int(t)`),
data-dependent shapes (`nonzero`, boolean-mask indexing, `masked_select`, `unique`), `torch.multinomial`, a
blocking copy to the host (`.cpu()`, `.numpy()`), and a tensor built from Python data straight on a device
(`torch.tensor(values, device=...)`, a blocking host-to-device copy). A host tensor moved with
`.to(device, non_blocking=True)` does not wait and is not counted.

On a CPU every tensor is a host tensor, so the counter counts by call, not by device. Reads of what
`cache_dflash.to_host` already brought to the host (one counted read) are not counted again where the test marks its
results as `HostCopy` (`marked_host_copies`).
"""

from __future__ import annotations

import os
import sys
from collections import Counter

import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import ProfilerActivity, profile

READS = {"__bool__", "__int__", "__float__", "__index__", "item", "tolist", "cpu", "numpy"}
DATA_DEPENDENT = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "multinomial"}


def _holds_bool_tensor(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(item, torch.Tensor) and item.dtype == torch.bool for item in items)


def _waiting_call(name: str, args: tuple, kwargs: dict) -> str | None:
    """The name under which a torch call is counted, or None when it does not wait for the device."""
    if name in READS or name in DATA_DEPENDENT:
        return name
    if name in ("tensor", "as_tensor") and kwargs.get("device") is not None:
        return f"{name}(device=...)"
    if name in ("__getitem__", "__setitem__") and len(args) > 1 and _holds_bool_tensor(args[1]):
        return f"{name}[bool mask]"
    if name == "where" and len(args) + len(kwargs) == 1:
        return "where(condition)"
    if (name == "repeat_interleave" and "output_size" not in kwargs
            and any(isinstance(a, torch.Tensor) for a in args[1:2])):
        return "repeat_interleave"
    return None


class HostCopy(torch.Tensor):
    """A tensor already on the host (a `to_host` result, and everything computed from it): reading it waits for
    nothing."""


def marked_host_copies(monkeypatch, module) -> None:
    """Make `module.to_host` return HostCopy tensors, whose reads the counter skips (its own read is counted)."""
    to_host = module.to_host
    monkeypatch.setattr(module, "to_host", lambda *tensors: tuple(part.as_subclass(HostCopy)
                                                                   for part in to_host(*tensors)))


def _caller_file() -> str:
    """The file of the innermost frame outside torch, this module and any mode's `__torch_function__` (which only
    forwards the call): the code that made the call."""
    frame = sys._getframe(2)
    while frame is not None and (f"{os.sep}torch{os.sep}" in frame.f_code.co_filename
                                 or frame.f_code.co_filename == __file__
                                 or frame.f_code.co_name == "__torch_function__"):
        frame = frame.f_back
    return "" if frame is None else frame.f_code.co_filename


class HostSyncCounter(TorchFunctionMode):
    """Counts, by name, the torch calls inside the `with` block that would wait for a CUDA device; with `source`,
    only the calls made by code whose file path contains it (e.g. "dflash_hf": not Transformers' own)."""

    def __init__(self, source: str | None = None) -> None:
        super().__init__()
        self.source = source
        self.counts: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if any(isinstance(argument, HostCopy) for argument in args):
            return func(*args, **kwargs)
        counted = _waiting_call(getattr(func, "__name__", ""), args, kwargs)
        if counted is not None and (self.source is None or self.source in _caller_file()):
            self.counts[counted] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        """All counted calls."""
        return sum(self.counts.values())


def peak_cpu_bytes(function) -> int:
    """Peak bytes of CPU memory allocated while `function` runs, from the profiler's allocation events in order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        function()
    live = peak = 0
    for event in sorted(profiler.events(), key=lambda event: event.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak
