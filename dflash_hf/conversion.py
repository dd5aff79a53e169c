"""Conversion between the published DFlash layout and the other draft formats, weight-exact.

Transformers >= 5.24 runs DFlash inside `generate(assistant_model=..., speculation_type="dflash")` with its own draft
class, `MuseGlimmerAssistantModel`: the same network with the feature projection under `encoder.*`, bidirectional
layers only, and an inclusive sliding window. vLLM's speculators format (`speculators_model_type: "dflash"`) carries
the same network with copies of the target's embedding and LM head, target layers counted from 1, and the draft
layers' settings in a `transformer_layer_config` (docs/formats.md, "The speculators format"). Settings a format cannot
express are refused by name, never dropped. Reading either format needs neither Transformers' class nor speculators
(`DFlashDraftModel.from_pretrained` does it).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from .checkpoint_dflash import NATIVE_PREFIXES, check_draft_source
from .configuration_dflash import (
    DFLASH_HF_VERSION,
    NATIVE_DEFAULTS,
    NATIVE_EXTRA_FIELDS,
    NATIVE_SHARED_FIELDS,
    SCALING_DEFAULTS,
    SPECULATORS_LAYER_FIELDS,
    SPECULATORS_TYPE_KEY,
    DFlashConfig,
    config_from_native,
    is_dflash2,
    layer_attention,
    read_rope_parameters,
)
from .modeling_dflash import DFlashDraftModel
from .versions_dflash import native_draft_classes

CONVERSION_TARGETS = ("transformers", "dflash", "speculators")
# The draft's own weights that a speculators checkpoint writes in its own way (its LM head and vocabulary mapping).
OWN_HEAD_WEIGHTS = ("lm_head.weight", "d2t", "t2d")


def deepspec_parts(config: DFlashConfig) -> list[str]:
    """A DeepSpec draft's parts no other format holds, by name: its shifted block, Markov head and confidence head."""
    parts = [(config.shifted_labels, "shifted_labels=True (DeepSpec's block: the last committed token, then masks)"),
             (config.markov_rank, f"markov_rank={config.markov_rank} (a DSpark Markov head)"),
             (config.enable_confidence_head, "enable_confidence_head=True (a DSpark confidence head)")]
    return [name for present, name in parts if present]


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
    if config.layer_style != "qwen3":
        problems.append(f"layer_style={config.layer_style} (Gemma-4 layers; native layers are Qwen3's)")
    problems += deepspec_parts(config)
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


def inexpressible_in_speculators(config: DFlashConfig, num_target_layers: int | None = None) -> list[str]:
    """The draft settings vLLM speculators' DFlash format cannot express, by name (empty: the conversion is exact).

    num_target_layers: the target's decoder layers, when known (speculators' pipeline reserves its last layer).
    """
    problems = []
    if is_dflash2(config):
        problems.append("architectures=DFlash2DraftModel (convolutions and candidate selector)")
    causal_full = [i for i in range(config.num_hidden_layers)
                   if config.layer_types[i] == "full_attention" and layer_attention(config, i)[0]]
    if causal_full:
        problems.append(f"causal full-attention layers {causal_full} (is_causal={config.is_causal}; speculators' "
                        "full-attention layers are bidirectional)")
    for name, neutral in SCALING_DEFAULTS.items():
        if getattr(config, name) != neutral:
            problems.append(f"{name}={getattr(config, name)}")
    problems += deepspec_parts(config)
    if config.layer_style != "qwen3":
        problems.append(f"layer_style={config.layer_style} (Gemma-4 layers; speculators' layer config builds Qwen3's)")
    if config.dflash_config.get("mask_token_id") is None:
        problems.append("mask_token_id (the config names the mask token only as a string)")
    last = None if num_target_layers is None else num_target_layers - 1
    if last in config.dflash_config["target_layer_ids"]:
        problems.append(f"target layer {last}, the target's last (speculators' pipeline reads it apart from the "
                        "draft's features, and its converter drops it)")
    return problems


