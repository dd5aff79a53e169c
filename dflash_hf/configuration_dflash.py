"""DFlash draft configuration: a Qwen3 config plus the DFlash fields of the published drafts.

The config normalises and validates itself when it is constructed or loaded, so every published
variant (design doc section 1) reads the same way afterwards. Hub remote code: imports only
torch and transformers.
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen3Config

DFLASH_HF_VERSION = "0.2.0"  # the package version; exported folders record it (config field and file headers)
# The Hub remote code: these files are copied next to the weights by `save_pretrained`.
REMOTE_CODE_FILES = (
    "configuration_dflash.py",
    "modeling_dflash.py",
    "cache_dflash.py",
    "sampling_dflash.py",
    "target_dflash.py",
    "proposer_dflash.py",
    "generation_dflash.py",
)
DEFAULT_BLOCK_SIZE = 16  # dflash-formats.md: `block_size` when a config names none
# Written into every saved config.json, even where equal to the class default (readers other than Transformers).
ALWAYS_SAVED = ("block_size", "num_target_layers", "dflash_config", "rope_parameters", "rope_theta", "rope_scaling")


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
        merged["rope_theta"] = getattr(config, "rope_theta", None) or 10000.0
    merged["rope_type"] = merged.get("rope_type", merged.get("type", "default")) or "default"
    merged.pop("type", None)
    return merged


def dflash_field(config: Any, dflash_config: dict[str, Any], name: str, default: Any = None) -> Any:
    """A DFlash field: `dflash_config[name]` first, then the top-level attribute, then `default` (formats doc)."""
    if dflash_config.get(name) is not None:
        return dflash_config[name]
    value = getattr(config, name, None)
    return default if value is None else value


class DFlashConfig(Qwen3Config):
    """Qwen3 config with `block_size`, `num_target_layers` and `dflash_config` (mask token, target layers).

    The class keeps `model_type = "qwen3"`, as the published drafts do, so the same `config.json` is read by
    Transformers, vLLM and SGLang. After construction the layout is canonical: top-level `block_size` and
    `num_target_layers`; `dflash_config` with `target_layer_ids` (computed when absent), `mask_token_id` when
    known and `mask_token` when published as a string; rope in the installed Transformers' own style.
    """

    def __init__(self, block_size: int | None = None, num_target_layers: int | None = None,
                 dflash_config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.block_size = block_size
        self.num_target_layers = num_target_layers
        self.dflash_config = dict(dflash_config or {})
        super().__init__(**kwargs)
        normalize_dflash_config(self)

    def to_dict(self) -> dict[str, Any]:
        """The config as saved: rope written both ways (`rope_parameters` and top-level `rope_theta`/`rope_scaling`).

        Serving engines that read a Transformers-4 Qwen3 config look only at `rope_theta`; Transformers 5 reads
        `rope_parameters`. Writing both keeps every reader on the draft's rope.
        """
        output = super().to_dict()
        rope = read_rope_parameters(self)
        output["rope_parameters"] = dict(rope)
        output["rope_theta"] = rope.pop("rope_theta")
        output["rope_scaling"] = None if rope["rope_type"] == "default" else rope
        return output

    def to_diff_dict(self) -> dict[str, Any]:
        """What `save_pretrained` writes: the fields that differ from the defaults, plus every DFlash and rope field."""
        output = super().to_diff_dict()
        full = self.to_dict()
        output.update({key: full[key] for key in ALWAYS_SAVED})
        return output


def _check_supported(config: Qwen3Config) -> None:
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


def normalize_dflash_config(config: Qwen3Config) -> None:
    """Rewrite the published variants into the canonical layout (see DFlashConfig), in place; idempotent."""
    _check_supported(config)
    dflash_config = dict(getattr(config, "dflash_config", None) or {})
    block_size = int(dflash_field(config, dflash_config, "block_size", DEFAULT_BLOCK_SIZE))
    if block_size < 2:
        raise ValueError(f"Draft config `block_size` must be at least 2, got {block_size}.")
    num_target_layers = dflash_field(config, dflash_config, "num_target_layers")
    for moved in ("block_size", "num_target_layers"):
        dflash_config.pop(moved, None)
    config.block_size = block_size
    config.num_target_layers = None if num_target_layers is None else int(num_target_layers)

    target_layer_ids = dflash_field(config, dflash_config, "target_layer_ids")
    if target_layer_ids is None and config.num_target_layers is not None:
        target_layer_ids = default_target_layer_ids(config.num_target_layers, config.num_hidden_layers)
    if target_layer_ids is not None:
        target_layer_ids = [int(i) for i in target_layer_ids]
        if not target_layer_ids or min(target_layer_ids) < 0:
            raise ValueError(f"Draft config `target_layer_ids` must be non-negative layer indices, got {target_layer_ids}.")
        dflash_config["target_layer_ids"] = target_layer_ids
    mask_token_id = dflash_field(config, dflash_config, "mask_token_id")
    mask_token = dflash_config.get("mask_token")
    if mask_token_id is None and isinstance(mask_token, int):
        mask_token_id = dflash_config.pop("mask_token")
    if mask_token_id is not None:
        dflash_config["mask_token_id"] = int(mask_token_id)
    config.dflash_config = dflash_config
    _normalize_rope(config)


def _normalize_rope(config: Qwen3Config) -> None:
    """Transformers 4.x reads `rope_theta`/`rope_scaling`: fill them from `rope_parameters` (5.x converts itself)."""
    parameters = getattr(config, "rope_parameters", None)
    if "rope_theta" not in config.__dict__ or not isinstance(parameters, dict):
        return  # Transformers 5.x: `rope_parameters` is the config's own field
    rope = read_rope_parameters(config)
    config.rope_theta = rope.pop("rope_theta")
    config.rope_scaling = None if rope["rope_type"] == "default" else rope
    del config.rope_parameters
