"""CPU kernels of one generation call: few-row products by the fastest kernel timed here, and a verify's attention
over grouped key/value heads without copies. See docs/architecture.md, "CPU kernels".

A verify (a few tokens per row) and a draft pass multiply a few rows by every weight of a model. On some CPUs MKL's
kernels for such products are 2-4x slower than oneDNN's packed weights, on others faster; the loop times the kernels
once per shape and runs each product with the fastest. Everything here is switched on for one call
(`cpu_kernels(mode)`: every few-row product, or the LM heads' alone, where rerouting the layers costs more than it
saves: `cost_model.choose_cpu_kernels`), and what a call packs lives and dies with it: a packed copy is made from the
weight's values at its first use in the call, so no edit of a weight between calls (in place, through `.data`, new
storage) can leave a stale copy in use. Models are never changed (no hooks, no attributes). Calls in other threads
have their own scope.

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from .devices_dflash import GROUPED_QUERY_SDPA, execution_device, target_text_config
from .versions_dflash import exact_grouped_query_sdpa

MAX_FEW_ROWS = 64  # more rows than this: F.linear, a product BLAS handles well
# `spec_generate(cpu_kernels=...)`: False, every product by F.linear; "lm_head", the LM heads' few-row products by the
# kernel table, the layers' by F.linear; True, every few-row product by the kernel table (docs/api.md, `cpu_kernels`)
CPU_KERNEL_MODES = (False, "lm_head", True)
CPU_KERNEL_NAMES = {False: "off", "lm_head": "lm-head", True: "on"}  # the modes as `--cpu-kernels` names them
KERNEL_TIMING_REPEATS = 3

# (dtype, weight shape, rows, threads) -> the kernel `few_row_product` timed fastest for that shape in this process:
# a property of the machine, so it outlives a call (the packed copies do not).
FEW_ROW_KERNEL_CHOICE: dict[tuple[torch.dtype, tuple[int, ...], int, int], str] = {}
_CHOICE_LOCK = threading.Lock()  # threads choosing kernels at once


def _has_onednn_linear() -> bool:
    """Whether this torch build has oneDNN's packed-weight linear (private `torch.ops.mkldnn` operators)."""
    try:
        return bool(torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
                    and hasattr(torch.ops.mkldnn, "_linear_pointwise"))
    except (AttributeError, RuntimeError):
        return False


HAS_ONEDNN_LINEAR = _has_onednn_linear()


class PackedWeights:
    """oneDNN packed copies of the weights one generation call multiplies with oneDNN: made at a weight's first use in
    the call (again if it changes in place or gets new storage during the call), dropped with the call."""

    def __init__(self, layers: bool = True) -> None:
        self.copies: dict[int, tuple[torch.Tensor, int, int, torch.Tensor]] = {}  # id -> (weight, version, ptr, copy)
        self.layers = layers  # the models' own Linear layers are rerouted too (`few_row_kernels`), not only the heads

    def packed(self, weight: torch.Tensor) -> torch.Tensor:
        """The packed copy of a CPU weight [V, H] as its values are now."""
        entry = self.copies.get(id(weight))
        if entry is None or entry[0] is not weight or entry[1] != weight._version or entry[2] != weight.data_ptr():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
            entry = (weight, weight._version, weight.data_ptr(), packed)
            self.copies[id(weight)] = entry
        return entry[3]

    def drop(self, weight: torch.Tensor) -> None:
        """Forget the packed copy of `weight` (its products do not use oneDNN)."""
        self.copies.pop(id(weight), None)

    def holds(self, weight: torch.Tensor) -> bool:
        """Whether a packed copy of `weight` is kept."""
        return id(weight) in self.copies


_CALL_KERNELS: ContextVar[PackedWeights | None] = ContextVar("dflash_hf_cpu_kernels", default=None)


@contextmanager
def cpu_kernels(mode: bool | str = True) -> Iterator[PackedWeights | None]:
    """The few-row kernels for the block (a generation call), with packed copies of its own: `mode` True, every
    few-row product; "lm_head", the LM heads' only (`few_row_logits`, `few_row_product`), the models' layers as they
    compute; False, every product runs `F.linear`, as the models compute it. Yields the call's packed copies (None
    when off)."""
    mode = cpu_kernel_mode(mode, "cpu")
    packed = PackedWeights(layers=mode is True) if mode else None
    token = _CALL_KERNELS.set(packed)
    try:
        yield packed
    finally:
        _CALL_KERNELS.reset(token)


