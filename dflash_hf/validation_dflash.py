"""Checks of a call's inputs, each error naming the problem and the fix: the target, the prompt and its padding, the
draft against the target (`check_draft_target` also returns the mask id and warns about a dtype mismatch), and the
streamers and sampling generators, which `row_streamers` / `row_generators` return one per row.

Hub remote code: imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import numbers
import warnings
from typing import Any, Sequence

import torch

from .devices_dflash import execution_device, target_text_config
from .proposer_dflash import DFlashDraft


def check_left_padding(attention_mask: Any, shape: torch.Size) -> None:
    """Raise a TypeError / ValueError unless attention_mask is a 0/1 tensor of `shape` padding rows
    on the left only."""
    if not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor of shape [batch, prompt_length], got "
                        f"{type(attention_mask).__name__}; e.g. torch.tensor(mask) "
                        "or the tokenizer's return_tensors='pt'.")
    if tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} "
                         f"but input_ids has shape {tuple(shape)}.")
    if bool(((attention_mask != 0) & (attention_mask != 1)).any()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (prompt token).")
    values = attention_mask.long()
    empty = (values.sum(dim=1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"The prompt of row {empty[0]} is empty: its attention_mask is all zeros.")
    right_padded = (values[:, 1:] < values[:, :-1]).any(dim=1).nonzero().flatten().tolist()
    if right_padded:
        raise ValueError(
            f"attention_mask pads row {right_padded[0]} on the right (or in the middle); spec_generate needs "
            "left padding: set tokenizer.padding_side = 'left'."
        )


def check_target(target: Any) -> None:
    """Raise a TypeError / ValueError unless `target` is a decoder-only model with an input embedding."""
    if not isinstance(target, torch.nn.Module):
        raise TypeError(f"target must be a Transformers causal LM (an nn.Module, e.g. AutoModelForCausalLM."
                        f"from_pretrained(...)), got {type(target).__name__}.")
    embeddings = target.get_input_embeddings() if hasattr(target, "get_input_embeddings") else None
    if embeddings is None or getattr(embeddings, "weight", None) is None:
        raise ValueError(f"Target {type(target).__name__} exposes no input embedding (get_input_embeddings()); "
                         "pass a *ForCausalLM model.")
    config = target_text_config(target) if hasattr(target, "config") else None
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"Target {type(target).__name__} is an encoder-decoder model; "
                         "DFlash needs a decoder-only target.")


def check_prompt(target: torch.nn.Module, input_ids: Any, attention_mask: Any, max_new_tokens: Any) -> None:
    """Raise a ValueError/TypeError naming the problem with the prompt (its shape, padding and ids) or with
    `max_new_tokens` (an integer >= 1 that fits the target's positions after it)."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.long, torch.int):
        raise TypeError("input_ids must be an integer torch.Tensor of shape [batch, prompt_length].")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape [batch, prompt_length], got {tuple(input_ids.shape)}.")
    if input_ids.shape[0] == 0:
        raise ValueError("input_ids has no rows: the batch is empty.")
    if input_ids.shape[1] == 0:
        raise ValueError("The prompt is empty: input_ids needs at least one token.")
    if attention_mask is not None:
        check_left_padding(attention_mask, input_ids.shape)
    vocabulary = target.get_input_embeddings().weight.shape[0]
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocabulary:
        raise ValueError(f"input_ids holds token id {low if low < 0 else high}, outside the target's vocabulary "
                         f"(0 to {vocabulary - 1}); was the prompt tokenized with the target's tokenizer?")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.")
    limit = getattr(target_text_config(target), "max_position_embeddings", None) if hasattr(target, "config") else None
    total = input_ids.shape[1] + max_new_tokens
    if limit is not None and total > limit:
        raise ValueError(
            f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} = {total} exceeds the "
            f"target's position limit max_position_embeddings={limit}."
        )


