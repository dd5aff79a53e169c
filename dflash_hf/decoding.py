"""The DFlash decoding loop: draft a block, verify it with the target in one pass, keep the longest match.

Sampling and verification are small pure functions; the loop (`speculative_decode`) takes any
proposer, so it can be tested with proposers whose behaviour is known. `spec_generate` wires it
to a DFlash draft.

Hub remote code: this file imports only torch and transformers.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .modeling_dflash import DFlashDraftModel


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------


@dataclass
class SpecGenerateOutput:
    """Output ids of one speculative generation, with its statistics."""

    output_ids: torch.Tensor  # [1, prompt + new]
    num_prompt_tokens: int
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens committed per target forward
    time_to_first_token: float = 0.0  # seconds: prefill and the first token
    time_per_output_token: float = 0.0  # seconds per token after the first
    block_size: int = 1

    @property
    def num_output_tokens(self) -> int:
        """Number of generated tokens (prompt excluded)."""
        return self.output_ids.shape[1] - self.num_prompt_tokens

    @property
    def new_token_ids(self) -> torch.Tensor:
        """The generated tokens only, [1, new]."""
        return self.output_ids[:, self.num_prompt_tokens :]

    @property
    def tau(self) -> float:
        """Mean acceptance length: tokens per draft/verify step (0.0 when no step ran)."""
        lengths = self.acceptance_lengths
        return sum(lengths) / len(lengths) if lengths else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens divided by the whole generation time."""
        total = self.time_to_first_token + self.time_per_output_token * max(self.num_output_tokens - 1, 0)
        return self.num_output_tokens / total if total > 0 else 0.0


# --------------------------------------------------------------------------------------------------
# Sampling and verification: pure functions
# --------------------------------------------------------------------------------------------------


