"""The support matrix in code: which target families run, and how. Every per-family table of the package is here;
the modules that act on a family read it from here (README, "Supported targets").

- Recurrent layers: the layer-type words and model types that mark a cache holding a recurrent state
  (`support_dflash.recurrent_layers`), the hybrid families whose states `recurrent_dflash` rolls back, and the
  recurrent families refused with the reason (`support_dflash.target_refusal` gives it).
- Logits: the config settings with which a family's forward post-processes its LM head's logits
  (`target_dflash.logit_processing`).

Hub remote code: imports nothing beyond the standard library.
"""

from __future__ import annotations

# Words in a layer type (`layer_types`, `layers_block_type`) that mark a layer whose cache is a recurrent state
# (linear attention, gated delta rule, state space, short convolution) rather than keys and values per position.
RECURRENT_LAYER_WORDS = ("linear", "mamba", "ssm", "conv", "recurrent", "rwkv", "delta", "lstm", "hybrid", "retention")
# Architectures with such layers whose config may not name them per layer: model_type -> the layers' type.
RECURRENT_MODEL_TYPES = {
    "mamba": "mamba", "mamba2": "mamba", "falcon_mamba": "mamba", "jamba": "mamba", "bamba": "mamba",
    "zamba": "mamba", "zamba2": "mamba", "falcon_h1": "mamba", "granitemoehybrid": "mamba", "nemotron_h": "mamba",
    "rwkv": "rwkv", "xlstm": "mlstm", "recurrent_gemma": "recurrent", "lfm2": "conv", "lfm2_moe": "conv",
    "qwen3_next": "linear_attention", "qwen3_5": "linear_attention", "qwen3_5_moe": "linear_attention",
    "kimi_linear": "linear_attention", "minimax": "linear_attention", "olmo_hybrid": "linear_attention",
    "bailing_hybrid": "linear_attention",
}


# Hybrid families whose recurrent layers `recurrent_dflash` rolls back (tested exact, tests/test_hybrid_targets.py),
# on the Transformers versions whose cache API holds them as linear-attention cache layers (5.x): Gated DeltaNet
# (Qwen3-Next, Qwen3.5/3.6, OLMo-Hybrid), Kimi Delta Attention, Mamba-2 (Nemotron-H, Granite 4 hybrid), LFM2's
# short convolutions.
ROLLBACK_MODEL_TYPES = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "olmo_hybrid", "kimi_linear", "nemotron_h",
                        "granitemoehybrid", "lfm2", "lfm2_moe")
HYBRID_TRANSFORMERS = "transformers 5.25 (the version dflash-hf tests hybrid targets with)"
# Recurrent families that stay refused, and why (found on Transformers 5.24 with tiny models of each).
RECURRENT_REFUSALS = {
    "jamba": "its multi-token Mamba path starts the SSM state from zero instead of the cached state, so a verified "
             "block cannot continue from the cache",
    "bamba": "a multi-token forward over a cache numbers its positions from 0 unless told otherwise, which the "
             "loop does not do for every verify",
    "falcon_h1": "each layer keeps attention keys and a Mamba state in one cache layer, which the rollback does not "
                 "split",
    "minimax": "it keeps its linear-attention states in its own cache class (MiniMaxCache), which cannot be cut back",
}


# Config settings with which a target's forward post-processes the head's logits (Gemma's soft-capping, Cohere's and
# Granite's scales, muP multipliers): soft caps act when set and non-zero, scales when set and not 1.
LOGIT_SOFT_CAPS = ("final_logit_softcapping", "output_logit_soft_cap", "logits_soft_cap")
LOGIT_SCALES = ("logit_scale", "logits_scaling", "lm_head_multiplier", "output_multiplier",
                "logits_mup_width_multiplier")
