"""Conversion between the published DFlash layout and Transformers' native DFlash draft, both ways, weight-exact.

Transformers >= 5.24 runs DFlash inside `generate(assistant_model=..., speculation_type="dflash")` with its own draft
class, `MuseGlimmerAssistantModel`: the same network with the feature projection under `encoder.*`, bidirectional
layers only, and an inclusive sliding window. Settings it cannot express are refused by name, never dropped.
Reading a native folder needs no native class (`DFlashDraftModel.from_pretrained` does it on any version).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .checkpoint_dflash import NATIVE_PREFIXES, check_draft_source
from .configuration_dflash import (
    NATIVE_DEFAULTS,
    NATIVE_EXTRA_FIELDS,
    NATIVE_SHARED_FIELDS,
    DFlashConfig,
    config_from_native,
    is_dflash2,
    layer_attention,
    read_rope_parameters,
)
from .modeling_dflash import DFlashDraftModel
from .versions_dflash import native_draft_classes

CONVERSION_TARGETS = ("transformers", "dflash")


def inexpressible_in_native(config: DFlashConfig) -> list[str]:
    """The draft settings the native class cannot express, by name (empty: the conversion is exact)."""
    problems = []
    if is_dflash2(config):
        problems.append("architectures=DFlash2DraftModel (convolutions and candidate selector)")
    causal_layers = [i for i in range(config.num_hidden_layers) if layer_attention(config, i)[0]]
    if causal_layers:
        problems.append(f"causal layers {causal_layers} (is_causal={config.is_causal}; "
                        "native layers are bidirectional)")
    for name, neutral in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                          ("final_logit_softcapping", None)):
        if getattr(config, name) != neutral:
            problems.append(f"{name}={getattr(config, name)}")
    if config.attention_bias:
        problems.append("attention_bias=True")
    if config.draft_vocab_size is not None:
        problems.append(f"draft_vocab_size={config.draft_vocab_size} (an LM head of its own; native drafts borrow "
                        "the target's)")
    if config.dflash_config.get("mask_token_id") is None:
        problems.append("mask_token_id (the config names the mask token only as a string)")
    return problems


def native_config_arguments(config: DFlashConfig) -> dict[str, Any]:
    """MuseGlimmerAssistantConfig arguments for a draft config the native class can express."""
    sliding = "sliding_attention" in config.layer_types
    arguments = {name: getattr(config, name) for name in NATIVE_SHARED_FIELDS}
    arguments.update(
        layer_types=list(config.layer_types), rope_parameters=read_rope_parameters(config),
        sliding_window=config.sliding_window - 1 if sliding else NATIVE_DEFAULTS["sliding_window"],
        target_layer_ids=list(config.dflash_config["target_layer_ids"]),
        mask_token_id=config.dflash_config["mask_token_id"],
        bos_token_id=None, eos_token_id=None, pad_token_id=None,  # the target's tokens decide; a draft has none
    )
    extras = {"vocab_size": None if config.dflash_config.get("vocab_size_unknown") else config.vocab_size,
              "num_target_layers": config.num_target_layers, "mask_token": config.dflash_config.get("mask_token")}
    arguments.update({name: extras[name] for name in NATIVE_EXTRA_FIELDS if extras[name] is not None})
    return arguments


def renamed(name: str, prefixes: dict[str, str]) -> str:
    """A weight name with its prefix replaced by `prefixes` (old -> new); other names unchanged."""
    for old, new in prefixes.items():
        if name.startswith(old):
            return new + name[len(old):]
    return name


def to_native(draft: DFlashDraftModel) -> torch.nn.Module:
    """The same draft as a `MuseGlimmerAssistantModel` (same weights and dtype), or a ValueError naming what the
    native class cannot express."""
    config_class, model_class = native_draft_classes()
    problems = inexpressible_in_native(draft.config)
    if problems:
        raise ValueError("This draft cannot be expressed as Transformers' native DFlash draft: " + "; ".join(problems))
    native = model_class(config_class(**native_config_arguments(draft.config)))
    to_native_names = {ours: native for native, ours in NATIVE_PREFIXES.items()}
    native.load_state_dict({renamed(name, to_native_names): tensor for name, tensor in draft.state_dict().items()},
                           strict=True)
    for parameter in native.parameters():  # the weights' dtype; buffers (rope frequencies) stay float32, as ours
        parameter.data = parameter.data.to(draft.dtype)
    return native.to(draft.device).eval()


def from_native(native: torch.nn.Module) -> DFlashDraftModel:
    """A loaded `MuseGlimmerAssistantModel` as the same DFlash draft (same weights and dtype)."""
    draft = DFlashDraftModel(DFlashConfig(**config_from_native(native.config.to_dict())))
    draft.load_state_dict({renamed(name, NATIVE_PREFIXES): tensor for name, tensor in native.state_dict().items()},
                          strict=True)
    return draft.to(native.dtype).eval()


def convert(source: str | Path, destination: str | Path, to: str, vocab_size: int | None = None) -> Path:
    """Convert the draft folder (or Hub id) `source` into `destination`: `to="transformers"` writes a native
    `MuseGlimmerAssistantModel` checkpoint, `to="dflash"` the published DFlash layout with remote code.

    vocab_size: the target's vocabulary size, needed (and only used) for a native draft that does not record it.
    """
    if to not in CONVERSION_TARGETS:
        raise ValueError(f"to must be one of {CONVERSION_TARGETS}, got {to!r}.")
    if Path(destination).exists() and not Path(destination).is_dir():
        raise ValueError(f"{destination} is an existing file; pass a folder to write the draft into.")
    check_draft_source(source)  # a missing or empty local folder first, whatever the direction
    if to == "transformers":
        native_draft_classes()  # refuse before loading anything
    draft = DFlashDraftModel.from_pretrained(source, dtype="auto")
    if draft.config.dflash_config.get("vocab_size_unknown"):
        if vocab_size is None:
            raise ValueError(f"{source} does not record the target's vocabulary size (Transformers' native drafts do "
                             "not); pass it: --vocab-size V (python: vocab_size=V), V = the target's vocabulary size.")
        draft.config.vocab_size = vocab_size
        del draft.config.dflash_config["vocab_size_unknown"]
    model = to_native(draft) if to == "transformers" else draft
    model.save_pretrained(destination)
    return Path(destination)
