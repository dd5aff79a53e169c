"""DFlash draft configuration: a Qwen3 config plus the DFlash fields of the published drafts.

The config normalises and validates itself when it is constructed or loaded, so every published
variant (docs/formats.md) reads the same way afterwards. Hub remote code: imports only
torch and transformers.
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen3Config

from .versions_dflash import rope_type_refusal

DFLASH_HF_VERSION = "0.2.0"  # the package version; exported folders record it (config field and file headers)
# The Hub remote code: these files are copied next to the weights by `save_pretrained`.
REMOTE_CODE_FILES = (
    "configuration_dflash.py",
    "modeling_dflash.py",
    "checkpoint_dflash.py",
    "versions_dflash.py",
    "families_dflash.py",
    "support_dflash.py",
    "cache_dflash.py",
    "masks_dflash.py",
    "sampling_dflash.py",
    "processors_dflash.py",
    "devices_dflash.py",
    "kernels_dflash.py",
    "target_dflash.py",
    "draft_backends_dflash.py",
    "proposer_dflash.py",
    "mixers_dflash.py",
    "recurrent_dflash.py",
    "static_dflash.py",
    "static_recurrent_dflash.py",
    "backends_dflash.py",
    "tree_dflash.py",
    "tokens_dflash.py",
    "validation_dflash.py",
    "settings_dflash.py",
    "steps_dflash.py",
    "generation_dflash.py",
    "custom_generate_dflash.py",
)
# `save_pretrained` also writes custom_generate_dflash.py here, where `generate(custom_generate=FOLDER)` looks.
CUSTOM_GENERATE_FILE = "custom_generate/generate.py"
DEFAULT_BLOCK_SIZE = 16  # docs/formats.md: `block_size` when a config names none
# Written into every saved config.json, even where equal to the class default (readers other than Transformers).
ALWAYS_SAVED = ("block_size", "num_target_layers", "dflash_config", "rope_parameters", "rope_theta", "rope_scaling")


# Transformers' native DFlash draft (`MuseGlimmerAssistantConfig`, Transformers >= 5.24): its model type, and its class
# defaults (its config.json may omit a field equal to them; a test on 5.x compares this table with the class).
NATIVE_MODEL_TYPE = "muse_glimmer_assistant"
NATIVE_DEFAULTS = {
    "hidden_size": 6656, "intermediate_size": 19968, "num_hidden_layers": 5, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "rms_norm_eps": 1e-5, "max_position_embeddings": 131072,
    "attention_dropout": 0, "hidden_act": "silu", "block_size": 16, "mask_token_id": 201818,
    "target_layer_ids": [1, 13, 25, 37, 49], "sliding_window": 2048, "layer_types": None,
    "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
}
# Fields both configs have under the same name and meaning.
NATIVE_SHARED_FIELDS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings",
                        "attention_dropout", "hidden_act", "block_size")
# DFlash fields a native config can carry as extra attributes (dflash-hf writes them; other native configs lack them).
NATIVE_EXTRA_FIELDS = ("vocab_size", "num_target_layers", "mask_token")


def config_from_native(native: dict[str, Any]) -> dict[str, Any]:
    """DFlashConfig arguments for a native `muse_glimmer_assistant` config dict: the same draft, exactly.

    Native layers are all bidirectional; its sliding window is inclusive (|q - k| <= W), ours exclusive, so W + 1.
    """
    values = {**NATIVE_DEFAULTS, **{key: value for key, value in native.items() if value is not None}}
    layer_types = values["layer_types"] or ["sliding_attention"] * values["num_hidden_layers"]
    rope = _native_rope(native)
    arguments = {name: values[name] for name in NATIVE_SHARED_FIELDS}
    arguments.update(
        architectures=["DFlashDraftModel"], attention_bias=False, tie_word_embeddings=False,
        layer_types=layer_types, is_causal=False if "sliding_attention" in layer_types else None,
        sliding_window=values["sliding_window"] + 1 if "sliding_attention" in layer_types else None,
        rope_theta=rope.pop("rope_theta"), rope_scaling=None if rope["rope_type"] == "default" else rope,
        num_target_layers=values.get("num_target_layers"),
        dflash_config={"target_layer_ids": list(values["target_layer_ids"]), "mask_token_id": values["mask_token_id"],
                       **({"mask_token": values["mask_token"]} if values.get("mask_token") else {})},
    )
    if values.get("vocab_size") is not None:
        arguments["vocab_size"] = values["vocab_size"]
    else:  # Transformers' native drafts do not record the target's vocabulary
        arguments["dflash_config"]["vocab_size_unknown"] = True
    return arguments


def _native_rope(native: dict[str, Any]) -> dict[str, Any]:
    """A native config's rope as one dict, read as its class reads it: `rope_parameters`, else top-level
    `rope_theta` / `rope_scaling`, else the class default."""
    parameters = native.get("rope_parameters")
    if parameters and "rope_theta" not in parameters:  # also a rope per layer type: {"full_attention": {...}, ...}
        raise ValueError(f"Native draft config rope {parameters} is not one rope with a `rope_theta`; dflash-hf "
                         "drafts have one rope for every layer.")
    default_theta = NATIVE_DEFAULTS["rope_parameters"]["rope_theta"]
    return read_rope_parameters({**native, "rope_theta": native.get("rope_theta") or default_theta})


# vLLM speculators' DFlash format (docs/formats.md, "The speculators format"): the key that marks its config.json, the
# defaults of its config class (`DFlashSpeculatorConfig`) for the fields this package reads, and the fields read from
# its `transformer_layer_config` once that config's own class has filled its defaults.
SPECULATORS_TYPE_KEY = "speculators_model_type"
SPECULATORS_DEFAULTS = {"block_size": 8, "draft_vocab_size": 32000, "sliding_window_non_causal": False,
                        "sample_from_anchor": False}
SPECULATORS_LAYER_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                            "num_attention_heads", "num_key_value_heads", "hidden_act", "max_position_embeddings",
                            "rms_norm_eps", "attention_bias", "attention_dropout")
# Top-level keys vLLM lets override the `transformer_layer_config` ones when it serves the draft.
SPECULATORS_ATTENTION_OVERRIDES = ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers")
# Its checkpoint's copies of the verifier's weights (speculators fills them from the verifier and never trains them):
# the draft uses the target's own. With a full vocabulary the LM head is one of them too.
SPECULATORS_VERIFIER_COPIES = ("embed_tokens.weight", "verifier_lm_head.weight", "verifier_norm.weight")
SPECULATORS_FULL_VOCAB_COPIES = ("lm_head.weight", "d2t", "t2d")


def speculators_verifier_copies(config: Any) -> tuple[str, ...]:
    """The weights of a speculators checkpoint that a draft of `config` leaves unread (the target's own are used)."""
    own_head = getattr(config, "draft_vocab_size", None) is not None
    return SPECULATORS_VERIFIER_COPIES + (() if own_head else SPECULATORS_FULL_VOCAB_COPIES)


def config_from_speculators(speculators: dict[str, Any]) -> dict[str, Any]:
    """DFlashConfig arguments for a vLLM speculators DFlash config dict (`speculators_model_type: "dflash"`): the same
    draft, as speculators builds it; settings this package cannot run exactly are refused by name."""
    from transformers import AutoConfig

    kind = speculators.get(SPECULATORS_TYPE_KEY)
    if kind != "dflash":
        raise ValueError(f"A speculators config of type {kind!r} is not a DFlash draft; dflash-hf loads "
                         "`speculators_model_type: \"dflash\"` (see docs/formats.md).")
    values = {**SPECULATORS_DEFAULTS, **{key: value for key, value in speculators.items() if value is not None}}
    if values["sample_from_anchor"]:
        raise ValueError("This speculators draft has `sample_from_anchor: true` (the anchor position drafts too); "
                         "dflash-hf runs speculators DFlash drafts whose anchor is the bonus token (see "
                         "docs/formats.md).")
    layer = values.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError("A speculators DFlash config needs `transformer_layer_config` (a dict: the draft layers' "
                         f"config), got {type(layer).__name__}.")
    layer = {**layer, **{key: values[key] for key in SPECULATORS_ATTENTION_OVERRIDES if key in values}}
    layer_config = AutoConfig.for_model(layer.pop("model_type", "qwen3"), **layer)  # its class fills the defaults
    arguments = {name: getattr(layer_config, name) for name in SPECULATORS_LAYER_FIELDS}
    hidden = arguments["hidden_size"]
    arguments["head_dim"] = getattr(layer_config, "head_dim", None) or hidden // arguments["num_attention_heads"]
    if values.get("target_hidden_size") not in (None, hidden):
        raise ValueError(f"This speculators draft reads a target of hidden size {values['target_hidden_size']} into "
                         f"layers of hidden size {hidden}; dflash-hf drafts share the target's hidden size.")
    aux = values.get("aux_hidden_state_layer_ids")
    if not aux or min(int(i) for i in aux) < 1:
        raise ValueError("A speculators DFlash config needs `aux_hidden_state_layer_ids` of 1 or more (layer id + 1 "
                         f"of each target layer it reads), got {aux}.")
    # A layer typed sliding without a window has no window in speculators' mask: bidirectional, as a full layer.
    window = getattr(layer_config, "sliding_window", None)
    layer_types = [layer_type if window is not None else "full_attention" for layer_type in
                   getattr(layer_config, "layer_types", None) or ["full_attention"] * arguments["num_hidden_layers"]]
    sliding = "sliding_attention" in layer_types
    rope = read_rope_parameters(layer_config)
    if isinstance(rope.get("sliding_attention"), dict):  # a rope per layer type: speculators uses the sliding one
        rope = read_rope_parameters({"rope_parameters": rope["sliding_attention"]})
    draft_vocab_size = int(values["draft_vocab_size"])
    mask_token_id = values.get("mask_token_id")
    arguments.update(
        architectures=["DFlashDraftModel"], tie_word_embeddings=False, layer_types=layer_types,
        sliding_window=window if sliding else None,
        is_causal=False if sliding and values["sliding_window_non_causal"] else None,
        rope_theta=rope.pop("rope_theta"), rope_scaling=None if rope["rope_type"] == "default" else rope,
        block_size=int(values["block_size"]), num_target_layers=None,
        draft_vocab_size=None if draft_vocab_size == arguments["vocab_size"] else draft_vocab_size,
        dflash_config={"target_layer_ids": [int(i) - 1 for i in aux],
                       **({} if mask_token_id is None else {"mask_token_id": int(mask_token_id)})},
    )
    for name in ("torch_dtype", "dtype"):
        if values.get(name) is not None:
            arguments[name] = values[name]
    return arguments


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers feeding the draft when the config names none: evenly spaced from 1 to N-3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


def read_rope_parameters(config: Any) -> dict[str, Any]:
    """The rope settings as one dict (`rope_theta`, `rope_type`, scaling keys) from either config style (a config
    object or a config dict)."""
    get = config.get if isinstance(config, dict) else lambda name: getattr(config, name, None)
    parameters = get("rope_parameters")
    if isinstance(parameters, dict) and "rope_theta" in parameters:
        merged = dict(parameters)
    else:
        merged = dict(get("rope_scaling") or {})
        merged["rope_theta"] = get("rope_theta") or 10000.0
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
    known and `mask_token` when published as a string; rope in the installed Transformers' own style; the newer
    fields of docs/formats.md (`layer_types`, `sliding_window`, `is_causal`, `input_embedding_scale`,
    `output_multiplier`, `final_logit_softcapping`, `draft_vocab_size`, DFlash2's convolution and selector sizes,
    DeepSpec's fields, `layer_style` and `attention_k_eq_v`) at top level. DeepSpec's Gemma-4 config
    (`Gemma4DSparkModel`) is mapped at construction (`config_from_deepspec_gemma4`).
    """

    def __init__(self, block_size: int | None = None, num_target_layers: int | None = None,
                 dflash_config: dict[str, Any] | None = None, **kwargs: Any) -> None:
        self.block_size = block_size
        self.num_target_layers = num_target_layers
        self.dflash_config = dict(dflash_config or {})
        if DEEPSPEC_GEMMA4_ARCHITECTURE in (kwargs.get("architectures") or []):  # its names mapped to ours
            kwargs = config_from_deepspec_gemma4(kwargs)
        # Qwen3Config drops `sliding_window` unless `use_sliding_window`; DFlash drafts name sliding layers by type.
        published_sliding_window = kwargs.get("sliding_window")
        try:
            super().__init__(**kwargs)
        except (TypeError, ValueError):
            raise
        except Exception as error:  # Transformers 5 validates with huggingface_hub's error, not a ValueError
            raise ValueError(f"Draft config is not a valid Qwen3 config: {error}") from error
        normalize_dflash_config(self, published_sliding_window)

    def to_dict(self) -> dict[str, Any]:
        """The config as saved: rope written both ways (`rope_parameters` and top-level `rope_theta`/`rope_scaling`),
        and `draft_vocab_size` only for a draft with its own LM head.

        Serving engines that read a Transformers-4 Qwen3 config look only at `rope_theta`; Transformers 5 reads
        `rope_parameters`. Writing both keeps every reader on the draft's rope.
        """
        output = super().to_dict()
        rope = read_rope_parameters(self)
        output["rope_parameters"] = dict(rope)
        output["rope_theta"] = rope.pop("rope_theta")
        output["rope_scaling"] = None if rope["rope_type"] == "default" else rope
        if output.get("draft_vocab_size") is None:  # a draft borrowing the target's head: no key, as published
            output.pop("draft_vocab_size", None)
        return output

    def to_diff_dict(self) -> dict[str, Any]:
        """What `save_pretrained` writes: the fields that differ from the defaults, plus every DFlash and
        rope field."""
        output = super().to_diff_dict()
        full = self.to_dict()
        output.update({key: full[key] for key in ALWAYS_SAVED})
        return output


SUPPORTED_ARCHITECTURES = ("DFlashDraftModel", "DFlash2DraftModel")
# DeepSeek DeepSpec's one class for its DFlash and DSpark drafts (docs/formats.md, "DeepSeek DeepSpec drafts"): loaded
# as a DFlash draft with shifted labels, a Markov head (`markov_rank` > 0) and a confidence head where the config says.
DEEPSPEC_ARCHITECTURE = "Qwen3DSparkModel"
# The same draft over Gemma-4 targets: Gemma-4's layers (`layer_style` "gemma4"), its config the target's Gemma-4 text
# config with DeepSpec's fields, mapped at load (`config_from_deepspec_gemma4`).
DEEPSPEC_GEMMA4_ARCHITECTURE = "Gemma4DSparkModel"
DEEPSPEC_ARCHITECTURES = (DEEPSPEC_ARCHITECTURE, DEEPSPEC_GEMMA4_ARCHITECTURE)
# The draft layer's kinds (docs/formats.md): "qwen3", a Qwen3 decoder layer; "gemma4", a Gemma-4 one (DeepSpec's
# Gemma-4 draft): norms after attention and MLP too, a weightless value norm, attention unscaled (the q and k norms
# set the scale), every norm weighted in float32, and the layer's output times its `layer_scalar` buffer.
LAYER_STYLES = ("qwen3", "gemma4")
MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
# A DeepSpec checkpoint's frozen copies of the target's embedding and LM head (DeepSpec's trainer copies them from the
# target and never trains them): the draft borrows the target's own, as every DFlash draft, and leaves these unread.
DEEPSPEC_BORROWED_WEIGHTS = ("embed_tokens.weight", "lm_head.weight")
LAYER_TYPES = ("full_attention", "sliding_attention")
# Fields of the newer drafts (docs/formats.md), read like every DFlash field, kept at top level once normalised.
SCALING_DEFAULTS = {"input_embedding_scale": 1.0, "output_multiplier": 1.0, "final_logit_softcapping": None}
DFLASH2_FIELDS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


def is_dflash2(config: Any) -> bool:
    """Whether the config (object or dict) describes a `DFlash2DraftModel` (convolutions and a candidate selector)."""
    architectures = config.get("architectures") if isinstance(config, dict) else getattr(config, "architectures", None)
    return "DFlash2DraftModel" in (architectures or [])


def layer_attention(config: Any, layer_idx: int) -> tuple[bool, int | None]:
    """(causal, sliding window or None) of a draft layer: `is_causal` when set, else causal exactly when sliding."""
    sliding = config.layer_types[layer_idx] == "sliding_attention"
    causal = sliding if config.is_causal is None else config.is_causal
    return causal, config.sliding_window if sliding else None


# DeepSpec's Gemma-4 draft config (its `build_draft_config`: the target's Gemma-4 text config, copied, with DeepSpec's
# fields): the keys read as they are; the rest is mapped (`config_from_deepspec_gemma4`) or, the target's own (sliding
# window, per-layer inputs, model type) and training's (`num_anchors`), left out.
GEMMA4_SHARED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "rms_norm_eps", "attention_bias", "attention_dropout", "max_position_embeddings",
                        "initializer_range", "layer_types", "final_logit_softcapping", "block_size",
                        "num_target_layers", "target_layer_ids", "mask_token_id", "markov_rank", "markov_head_type",
                        "enable_confidence_head", "confidence_head_with_markov", "dflash_config", "pad_token_id",
                        "bos_token_id", "eos_token_id", "dtype", "torch_dtype", "transformers_version")


def config_from_deepspec_gemma4(values: dict[str, Any]) -> dict[str, Any]:
    """DFlashConfig arguments for DeepSpec's Gemma-4 draft config (`Gemma4DSparkModel`) as a dict: the draft its code
    builds. Its attention: `global_head_dim`, and `num_global_key_value_heads` when keys are values
    (`attention_k_eq_v`); its rope: the full-attention one; embeddings times sqrt(hidden_size), as Gemma's. What its
    code does not build (an MoE block, per-layer inputs) or builds per Transformers version is refused by name."""
    for name, unbuilt in (("enable_moe_block", "an MoE block"), ("hidden_size_per_layer_input", "per-layer inputs")):
        if values.get(name):
            raise ValueError(f"This Gemma-4 DeepSpec draft config sets `{name}` ({unbuilt}), which DeepSpec's "
                             "Gemma-4 draft does not build; dflash-hf loads the drafts its code builds "
                             "(docs/formats.md, \"DeepSeek DeepSpec drafts\").")
    if values.get("use_double_wide_mlp") and values.get("num_kv_shared_layers"):
        raise ValueError("This Gemma-4 DeepSpec draft config sets `use_double_wide_mlp` with `num_kv_shared_layers`: "
                         "its MLP widths then depend on the Transformers version DeepSpec ran, which the config does "
                         "not record; set `use_double_wide_mlp` to false if every MLP is `intermediate_size` wide.")
    missing = [name for name in ("global_head_dim", "rope_parameters", "hidden_size") if values.get(name) is None]
    shared = bool(values.get("attention_k_eq_v"))
    if shared and values.get("num_global_key_value_heads") is None:
        missing.append("num_global_key_value_heads")
    if missing:
        raise ValueError(f"This Gemma-4 DeepSpec draft config lacks {', '.join(missing)} (DeepSpec's "
                         "build_draft_config copies them from the target's Gemma-4 text config); add them from it.")
    rope = values["rope_parameters"].get("full_attention") or {}  # DeepSpec's draft: every layer full attention
    if "rope_theta" not in rope:
        raise ValueError(f"This Gemma-4 DeepSpec draft config has no full-attention rope with a `rope_theta` in "
                         f"`rope_parameters` ({values['rope_parameters']}); copy it from the target's text config.")
    rope = {**rope, "rope_type": rope.get("rope_type") or "default"}
    refusal = rope_type_refusal(rope["rope_type"], f"DeepSpec's Gemma-4 draft ({DEEPSPEC_GEMMA4_ARCHITECTURE})")
    if refusal is not None:
        raise ValueError(refusal)
    arguments = {name: values[name] for name in GEMMA4_SHARED_FIELDS if name in values}
    arguments.update(
        architectures=[DEEPSPEC_GEMMA4_ARCHITECTURE], layer_style="gemma4", attention_k_eq_v=shared,
        head_dim=int(values["global_head_dim"]), tie_word_embeddings=False,
        num_key_value_heads=int(values["num_global_key_value_heads" if shared else "num_key_value_heads"]),
        hidden_act=values.get("hidden_activation") or "gelu_pytorch_tanh",
        input_embedding_scale=float(values["hidden_size"]) ** 0.5,
        rope_theta=float(rope["rope_theta"]), rope_scaling=None if rope["rope_type"] == "default" else rope,
    )
    return arguments


def _check_architecture(config: Qwen3Config) -> None:
    architectures = getattr(config, "architectures", None) or []
    unknown = [name for name in architectures if ("DFlash" in name or "DSpark" in name)
               and name not in (*SUPPORTED_ARCHITECTURES, *DEEPSPEC_ARCHITECTURES)]
    if unknown:
        raise ValueError(f"Draft architecture {unknown} is not supported: dflash-hf loads "
                         f"{' and '.join(SUPPORTED_ARCHITECTURES)} drafts (see docs/formats.md).")


def normalize_dflash_config(config: Qwen3Config, published_sliding_window: int | None = None) -> None:
    """Rewrite the published variants into the canonical layout (see DFlashConfig), in place; idempotent."""
    _check_architecture(config)
    dflash_config = dict(getattr(config, "dflash_config", None) or {})
    block_size = int(dflash_field(config, dflash_config, "block_size", DEFAULT_BLOCK_SIZE))
    if set(DEEPSPEC_ARCHITECTURES) & set(config.architectures or []):
        # DeepSpec's `block_size` counts the drafted rows (all of them proposals); ours the verified tokens: one more
        block_size += 1
        config.architectures = ["DFlashDraftModel"]
        config.shifted_labels = True
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
            raise ValueError(f"Draft config `target_layer_ids` must be non-negative layer indices, "
                             f"got {target_layer_ids}.")
        dflash_config["target_layer_ids"] = target_layer_ids
    mask_token_id = dflash_field(config, dflash_config, "mask_token_id")
    mask_token = dflash_config.get("mask_token")
    if mask_token_id is None and isinstance(mask_token, int):
        mask_token_id = dflash_config.pop("mask_token")
    if mask_token_id is not None:
        dflash_config["mask_token_id"] = int(mask_token_id)
    _normalize_layer_attention(config, dflash_config, published_sliding_window)
    for name, default in SCALING_DEFAULTS.items():
        setattr(config, name, dflash_field(config, dflash_config, name, default))
        dflash_config.pop(name, None)
    if config.final_logit_softcapping is not None and config.final_logit_softcapping <= 0:
        config.final_logit_softcapping = None  # the formats doc: applied only when set and > 0
    if is_dflash2(config):
        _normalize_dflash2(config, dflash_config)
    _normalize_layer_style(config, dflash_config)
    _normalize_deepspec(config, dflash_config)
    _check_draft_vocab(config, dflash_config)
    _normalize_draft_vocab_size(config, dflash_config)
    config.dflash_config = dflash_config
    _normalize_rope(config)


def _normalize_layer_attention(config: Qwen3Config, dflash_config: dict[str, Any],
                               published_window: int | None) -> None:
    """Per-layer attention (`layer_types`, `sliding_window`, `is_causal`) at top level, checked; idempotent."""
    layer_types = dflash_field(config, dflash_config, "layer_types") or ["full_attention"] * config.num_hidden_layers
    layer_types = list(layer_types)
    if len(layer_types) != config.num_hidden_layers or any(kind not in LAYER_TYPES for kind in layer_types):
        raise ValueError(f"Draft config `layer_types` must name one of {LAYER_TYPES} for each of the "
                         f"{config.num_hidden_layers} layers, got {layer_types}.")
    window = dflash_field(config, dflash_config, "sliding_window", published_window)
    if "sliding_attention" in layer_types and (window is None or int(window) < 1):
        raise ValueError("Draft config has sliding-attention layers but no positive `sliding_window`; "
                         "set it to the window the draft was trained with.")
    is_causal = dflash_field(config, dflash_config, "is_causal")
    for name in ("layer_types", "sliding_window", "is_causal"):
        dflash_config.pop(name, None)
    config.layer_types = layer_types
    config.sliding_window = None if window is None else int(window)
    # Servers build a Qwen3 config from the file, which keeps `sliding_window` only with this flag (docs/serving.md)
    config.use_sliding_window = "sliding_attention" in layer_types
    config.is_causal = None if is_causal is None else bool(is_causal)


def _normalize_layer_style(config: Qwen3Config, dflash_config: dict[str, Any]) -> None:
    """`layer_style` (one of LAYER_STYLES, "qwen3" when absent) and `attention_k_eq_v` (values are the key
    projection's output, no `v_proj`: Gemma-4's, so only with its layers) at top level, checked; idempotent."""
    style = dflash_field(config, dflash_config, "layer_style", "qwen3")
    shared = bool(dflash_field(config, dflash_config, "attention_k_eq_v", False))
    for name in ("layer_style", "attention_k_eq_v"):
        dflash_config.pop(name, None)
    if style not in LAYER_STYLES:
        raise ValueError(f"Draft config `layer_style` must be one of {LAYER_STYLES}, got {style!r}.")
    if style != "qwen3" and is_dflash2(config):
        raise ValueError("A DFlash2 draft has Qwen3 layers; remove `layer_style`.")
    if shared and style != "gemma4":
        raise ValueError("Draft config sets `attention_k_eq_v` (Gemma-4's keys-as-values attention) on Qwen3 layers; "
                         "it goes with `layer_style: \"gemma4\"`.")
    config.layer_style, config.attention_k_eq_v = style, shared


def _check_draft_vocab(config: Qwen3Config, dflash_config: dict[str, Any]) -> None:
    """`dflash_config.draft_vocab` (optional, dflash-hf's): distinct token ids of the target's vocabulary, most
    frequent first, that the draft proposes from (its LM head over those rows only); loaders that do not know it
    ignore it."""
    draft_vocab = dflash_config.get("draft_vocab")
    if draft_vocab is None:
        return
    ids = [int(token) for token in draft_vocab] if isinstance(draft_vocab, (list, tuple)) else []
    if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= config.vocab_size:
        raise ValueError(f"Draft config `draft_vocab` must be a non-empty list of distinct token ids below vocab_size "
                         f"{config.vocab_size}; got {str(draft_vocab)[:80]}. Remove it to propose from every token.")
    dflash_config["draft_vocab"] = ids


def _normalize_draft_vocab_size(config: Qwen3Config, dflash_config: dict[str, Any]) -> None:
    """`draft_vocab_size` K (optional, as EAGLE-3 configs have it) at top level: the draft has its own LM head over K
    tokens of the target's vocabulary, mapped by its `d2t` / `t2d` buffers (docs/formats.md, "A draft's own
    vocabulary"). Refused outside 1 .. vocab_size, or next to `dflash_config.draft_vocab` (the ids come from d2t)."""
    size = dflash_field(config, dflash_config, "draft_vocab_size")
    dflash_config.pop("draft_vocab_size", None)
    config.draft_vocab_size = None if size is None else int(size)
    if size is None:
        return
    if not 1 <= config.draft_vocab_size <= config.vocab_size:
        raise ValueError(f"Draft config `draft_vocab_size` must be from 1 to vocab_size {config.vocab_size}, got "
                         f"{size}; remove it for a draft that borrows the target's LM head.")
    if dflash_config.get("draft_vocab") is not None:
        raise ValueError("Draft config has both `draft_vocab_size` (its own LM head, whose token ids are its `d2t` "
                         "weights) and `dflash_config.draft_vocab`; remove `draft_vocab`.")


def _normalize_dflash2(config: Qwen3Config, dflash_config: dict[str, Any]) -> None:
    """The DFlash2 fields at top level, each required and positive; the group size divides the hidden size."""
    for name in DFLASH2_FIELDS:
        value = dflash_field(config, dflash_config, name)
        if value is None or int(value) < 1:
            raise ValueError(f"DFlash2 draft config needs a positive `{name}` (dflash_config or top level), "
                             f"got {value}.")
        setattr(config, name, int(value))
        dflash_config.pop(name, None)
    if config.hidden_size % config.conv_group_size:
        raise ValueError(f"DFlash2 `conv_group_size` {config.conv_group_size} "
                         f"must divide hidden_size {config.hidden_size}.")


def _normalize_deepspec(config: Qwen3Config, dflash_config: dict[str, Any]) -> None:
    """DeepSpec's fields at top level, checked (docs/formats.md, "DeepSeek DeepSpec drafts"): `shifted_labels` (the
    block is [t0, MASK x (B-2)] and row k predicts position s + k + 1), `markov_rank` (0: no Markov head),
    `markov_head_type`, `enable_confidence_head`, `confidence_head_with_markov`."""
    values = {name: dflash_field(config, dflash_config, name) for name in DEEPSPEC_FIELDS}
    for name in DEEPSPEC_FIELDS:
        dflash_config.pop(name, None)
    config.shifted_labels = bool(values["shifted_labels"])
    config.markov_rank = int(values["markov_rank"] or 0)
    kind = values["markov_head_type"]
    if config.markov_rank < 0:
        raise ValueError(f"Draft config `markov_rank` must be 0 (no Markov head) or positive, "
                         f"got {config.markov_rank}.")
    if config.markov_rank and str(kind).lower() not in MARKOV_HEAD_TYPES:
        raise ValueError(f"Draft config has `markov_rank` {config.markov_rank} but `markov_head_type` {kind!r}; set "
                         f"it to one of {MARKOV_HEAD_TYPES} (DeepSpec's markov_head.py).")
    config.markov_head_type = str(kind).lower() if config.markov_rank else None
    config.enable_confidence_head = bool(values["enable_confidence_head"])
    config.confidence_head_with_markov = config.enable_confidence_head and bool(values["confidence_head_with_markov"])
    if config.confidence_head_with_markov and not config.markov_rank:
        raise ValueError("Draft config sets `confidence_head_with_markov` but has no Markov head (`markov_rank` 0); "
                         "set it to false.")
    if (config.markov_rank or config.enable_confidence_head) and not config.shifted_labels:
        raise ValueError("A Markov or confidence head needs `shifted_labels` (DeepSpec's block, whose every row is a "
                         "proposal); set `shifted_labels: true` or remove the heads.")


DEEPSPEC_FIELDS = ("shifted_labels", "markov_rank", "markov_head_type", "enable_confidence_head",
                   "confidence_head_with_markov")


def _normalize_rope(config: Qwen3Config) -> None:
    """Transformers 4.x reads `rope_theta`/`rope_scaling`: fill them from `rope_parameters` (5.x converts itself)."""
    parameters = getattr(config, "rope_parameters", None)
    if "rope_theta" not in config.__dict__ or not isinstance(parameters, dict):
        return  # Transformers 5.x: `rope_parameters` is the config's own field
    rope = read_rope_parameters(config)
    config.rope_theta = rope.pop("rope_theta")
    config.rope_scaling = None if rope["rope_type"] == "default" else rope
    del config.rope_parameters
