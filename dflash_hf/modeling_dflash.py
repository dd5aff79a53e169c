"""DFlash draft model: a small block-diffusion transformer conditioned on target hidden states.

One forward pass drafts a whole block. Each layer is a Qwen3 decoder layer with "KV injection":
its keys/values are computed over [fused target context ; block], and every block query attends
to all of them (non-causal). Embedding and LM head are borrowed from the target.

Hub remote code: this file imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .cache_dflash import DraftContextCache
from .configuration_dflash import DFLASH_HF_VERSION, REMOTE_CODE_FILES, DFlashConfig, read_rope_parameters

# The first line of every remote-code file that `save_pretrained` writes.
REMOTE_CODE_HEADER = "# Exported by dflash-hf {version}: a copy of the package's module; change the package, not this file.\n"


def without_export_header(text: str) -> str:
    """A remote-code file's text without the header line `save_pretrained` puts first (as the package has it)."""
    return text.split("\n", 1)[1] if text.startswith(REMOTE_CODE_HEADER.split("{", 1)[0]) else text


class DFlashRMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 (as Qwen3RMSNorm)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class DFlashMLP(nn.Module):
    """SwiGLU feed-forward block."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DFlashRotaryEmbedding(nn.Module):
    """Rotary position embedding at absolute positions, with the draft config's rope settings.

    Frequencies come from Transformers' rope-init table (any rope type the installed version knows); where the table
    has no default rope (5.x) it is computed here, as Transformers 5 models do. `inv_freq` is a non-persistent buffer.
    """

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        self.rope_type = read_rope_parameters(config)["rope_type"]
        known = {"default": self.compute_default_rope_parameters, **ROPE_INIT_FUNCTIONS}  # 5.x has no "default" entry
        if self.rope_type not in known:
            raise ValueError(f"Draft rope type {self.rope_type!r} is not known to this Transformers version "
                             f"(known: {', '.join(known)}).")
        self.rope_init = known[self.rope_type]
        inv_freq, self.attention_scaling = self.rope_init(config, None)  # (config, device): both versions take it
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)  # Transformers 5 re-inits from it

    @staticmethod
    def compute_default_rope_parameters(config: DFlashConfig, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, float]:
        """Inverse frequencies [head_dim // 2] of the original rope, and the cos/sin scaling (1.0)."""
        base = float(read_rope_parameters(config)["rope_theta"])
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)), 1.0

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> DFlashRotaryEmbedding:
        """Moves like any module, but the frequencies stay float32 through dtype casts (recomputed, not rounded)."""
        super()._apply(fn, recurse)
        if self.inv_freq.dtype != torch.float32 and not self.inv_freq.is_meta:
            inv_freq = self.rope_init(self.config, None)[0].to(self.inv_freq.device)
            self.inv_freq, self.original_inv_freq = inv_freq, inv_freq.clone()
        return self

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.float()  # [B, T, D/2]
        angles = torch.cat((freqs, freqs), dim=-1)  # [B, T, D]
        cos, sin = angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotates half the hidden dims of the input."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, heads, T, D] by cos/sin [B, T, D]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


def eager_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain softmax attention with GQA; returns ([B, T, heads, D], weights)."""
    groups = module.num_key_value_groups
    key = key.repeat_interleave(groups, dim=1)  # [B, heads, S, D]
    value = value.repeat_interleave(groups, dim=1)
    weights = torch.matmul(query, key.transpose(2, 3)) * scaling  # [B, heads, T, S]
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            weights = weights.masked_fill(~attention_mask, torch.finfo(weights.dtype).min)
        else:
            weights = weights + attention_mask
    weights = nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = nn.functional.dropout(weights, p=dropout, training=module.training)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return output, weights


def attention_function(implementation: str | None) -> Callable[..., tuple[torch.Tensor, Any]]:
    """Attention kernel from Transformers' backend table (sdpa, flash_attention_2, ...), or local eager."""
    if implementation in (None, "eager"):
        return eager_attention
    return ALL_ATTENTION_FUNCTIONS[implementation]