def process_logits(
    logits: torch.Tensor, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> torch.Tensor:
    """Temperature, then top-k, then top-p filtering (as Transformers' warpers), in float32: [N, V]."""
    scores = logits.float() / temperature
    if top_k is not None and top_k < scores.shape[-1]:
        kth_best = torch.topk(scores, top_k, dim=-1).values[..., -1:]  # [N, 1]
        scores = scores.masked_fill(scores < kth_best, float("-inf"))
    if top_p is not None and top_p < 1.0:
        sorted_scores, sorted_indices = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        sorted_remove = cumulative <= (1.0 - top_p)
        sorted_remove[..., -1:] = False  # always keep the best token
        remove = sorted_remove.scatter(-1, sorted_indices, sorted_remove)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores


def pick_tokens(
    logits: torch.Tensor,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """One token per row of logits [N, V]: argmax at temperature 0, else a sample of the processed distribution."""
    if temperature == 0.0:
        return logits.argmax(dim=-1)
    probabilities = process_logits(logits, temperature, top_k, top_p).softmax(dim=-1)
    return torch.multinomial(probabilities, 1, generator=generator).squeeze(-1)  # [N]


def count_accepted(proposals: list[int], target_tokens: list[int]) -> int:
    """Number of leading proposals (B-1) equal to the target's tokens (B) at the same positions."""
    accepted = 0
    while accepted < len(proposals) and proposals[accepted] == target_tokens[accepted]:
        accepted += 1
    return accepted


def first_stop_index(tokens: list[int], stop_token_ids: set[int]) -> int | None:
    """Index of the first stop token in `tokens`, or None."""
    for index, token in enumerate(tokens):
        if token in stop_token_ids:
            return index
    return None


# --------------------------------------------------------------------------------------------------
# Target helpers
# --------------------------------------------------------------------------------------------------


def target_text_config(target: torch.nn.Module) -> Any:
    """The decoder config of a target (the text config of multimodal wrappers)."""
    config = target.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def cache_keyword(target: torch.nn.Module) -> str:
    """The forward argument that takes the KV cache: `cache` on Transformers 5.x, `past_key_values` on 4.x."""
    return "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"


def returned_cache(outputs: Any) -> Any:
    """The KV cache of a forward's outputs (`cache` on 5.x, `past_key_values` on 4.x)."""
    cache = getattr(outputs, "cache", None)
    return outputs.past_key_values if cache is None else cache


def crop_cache(cache: Any, length: int) -> None:
    """Keep the first `length` positions of a Transformers KV cache (4.x and 5.x `crop` semantics)."""
    excess = cache.get_seq_length() - length
    if excess > 0:
        cache.crop(-excess)  # a negative count removes that many positions on 4.57 and 5.x alike


def select_features(hidden_states: tuple[torch.Tensor, ...], target_layer_ids: list[int]) -> torch.Tensor:
    """Concatenate the outputs of the chosen target layers: [B, T, len(ids) * H]."""
    return torch.cat([hidden_states[layer_id + 1] for layer_id in target_layer_ids], dim=-1)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def draft_logits(lm_head: torch.nn.Module, states: torch.Tensor) -> torch.Tensor:
    """LM-head logits [N, V] of a few draft rows [N, H].

    For a plain Linear head this computes (W @ states^T)^T: a GEMM with a few columns, which CPU BLAS
    runs about twice as fast as a few rows times W^T (measured on AVX2 with MKL; same cost on GPU).
    """
    if type(lm_head) is not torch.nn.Linear:
        return lm_head(states)
    logits = (lm_head.weight @ states.T).T  # [N, V]
    return logits if lm_head.bias is None else logits + lm_head.bias


# --------------------------------------------------------------------------------------------------
# Proposers
# --------------------------------------------------------------------------------------------------


@dataclass
class DraftStep:
    """What a proposer gets for one step."""

    output_ids: torch.Tensor  # [1, s + 1]: prompt and committed tokens; the last is pending (position s)
    target_hidden: torch.Tensor | None  # [1, C_new, L*H]: features of positions the proposer has not seen
    context_position_ids: torch.Tensor | None  # [1, C_new]
    block_size: int  # propose block_size - 1 tokens for positions s+1 .. s+block_size-1


class Proposer(Protocol):
    """Anything that proposes the next tokens; `target_layer_ids` None means it needs no target features."""

    target_layer_ids: list[int] | None

    def propose(self, step: DraftStep) -> torch.Tensor:
        """Proposed token ids [1, step.block_size - 1]."""
        ...


class DFlashProposer:
    """Proposes a block with a DFlash draft; owns the draft's context cache for one generation."""

    def __init__(self, draft: DFlashDraftModel, target: torch.nn.Module, mask_token_id: int) -> None:
        self.draft = draft
        self.target_layer_ids = draft.target_layer_ids
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.mask_token_id = mask_token_id
        self.cache = draft.new_cache()

    def propose(self, step: DraftStep) -> torch.Tensor:
        start = step.output_ids.shape[1] - 1  # position s of the pending token
        block_ids = torch.full(
            (1, step.block_size), self.mask_token_id, dtype=torch.long, device=step.output_ids.device
        )
        block_ids[0, 0] = step.output_ids[0, -1]
        block_positions = torch.arange(start, start + step.block_size, device=block_ids.device)[None]
        hidden = self.draft(
            self.embed_tokens(block_ids),  # [1, B, H]
            step.target_hidden,
            block_positions,
            step.context_position_ids,
            cache=self.cache,
        )
        proposal_states = hidden[0, 1:].contiguous().to(self.lm_head.weight.dtype)  # [B-1, H]
        return draft_logits(self.lm_head, proposal_states).argmax(dim=-1)[None]  # [1, B-1]


# --------------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------------


def check_generation_inputs(
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    top_p: float | None,
    attention_mask: torch.Tensor | None,
) -> None:
    """Raise a ValueError/TypeError naming the problem with the prompt or the generation settings."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dtype not in (torch.long, torch.int):
        raise TypeError("input_ids must be an integer torch.Tensor of shape [1, prompt_length].")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape [1, prompt_length], got {tuple(input_ids.shape)}.")
    if input_ids.shape[0] != 1:
        raise ValueError(f"Batch size {input_ids.shape[0]} is not supported yet: spec_generate takes one prompt.")
    if input_ids.shape[1] == 0:
        raise ValueError("The prompt is empty: input_ids needs at least one token.")
    if attention_mask is not None and not bool(attention_mask.bool().all()):
        raise ValueError("attention_mask has padded positions; padding is not supported with a batch of one.")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}.")
    if top_k is not None and top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}.")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
    config = target_text_config(target)
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"Target {type(target).__name__} is an encoder-decoder model; DFlash needs a decoder-only target.")
    limit = getattr(config, "max_position_embeddings", None)
    total = input_ids.shape[1] + max_new_tokens
    if limit is not None and total > limit:
        raise ValueError(
            f"prompt length {input_ids.shape[1]} + max_new_tokens {max_new_tokens} = {total} exceeds the "
            f"target's position limit max_position_embeddings={limit}."
        )


def check_draft_target(
    draft: DFlashDraftModel, target: torch.nn.Module, mask_token_id: int | None, total_length: int
) -> int:
    """Raise a ValueError naming any mismatch between draft and target; return the mask token id."""
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
            f"Draft hidden_size {draft.config.hidden_size} does not match the target's hidden size {target_hidden_size}."
        )
    target_vocab = lm_head.weight.shape[0]
    if draft.config.vocab_size != target_vocab:
        raise ValueError(f"Draft vocab_size {draft.config.vocab_size} does not match the target's vocabulary {target_vocab}.")
    num_layers = getattr(config, "num_hidden_layers", None)
    if num_layers is None:
        raise ValueError(f"Target config {type(config).__name__} has no num_hidden_layers; unknown target architecture.")
    if draft.config.num_target_layers is not None and draft.config.num_target_layers != num_layers:
        raise ValueError(
            f"Draft was trained for a target with {draft.config.num_target_layers} layers (num_target_layers); "
            f"this target has {num_layers}."
        )
    bad_layers = [i for i in draft.target_layer_ids if not 0 <= i < num_layers]
    if bad_layers:
        raise ValueError(f"target_layer_ids {bad_layers} are outside the target's {num_layers} layers.")
    if mask_token_id is None:
        mask_token_id = draft.mask_token_id
    if mask_token_id is None:
        name = draft.config.dflash_config.get("mask_token")
        raise ValueError(
            f"The draft config names its mask token only as {name!r}; pass "
            "mask_token_id=tokenizer.convert_tokens_to_ids(...) to spec_generate."
        )
    if not 0 <= mask_token_id < embeddings.weight.shape[0]:
        raise ValueError(f"mask_token_id {mask_token_id} is outside the target vocabulary (size {embeddings.weight.shape[0]}).")
    draft_parameter = next(draft.parameters())
    if draft_parameter.device != embeddings.weight.device:
        raise ValueError(
            f"Draft is on {draft_parameter.device} but the target's embedding is on {embeddings.weight.device}; "
            "move both to the same device."
        )
    if not (draft_parameter.is_floating_point() and embeddings.weight.is_floating_point()):
        raise ValueError(
            f"Draft dtype {draft_parameter.dtype} and target dtype {embeddings.weight.dtype} cannot be mixed: "
            "both must be floating point (float32, bfloat16 or float16)."
        )
    draft_limit = getattr(draft.config, "max_position_embeddings", None)
    if draft_limit is not None and total_length > draft_limit:
        raise ValueError(f"prompt + max_new_tokens = {total_length} exceeds the draft's max_position_embeddings={draft_limit}.")
    return int(mask_token_id)


# --------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------


def speculative_decode(
    target: torch.nn.Module,
    proposer: Proposer | None,
    input_ids: torch.Tensor,
    max_new_tokens: int,
    block_size: int,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_token_ids: list[int] | None = None,
    generator: torch.Generator | None = None,
) -> SpecGenerateOutput:
    """Draft-and-verify decoding of a batch of one (design doc section 3); exact for any proposer."""
    device = target.get_input_embeddings().weight.device
    input_ids = input_ids.to(device)
    prompt_length = input_ids.shape[1]
    stop_tokens = set(stop_token_ids or [])
    layer_ids = proposer.target_layer_ids if (proposer is not None and block_size > 1) else None
    want_hidden = layer_ids is not None
    cache_argument = cache_keyword(target)
    keep_last_logits = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}

    def pick(logits: torch.Tensor) -> torch.Tensor:
        return pick_tokens(logits, temperature, top_k, top_p, generator)

    _synchronize(device)
    started = time.perf_counter()
    prefill = target(
        input_ids=input_ids,
        position_ids=torch.arange(prompt_length, device=device)[None],
        use_cache=True,
        output_hidden_states=want_hidden,
        **keep_last_logits,
    )
    cache = returned_cache(prefill)
    if cache is None or not hasattr(cache, "crop"):
        raise ValueError(f"Target {type(target).__name__} returned no croppable KV cache; DFlash needs a DynamicCache.")
    pending_features: list[torch.Tensor] = []
    if want_hidden:
        num_layers = target_text_config(target).num_hidden_layers
        if len(prefill.hidden_states) != num_layers + 1:
            raise ValueError(
                f"Target returned {len(prefill.hidden_states)} hidden states for {num_layers} layers; "
                "expected the embedding output plus one per layer."
            )
        pending_features.append(select_features(prefill.hidden_states, layer_ids))
    pending_start = 0  # first position whose features the proposer has not seen
    generated: list[int] = [int(pick(prefill.logits[:, -1])[0])]
    del prefill
    _synchronize(device)
    first_token_time = time.perf_counter()

    acceptance_lengths: list[int] = []
    finished = first_stop_index(generated, stop_tokens) is not None
    while not finished and len(generated) < max_new_tokens:
        step_block = min(block_size, max_new_tokens - len(generated))
        start = prompt_length + len(generated) - 1  # position of the pending token
        pending_token = torch.tensor([[generated[-1]]], device=device)
        if step_block > 1:
            output_ids = torch.cat((input_ids, torch.tensor([generated], device=device)), dim=1)
            features = torch.cat(pending_features, dim=1) if want_hidden else None
            positions = torch.arange(pending_start, start, device=device)[None] if want_hidden else None
            proposals = proposer.propose(DraftStep(output_ids, features, positions, step_block))
            proposals = proposals.to(device=device, dtype=torch.long).reshape(1, step_block - 1)
            pending_features, pending_start = [], start
            verify_ids = torch.cat((pending_token, proposals), dim=1)  # [1, b]
        else:
            proposals = None
            verify_ids = pending_token
        verify = target(
            input_ids=verify_ids,
            position_ids=torch.arange(start, start + step_block, device=device)[None],
            use_cache=True,
            **{cache_argument: cache},
            output_hidden_states=want_hidden,
        )
        target_tokens = pick(verify.logits[0])  # [b]: target's token for positions s+1 .. s+b
        if proposals is None:
            accepted, new_tokens = 0, target_tokens.tolist()
        else:
            proposed_and_target = torch.cat((proposals[0], target_tokens)).tolist()  # one device sync
            proposed, target_list = proposed_and_target[: step_block - 1], proposed_and_target[step_block - 1 :]
            accepted = count_accepted(proposed, target_list)
            new_tokens = proposed[:accepted] + [target_list[accepted]]
        crop_cache(cache, start + accepted + 1)
        if want_hidden:
            pending_features.append(select_features(verify.hidden_states, layer_ids)[:, : accepted + 1])
        del verify
        acceptance_lengths.append(accepted + 1)
        stop_at = first_stop_index(new_tokens, stop_tokens)
        if stop_at is not None:
            new_tokens, finished = new_tokens[: stop_at + 1], True
        generated.extend(new_tokens)

    generated = generated[:max_new_tokens]
    _synchronize(device)
    ended = time.perf_counter()
    output_ids = torch.cat((input_ids, torch.tensor([generated], dtype=input_ids.dtype, device=device)), dim=1)
    return SpecGenerateOutput(
        output_ids=output_ids,
        num_prompt_tokens=prompt_length,
        acceptance_lengths=acceptance_lengths,
        time_to_first_token=first_token_time - started,
        time_per_output_token=(ended - first_token_time) / max(len(generated) - 1, 1),
        block_size=block_size,
    )


@torch.no_grad()
def spec_generate(
    draft: DFlashDraftModel,
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_k: int | None = None,
    top_p: float | None = None,
    stop_token_ids: list[int] | int | None = None,
    block_size: int | None = None,
    generator: torch.Generator | None = None,
    seed: int | None = None,
    mask_token_id: int | None = None,
    attention_mask: torch.Tensor | None = None,
    return_stats: bool = False,
) -> torch.Tensor | SpecGenerateOutput:
    """Generate with `target`, drafting blocks with `draft`; returns ids [1, prompt + new] (or stats too).

    Output equals the target's own greedy decode (temperature 0) or follows its sampling distribution.
    """
    check_generation_inputs(target, input_ids, max_new_tokens, temperature, top_k, top_p, attention_mask)
    mask_token_id = check_draft_target(draft, target, mask_token_id, input_ids.shape[1] + max_new_tokens)
    block_size = draft.block_size if block_size is None else block_size
    if not isinstance(block_size, int) or not 1 <= block_size <= draft.block_size:
        raise ValueError(f"block_size must be an integer from 1 to the draft's trained size {draft.block_size}, got {block_size!r}.")
    if isinstance(stop_token_ids, int):
        stop_token_ids = [stop_token_ids]
    device = target.get_input_embeddings().weight.device
    if temperature > 0 and generator is None and seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    if generator is not None and generator.device.type != device.type:
        raise ValueError(f"generator is on {generator.device} but the target runs on {device}.")
    result = speculative_decode(
        target,
        DFlashProposer(draft, target, mask_token_id),
        input_ids,
        max_new_tokens=max_new_tokens,
        block_size=block_size,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        stop_token_ids=stop_token_ids,
        generator=generator,
    )
    return result if return_stats else result.output_ids