def speculators_config(config: DFlashConfig, draft_vocab_size: int, verifier: str | None,
                       verifier_architectures: list[str], dtype: torch.dtype) -> dict[str, Any]:
    """The config.json of vLLM speculators' DFlash format for a draft config it can express (see
    `inexpressible_in_speculators`): `transformer_layer_config` holds the draft layers' Qwen3 settings (rope written
    both ways, as Transformers 4 and 5 read it), `aux_hidden_state_layer_ids` the target layer ids + 1."""
    sliding = "sliding_attention" in config.layer_types
    rope = read_rope_parameters(config)
    rope_theta = rope.pop("rope_theta")
    layer = {"model_type": "qwen3", **{name: getattr(config, name) for name in SPECULATORS_LAYER_FIELDS},
             "head_dim": config.head_dim, "tie_word_embeddings": False, "layer_types": list(config.layer_types),
             "use_sliding_window": sliding, "sliding_window": config.sliding_window if sliding else None,
             "rope_theta": rope_theta, "rope_scaling": None if rope["rope_type"] == "default" else dict(rope),
             "rope_parameters": {**rope, "rope_theta": rope_theta}}
    block_size = config.block_size
    dtype_name = str(dtype).removeprefix("torch.")
    return {
        "architectures": ["DFlashDraftModel"],  # what speculators' save_pretrained writes (its class default differs)
        SPECULATORS_TYPE_KEY: "dflash",
        "transformer_layer_config": layer,
        "draft_vocab_size": draft_vocab_size,
        "block_size": block_size,
        "target_hidden_size": None,
        "aux_hidden_state_layer_ids": [i + 1 for i in config.dflash_config["target_layer_ids"]],
        "mask_token_id": config.dflash_config["mask_token_id"],
        "sliding_window_non_causal": sliding and config.is_causal is False,
        "sample_from_anchor": False,
        "speculators_config": {
            "algorithm": "dflash",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": block_size - 1,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
        "tie_word_embeddings": False,
        "torch_dtype": dtype_name,
        "dtype": dtype_name,
        "dflash_hf_version": DFLASH_HF_VERSION,
    }


def speculators_weights(draft: DFlashDraftModel, target: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of a speculators DFlash checkpoint for `draft` (in its dtype): its own weights under the same
    names, the target's input embedding as `embed_tokens`, and an LM head over the draft's vocabulary: its own (with
    `d2t` / `t2d`), the target's rows of a `draft_vocab` list (ascending ids), or the target's whole head."""
    state = draft.state_dict()
    weights = {name: tensor for name, tensor in state.items() if name not in OWN_HEAD_WEIGHTS}
    head = target.get_output_embeddings().weight  # [V, H]
    vocab_size = draft.config.vocab_size
    ids = draft.draft_vocab
    if draft.lm_head is not None:
        weights["lm_head.weight"] = state["lm_head.weight"]
    elif ids is not None:
        ids = sorted(ids)
        weights["lm_head.weight"] = head[ids]  # [K, H]
    else:
        weights["lm_head.weight"] = head
    if ids is not None and len(ids) < vocab_size:
        ids = torch.tensor(ids, dtype=torch.long)  # [K]
        weights["d2t"] = ids - torch.arange(len(ids))
        weights["t2d"] = torch.zeros(vocab_size, dtype=torch.bool).index_fill_(0, ids, True)
    weights["embed_tokens.weight"] = target.get_input_embeddings().weight  # [V, H]
    return {name: (tensor.detach().to(draft.dtype) if tensor.is_floating_point() else tensor.detach()).cpu().clone()
            for name, tensor in weights.items()}


def to_speculators(draft: DFlashDraftModel, target: torch.nn.Module, destination: str | Path,
                   verifier: str | None = None) -> Path:
    """Write `draft` into `destination` in vLLM speculators' DFlash format (config.json and model.safetensors), with
    `target`'s embedding and LM head, or raise a ValueError naming what the format cannot express.

    verifier: the target's Hub id or path recorded in the config (default: the target's `name_or_path`).
    """
    target_config = target.config.get_text_config()
    problems = inexpressible_in_speculators(draft.config, getattr(target_config, "num_hidden_layers", None))
    head_rows = target.get_output_embeddings().weight.shape[0]
    if target_config.hidden_size != draft.config.hidden_size or head_rows != draft.config.vocab_size:
        problems.append(f"a target of hidden size {target_config.hidden_size} and {head_rows} LM-head rows (the "
                        f"draft's: {draft.config.hidden_size} and vocab_size {draft.config.vocab_size}); pass the "
                        "target the draft was trained for")
    if problems:
        raise ValueError("This draft cannot be written in vLLM speculators' DFlash format: " + "; ".join(problems))
    weights = speculators_weights(draft, target)
    config = speculators_config(draft.config, weights["lm_head.weight"].shape[0],
                                verifier or target.config.name_or_path or None,
                                target.config.architectures or [type(target).__name__], draft.dtype)
    destination = Path(destination)
    destination.mkdir(parents=True, exist_ok=True)
    (destination / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    save_file(weights, destination / "model.safetensors", metadata={"format": "pt"})
    return destination


def convert(source: str | Path, destination: str | Path, to: str, vocab_size: int | None = None,
            target: str | Path | torch.nn.Module | None = None) -> Path:
    """Convert the draft folder (or Hub id) `source` into `destination`: `to="transformers"` writes a native
    `MuseGlimmerAssistantModel` checkpoint, `to="dflash"` the published DFlash layout with remote code,
    `to="speculators"` vLLM speculators' DFlash format.

    vocab_size: the target's vocabulary size, needed (and only used) for a native draft that does not record it.
    target: the target model, or its Hub id / folder (loaded in its own dtype): needed for `to="speculators"`, whose
        checkpoints carry the target's embedding and LM head and name it as their verifier.
    """
    if to not in CONVERSION_TARGETS:
        raise ValueError(f"to must be one of {CONVERSION_TARGETS}, got {to!r}.")
    if Path(destination).exists() and not Path(destination).is_dir():
        raise ValueError(f"{destination} is an existing file; pass a folder to write the draft into.")
    if to == "speculators" and target is None:
        raise ValueError("A speculators checkpoint carries the target's embedding and LM head and names the target; "
                         "pass it: --verifier MODEL (python: target=MODEL), the Hub id or folder of the target model.")
    check_draft_source(source)  # a missing or empty local folder first, whatever the direction
    if to == "transformers":
        native_draft_classes()  # refuse before loading anything
    draft = DFlashDraftModel.from_pretrained(source, dtype="auto")
    if to == "speculators":
        verifier = None if isinstance(target, torch.nn.Module) else str(target)
        if verifier is not None:
            from transformers import AutoModelForCausalLM

            target = AutoModelForCausalLM.from_pretrained(verifier, dtype="auto")
        if draft.config.dflash_config.pop("vocab_size_unknown", None):  # a native draft: the target's head tells
            draft.config.vocab_size = target.get_output_embeddings().weight.shape[0]
        return to_speculators(draft, target, destination, verifier=verifier)
    if draft.config.dflash_config.get("vocab_size_unknown"):
        if vocab_size is None:
            raise ValueError(f"{source} does not record the target's vocabulary size (Transformers' native drafts do "
                             "not); pass it: --vocab-size V (python: vocab_size=V), V = the target's vocabulary size.")
        draft.config.vocab_size = vocab_size
        del draft.config.dflash_config["vocab_size_unknown"]
    model = to_native(draft) if to == "transformers" else draft
    model.save_pretrained(destination)
    return Path(destination)
