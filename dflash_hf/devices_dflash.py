"""Where a Transformers model computes, what its decoder config is and which attention backends take a mask as given:
the few facts every other module reads of a target (possibly dispatched or offloaded by Accelerate, possibly a
multimodal wrapper around a decoder) or of a draft; and how a compiled forward's failures reach the user
(`compiled_call`).

Hub remote code: imports only torch (and Accelerate, only for offloaded models).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

# `kernels_dflash.grouped_query_sdpa`'s name in Transformers' attention table (a name with "flash" in it would be read
# as a flash-attention kernel)
GROUPED_QUERY_SDPA = "grouped_query_sdpa"
# Attention implementations (names in Transformers' attention table) that apply a given 2-D or 4-D mask as it is: a
# tree's mask, a compiled verify's mask over a static cache, a draft's mask over context and block.
MASKED_ATTENTION = ("sdpa", "eager", GROUPED_QUERY_SDPA)


def target_text_config(target: torch.nn.Module) -> Any:
    """The decoder config of a target (the text config of multimodal wrappers)."""
    config = target.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def mask_dtype(target: torch.nn.Module) -> torch.dtype:
    """The dtype of an additive attention mask for `target`: its embedding's, or float32 where that is not a float
    (a quantized embedding)."""
    dtype = target.get_input_embeddings().weight.dtype
    return dtype if dtype.is_floating_point else torch.float32


def execution_device(module: torch.nn.Module) -> torch.device:
    """Where `module` computes: its Accelerate hook's execution device (dispatched or offloaded), else its weights'."""
    hook = getattr(module, "_hf_hook", None)
    for item in getattr(hook, "hooks", None) or ([] if hook is None else [hook]):  # a SequentialHook holds several
        device = getattr(item, "execution_device", None)
        if device is not None:
            return torch.device(device)
    parameter = next((p for p in module.parameters() if p.device.type != "meta"), None)
    return torch.device("cpu") if parameter is None else parameter.device


def target_device(target: torch.nn.Module) -> torch.device:
    """The loop's device: where the target's input embedding computes (its input ids go there)."""
    return execution_device(target.get_input_embeddings())


@contextmanager
def materialized_weight(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    """The module's weight, on its execution device for the `with` block (an offloaded weight is loaded meanwhile)."""
    if module.weight.device.type != "meta":
        yield module.weight
        return
    from accelerate.utils import align_module_device  # only offloaded (Accelerate-hooked) models get here

    with align_module_device(module, execution_device(module)):
        yield module.weight


def compiled_call(compiled: Callable[..., Any], what: str, *args: Any, **kwargs: Any) -> Any:
    """`compiled(*args, **kwargs)` (a `torch.compile`d function of `compile=True`), with torch.compile's two failures
    as ValueErrors that say what to do: `what` (say, "Qwen3ForCausalLM's verify") is not one graph with the installed
    Transformers and torch, or it has compiled as often as torch.compile's recompile limit allows in this process."""
    try:
        return compiled(*args, **kwargs)
    except torch._dynamo.exc.FailOnRecompileLimitHit as error:
        raise ValueError(
            f"compile=True: {what} has reached torch.compile's recompile limit in this process (each new target, "
            "draft, row count or cache size compiles it anew); pass compile={'recompile_limit': 32} (a dict of "
            "torch.compile options) to allow more, call torch.compiler.reset() to drop the process's compiled "
            "graphs, or pass compile=False (the eager loop). See README, \"Compiled decoding\".") from error
    except torch._dynamo.exc.TorchDynamoException as error:  # not one graph (a data-dependent loop, say)
        summary = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ValueError(
            f"compile=True cannot capture {what} as one graph with the installed Transformers and torch "
            f"(torch.compile: {summary}); pass compile=False (the eager loop runs it exactly). See README, "
            "\"Compiled decoding\".") from error