class DFlashAttention(nn.Module):
    """Non-causal attention of block queries over [context ; block] keys and values."""

    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = False
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def _keys_values(
        self, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length, _ = rows.shape
        shape = (batch, length, self.num_key_value_heads, self.head_dim)
        key = self.k_norm(self.k_proj(rows).view(shape)).transpose(1, 2)  # [B, kv_heads, T, D]
        value = self.v_proj(rows).view(shape).transpose(1, 2)
        return apply_rotary(key, cos, sin), value

    def forward(
        self,
        block_states: torch.Tensor,
        context: torch.Tensor,
        block_rope: tuple[torch.Tensor, torch.Tensor],
        context_rope: tuple[torch.Tensor, torch.Tensor],
        cache: DraftContextCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        batch, block_length, _ = block_states.shape  # block_states: [B, T, H], normalised
        query = self.q_proj(block_states).view(batch, block_length, self.num_heads, self.head_dim)
        query = apply_rotary(self.q_norm(query).transpose(1, 2), *block_rope)  # [B, heads, T, D]

        context_key, context_value = self._keys_values(context, *context_rope)  # context: [B, C, H]
        if cache is not None:
            context_key, context_value = cache.append(self.layer_idx, context_key, context_value)
        block_key, block_value = self._keys_values(block_states, *block_rope)
        key = torch.cat((context_key, block_key), dim=2)  # [B, kv_heads, C + T, D]
        value = torch.cat((context_value, block_value), dim=2)

        attend = attention_function(self.config._attn_implementation)
        output, _ = attend(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling,
            is_causal=False,
        )
        return self.o_proj(output.reshape(batch, block_length, -1))  # [B, T, H]


class DFlashDecoderLayer(nn.Module):
    """Qwen3 decoder layer whose attention also reads the fused target context."""

    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        block_rope: tuple[torch.Tensor, torch.Tensor],
        context_rope: tuple[torch.Tensor, torch.Tensor],
        cache: DraftContextCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attended = self.self_attn(
            self.input_layernorm(hidden_states), context, block_rope, context_rope, cache, attention_mask
        )
        hidden_states = hidden_states + attended
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DFlashDraftModel(PreTrainedModel):
    """DFlash draft: fuses target hidden states (`fc`, `hidden_norm`) and denoises a block of masks.

    Weight names and config keys are those of the published `z-lab/*-DFlash*` checkpoints.
    `spec_generate` runs lossless speculative decoding with a target model.
    """

    config_class = DFlashConfig
    base_model_prefix = "model"
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flash_attn_2 = True
    _supports_attention_backend = True

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__(config)
        if config.dflash_config.get("target_layer_ids") is None:
            raise ValueError("Draft config has neither `dflash_config.target_layer_ids` nor `num_target_layers`.")
        num_features = len(config.dflash_config["target_layer_ids"])
        self.fc = nn.Linear(num_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = DFlashRotaryEmbedding(config)
        self.post_init()

    @property
    def block_size(self) -> int:
        """Tokens per drafted block the draft was trained for (including the known first token)."""
        return self.config.block_size

    @property
    def target_layer_ids(self) -> list[int]:
        """Target decoder layers whose outputs feed the draft."""
        return list(self.config.dflash_config["target_layer_ids"])

    @property
    def mask_token_id(self) -> int | None:
        """Mask token id in the target vocabulary, or None when the config names it only as a string."""
        mask_token_id = self.config.dflash_config.get("mask_token_id")
        return None if mask_token_id is None else int(mask_token_id)

    def new_cache(self) -> DraftContextCache:
        """An empty context cache for one generation."""
        return DraftContextCache(len(self.layers))

    def forward(
        self,
        block_embeddings: torch.Tensor,
        target_hidden: torch.Tensor,
        block_position_ids: torch.Tensor,
        context_position_ids: torch.Tensor,
        cache: DraftContextCache | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Final normalised hidden states [B, T, H] of the block rows.

        block_embeddings [B, T, H]: target embeddings of [t0, MASK, ...]; target_hidden [B, C, L*H]:
        concatenated target layer outputs of the (new) context positions; position ids are absolute.
        attention_mask (optional, broadcastable to [B, 1, T, cached C + C + T], bool or additive) restricts what
        each block row sees (a batch hides padding and rejected columns); without it every block row sees all
        context rows and the whole block.
        """
        context = self.hidden_norm(self.fc(target_hidden.to(self.fc.weight.dtype)))  # [B, C, H]
        hidden_states = block_embeddings.to(self.fc.weight.dtype)
        block_rope = self.rotary_emb(block_position_ids, hidden_states.dtype)
        context_rope = self.rotary_emb(context_position_ids, hidden_states.dtype)
        for layer in self.layers:
            hidden_states = layer(hidden_states, context, block_rope, context_rope, cache, attention_mask)
        return self.norm(hidden_states)

    def spec_generate(self, target: nn.Module, input_ids: torch.Tensor, *args: Any, **generation_kwargs: Any) -> Any:
        """Lossless speculative decoding with `target`: ids [N, prompt + new], or `SpecGenerateOutput` with stats.

        Arguments: max_new_tokens, temperature, top_k, top_p, stop_token_ids, block_size, generator, seed, mask_token_id,
        attention_mask, streamer, pad_token_id, return_stats, acceptance, do_sample, generation_config; what is not passed
        comes from the target's generation config, as in `generate` (see `generation_dflash.spec_generate`).
        """
        # The loop depends on the model, never the other way, so it is imported here. Its modules are all named:
        # Transformers 4.57 copies a local remote-code folder's files into its module cache only when the model
        # file imports them itself.
        from .generation_dflash import spec_generate
        from .proposer_dflash import DFlashProposer  # noqa: F401
        from .sampling_dflash import commit_block  # noqa: F401
        from .target_dflash import verify_forward  # noqa: F401

        return spec_generate(self, target, input_ids, *args, **generation_kwargs)

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        """`PreTrainedModel.from_pretrained`, refusing a checkpoint whose weights do not match the draft one for one."""
        wants_loading_info = kwargs.pop("output_loading_info", False)
        try:
            model, loading_info = super().from_pretrained(*args, output_loading_info=True, **kwargs)
        except RuntimeError as error:  # Transformers refuses weights of other shapes with a RuntimeError
            if "size" not in str(error):
                raise
            raise ValueError(f"The checkpoint's weights do not match a DFlash draft of this config: {error}") from error
        problems = {key: sorted(map(str, value)) for key, value in loading_info.items()
                    if key in ("missing_keys", "unexpected_keys", "mismatched_keys") and value}
        if problems:
            details = "; ".join(f"{key}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}"
                                for key, names in problems.items())
            raise ValueError(f"The checkpoint's weights do not match a DFlash draft of this config ({details}). "
                             "Is it a DFlash draft in the published layout (fc, hidden_norm, layers.*, norm)?")
        return (model, loading_info) if wants_loading_info else model

    def save_pretrained(self, save_directory: str | Path, *args: Any, **kwargs: Any) -> None:
        """`PreTrainedModel.save_pretrained`, recording the dflash-hf version in config.json and the remote-code files."""
        self.config.dflash_hf_version = DFLASH_HF_VERSION
        super().save_pretrained(save_directory, *args, **kwargs)
        header = REMOTE_CODE_HEADER.format(version=DFLASH_HF_VERSION)
        for name in REMOTE_CODE_FILES:
            path = Path(save_directory) / name
            if path.exists():
                path.write_text(header + without_export_header(path.read_text(encoding="utf-8")), encoding="utf-8")


DFlashConfig.register_for_auto_class()
DFlashDraftModel.register_for_auto_class("AutoModel")
