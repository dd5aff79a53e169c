"""Whether a call can verify trees and run compiled, decided before any forward: the tree and `compile=True`
refusals (`tree_refusal`, `compile_refusal`, each a reason in words or None), the checks of `tree_size` and
`compile`, and `compile=True`'s `torch.compile` options.

Hub remote code: imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

import torch

from .cache_dflash import config_cache, recurrent_layers, target_refusal, windowed_mask_refusal
from .devices_dflash import MASKED_ATTENTION, target_text_config
from .mixers_dflash import rollback_mixers
from .proposer_dflash import DFlashDraft
from .target_dflash import feature_modules
from .versions_dflash import torch_refusal

if TYPE_CHECKING:
    from .settings_dflash import StepCosts


def check_tree_size(tree_size: Any, target: torch.nn.Module, draft: DFlashDraft | None,
                    step_costs: StepCosts | None) -> None:
    """Raise when `tree_size` is not a positive int (or None), or when the call cannot verify a tree."""
    if tree_size is None:
        return
    if tree_size == "auto":
        raise ValueError("tree_size='auto' is a choice timed on this machine, made once and not per call: pass the "
                         "size that dflash_hf.cost_model.choose_tree_size(draft, target, prompt, ...) returns (bench "
                         "and demo do this; docs/sampling.md, \"Trees\").")
    if isinstance(tree_size, bool) or not isinstance(tree_size, int) or tree_size < 1:
        raise ValueError(f"tree_size must be a positive int (drafted tokens per step) or None (a chain), got "
                         f"{tree_size!r}.")
    refusal = tree_refusal(target, draft, step_costs)
    if refusal is not None:
        raise ValueError(refusal)


def tree_refusal(target: torch.nn.Module, draft: DFlashDraft | None, step_costs: StepCosts | None = None
                 ) -> str | None:
    """Why calls with this target and draft cannot verify trees (`spec_generate(tree_size=N)` raises it), or None."""
    if step_costs is not None:
        return "tree_size and step_costs (verify widths chosen per step) cannot be combined; pass one."
    config = target_text_config(target)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in MASKED_ATTENTION:
        return (f"tree_size needs the target's attention to take a 4-D mask ({', '.join(MASKED_ATTENTION)}); this "
                f"target uses {implementation!r}: load it with attn_implementation=\"sdpa\".")
    refusal = windowed_mask_refusal(config)
    if refusal is not None:
        return (f"tree_size is not supported with {type(target).__name__}: {refusal} (a tree's mask is built by "
                "position for full and sliding-window attention); pass tree_size=None.")
    return None


def compile_refusal(target: torch.nn.Module, step_costs: Any, cpu_kernels: bool | None,
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
                    "README, \"Hybrid targets\").")
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