def cpu_kernel_mode(choice: bool | str | None, device_type: str) -> bool | str:
    """A `cpu_kernels` choice as one of CPU_KERNEL_MODES: None is on (True) for a target computing on the CPU (its
    `device_type`), off elsewhere; anything else not in CPU_KERNEL_MODES is refused by name."""
    if choice is None:
        return device_type == "cpu"
    if isinstance(choice, bool) or choice == "lm_head":
        return choice
    raise ValueError(f"cpu_kernels={choice!r}: expected True, False, 'lm_head' or None (on for a CPU target); "
                     "docs/api.md describes them")


def _linear(weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(states, weight, bias)


def _transposed(weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor) -> torch.Tensor:
    logits = (weight @ states.T).T  # [N, V]: a GEMM with a few columns
    return logits if bias is None else logits + bias


def _onednn(weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor) -> torch.Tensor:
    packed = _CALL_KERNELS.get()
    if packed is None or weight.is_inference():  # no call to pack for, or no version counter to notice a change by
        return torch.nn.functional.linear(states, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(states, packed.packed(weight), bias, "none", [], "")


FEW_ROW_KERNELS: dict[str, Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor], torch.Tensor]] = {
    "linear": _linear, "transposed": _transposed, "onednn": _onednn}


def few_row_product(weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor) -> torch.Tensor:
    """states [N, H] times weight^T [H, V] (+ bias): [N, V].

    Inside `cpu_kernels()`, on a CPU, for up to `MAX_FEW_ROWS` rows: the fastest of `F.linear`, (W @ states^T)^T and
    oneDNN's packed weights for this shape, timed once per process (`FEW_ROW_KERNEL_CHOICE`). Elsewhere `F.linear`.
    """
    if _CALL_KERNELS.get() is None or states.device.type != "cpu" or not 0 < states.shape[0] <= MAX_FEW_ROWS:
        return torch.nn.functional.linear(states, weight, bias)
    key = (states.dtype, tuple(weight.shape), states.shape[0], torch.get_num_threads())
    kernel = FEW_ROW_KERNEL_CHOICE.get(key)
    if kernel is None:
        with _CHOICE_LOCK:
            kernel = FEW_ROW_KERNEL_CHOICE.get(key) or fastest_kernel(weight, bias, states)
            FEW_ROW_KERNEL_CHOICE[key] = kernel
    return FEW_ROW_KERNELS[kernel](weight, bias, states)


def fastest_kernel(weight: torch.Tensor, bias: torch.Tensor | None, states: torch.Tensor) -> str:
    """The name of the `FEW_ROW_KERNELS` entry that ran this product fastest here (best of a few runs, after one).

    oneDNN is tried where this torch has it; a build whose private operators are missing or refuse the call falls
    back to the other two."""
    def best_seconds(kernel: Callable[..., torch.Tensor]) -> float:
        kernel(weight, bias, states)
        times = []
        for _ in range(KERNEL_TIMING_REPEATS):
            started = time.perf_counter()
            kernel(weight, bias, states)
            times.append(time.perf_counter() - started)
        return min(times)

    seconds = {"linear": best_seconds(_linear), "transposed": best_seconds(_transposed)}
    packed = _CALL_KERNELS.get()
    if HAS_ONEDNN_LINEAR and packed is not None and states.dtype in (torch.float32, torch.bfloat16):
        try:
            seconds["onednn"] = best_seconds(FEW_ROW_KERNELS["onednn"])
        except (RuntimeError, TypeError, AttributeError, NotImplementedError):  # a dtype, CPU or torch without it
            pass
    fastest = min(seconds, key=seconds.get)
    shape_uses_onednn = any(kernel == "onednn" for (dtype, shape, *_), kernel in list(FEW_ROW_KERNEL_CHOICE.items())
                            if dtype == states.dtype and shape == tuple(weight.shape))
    if packed is not None and fastest != "onednn" and not shape_uses_onednn:
        packed.drop(weight)  # no copy of a weight whose products do not use it
    return fastest


def is_plain_linear(module: torch.nn.Module) -> bool:
    """A bare `nn.Linear` whose weight is a plain materialised tensor (not a quantizer's tensor subclass, as torchao's)
    and whose forward no hook wraps (Accelerate, torch hooks)."""
    return (
        type(module) is torch.nn.Linear
        and type(module.weight) in (torch.Tensor, torch.nn.Parameter)
        and module.weight.device.type != "meta"
        and not (module._forward_hooks or module._forward_pre_hooks)
        and "forward" not in vars(module)  # Accelerate's hooks replace the instance's forward
    )


