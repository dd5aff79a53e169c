"""The draft a recipe starts from: a config shaped like any target, and an initialisation from its top layers."""

from __future__ import annotations

from typing import Any

import torch

from ..configuration_dflash import DFlashConfig, default_target_layer_ids, read_rope_parameters
from ..devices_dflash import target_text_config
from ..modeling_dflash import DFlashDraftModel

# A new draft's shape when `dflash-hf train` is not told otherwise: the published drafts' (z-lab/Qwen3-8B-DFlash-b16
# and its siblings: 5 layers, blocks of 16; docs/training.md, "What is trained").
DEFAULT_DRAFT_LAYERS = 5
DEFAULT_DRAFT_BLOCK_SIZE = 16


def draft_config_for(
    target: torch.nn.Module,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int] | None = None,
    layer_attention: dict[str, Any] | None = None,
    draft_vocab_size: int | None = None,
) -> DFlashConfig:
    """A draft config shaped like the target's layers (hidden size, heads, MLP, rope), in the published layout.

    layer_attention: optional `layer_types`, `sliding_window`, `is_causal` (docs/formats.md). draft_vocab_size: K
    for a draft with its own LM head over K tokens (None: it borrows the target's).
    """
    config = target_text_config(target)
    num_target_layers = config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = read_rope_parameters(config)
    rope_theta = rope.pop("rope_theta")
    return DFlashConfig(
        architectures=["DFlashDraftModel"],
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        hidden_act=getattr(config, "hidden_act", "silu"),
        rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=None if rope["rope_type"] == "default" else rope,
        max_position_embeddings=config.max_position_embeddings,
        vocab_size=target.get_output_embeddings().weight.shape[0],
        block_size=block_size,
        num_target_layers=num_target_layers,
        dflash_config={
            "mask_token_id": mask_token_id,
            "target_layer_ids": target_layer_ids or default_target_layer_ids(num_target_layers, num_layers),
        },
        tie_word_embeddings=False,
        draft_vocab_size=draft_vocab_size,
        **(layer_attention or {}),
    )


def source_layer_ids(target: torch.nn.Module, draft: DFlashDraftModel) -> list[int]:
    """Target layers a draft copies when initialised from the target: those right after its deepest feature."""
    num_target_layers = target_text_config(target).num_hidden_layers
    num_draft_layers = len(draft.layers)
    start = min(max(draft.target_layer_ids) + 1, num_target_layers - num_draft_layers)
    return list(range(start, start + num_draft_layers))


@torch.no_grad()
def initialize_from_target(draft: DFlashDraftModel, target: torch.nn.Module,
                           calibration_ids: torch.Tensor) -> list[int]:
    """Start the draft as the target's top layers reading its deepest feature; returns the copied layer ids.

    Each draft layer takes the weights of one target layer (same shapes, as `draft_config_for` builds them),
    `norm` the target's final norm, `fc` passes the deepest feature through and `hidden_norm` is the first
    copied layer's input norm. Targets without q/k norms (Llama) get q_norm/k_norm set to the mean RMS of
    their queries/keys on `calibration_ids` [T], so attention logits start at the target's scale.
    """
    decoder = target.get_decoder()
    target_layers = decoder.layers
    layer_ids = source_layer_ids(target, draft)
    query_key_rms: dict[tuple[int, str], list[torch.Tensor]] = {}
    hooks = []
    for draft_index, layer_id in enumerate(layer_ids):
        attention = target_layers[layer_id].self_attn
        for name in ("q_proj", "k_proj"):
            def record(module, inputs, output, key=(draft_index, name)):
                heads = output.float().view(*output.shape[:-1], -1, draft.layers[0].self_attn.head_dim)
                query_key_rms.setdefault(key, []).append(heads.pow(2).mean(-1).sqrt().mean())
            hooks.append(getattr(attention, name).register_forward_hook(record))
    try:
        target(calibration_ids[None].to(target.device))
    finally:
        for hook in hooks:
            hook.remove()
    for draft_index, layer_id in enumerate(layer_ids):
        source = target_layers[layer_id].state_dict()
        destination = draft.layers[draft_index]
        for name, tensor in destination.state_dict().items():
            if name in source and source[name].shape == tensor.shape:
                tensor.copy_(source[name])
            elif name.endswith(("q_norm.weight", "k_norm.weight")):
                projection = "q_proj" if name.endswith("q_norm.weight") else "k_proj"
                tensor.fill_(float(torch.stack(query_key_rms[(draft_index, projection)]).mean()))
            else:
                raise ValueError(f"Target layer {layer_id} has no weight matching draft weight "
                                 f"{name!r} {tuple(tensor.shape)}.")
    draft.norm.weight.copy_(decoder.norm.weight)
    draft.hidden_norm.weight.copy_(target_layers[layer_ids[0]].input_layernorm.weight)
    hidden_size = draft.config.hidden_size
    deepest = draft.target_layer_ids.index(max(draft.target_layer_ids))
    draft.fc.weight.zero_()
    draft.fc.weight[:, deepest * hidden_size : (deepest + 1) * hidden_size] = torch.eye(hidden_size)
    return layer_ids


