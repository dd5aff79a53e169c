"""The DFlash decoding loop: draft a block, verify it with the target in one pass, keep the longest match.

Sampling and verification are small pure functions; the loop (`speculative_decode`) takes any
proposer, so it can be tested with proposers whose behaviour is known. `spec_generate` wires it
to a DFlash draft.

Batches: prompts are left-padded ([N, T] with an attention mask). Each row accepts its own
number of tokens per step, so rows leave unused columns ("holes") in the shared KV caches; an
attention mask hides them and the caches are compacted whenever a row's holes pass
`CACHE_HOLE_BUDGET`, so memory stays bounded. Finished rows leave the batch.

Hub remote code: this file imports only torch and transformers.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, Sequence

import torch

if TYPE_CHECKING:  # pragma: no cover
    from .modeling_dflash import DFlashDraftModel

# A cache is compacted when its width exceeds the longest row's real positions by more than this.
CACHE_HOLE_BUDGET = 32


# --------------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------------


@dataclass
class SpecGenerateOutput:
    """Output ids of one speculative generation over N rows (N = 1 included), with per-row statistics.

    Row i's new tokens are `output_ids[i, num_prompt_tokens : num_prompt_tokens + num_new_tokens[i]]`;
    after them the row is padded with `pad_token_id` up to the longest row.
    """

    output_ids: torch.Tensor  # [N, T + W]: the prompts as passed (left padding kept), then the new tokens
    num_prompt_tokens: int  # T: the prompt width, padding included
    num_new_tokens: list[int]  # per row: generated tokens, a final stop token included
    acceptance_lengths: list[list[int]]  # per row: tokens committed by each verify step the row took part in
    time_to_first_token: float = 0.0  # seconds: prefill and the first token of every row
    total_time: float = 0.0  # seconds: the whole generation
    block_size: int = 1

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens of all rows (padding excluded)."""
        return sum(self.num_new_tokens)

    @property
    def new_token_ids(self) -> torch.Tensor:
        """The generated part [N, W], right-padded with pad_token_id where a row ended early."""
        return self.output_ids[:, self.num_prompt_tokens :]

    def new_tokens(self, row: int) -> list[int]:
        """Row `row`'s generated tokens, without padding."""
        return self.new_token_ids[row, : self.num_new_tokens[row]].tolist()

    @property
    def tau(self) -> float:
        """Mean acceptance length over every row's steps: tokens per draft/verify step (0.0 when none ran)."""
        lengths = [length for row in self.acceptance_lengths for length in row]
        return sum(lengths) / len(lengths) if lengths else 0.0

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens of all rows divided by the whole generation time."""
        return self.num_output_tokens / self.total_time if self.total_time > 0 else 0.0

    @property
    def time_per_output_token(self) -> float:
        """Seconds per token after the first, along the longest row."""
        longest = max(self.num_new_tokens, default=0)
        return (self.total_time - self.time_to_first_token) / max(longest - 1, 1)


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


def commit_block(
    proposed: list[int], target_tokens: list[int], limit: int, stop_token_ids: set[int]
) -> tuple[int, list[int], bool]:
    """One row's verify: (accepted proposals, tokens committed, whether a stop token ended the row).

    The first `limit` positions at most are committed (what max_new_tokens still allows), cut after a stop token.
    """
    accepted = count_accepted(proposed[: limit - 1], target_tokens[:limit])
    committed = proposed[:accepted] + [target_tokens[accepted]]
    stop_at = first_stop_index(committed, stop_token_ids)
    return accepted, committed if stop_at is None else committed[: stop_at + 1], stop_at is not None


# --------------------------------------------------------------------------------------------------
# Batch cache layout: N rows share the cache columns; each row marks which columns are its positions
# --------------------------------------------------------------------------------------------------


def left_pad(
    sequences: Sequence[Sequence[int]], pad_token_id: int, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists as a left-padded batch: (input_ids [N, T], attention_mask [N, T])."""
    width = max(len(sequence) for sequence in sequences)
    input_ids = torch.tensor([[pad_token_id] * (width - len(s)) + list(s) for s in sequences], device=device)
    attention_mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in sequences], device=device)
    return input_ids, attention_mask