def check_draft_target(draft: DFlashDraft, target: torch.nn.Module, mask_token_id: int | None,
                       total_length: int) -> int:
    """Raise a ValueError naming any mismatch between draft and target (shapes, layers, mask id, device, dtype, the
    draft's position limit); return the mask token id."""
    check_draft_shapes(draft, target)
    if mask_token_id is None:
        mask_token_id = draft.mask_token_id
    if mask_token_id is None:
        name = draft.config.dflash_config.get("mask_token")
        raise ValueError(
            f"The draft config names its mask token only as {name!r}; pass "
            "mask_token_id=tokenizer.convert_tokens_to_ids(...) to spec_generate."
        )
    embeddings = target.get_input_embeddings()
    embedding_weight, device = embeddings.weight, execution_device(embeddings)
    if not 0 <= mask_token_id < embedding_weight.shape[0]:
        raise ValueError(f"mask_token_id {mask_token_id} is outside the target vocabulary "
                         f"(size {embedding_weight.shape[0]}).")
    draft_parameter = next(draft.parameters())
    if draft_parameter.device != device:
        raise ValueError(
            f"Draft is on {draft_parameter.device} but the target's embedding computes on {device}; "
            f"move the draft there: draft.to({str(device)!r})."
        )
    if not (draft_parameter.is_floating_point() and embedding_weight.is_floating_point()):
        raise ValueError(
            f"Draft dtype {draft_parameter.dtype} and target dtype {embedding_weight.dtype} cannot be mixed: "
            "both must be floating point (float32, bfloat16 or float16)."
        )
    if draft_parameter.dtype != embedding_weight.dtype:
        warnings.warn(
            f"The draft is {draft_parameter.dtype} but the target is {embedding_weight.dtype}: every step runs the "
            f"draft in {draft_parameter.dtype} and casts its inputs and outputs (slower; the output is the target's "
            f"either way). Load the draft with dtype={embedding_weight.dtype} "
            f"or call draft.to({embedding_weight.dtype}).",
            stacklevel=4,
        )
    draft_limit = getattr(draft.config, "max_position_embeddings", None)
    if draft_limit is not None and total_length > draft_limit:
        raise ValueError(f"prompt + max_new_tokens = {total_length} "
                         f"exceeds the draft's max_position_embeddings={draft_limit}.")
    return int(mask_token_id)


def check_draft_shapes(draft: DFlashDraft, target: torch.nn.Module) -> None:
    """Raise a ValueError when the draft was not built for this target: hidden size, vocabulary, layer count, the
    layers it reads."""
    embeddings, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    if embeddings is None or lm_head is None or not hasattr(lm_head, "weight"):
        raise ValueError(
            f"Target {type(target).__name__} exposes no input embedding or LM head "
            "(get_input_embeddings()/get_output_embeddings()); pass a *ForCausalLM model."
        )
    config = target_text_config(target)
    target_hidden_size = embeddings.weight.shape[1]
    if draft.config.hidden_size != target_hidden_size:
        raise ValueError(
            f"Draft hidden_size {draft.config.hidden_size} "
            f"does not match the target's hidden size {target_hidden_size}."
        )
    target_vocab = lm_head.weight.shape[0]
    if draft.config.vocab_size != target_vocab and not draft.config.dflash_config.get("vocab_size_unknown"):
        raise ValueError(f"Draft vocab_size {draft.config.vocab_size} "
                         f"does not match the target's vocabulary {target_vocab}.")
    num_layers = getattr(config, "num_hidden_layers", None)
    if num_layers is None:
        raise ValueError(f"Target config {type(config).__name__} has no num_hidden_layers; "
                         "unknown target architecture.")
    if draft.config.num_target_layers is not None and draft.config.num_target_layers != num_layers:
        raise ValueError(
            f"Draft was trained for a target with {draft.config.num_target_layers} layers (num_target_layers); "
            f"this target has {num_layers}."
        )
    bad_layers = [i for i in draft.target_layer_ids if not 0 <= i < num_layers]
    if bad_layers:
        raise ValueError(f"target_layer_ids {bad_layers} are outside the target's {num_layers} layers.")


def row_streamers(streamer: Any, num_rows: int) -> tuple[Any, ...] | None:
    """One streamer per row: a streamer for a batch of one, or a list of N streamers."""
    if streamer is None:
        return None
    streamers = list(streamer) if isinstance(streamer, (list, tuple)) else [streamer]
    if len(streamers) != num_rows:
        raise ValueError(
            f"Got {len(streamers)} streamer(s) for a batch of {num_rows}: a streamer receives one row; "
            "pass a list with one streamer per row."
        )
    for item in streamers:
        if not (callable(getattr(item, "put", None)) and callable(getattr(item, "end", None))):
            raise TypeError(f"streamer {type(item).__name__} lacks put()/end() (Transformers' streamer protocol).")
    return tuple(streamers)


def row_generators(generator: torch.Generator | Sequence[torch.Generator] | None, num_rows: int,
                   device: torch.device, seed: int | None = None) -> tuple[torch.Generator | None, ...]:
    """One sampling generator per row: the given one shared, one per row as given, or a new one seeded with `seed`."""
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)):
        raise TypeError(f"seed must be an integer, got {seed!r}.")
    if generator is None and seed is not None:
        generator = torch.Generator(device=device).manual_seed(int(seed))
    if isinstance(generator, (list, tuple)) and len(generator) != num_rows:
        raise ValueError(f"Got {len(generator)} generators for a batch of {num_rows}: pass one, or one per row.")
    generators = tuple(generator) if isinstance(generator, (list, tuple)) else (generator,) * num_rows
    for item in generators:
        if item is not None and not isinstance(item, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator (or a list of one per row), got {item!r}; to seed "
                            f"the sampling pass seed={item!r} instead.")
        if item is not None and item.device.type != device.type:
            raise ValueError(f"generator is on {item.device} but the target runs on {device}.")
    return generators