def ids_by_count(counts: torch.Tensor, size: int) -> list[int]:
    """`size` ids by their counts [V]: most frequent first (ties: lower id first), then the lowest ids not seen (BPE
    ids come roughly by frequency)."""
    vocab_size = len(counts)
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary size must be from 1 to the vocabulary size {vocab_size}, got {size}.")
    seen = (counts > 0).nonzero().flatten()
    ranked = seen[torch.argsort(-counts[seen], stable=True)].tolist()  # by count, then by id
    unseen = (counts == 0).nonzero().flatten().tolist()
    return (ranked + unseen)[:size]


@torch.no_grad()
def initialize_draft_vocabulary(draft: DFlashDraftModel, target: torch.nn.Module, token_ids: list[int]) -> None:
    """Give the draft's own LM head the vocabulary `token_ids` (`set_draft_vocabulary`) and start its rows as the
    target LM head's rows of those ids, so it starts scoring them as the target's head does."""
    draft.set_draft_vocabulary(token_ids)
    weight = target.get_output_embeddings().weight
    ids = torch.tensor(draft.draft_vocab, device=weight.device)  # [K]: its rows' target ids, ascending
    draft.lm_head.weight.copy_(weight[ids].to(draft.lm_head.weight))


def with_own_head(draft: DFlashDraftModel, size: int) -> DFlashDraftModel:
    """The same draft (its weights, on its device) with an LM head of its own over `size` tokens, instead of the
    target's head and any `dflash_config.draft_vocab` list; its vocabulary is still to be set
    (`initialize_draft_vocabulary`)."""
    settings = draft.config.to_dict()
    settings["dflash_config"] = {key: value for key, value in settings["dflash_config"].items()
                                 if key != "draft_vocab"}
    own = DFlashDraftModel(DFlashConfig.from_dict({**settings, "draft_vocab_size": size}))
    missing, unexpected = own.load_state_dict(draft.state_dict(), strict=False)
    if unexpected or set(missing) != {"lm_head.weight", "d2t", "t2d"}:
        raise ValueError(f"The draft's weights do not carry over to one with its own LM head: missing {missing}, "
                         f"unexpected {unexpected}.")
    return own.to(next(draft.parameters()).device)


def dspark_config(config: DFlashConfig, heads: dict[str, Any]) -> DFlashConfig:
    """`config` with DeepSpec's DSpark fields `heads` (`shifted_labels`, `markov_rank`, `markov_head_type`,
    `enable_confidence_head`, `confidence_head_with_markov`), checked as a loaded config's are."""
    return DFlashConfig.from_dict({**config.to_dict(), **heads})


def with_dspark_heads(draft: DFlashDraftModel, heads: dict[str, Any]) -> DFlashDraftModel:
    """The same draft (its weights, on its device) with DeepSpec's block and heads `heads` (`dspark_config`): its
    layers as they are, the new heads freshly initialised (the block's rows then mean the next token: retrained)."""
    own = DFlashDraftModel(dspark_config(draft.config, heads))
    missing, unexpected = own.load_state_dict(draft.state_dict(), strict=False)
    if unexpected or any(not name.startswith(("markov_head.", "confidence_head.")) for name in missing):
        raise ValueError(f"The draft's weights do not carry over to one with DSpark heads: missing {missing}, "
                         f"unexpected {unexpected}.")
    return own.to(next(draft.parameters()).device)