def left_padded_positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids [N, T] of left-padded rows: 0 at each row's first real token (pads get 0 too)."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def compaction_index(valid: torch.Tensor, width: int) -> torch.Tensor:
    """Column order [N, width] that moves each row's real columns (valid [N, W]) to the right end, in order."""
    order = torch.argsort(valid.to(torch.int8), dim=1, stable=True)  # holes first, real columns last, order kept
    return order[:, valid.shape[1] - width :]


def gather_columns(states: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Per-row choice of sequence columns: states [N, heads, W, D], index [N, W'] -> [N, heads, W', D]."""
    batch, heads, _, head_dim = states.shape
    return states.gather(2, index[:, None, :, None].expand(batch, heads, index.shape[1], head_dim))


def reorder_cache_columns(cache: Any, index: torch.Tensor) -> None:
    """Apply a per-row column order [N, W'] to every layer of a Transformers DynamicCache (4.57 and 5.x)."""
    for layer in cache.layers:
        layer.keys = gather_columns(layer.keys, index)
        layer.values = gather_columns(layer.values, index)


class CacheColumns:
    """Which columns of a cache shared by N rows hold each row's real positions; decides compaction.

    Counts are kept on the host, so asking whether there are holes never waits for the device.
    """

    def __init__(self, valid: torch.Tensor, real_counts: list[int]) -> None:
        self.valid = valid  # [N, W] bool
        self.real_counts = real_counts  # per row: number of True in `valid`

    @property
    def width(self) -> int:
        """Number of columns (the cache's sequence length)."""
        return self.valid.shape[1]

    @property
    def has_holes(self) -> bool:
        """Whether some row has columns that are not its positions (padding or rejected tokens)."""
        return any(count < self.width for count in self.real_counts)

    def append(self, kept: torch.Tensor, kept_counts: list[int]) -> None:
        """Add columns kept [N, w] (True where the row keeps that column) with their per-row counts."""
        self.valid = torch.cat((self.valid, kept), dim=1)
        self.real_counts = [count + added for count, added in zip(self.real_counts, kept_counts)]

    def attention_mask(self, new_columns: int) -> torch.Tensor | None:
        """2-D mask [N, W + new] over cached and new columns, or None when every column is real."""
        if not self.has_holes:
            return None
        return torch.cat((self.valid, self.valid.new_ones(self.valid.shape[0], new_columns)), dim=1)

    def select_rows(self, keep: list[int], index: torch.Tensor) -> None:
        """Keep rows `keep` (index: the same as a tensor on the cache's device)."""
        self.valid = self.valid[index]
        self.real_counts = [self.real_counts[row] for row in keep]

    def compaction(self) -> torch.Tensor | None:
        """The column order [N, W'] that removes the holes once they exceed CACHE_HOLE_BUDGET (else None)."""
        longest = max(self.real_counts)
        if self.width - longest <= CACHE_HOLE_BUDGET:
            return None
        index = compaction_index(self.valid, longest)
        self.valid = self.valid.gather(1, index)
        return index


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


def few_row_logits(lm_head: torch.nn.Module, states: torch.Tensor) -> torch.Tensor:
    """LM-head logits [N, V] of a few rows [N, H].

    For a plain Linear head this computes (W @ states^T)^T: a GEMM with a few columns, which CPU BLAS
    runs about twice as fast as a few rows times W^T (measured on AVX2 with MKL; same cost on GPU).
    """
    if type(lm_head) is not torch.nn.Linear:
        return lm_head(states)
    logits = (lm_head.weight @ states.T).T  # [N, V]
    return logits if lm_head.bias is None else logits + lm_head.bias


# Causal LMs whose logits are exactly `lm_head(last hidden state)`: their verify runs the base model and
# applies the head with `few_row_logits`. Other targets run their own forward.
PLAIN_HEAD_TARGETS = ("LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")


def verify_forward(target: torch.nn.Module, **inputs: Any) -> tuple[torch.Tensor, Any]:
    """A verify pass: (logits [n, b, V], the forward's outputs with its cache and hidden states)."""
    base = getattr(target, "model", None)
    if type(target).__name__ not in PLAIN_HEAD_TARGETS or base is None:
        outputs = target(**inputs)
        return outputs.logits, outputs
    outputs = base(**inputs)
    hidden = outputs.last_hidden_state  # [n, b, H]
    logits = few_row_logits(target.get_output_embeddings(), hidden.reshape(-1, hidden.shape[-1]))
    return logits.view(hidden.shape[0], hidden.shape[1], -1), outputs


# --------------------------------------------------------------------------------------------------
# Proposers
# --------------------------------------------------------------------------------------------------


@dataclass
class DraftStep:
    """What a proposer gets for one step of N active rows."""

    sequences: list[list[int]]  # per row: prompt (no padding) and committed tokens; the last is pending
    target_hidden: torch.Tensor | None  # [N, C_new, L*H]: features of positions the proposer has not seen
    context_position_ids: torch.Tensor | None  # [N, C_new]
    context_valid: torch.Tensor | None  # [N, C_new] bool: which columns are real positions (None: all)
    block_size: int  # propose block_size - 1 tokens for positions s+1 .. s+block_size-1 of each row
    row_ids: list[int]  # each row's index in the caller's batch (finished rows leave it)


class Proposer(Protocol):
    """Anything that proposes the next tokens; `target_layer_ids` None means it needs no target features."""

    target_layer_ids: list[int] | None

    def propose(self, step: DraftStep) -> torch.Tensor:
        """Proposed token ids [N, step.block_size - 1]."""
        ...


class DFlashProposer:
    """Proposes blocks with a DFlash draft; owns the draft's context cache for one generation."""

    def __init__(self, draft: DFlashDraftModel, target: torch.nn.Module, mask_token_id: int) -> None:
        self.draft = draft
        self.target_layer_ids = draft.target_layer_ids
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.mask_token_id = mask_token_id
        self.cache = draft.new_cache()
        self.columns: CacheColumns | None = None  # real context positions among the cache's columns
        self.row_ids: list[int] | None = None

    def _follow_rows(self, row_ids: list[int], device: torch.device) -> None:
        """Drop the cached context of rows that left the batch."""
        if self.row_ids is not None and row_ids != self.row_ids:
            keep = [self.row_ids.index(row) for row in row_ids]
            index = torch.tensor(keep, device=device)
            self.cache.select_rows(index)
            self.columns.select_rows(keep, index)
        self.row_ids = list(row_ids)

    def propose(self, step: DraftStep) -> torch.Tensor:
        device = self.embed_tokens.weight.device
        self._follow_rows(step.row_ids, device)
        num_rows, block_size = len(step.sequences), step.block_size
        if self.columns is None:
            self.columns = CacheColumns(torch.ones(num_rows, 0, dtype=torch.bool, device=device), [0] * num_rows)
        new_columns = step.target_hidden.shape[1]
        new_valid = step.context_valid
        if new_valid is None:
            new_valid = torch.ones(num_rows, new_columns, dtype=torch.bool, device=device)
        context_counts = [len(sequence) - 1 for sequence in step.sequences]  # positions before the pending token
        self.columns.append(new_valid, [total - seen for total, seen in zip(context_counts, self.columns.real_counts)])
        seen_mask = self.columns.attention_mask(block_size)  # [N, C + B] or None
        attention_mask = None if seen_mask is None else seen_mask[:, None, None, :]  # [N, 1, 1, C + B]

        starts = torch.tensor(context_counts, device=device)  # position s of each pending token
        block_ids = torch.full((num_rows, block_size), self.mask_token_id, dtype=torch.long, device=device)
        block_ids[:, 0] = torch.tensor([sequence[-1] for sequence in step.sequences], device=device)
        block_positions = starts[:, None] + torch.arange(block_size, device=device)  # [N, B]
        hidden = self.draft(
            self.embed_tokens(block_ids),  # [N, B, H]
            step.target_hidden,
            block_positions,
            step.context_position_ids,
            cache=self.cache,
            attention_mask=attention_mask,
        )
        index = self.columns.compaction()
        if index is not None:
            self.cache.reorder_columns(index)
        proposal_states = hidden[:, 1:].reshape(num_rows * (block_size - 1), -1)  # [N * (B-1), H]
        proposal_states = proposal_states.contiguous().to(self.lm_head.weight.dtype)
        return few_row_logits(self.lm_head, proposal_states).argmax(dim=-1).view(num_rows, block_size - 1)


# --------------------------------------------------------------------------------------------------
# Input checks
# --------------------------------------------------------------------------------------------------


def check_left_padding(attention_mask: torch.Tensor, shape: torch.Size) -> None:
    """Raise a ValueError unless attention_mask is a 0/1 mask of `shape` padding each row on the left only."""
    if tuple(attention_mask.shape) != tuple(shape):
        raise ValueError(f"attention_mask has shape {tuple(attention_mask.shape)} but input_ids has shape {tuple(shape)}.")
    values = attention_mask.long()
    if bool(((values != 0) & (values != 1)).any()):
        raise ValueError("attention_mask must hold only 0 (padding) and 1 (prompt token).")
    empty = (values.sum(dim=1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"The prompt of row {empty[0]} is empty: its attention_mask is all zeros.")
    right_padded = (values[:, 1:] < values[:, :-1]).any(dim=1).nonzero().flatten().tolist()
    if right_padded:
        raise ValueError(
            f"attention_mask pads row {right_padded[0]} on the right (or in the middle); spec_generate needs "
            "left padding: set tokenizer.padding_side = 'left'."
        )


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
        raise TypeError("input_ids must be an integer torch.Tensor of shape [batch, prompt_length].")
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must have shape [batch, prompt_length], got {tuple(input_ids.shape)}.")
    if input_ids.shape[0] == 0:
        raise ValueError("input_ids has no rows: the batch is empty.")
    if input_ids.shape[1] == 0:
        raise ValueError("The prompt is empty: input_ids needs at least one token.")
    if attention_mask is not None:
        check_left_padding(attention_mask, input_ids.shape)
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
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    attention_mask: torch.Tensor | None = None,
    streamers: Sequence[Any] | None = None,
    pad_token_id: int = 0,
) -> SpecGenerateOutput:
    """Draft-and-verify decoding of N left-padded prompts [N, T] (design doc section 3); exact for any proposer.

    `generator` is one generator for the batch or one per row; `streamers` has one streamer per row.
    """
    device = target.get_input_embeddings().weight.device
    input_ids = input_ids.to(device)
    num_rows, prompt_width = input_ids.shape
    prompt_mask = None if attention_mask is None or bool(attention_mask.bool().all()) else attention_mask.to(device).bool()
    prompt_lengths = [prompt_width] * num_rows if prompt_mask is None else prompt_mask.sum(dim=1).tolist()
    prompts = [input_ids[row, prompt_width - length :].tolist() for row, length in enumerate(prompt_lengths)]
    generators = list(generator) if isinstance(generator, (list, tuple)) else [generator] * num_rows
    stop_tokens = set(stop_token_ids or [])
    layer_ids = proposer.target_layer_ids if (proposer is not None and block_size > 1) else None
    want_hidden = layer_ids is not None
    cache_argument = cache_keyword(target)
    keep_last_logits = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(target.forward).parameters else {}

    def pick_block(logits: torch.Tensor, rows: list[int], counts: list[int]) -> torch.Tensor:
        """The target's tokens [n, b] for verify logits [n, b, V]; row i only samples its first counts[i]."""
        if temperature == 0.0:
            return logits.argmax(dim=-1)
        picked = torch.full(logits.shape[:2], -1, dtype=torch.long, device=logits.device)
        for index, (row, count) in enumerate(zip(rows, counts)):
            picked[index, :count] = pick_tokens(logits[index, :count], temperature, top_k, top_p, generators[row])
        return picked

    for row, streamer in enumerate(streamers or []):
        streamer.put(torch.tensor([prompts[row]]))
    _synchronize(device)
    started = time.perf_counter()
    prefill = target(
        input_ids=input_ids,
        attention_mask=None if prompt_mask is None else prompt_mask.long(),
        position_ids=torch.arange(prompt_width, device=device)[None].expand(num_rows, -1)
        if prompt_mask is None
        else left_padded_positions(prompt_mask),
        use_cache=True,
        output_hidden_states=want_hidden,
        **keep_last_logits,
    )
    cache = returned_cache(prefill)
    if cache is None or not hasattr(cache, "crop"):
        raise ValueError(f"Target {type(target).__name__} returned no croppable KV cache; DFlash needs a DynamicCache.")
    if num_rows > 1 and not (hasattr(cache, "layers") and hasattr(cache, "batch_select_indices")):
        raise ValueError(f"Target {type(target).__name__} returned a {type(cache).__name__}; batches need a DynamicCache.")
    columns = CacheColumns(
        torch.ones_like(input_ids, dtype=torch.bool) if prompt_mask is None else prompt_mask, list(prompt_lengths)
    )
    features = feature_positions = feature_valid = None  # context the proposer has not seen yet
    if want_hidden:
        num_layers = target_text_config(target).num_hidden_layers
        if len(prefill.hidden_states) != num_layers + 1:
            raise ValueError(
                f"Target returned {len(prefill.hidden_states)} hidden states for {num_layers} layers; "
                "expected the embedding output plus one per layer."
            )
        features = select_features(prefill.hidden_states, layer_ids)  # [N, T, L*H]
        feature_positions = left_padded_positions(columns.valid)
        if prompt_mask is not None:
            feature_valid = prompt_mask
            features = torch.where(prompt_mask[..., None], features, 0.0)  # padding carries no signal
    all_rows = list(range(num_rows))
    first_tokens = pick_block(prefill.logits[:, -1:], all_rows, [1] * num_rows)[:, 0].tolist()
    del prefill
    _synchronize(device)
    first_token_time = time.perf_counter()

    generated: list[list[int]] = [[token] for token in first_tokens]
    acceptance_lengths: list[list[int]] = [[] for _ in all_rows]
    finished = [token in stop_tokens or max_new_tokens == 1 for token in first_tokens]
    for row, streamer in enumerate(streamers or []):
        streamer.put(torch.tensor([first_tokens[row]]))
    active = all_rows
    while True:
        still_active = [row for row in active if not finished[row]]
        if not still_active:
            break
        if len(still_active) < len(active):  # finished rows leave the batch and its caches
            keep = [active.index(row) for row in still_active]
            index = torch.tensor(keep, device=device)
            cache.batch_select_indices(index)
            columns.select_rows(keep, index)
            if want_hidden:
                features, feature_positions = features[index], feature_positions[index]
                feature_valid = None if feature_valid is None else feature_valid[index]
            active = still_active
        order = columns.compaction()  # bounded memory: drop the holes once they pass the budget
        if order is not None:
            reorder_cache_columns(cache, order)

        remaining = [max_new_tokens - len(generated[row]) for row in active]
        step_block = min(block_size, max(remaining))
        counts = [min(step_block, left) for left in remaining]  # positions each row may still commit
        starts = torch.tensor([prompt_lengths[row] + len(generated[row]) - 1 for row in active], device=device)
        pending = torch.tensor([[generated[row][-1]] for row in active], device=device)  # [n, 1]
        if step_block > 1:
            step = DraftStep(
                sequences=[prompts[row] + generated[row] for row in active],
                target_hidden=features,
                context_position_ids=feature_positions,
                context_valid=feature_valid,
                block_size=step_block,
                row_ids=list(active),
            )
            proposals = proposer.propose(step).to(device=device, dtype=torch.long).reshape(len(active), step_block - 1)
        else:
            proposals = pending[:, :0]
        offsets = torch.arange(step_block, device=device)
        verify_positions = starts[:, None] + offsets  # [n, b]
        verify_mask = columns.attention_mask(step_block)
        verify_logits, verify = verify_forward(
            target,
            input_ids=torch.cat((pending, proposals), dim=1),  # [n, b]
            attention_mask=None if verify_mask is None else verify_mask.long(),
            position_ids=verify_positions,
            use_cache=True,
            **{cache_argument: cache},
            output_hidden_states=want_hidden,
        )
        target_tokens = pick_block(verify_logits, active, counts)  # [n, b]: the target's tokens at s+1 .. s+b
        proposed_and_target = torch.cat((proposals, target_tokens), dim=1).tolist()  # one device sync
        accepted_counts = []
        for index, row in enumerate(active):
            accepted, new_tokens, stopped = commit_block(
                proposed_and_target[index][: step_block - 1],
                proposed_and_target[index][step_block - 1 :],
                counts[index],
                stop_tokens,
            )
            acceptance_lengths[row].append(accepted + 1)
            accepted_counts.append(accepted)
            generated[row].extend(new_tokens)
            finished[row] = stopped or len(generated[row]) >= max_new_tokens
            if streamers:
                streamers[row].put(torch.tensor(new_tokens))

        # Each row keeps the verify columns of its pending token and accepted proposals.
        kept_width = max(accepted_counts) + 1
        accepted_tensor = torch.tensor(accepted_counts, device=device)
        kept = offsets[None, :kept_width] <= accepted_tensor[:, None]  # [n, kept_width]
        columns.append(kept, [accepted + 1 for accepted in accepted_counts])
        crop_cache(cache, columns.width)
        if want_hidden:
            features = select_features(verify.hidden_states, layer_ids)[:, :kept_width]  # [n, w, L*H]
            feature_positions = verify_positions[:, :kept_width]
            holes = kept_width * len(active) != sum(accepted_counts) + len(active)
            feature_valid = kept if holes else None
            if holes:
                features = torch.where(kept[..., None], features, 0.0)
        del verify, verify_logits

    for streamer in streamers or []:
        streamer.end()
    _synchronize(device)
    ended = time.perf_counter()
    num_new_tokens = [len(tokens) for tokens in generated]
    new_ids = torch.full((num_rows, max(num_new_tokens)), pad_token_id, dtype=input_ids.dtype, device=device)
    for row, tokens in enumerate(generated):
        new_ids[row, : len(tokens)] = torch.tensor(tokens, dtype=input_ids.dtype, device=device)
    return SpecGenerateOutput(
        output_ids=torch.cat((input_ids, new_ids), dim=1),
        num_prompt_tokens=prompt_width,
        num_new_tokens=num_new_tokens,
        acceptance_lengths=acceptance_lengths,
        time_to_first_token=first_token_time - started,
        total_time=ended - started,
        block_size=block_size,
    )


def _as_streamers(streamer: Any, num_rows: int) -> list[Any] | None:
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
    return streamers


def _as_generators(
    generator: torch.Generator | Sequence[torch.Generator] | None, seed: int | None, num_rows: int, device: torch.device
) -> torch.Generator | list[torch.Generator] | None:
    """The sampling generator(s): the given one, one per row, or one seeded with `seed`."""
    if generator is None and seed is not None:
        return torch.Generator(device=device).manual_seed(seed)
    generators = list(generator) if isinstance(generator, (list, tuple)) else [generator]
    if isinstance(generator, (list, tuple)) and len(generators) != num_rows:
        raise ValueError(f"Got {len(generators)} generators for a batch of {num_rows}: pass one, or one per row.")
    for item in generators:
        if item is not None and item.device.type != device.type:
            raise ValueError(f"generator is on {item.device} but the target runs on {device}.")
    return generator if not isinstance(generator, tuple) else list(generator)


def default_pad_token_id(target: torch.nn.Module, stop_token_ids: list[int] | None) -> int:
    """Padding for rows that end early: the target's pad id, else its first stop token, else 0."""
    configured = getattr(getattr(target, "generation_config", None), "pad_token_id", None)
    if isinstance(configured, int):
        return configured
    return stop_token_ids[0] if stop_token_ids else 0


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
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    seed: int | None = None,
    mask_token_id: int | None = None,
    attention_mask: torch.Tensor | None = None,
    streamer: Any = None,
    pad_token_id: int | None = None,
    return_stats: bool = False,
) -> torch.Tensor | SpecGenerateOutput:
    """Generate with `target`, drafting blocks with `draft`; returns ids [N, prompt + new] (or stats too).

    Each row equals the target's own greedy decode of that prompt (temperature 0) or follows its sampling
    distribution. Prompts of a batch are left-padded (`attention_mask`); see `SpecGenerateOutput` for the format.
    """
    check_generation_inputs(target, input_ids, max_new_tokens, temperature, top_k, top_p, attention_mask)
    mask_token_id = check_draft_target(draft, target, mask_token_id, input_ids.shape[1] + max_new_tokens)
    block_size = draft.block_size if block_size is None else block_size
    if not isinstance(block_size, int) or not 1 <= block_size <= draft.block_size:
        raise ValueError(f"block_size must be an integer from 1 to the draft's trained size {draft.block_size}, got {block_size!r}.")
    if isinstance(stop_token_ids, int):
        stop_token_ids = [stop_token_ids]
    num_rows = input_ids.shape[0]
    attention = getattr(draft.config, "_attn_implementation", None)
    if num_rows > 1 and attention not in (None, "eager", "sdpa"):
        raise ValueError(
            f"A batch of {num_rows} needs a masked draft attention, which {attention!r} does not take here; "
            "call draft.set_attn_implementation('sdpa') first."
        )
    device = target.get_input_embeddings().weight.device
    generator = _as_generators(generator, seed if temperature > 0 else None, num_rows, device)
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
        attention_mask=attention_mask,
        streamers=_as_streamers(streamer, num_rows),
        pad_token_id=default_pad_token_id(target, stop_token_ids) if pad_token_id is None else pad_token_id,
    )
    return result if return_stats else result.output_ids
