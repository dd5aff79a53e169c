"""DFlash draft model: a small block-diffusion transformer conditioned on target hidden states.

One forward pass drafts a whole block. Each layer is a Qwen3 decoder layer with "KV injection":
its keys/values are computed over [fused target context ; block], and every block query attends
to all of them (non-causal), or causally and/or within a sliding window where the config's
`layer_types` / `is_causal` say so; with `layer_style` "gemma4" each layer is a Gemma-4 one instead (DeepSpec's
Gemma-4 drafts, docs/formats.md). Embedding and LM head are borrowed from the target, or the draft
has its own LM head over K tokens of the target's vocabulary (`draft_vocab_size`, with `d2t` / `t2d`).
`DFlash2DraftModel` adds dynamic causal convolutions around each sub-layer and a candidate
selector over the head's top-K (docs/formats.md).

Hub remote code: this file imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PreTrainedModel
from transformers.activations import ACT2FN
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .backends_dflash import TargetBackend  # noqa: F401

# Transformers 4.57 copies, from a local folder loaded with trust_remote_code, only the files that the loaded module
# imports itself, not what those import: every remote-code module the model needs is imported here (the ones marked
# F401 for that alone), so that an exported folder loads there too; tests/test_structure.py checks none is missing.
from .cache_dflash import CacheColumns  # noqa: F401
from .checkpoint_dflash import DFlashCheckpointMixin
from .configuration_dflash import (
    DEEPSPEC_BORROWED_WEIGHTS,
    DFlashConfig,
    is_dflash2,
    layer_attention,
    read_rope_parameters,
)
from .custom_generate_dflash import generate as custom_generate  # noqa: F401
from .devices_dflash import MASKED_ATTENTION, materialized_weight, target_device  # noqa: F401
from .draft_backends_dflash import DraftBackend, DraftContextCache  # noqa: F401
from .families_dflash import ROLLBACK_MODEL_TYPES  # noqa: F401
from .generation_dflash import DFlashGenerationMixin
from .kernels_dflash import cpu_kernels  # noqa: F401
from .masks_dflash import VerifyLayout  # noqa: F401
from .mixers_dflash import rollback_mixers  # noqa: F401
from .processors_dflash import PositionRules  # noqa: F401
from .proposer_dflash import DFlashProposer  # noqa: F401
from .recurrent_dflash import RecurrentStates  # noqa: F401
from .sampling_dflash import process_logits  # noqa: F401
from .settings_dflash import resolve_settings  # noqa: F401
from .static_dflash import StaticBackend  # noqa: F401
from .static_recurrent_dflash import StaticRecurrentRollback  # noqa: F401
from .steps_dflash import ChainStep  # noqa: F401
from .support_dflash import target_refusal  # noqa: F401
from .target_dflash import verify_forward  # noqa: F401
from .tokens_dflash import generation_tokens  # noqa: F401
from .tree_dflash import build_trees  # noqa: F401
from .validation_dflash import check_target  # noqa: F401
from .versions_dflash import cache_keyword  # noqa: F401

# Draft dtypes whose range cannot hold target features (Qwen3 has hidden-state outliers over float16's 65,504): the
# draft fuses its context in float32 there (`DFlashDraftModel.fuse_context`). bfloat16 has float32's exponent range.
NARROW_RANGE_DTYPES = (torch.float16,)


class DFlashRMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32: weighted in the input's dtype (as Qwen3RMSNorm), or with `style`
    "gemma4" weighted in float32 (as Gemma4RMSNorm), there also without a weight (`with_weight` False)."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, style: str = "qwen3", with_weight: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size)) if with_weight else None
        self.variance_epsilon = eps
        self.gemma4 = style == "gemma4"

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        if self.gemma4:
            hidden_states = hidden_states * torch.pow(variance + self.variance_epsilon, -0.5)
            weighted = hidden_states if self.weight is None else hidden_states * self.weight.float()
            return weighted.to(input_dtype)
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
        self.register_buffer("original_inv_freq", inv_freq.clone(),
                             persistent=False)  # Transformers 5 re-inits from it

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


def attention_function(implementation: str | None, masked: bool = False) -> Callable[..., tuple[torch.Tensor, Any]]:
    """Attention kernel from Transformers' backend table (sdpa, flash_attention_2, ...), or local eager.

    A masked call (padding, holes, causal or sliding layers, training's block mask) under a backend that would read
    the 4-D mask as a 2-D padding mask (flash-attention, flex, ...) runs on sdpa instead; unmasked calls keep it.
    """
    if masked and implementation not in (None, *MASKED_ATTENTION):
        implementation = "sdpa"
    if implementation in (None, "eager"):
        return eager_attention
    return ALL_ATTENTION_FUNCTIONS[implementation]


def layer_attention_mask(
    base_mask: torch.Tensor | None,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    causal: bool,
    window: int | None,
) -> torch.Tensor | None:
    """Bool mask [N, 1, T, S] of one layer kind (docs/formats.md), over key positions [N, S] of [context ; block].

    causal: a query sees keys at positions <= its own; window w: also qpos - kpos < w, and kpos - qpos < w when not
    causal. Positions are absolute, so a row's mask does not depend on the holes a batch leaves in the cache;
    `base_mask` (bool or additive, broadcastable to [N, 1, T, S]) hides padding and holes. None: no restriction.
    """
    if not causal and window is None:
        return base_mask
    query = query_positions[:, None, :, None]  # [N, 1, T, 1]
    key = key_positions[:, None, None, :]  # [N, 1, 1, S]
    allowed = key <= query if causal else torch.ones_like(key >= query)
    if window is not None:
        allowed = allowed & (query - key < window)
        if not causal:
            allowed = allowed & (key - query < window)
    if base_mask is None:
        return allowed
    if base_mask.dtype != torch.bool:  # additive: 0 where visible, a large negative number where hidden
        base_mask = base_mask > torch.finfo(base_mask.dtype).min / 2
    return allowed & base_mask


class TiledMask(Protocol):
    """An attention mask that runs the attention itself, tile by tile over the query rows, so that only the keys each
    tile sees are computed: training's (`TiledBlockMask`, dflash_hf/training/objective.py). The model only passes it
    on, to each layer restricted by its kind; a call with a cache never takes one."""

    def restricted(self, query_positions: torch.Tensor, key_positions: torch.Tensor, causal: bool,
                   window: int | None) -> TiledMask:
        """The same mask with one layer kind's causal / sliding restriction (`layer_attention_mask`) added, over
        query positions [N, T] and key positions [N, C + T]."""

    def attend(self, attention: Callable[..., tuple[torch.Tensor, Any]], module: nn.Module, query: torch.Tensor,
               key: torch.Tensor, value: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """`attention` over query [N, heads, T, D] and key, value [N, kv_heads, C + T, D]; the output
        [N, T, heads, D] in row order."""


def is_tiled(attention_mask: torch.Tensor | TiledMask | None) -> bool:
    """Whether `attention_mask` is a `TiledMask` (not a tensor, not None)."""
    return attention_mask is not None and not isinstance(attention_mask, torch.Tensor)


class DFlashAttention(nn.Module):
    """Attention of block queries over [context ; block] keys and values (non-causal unless the layer says so)."""

    def __init__(self, config: DFlashConfig, layer_idx: int) -> None:
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        gemma4 = config.layer_style == "gemma4"
        self.scaling = 1.0 if gemma4 else self.head_dim**-0.5  # Gemma-4: the q and k norms set the scale
        self.attention_dropout = config.attention_dropout
        self.is_causal = False  # causal and sliding layers get their restriction from the mask (queries are a block)
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        # keys as values (`attention_k_eq_v`, Gemma-4): the values are the key projection's output, value-normed
        self.v_proj = None if config.attention_k_eq_v else nn.Linear(
            config.hidden_size, self.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps, style=config.layer_style)
        self.k_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps, style=config.layer_style)
        self.v_norm = DFlashRMSNorm(self.head_dim, eps=config.rms_norm_eps, style=config.layer_style,
                                    with_weight=False) if gemma4 else None

    def _keys_values(
        self, rows: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        batch, length, _ = rows.shape
        shape = (batch, length, self.num_key_value_heads, self.head_dim)
        projected = self.k_proj(rows).view(shape)
        key = self.k_norm(projected).transpose(1, 2)  # [B, kv_heads, T, D]
        value = projected if self.v_proj is None else self.v_proj(rows).view(shape)
        value = (value if self.v_norm is None else self.v_norm(value)).transpose(1, 2)
        return apply_rotary(key, cos, sin), value

    def forward(
        self,
        block_states: torch.Tensor,
        context: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: DraftContextCache | None = None,
        attention_mask: torch.Tensor | TiledMask | None = None,
    ) -> torch.Tensor:
        """Attention of the block rows [B, T, H] (normalised) over the context rows [B, C, H] (and the cached
        ones) and the block; `rope`: cos and sin [B, C + T, D] of the context rows, then the block's."""
        batch, block_length, _ = block_states.shape
        context_length = context.shape[1]
        cos, sin = rope
        query = self.q_proj(block_states).view(batch, block_length, self.num_heads, self.head_dim)
        query = apply_rotary(self.q_norm(query).transpose(1, 2), cos[:, context_length:],
                             sin[:, context_length:])  # [B, heads, T, D]

        # one projection, norm and rotation of the context and block rows together: [B, kv_heads, C + T, D]
        keys, values = self._keys_values(torch.cat((context, block_states), dim=1), cos, sin)
        context_key, block_key = keys.split((context_length, block_length), dim=2)
        context_value, block_value = values.split((context_length, block_length), dim=2)
        if cache is not None:  # [B, kv_heads, cached C + C + T, D], written in place
            key, value = cache.attention_inputs(self.layer_idx, context_key, context_value, block_key, block_value)
        else:
            key, value = keys, values

        attend = attention_function(self.config._attn_implementation, masked=attention_mask is not None)
        options = dict(dropout=self.attention_dropout if self.training else 0.0, scaling=self.scaling, is_causal=False)
        if is_tiled(attention_mask):  # training: only the keys each tile sees
            if cache is not None:
                raise ValueError("A TiledMask (training's TiledBlockMask) is a training mask: pass it without a "
                                 "cache.")
            output = attention_mask.attend(attend, self, query, key, value, **options)
        else:
            output, _ = attend(self, query, key, value, attention_mask, **options)
        return self.o_proj(output.reshape(batch, block_length, -1))  # [B, T, H]


class DFlashDynamicConvolution(nn.Module):
    """DFlash2's grouped dynamic causal convolution: `prepare` before a sub-layer, `finish` after it.

    Causal along each block only: a block's first rows see no earlier rows (zeros), never another block's.
    """

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.kernel_size, self.group_size = config.conv_kernel_size, config.conv_group_size
        self.num_groups = config.hidden_size // config.conv_group_size  # H / g
        base_kernel = torch.zeros(2, self.kernel_size, config.hidden_size)
        base_kernel[:, 0] = 1.0  # starts as the identity
        self.base_kernel = nn.Parameter(base_kernel)  # [2, k, H]
        self.kernel_projection = nn.Linear(config.hidden_size, 2 * self.kernel_size * self.num_groups, bias=False)

    def convolve(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor, block_length: int) -> torch.Tensor:
        """x [N, T, H] with T a whole number of blocks; dynamic [N, T, k, H/g]; base [k, H] -> [N, T, H]."""
        batch, length, hidden_size = x.shape
        rows = x.reshape(-1, block_length, self.num_groups, self.group_size)  # [N * blocks, b, H/g, g]
        dynamic = dynamic.reshape(-1, block_length, self.kernel_size, self.num_groups)  # [N * blocks, b, k, H/g]
        output = torch.zeros_like(rows)
        for offset in range(min(self.kernel_size, block_length)):
            shifted = F.pad(rows[:, : block_length - offset], (0, 0, 0, 0, offset, 0))  # row t holds x[t - offset]
            weight = base[offset].view(self.num_groups, self.group_size) + dynamic[:, :, offset, :, None]
            output = output + weight * shifted
        return output.view(batch, length, hidden_size)

    def prepare(self, x: torch.Tensor, block_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the sub-layer's input, the kernel `finish` uses) for normalised rows x [N, T, H]."""
        kernels = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.num_groups)
        return self.convolve(x, kernels[..., 0, :, :], self.base_kernel[0], block_length), kernels[..., 1, :, :]

    def finish(self, y: torch.Tensor, kernel: torch.Tensor, block_length: int) -> torch.Tensor:
        """The sub-layer's output y [N, T, H] convolved with the kernel `prepare` kept."""
        return self.convolve(y, kernel, self.base_kernel[1], block_length)


class DFlashCandidateSelector(nn.Module):
    """DFlash2's selector: walks the block choosing among the head's top-K, scored against the previous choice.

    The codebooks are plain parameters (the published safetensors name them without `.weight`).
    """

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.top_k = config.selector_top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(config.vocab_size, config.selector_rank)
                                                 * config.initializer_range)
        self.successor_codebook = nn.Parameter(torch.randn(config.vocab_size, config.selector_rank)
                                               * config.initializer_range)
        self.hidden_projection = nn.Linear(config.hidden_size, config.selector_rank, bias=False)

    def transitions(self, logits: torch.Tensor, hidden_states: torch.Tensor, anchor_tokens: torch.Tensor
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Each proposal position's K candidates [N, P, K] (the head's top-K) and the score of candidate j at
        position p after candidate i at position p - 1, [N, P, K, K] (position 0: after the anchor token [N], the
        same for every i); over logits [N, P, V] and hidden states [N, P, H] of the P proposal positions."""
        unary, candidates = logits.float().topk(min(self.top_k, logits.shape[-1]), dim=-1)  # [N, P, K]
        projected = self.hidden_projection(hidden_states.to(self.hidden_projection.weight.dtype)).float()  # [N, P, r]
        successors = F.embedding(candidates, self.successor_codebook).float()  # [N, P, K, r]
        anchors = anchor_tokens[:, None, None].expand(-1, 1, candidates.shape[2])  # [N, 1, K]
        predecessors = torch.cat((anchors, candidates[:, :-1]), dim=1)  # [N, P, K]: what may stand before position p
        queries = F.embedding(predecessors, self.predecessor_codebook).float() * projected[:, :, None]  # [N, P, K, r]
        return candidates, unary[:, :, None, :] + torch.einsum("npir,npjr->npij", queries, successors)

    def walk(
        self,
        logits: torch.Tensor,
        hidden_states: torch.Tensor,
        anchor_tokens: torch.Tensor,
        choose: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """Chosen tokens [N, P] over logits [N, P, V] and hidden states [N, P, H] of the P proposal positions.

        `choose(scores [N, K], candidate_ids [N, K])` returns the index [N] of each row's choice among its K
        candidates at one position (greedy: the argmax); the first predecessor is the anchor token [N].
        """
        return self.path(*self.transitions(logits, hidden_states, anchor_tokens), choose)

    @staticmethod
    def path(candidates: torch.Tensor, scores: torch.Tensor,
             choose: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """Chosen tokens [N, P] along candidates [N, P, K] and their `transitions` scores [N, P, K, K], each position
        chosen by `choose` (see `walk`) among the scores after the previous choice."""
        previous = torch.zeros(candidates.shape[0], dtype=torch.long, device=candidates.device)  # position 0: any row
        chosen = []
        for position in range(candidates.shape[1]):
            row_scores = scores[:, position].gather(1, previous[:, None, None].expand(-1, 1, scores.shape[3]))
            previous = choose(row_scores[:, 0], candidates[:, position])  # [N]
            chosen.append(candidates[:, position].gather(1, previous[:, None]).squeeze(1))
        return torch.stack(chosen, dim=1)


class DFlashMarkovHead(nn.Module):
    """DSpark's Markov head (DeepSpec `markov_head.py`): a rank-r bias on a proposal position's logits from the token
    before it (the anchor for the first), added after the LM head. Weight names as DeepSpec saves them.

    vanilla: bias = W2(W1[prev]); gated: W2(sigmoid(gate_proj([h; W1[prev]])) * W1[prev]); rnn: a state s (zero at
    each block's first position) with [s; W1[prev]; h] -> joint_proj -> gate g, candidate c, output o;
    s' = g * s + (1 - g) * tanh(c), bias = W2(tanh(o)). h: the position's final (normalised) hidden state.
    """

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        rank, hidden_size = config.markov_rank, config.hidden_size
        self.kind = config.markov_head_type
        self.markov_w1 = nn.Embedding(config.vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, config.vocab_size, bias=False)
        self.gate_proj = nn.Linear(hidden_size + rank, rank) if self.kind == "gated" else None
        self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank) if self.kind == "rnn" else None

    def initial_state(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """The state before a block's first position, for rows of hidden states [M, H]: zeros [M, r] (rnn), else
        None (the other kinds keep none)."""
        if self.joint_proj is None:
            return None
        return hidden_states.new_zeros(hidden_states.shape[0], self.markov_w1.embedding_dim,
                                       dtype=self.markov_w1.weight.dtype)

    def previous_embedding(self, previous_tokens: torch.Tensor) -> torch.Tensor:
        """W1[prev] [M, r] of the tokens before the positions [M]."""
        return self.markov_w1(previous_tokens.long())

    def step(self, previous_tokens: torch.Tensor, hidden_states: torch.Tensor, state: torch.Tensor | None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(bias [M, V], the state after this position) for M positions given the tokens before them [M], their
        hidden states [M, H] and the state before them (`initial_state`, or the last step's)."""
        latent, state = self.latent(previous_tokens, hidden_states, state)
        return self.markov_w2(latent), state

    def latent(self, previous_tokens: torch.Tensor, hidden_states: torch.Tensor, state: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(W2's input [M, r], the state after this position): `step` before its last projection, so that training
        can project a few rows at a time (the bias is `markov_w2` of it)."""
        previous = self.previous_embedding(previous_tokens)  # [M, r]
        hidden_states = hidden_states.to(previous.dtype)
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat((hidden_states, previous), dim=-1)))
            return gate.to(previous.dtype) * previous, None
        if self.kind == "rnn":
            gate, candidate, output = self.joint_proj(torch.cat((state, previous, hidden_states), dim=-1)).chunk(3, -1)
            gate = torch.sigmoid(gate)
            state = gate * state + (1.0 - gate) * torch.tanh(candidate)
            return torch.tanh(output), state
        return previous, None


class DFlashConfidenceHead(nn.Module):
    """DSpark's confidence head (DeepSpec `AcceptRatePredictor`): one logit per proposal position from its hidden
    state, and with `confidence_head_with_markov` also the Markov head's W1 of the token before it."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.with_markov = config.confidence_head_with_markov
        self.proj = nn.Linear(config.hidden_size + (config.markov_rank if self.with_markov else 0), 1)

    def forward(self, hidden_states: torch.Tensor, previous_embedding: torch.Tensor | None) -> torch.Tensor:
        """Logits [M] (float32) of hidden states [M, H] and W1[prev] [M, r] (read only `with_markov`)."""
        features = hidden_states.to(self.proj.weight.dtype)
        if self.with_markov:
            features = torch.cat((features, previous_embedding.to(features.dtype)), dim=-1)
        return self.proj(features).squeeze(-1).float()


class DFlashDecoderLayer(GradientCheckpointingLayer):
    """Qwen3 decoder layer whose attention also reads the fused target context (DFlash2: convolutions around both).
    With `layer_style` "gemma4", Gemma-4's layer instead (DeepSpec's Gemma-4 draft): `post_attention_layernorm` on the
    attention's output, `pre_feedforward_layernorm` and `post_feedforward_layernorm` around the MLP, and the output
    times the `layer_scalar` buffer. Under activation checkpointing (`gradient_checkpointing_enable`, training) the
    backward recomputes it."""

    def __init__(self, config: DFlashConfig, layer_idx: int, with_convolutions: bool = False) -> None:
        super().__init__()
        self.attention_kind = layer_attention(config, layer_idx)  # (causal, sliding window or None)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = DFlashMLP(config)
        size, eps, style = config.hidden_size, config.rms_norm_eps, config.layer_style
        self.input_layernorm = DFlashRMSNorm(size, eps=eps, style=style)
        self.post_attention_layernorm = DFlashRMSNorm(size, eps=eps, style=style)
        self.gemma4 = style == "gemma4"
        if self.gemma4:
            self.pre_feedforward_layernorm = DFlashRMSNorm(size, eps=eps, style=style)
            self.post_feedforward_layernorm = DFlashRMSNorm(size, eps=eps, style=style)
            self.register_buffer("layer_scalar", torch.ones(1))  # saved with the weights, as Gemma-4 layers save it
        self.attention_conv = DFlashDynamicConvolution(config) if with_convolutions else None
        self.mlp_conv = DFlashDynamicConvolution(config) if with_convolutions else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: DraftContextCache | None = None,
        attention_mask: torch.Tensor | TiledMask | None = None,
        block_length: int | None = None,
    ) -> torch.Tensor:
        block_length = block_length or hidden_states.shape[1]
        attend = lambda rows: self.self_attn(rows, context, rope, cache, attention_mask)  # noqa: E731
        if self.gemma4:
            hidden_states = hidden_states + self.post_attention_layernorm(attend(self.input_layernorm(hidden_states)))
            hidden_states = hidden_states + self.post_feedforward_layernorm(
                self.mlp(self.pre_feedforward_layernorm(hidden_states)))
            return hidden_states * self.layer_scalar
        hidden_states = hidden_states + self._around(attend, self.attention_conv, self.input_layernorm(hidden_states),
                                                     block_length)
        return hidden_states + self._around(self.mlp, self.mlp_conv, self.post_attention_layernorm(hidden_states),
                                            block_length)

    @staticmethod
    def _around(sublayer: Callable[[torch.Tensor], torch.Tensor], convolution: DFlashDynamicConvolution | None,
                rows: torch.Tensor, block_length: int) -> torch.Tensor:
        """The sub-layer on normalised rows, inside the DFlash2 convolution when there is one."""
        if convolution is None:
            return sublayer(rows)
        prepared, kernel = convolution.prepare(rows, block_length)
        return convolution.finish(sublayer(prepared), kernel, block_length)


class DFlashDraftModel(DFlashCheckpointMixin, PreTrainedModel, DFlashGenerationMixin):
    """DFlash draft: fuses target hidden states (`fc`, `hidden_norm`) and denoises a block of masks.

    Weight names and config keys are those of the published `z-lab/*-DFlash*` checkpoints (docs/formats.md).
    `spec_generate` (from `DFlashGenerationMixin`) runs lossless speculative decoding with a target model;
    `from_pretrained` and `save_pretrained` (from `DFlashCheckpointMixin`) are strict and versioned.
    """

    config_class = DFlashConfig
    with_dflash2_parts = False  # DFlash2DraftModel: convolutions around each sub-layer and a candidate selector
    base_model_prefix = "model"
    _no_split_modules = ["DFlashDecoderLayer"]
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flash_attn_2 = True
    _supports_attention_backend = True
    supports_gradient_checkpointing = True  # its DFlashDecoderLayers (docs/training.md, "Memory")
    main_input_name = "block_embeddings"  # no input ids: Transformers then asks no gradient of an input embedding

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__(config)
        if config.dflash_config.get("target_layer_ids") is None:
            raise ValueError("Draft config has neither `dflash_config.target_layer_ids` nor `num_target_layers`.")
        if is_dflash2(config) != self.with_dflash2_parts:
            raise ValueError(f"The config describes {config.architectures}; load it with "
                             f"{'DFlash2DraftModel' if is_dflash2(config) else 'DFlashDraftModel'} "
                             "(DFlashDraftModel.from_pretrained picks the class itself).")
        num_features = len(config.dflash_config["target_layer_ids"])
        self.fc = nn.Linear(num_features * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps, style=config.layer_style)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i, with_convolutions=self.with_dflash2_parts)
                                    for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(config.hidden_size, eps=config.rms_norm_eps, style=config.layer_style)
        self.rotary_emb = DFlashRotaryEmbedding(config)
        self.candidate_selector = DFlashCandidateSelector(config) if self.with_dflash2_parts else None
        # DeepSpec's DSpark heads (docs/formats.md, "DeepSeek DeepSpec drafts"); None where the config has none
        self.markov_head = DFlashMarkovHead(config) if config.markov_rank else None
        self.confidence_head = DFlashConfidenceHead(config) if config.enable_confidence_head else None
        if config.shifted_labels:  # DeepSpec's frozen copies of the target's embedding and head: left unread, quietly
            self._keys_to_ignore_on_load_unexpected = [f"^{re.escape(name)}$" for name in DEEPSPEC_BORROWED_WEIGHTS]
        self.lm_head = None  # None: the target's LM head; else the draft's own over its K tokens, mapped by d2t / t2d
        if config.draft_vocab_size is not None:
            self.lm_head = nn.Linear(config.hidden_size, config.draft_vocab_size, bias=False)
            # d2t [K] int64: draft id k is target id k + d2t[k]; t2d [V] bool: which target ids the draft has.
            # Until `set_draft_vocabulary`: the first K ids.
            self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.long))
            self.register_buffer("t2d", torch.arange(config.vocab_size) < config.draft_vocab_size)
        self.post_init()

    @property
    def block_size(self) -> int:
        """Tokens per drafted block the draft was trained for (including the known first token)."""
        return self.config.block_size

    @property
    def shifted_labels(self) -> bool:
        """Whether the block's every row is a proposal (DeepSpec): the block is [t0, MASK x (B-2)] at positions
        s .. s+B-2 and row k predicts position s+k+1; else row j (1 .. B-1) of [t0, MASK x (B-1)] predicts s+j."""
        return self.config.shifted_labels

    @property
    def target_layer_ids(self) -> list[int]:
        """Target decoder layers whose outputs feed the draft."""
        return list(self.config.dflash_config["target_layer_ids"])

    @property
    def mask_token_id(self) -> int | None:
        """Mask token id in the target vocabulary, or None when the config names it only as a string."""
        mask_token_id = self.config.dflash_config.get("mask_token_id")
        return None if mask_token_id is None else int(mask_token_id)

    @property
    def draft_vocab(self) -> list[int] | None:
        """Token ids the draft proposes from, or None: every token. With its own LM head: the target ids of its K
        rows (`arange(K) + d2t`, ascending); else `dflash_config.draft_vocab` (most frequent first), if set."""
        if self.lm_head is None:
            return self.config.dflash_config.get("draft_vocab")
        ids = torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t  # [K]
        ascending = bool((ids.diff() > 0).all()) and 0 <= int(ids[0]) and int(ids[-1]) < len(self.t2d)
        if not ascending or int(self.t2d.sum()) != len(ids) or not bool(self.t2d[ids].all()):
            raise ValueError("The draft's `d2t` and `t2d` do not describe one vocabulary (d2t: ascending target ids "
                             "below vocab_size, t2d: True exactly at them); export the draft again "
                             "(docs/formats.md, \"A draft's own vocabulary\").")
        return ids.tolist()

    @torch.no_grad()
    def set_draft_vocabulary(self, token_ids: list[int] | torch.Tensor) -> None:
        """Make the distinct target ids `token_ids` (K of them, any order) the vocabulary of the draft's own LM head:
        its rows are those ids in ascending order, so `d2t` and `t2d` describe them (as EAGLE-3 drafts store them)."""
        if self.lm_head is None:
            raise ValueError("This draft has no LM head of its own: build it with config `draft_vocab_size`.")
        ids = torch.as_tensor(token_ids, dtype=torch.long).flatten().sort().values.to(self.d2t.device)  # [K]
        if len(ids) != len(self.d2t) or len(ids.unique()) != len(ids) or int(ids[0]) < 0 \
                or int(ids[-1]) >= len(self.t2d):
            raise ValueError(f"The draft's vocabulary needs {len(self.d2t)} distinct ids from 0 to "
                             f"{len(self.t2d) - 1}, got {ids.tolist()[:8]}{' ...' if len(ids) > 8 else ''} "
                             f"({len(ids)} ids, {len(ids.unique())} distinct).")
        self.d2t.copy_(ids - torch.arange(len(ids), device=ids.device))
        self.t2d.zero_()
        self.t2d[ids] = True

    def new_cache(self) -> DraftContextCache:
        """An empty context cache for one generation."""
        return DraftContextCache(len(self.layers))

    def get_input_embeddings(self) -> None:
        """None: the draft has no embedding of its own (it reads the target's, `embed_block`), so code that handles
        a model's embedding (Accelerate's FSDP wrapping, Transformers' helpers) leaves it alone."""
        return None

    def embed_block(self, block_ids: torch.Tensor, embedding_weight: torch.Tensor) -> torch.Tensor:
        """Block inputs [N, T, H]: the raw lookup of ids [N, T] in the target's embedding weight, times
        `input_embedding_scale` (never the target embedding module's own scaling); with Gemma-4 layers the scale is
        first rounded to the weight's dtype, as Gemma's embedding module (DeepSpec's Gemma-4 draft's) rounds it."""
        embeddings = F.embedding(block_ids, embedding_weight)
        scale = self.config.input_embedding_scale
        if scale == 1.0:
            return embeddings
        if self.config.layer_style == "gemma4":
            return embeddings * torch.tensor(scale, dtype=embeddings.dtype, device=embeddings.device)
        return embeddings * scale

    def scale_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The draft's logits from its LM head's output (the target's, or its own): times `output_multiplier`, then
        soft-capped if set."""
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def forward(
        self,
        block_embeddings: torch.Tensor,
        target_hidden: torch.Tensor,
        block_position_ids: torch.Tensor,
        context_position_ids: torch.Tensor,
        cache: DraftContextCache | None = None,
        attention_mask: torch.Tensor | TiledMask | None = None,
        block_length: int | None = None,
    ) -> torch.Tensor:
        """Final normalised hidden states [B, T, H] of the block rows.

        block_embeddings [B, T, H]: `embed_block` of [t0, MASK, ...]; target_hidden [B, C, L*H]: concatenated target
        layer outputs of the (new) context positions; position ids are absolute. attention_mask (optional,
        broadcastable to [B, 1, T, cached C + C + T], bool or additive) hides padding, rejected columns, or (training)
        other blocks, or is a `TiledMask` (training's `TiledBlockMask`, no cache); each layer adds its causal /
        sliding-window restriction by position. block_length: rows per block when T holds several blocks (training;
        DFlash2's convolutions stay inside each block), else T.
        """
        context = self.fuse_context(target_hidden)  # [B, C, H]
        hidden_states = block_embeddings.to(self.fc.weight.dtype)
        context_position_ids = context_position_ids.expand(block_position_ids.shape[0], -1)
        # cos, sin [B, C + T, D] of the new context rows, then the block's: computed once for every layer
        rope = self.rotary_emb(torch.cat((context_position_ids, block_position_ids), 1), hidden_states.dtype)
        if cache is not None:
            context_position_ids = cache.append_positions(context_position_ids)
        masks = self._layer_masks(attention_mask, block_position_ids,
                                  torch.cat((context_position_ids, block_position_ids), 1))
        for layer in self.layers:
            hidden_states = layer(hidden_states, context, rope, cache, masks[layer.attention_kind],
                                  block_length)
        return self.norm(hidden_states)

    def fuse_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Fused context `hidden_norm(fc(features))` [B, C, H] in the draft's dtype, of features [B, C, L*H].

        A float16 draft (`NARROW_RANGE_DTYPES`) projects and normalises in float32 and casts the normalised rows
        back, so that features beyond its range stay finite; other drafts compute in their own dtype, as before.
        """
        dtype = self.fc.weight.dtype
        if dtype not in NARROW_RANGE_DTYPES:
            return self.hidden_norm(self.fc(target_hidden.to(dtype)))
        with materialized_weight(self.fc) as weight:  # an offloaded draft's weight is loaded meanwhile
            projected = F.linear(target_hidden.float(), weight.float())  # [B, C, H], float32
        return self.hidden_norm(projected).to(dtype)  # normalised in float32 (the norm keeps its input's dtype)

    def _layer_masks(self, attention_mask: torch.Tensor | TiledMask | None, query_positions: torch.Tensor,
                     key_positions: torch.Tensor
                     ) -> dict[tuple[bool, int | None], torch.Tensor | TiledMask | None]:
        """The attention mask of each layer kind (causal, window) present in the draft."""
        kinds = {layer.attention_kind for layer in self.layers}
        if is_tiled(attention_mask):
            return {kind: attention_mask.restricted(query_positions, key_positions, *kind) for kind in kinds}
        return {kind: layer_attention_mask(attention_mask, query_positions, key_positions, *kind) for kind in kinds}

    @classmethod
    def checkpoint_class(cls, config: DFlashConfig | dict[str, Any]) -> type[DFlashDraftModel]:
        """The class `cls.from_pretrained` loads a checkpoint with `config` (a config or its dict) as: DFlashDraftModel
        picks DFlash2DraftModel for a DFlash2 config; any other class loads as itself."""
        return DFlash2DraftModel if cls is DFlashDraftModel and is_dflash2(config) else cls


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2 draft: a DFlash draft with dynamic causal convolutions around attention and MLP, and a candidate
    selector that picks each proposal among the head's top-K given the previous one (docs/formats.md)."""

    with_dflash2_parts = True
    _no_split_modules = ["DFlashDecoderLayer", "DFlashCandidateSelector"]


DFlashConfig.register_for_auto_class()
DFlashDraftModel.register_for_auto_class("AutoModel")
DFlash2DraftModel.register_for_auto_class("AutoModel")