def few_row_logits(lm_head: torch.nn.Module, states: torch.Tensor) -> torch.Tensor:
    """LM-head logits [N, V] of a few rows [N, H]: `few_row_product` for a plain Linear head; any other head (hooked,
    offloaded) is called."""
    if not is_plain_linear(lm_head):
        return lm_head(states)
    return few_row_product(lm_head.weight, lm_head.bias, states)


class FewRowLinear(TorchFunctionMode):
    """While active, every `F.linear` of a few rows without autograd on a CPU, by a model's own weight (a Parameter),
    runs `few_row_product`; everything else runs as called (weights made per call, such as experts sliced from a
    stacked Parameter or dequantised weights, would be packed per call). Models stay untouched."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.nn.functional.linear and not torch.is_grad_enabled() and len(args) >= 2:
            states, weight = args[0], args[1]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if (type(weight) is torch.nn.Parameter and type(states) is torch.Tensor and weight.dim() == 2
                    and not weight.is_inference() and states.dtype == weight.dtype and states.dim() >= 1
                    and states.shape[-1] > 0
                    and (bias is None or (type(bias) in (torch.Tensor, torch.nn.Parameter)
                                          and bias.dtype == weight.dtype))):
                rows = states.reshape(-1, states.shape[-1])  # [N, H]; few_row_product decides device and row count
                return few_row_product(weight, bias, rows).view(*states.shape[:-1], weight.shape[0])
        return func(*args, **kwargs)


@contextmanager
def few_row_kernels(model: torch.nn.Module, tokens_per_row: int) -> Iterator[bool]:
    """While the block runs (one verify or draft pass of `tokens_per_row` tokens a row), inside `cpu_kernels(True)`, a
    model that computes on the CPU (not dispatched by Accelerate) has its few-row Linear products run by
    `FewRowLinear`. Yields whether they do. A pass of one token a row (a block of 1: `generate`'s own step) runs as
    `generate` runs it, so that block 1 costs what plain decoding costs (docs/architecture.md, "CPU kernels")."""
    packed = _CALL_KERNELS.get()
    switch = (packed is not None and packed.layers and tokens_per_row > 1 and execution_device(model).type == "cpu"
              and getattr(model, "hf_device_map", None) is None)
    if not switch:
        yield False
        return
    with FewRowLinear():
        yield True


# --- Attention of a multi-token verify: grouped key/value heads without copies -----------------------------------

_SDPA_EXTRAS = ("position_bias", "softcap", "s_aux", "sinks")  # attention variants the plain path does not cover


def grouped_query_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                       is_causal: bool | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Transformers' "sdpa" attention, except for a masked multi-token query over grouped key/value heads (a verify):
    SDPA's own grouped-query mode instead of first copying every key/value head for each query head. The same
    numbers, without the copies (MEASUREMENTS.md has their cost)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    groups = getattr(module, "num_key_value_groups", 1)
    if (groups == 1 or attention_mask is None or query.shape[2] == 1 or query.device.type != "cpu"
            or any(kwargs.get(name) is not None for name in _SDPA_EXTRAS)):
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask, dropout=dropout,
                                               scaling=scaling, is_causal=is_causal, **kwargs)
    output = torch.nn.functional.scaled_dot_product_attention(  # [n, heads, q, d]
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, scale=scaling, enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


def use_grouped_query_sdpa(target: torch.nn.Module) -> bool:
    """Switch a CPU target with grouped key/value heads from "sdpa" to `grouped_query_sdpa` (registered in
    Transformers' public attention table): the same logits, without copying each key/value head once per query head
    in a multi-token verify, on the torch releases where SDPA's grouped mode is bit-equal (`versions_dflash`). For
    whoever loads the model: dflash-hf's commands do it at load; the loop itself never changes a model's attention
    (another thread may be using the model). Returns whether it switched; `target.set_attn_implementation("sdpa")`
    switches back."""
    config = target.config
    switch = (exact_grouped_query_sdpa() and target_text_config(target) is config
              and getattr(config, "_attn_implementation", None) == "sdpa"
              and execution_device(target).type == "cpu" and hasattr(target, "set_attn_implementation")
              and getattr(config, "num_key_value_heads", None) not in (None,
                                                                      getattr(config, "num_attention_heads", None)))
    if not switch:
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(GROUPED_QUERY_SDPA, grouped_query_sdpa)
    AttentionMaskInterface.register(GROUPED_QUERY_SDPA, sdpa_mask)  # its masks are sdpa's
    try:
        target.set_attn_implementation(GROUPED_QUERY_SDPA)
    except (ValueError, ImportError):
        return False  # a model that cannot switch keeps its own attention
    return config._attn_implementation == GROUPED_QUERY_SDPA
