"""DFlash draft configuration: a Qwen3 config plus the DFlash fields of the published drafts.

Hub remote code: this file imports only torch and transformers.
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen3Config


class DFlashConfig(Qwen3Config):
    """Qwen3 config with `block_size`, `num_target_layers` and `dflash_config` (mask token, target layers).

    The class keeps `model_type = "qwen3"`, as the published drafts do, so the same `config.json`
    is read by Transformers, vLLM and SGLang. Use `normalize_dflash_config` to read the
    DFlash fields in any of the published variants.
    """


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers feeding the draft when the config names none: evenly spaced from 1 to N-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def read_rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings as one dict (`rope_theta`, `rope_type`, scaling keys) from either config style."""
    parameters = getattr(config, "rope_parameters", None)
    if isinstance(parameters, dict) and "rope_theta" in parameters:
        merged = dict(parameters)
    else:
        merged = dict(getattr(config, "rope_scaling", None) or {})
        merged["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    merged["rope_type"] = merged.get("rope_type", merged.get("type", "default")) or "default"
    return merged


def normalize_dflash_config(config: Qwen3Config) -> None:
    """Rewrite the published variants into one canonical layout, in place.

    Canonical: top-level `block_size` and `num_target_layers`; `dflash_config` holding
    `target_layer_ids` (computed when absent), `mask_token_id` when known and `mask_token`
    when published as a string. Transformers-4 configs get `rope_theta`/`rope_scaling` from
    `rope_parameters`. Unsupported draft families raise a ValueError.
    """
    architectures = getattr(config, "architectures", None) or []
    if any(name != "DFlashDraftModel" and "DFlash" in name for name in architectures):
        raise ValueError(
            f"Draft architecture {architectures} is not supported: dflash-hf loads `DFlashDraftModel` "
            "drafts (Qwen3/LLaMA-3.1 targets); hybrid-target drafts (DFlash2, Qwen3.5/3.6) are out of scope."
        )
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        raise ValueError(
            f"Draft config uses sliding-window layers (layer_types={layer_types}); dflash-hf supports "
            "full-attention DFlash drafts only."
        )

    dflash_config = dict(getattr(config, "dflash_config", None) or {})
    block_size = getattr(config, "block_size", None)
    if block_size is None:
        block_size = dflash_config.pop("block_size", None)
    else:
        dflash_config.pop("block_size", None)
    if block_size is None:
        raise ValueError("Draft config has no `block_size` (top level or in `dflash_config`).")
    if int(block_size) < 2:
        raise ValueError(f"Draft config `block_size` must be at least 2, got {block_size}.")
    config.block_size = int(block_size)

    num_target_layers = getattr(config, "num_target_layers", None)
    if num_target_layers is None:
        num_target_layers = dflash_config.pop("num_target_layers", None)
    if dflash_config.get("target_layer_ids") is None:
        if num_target_layers is None:
            raise ValueError("Draft config has neither `dflash_config.target_layer_ids` nor `num_target_layers`.")
        dflash_config["target_layer_ids"] = default_target_layer_ids(
            int(num_target_layers), config.num_hidden_layers
        )
    dflash_config["target_layer_ids"] = [int(i) for i in dflash_config["target_layer_ids"]]
    config.num_target_layers = None if num_target_layers is None else int(num_target_layers)

    mask_token = dflash_config.get("mask_token")
    if dflash_config.get("mask_token_id") is None and isinstance(mask_token, int):
        dflash_config["mask_token_id"] = mask_token
        dflash_config.pop("mask_token")
    config.dflash_config = dflash_config

    # Transformers 4.x reads `rope_theta`/`rope_scaling`; 5.x converts those itself.
    if getattr(config, "rope_theta", None) is not None and isinstance(getattr(config, "rope_parameters", None), dict):
        parameters = read_rope_parameters(config)
        config.rope_theta = parameters.pop("rope_theta")
        config.rope_scaling = None if parameters["rope_type"] == "default" else parameters
        del config.rope_parameters
