"""What one generation call does, decided once: `resolve_settings` merges the call's arguments over the generation
config (as `generate` does) and the draft's, checks every input, and returns one frozen `DecodingSettings`. Stop, pad
and mask ids, the block size, sampling, the acceptance rule, the CPU kernels and the step costs are decided here and
nowhere else (docs/architecture.md, "Where each setting is decided").

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

import inspect
import math
import numbers
import warnings
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from .cache_dflash import config_cache, recurrent_layers, target_refusal, windowed_mask_refusal
from .devices_dflash import MASKED_ATTENTION, execution_device, target_device, target_text_config
from .mixers_dflash import rollback_mixers
from .processors_dflash import CallPrompts, PositionRules, position_rules
from .proposer_dflash import DFlashDraft, draft_vocab_ids
from .target_dflash import feature_modules
from .versions_dflash import torch_refusal

# where neither the call nor the generation config sets a length (generate: max_length 20)
DEFAULT_MAX_NEW_TOKENS = 256
GENERATE_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}  # generate's, for unset fields
ACCEPTANCE_RULES = ("rejection", "equality")
# Generation settings the loop cannot honour, with the values at which they change nothing.
NEUTRAL_GENERATION_SETTINGS = {
    "num_beams": 1, "num_beam_groups": 1, "num_return_sequences": 1, "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0, "no_repeat_ngram_size": 0, "min_length": 0, "min_new_tokens": 0,
    "typical_p": 1.0, "epsilon_cutoff": 0.0, "eta_cutoff": 0.0, "min_p": None, "diversity_penalty": 0.0,
    "bad_words_ids": None, "suppress_tokens": None, "begin_suppress_tokens": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "sequence_bias": None, "exponential_decay_length_penalty": None,
    "guidance_scale": 1.0, "stop_strings": None, "max_time": None, "penalty_alpha": None, "dola_layers": None,
    "watermarking_config": None, "output_scores": False, "output_logits": False, "return_dict_in_generate": False,
    "renormalize_logits": False, "remove_invalid_values": False, "prompt_lookup_num_tokens": None,
    "encoder_no_repeat_ngram_size": 0, "top_h": None,
}
# The settings among them that choose another decoding method than one sample (or argmax) per position: what it is,
# and why it stays refused, with the alternative. The others are logits processors, warpers, stopping criteria and
# outputs, which the loop applies at each verified position (processors_dflash; README, "What generate's arguments
# do"); benchmarks set them all neutral to compare plain decoding (`neutral_overrides`).
DECODING_MODES = {
    "num_beams": ("beam search", "it keeps several hypotheses per row, and speculative decoding verifies one; "
                                 "call target.generate for it"),
    "num_beam_groups": ("diverse beam search", "it keeps several hypotheses per row; call target.generate for it"),
    "diversity_penalty": ("diverse beam search", "it keeps several hypotheses per row; call target.generate for it"),
    "num_return_sequences": ("several sequences per prompt", "repeat the prompt in the batch (sampling draws each "
                                                             "row apart)"),
    "penalty_alpha": ("contrastive search", "it re-ranks candidates by the hidden states of each one, which a block "
                                            "verify does not compute; call target.generate for it"),
    "dola_layers": ("DoLa decoding", "it contrasts early and final layers' logits, another distribution than the "
                                     "target's; call target.generate for it"),
    "guidance_scale": ("classifier-free guidance", "it needs a second, unconditional forward per step; call "
                                                   "target.generate for it"),
    "watermarking_config": ("watermarking", "its processor is not applied per verified position; call "
                                            "target.generate for it"),
    "prompt_lookup_num_tokens": ("prompt-lookup decoding", "another speculative method; call target.generate for "
                                                           "it, or use DFlash's draft"),
}
CALL_SETTINGS = {"max_new_tokens", "max_length", "do_sample", "temperature", "top_k", "top_p", "stop_token_ids",
                 "eos_token_id", "pad_token_id", "use_cache"}  # what a call may pass besides the neutral settings


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one loop step measured on this machine at one batch size (`cost_model.measure_verify_costs`)."""

    draft: float  # a draft pass over the block
    verify: tuple[float, ...]  # verify[w - 1]: a target verify of w tokens per row, w = 1 .. block size

    def __post_init__(self) -> None:
        seconds = (self.draft, *self.verify)
        if not self.verify or not all(isinstance(value, numbers.Real) and math.isfinite(value) for value in seconds) \
                or min(self.verify) <= 0 or self.draft < 0:
            raise ValueError(f"StepCosts needs finite, positive verify seconds for widths 1 .. B and a finite draft "
                             f"time >= 0; got draft {self.draft}, verify {self.verify}. Measure them with "
                             "dflash_hf.cost_model.measure_verify_costs.")


@dataclass(frozen=True)
class DecodingSettings:
    """What one call of the loop does, resolved once (`resolve_settings`);
    per-row generators and streamers expanded."""

    max_new_tokens: int
    block_size: int  # tokens verified per step: the pending token and block_size - 1 proposals
    temperature: float = 0.0  # 0.0: greedy
    top_k: int | None = None  # None: no top-k filter
    top_p: float | None = None  # None: no top-p filter
    stop_token_ids: frozenset[int] = frozenset()
    pad_token_id: int = 0  # fills rows that ended early
    mask_token_id: int | None = None  # the draft's mask id (None: no DFlash draft)
    acceptance: str = "rejection"  # sampling: speculative sampling of the draft's q, or the equality rule
    cpu_kernels: bool = True  # few-row products by the fastest kernel timed here (a CPU target only)
    generators: tuple[torch.Generator | None, ...] = ()  # one per row
    streamers: tuple[Any, ...] | None = None  # one per row
    step_costs: StepCosts | None = None  # given: each step verifies only the prefix of proposals worth its cost
    draft_vocab: torch.Tensor | None = None  # [K]: the ids the draft proposes from (None: every token)
    tree_size: int | None = None  # given: each step verifies a tree of this many drafted tokens (None: a chain)
    compile: dict[str, Any] | None = None  # given: torch.compile options of the static-shape verify (static_dflash)
    rules: PositionRules | None = None  # generate's processors and criteria at each position (None: none to apply)
    return_dict: bool = False  # return_dict_in_generate: the call returns its output object, not the ids alone

    @property
    def greedy(self) -> bool:
        """Whether the call decodes greedily."""
        return self.temperature == 0.0


# --- Token ids -------------------------------------------------------------------------------------------------------


def token_id_list(value: Any, name: str) -> list[int]:
    """Token ids given as an int, a numpy or 0-d/1-d torch integer, or a flat list/tuple of those: a list of ints."""
    if value is None:
        return []
    if hasattr(value, "__array__") and getattr(value, "ndim", 0) >= 1 and not isinstance(value, torch.Tensor):
        value = torch.as_tensor(value)  # a numpy (or other array library's) array of ids
    if isinstance(value, torch.Tensor):
        if value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool or value.dim() > 1:
            raise TypeError(f"{name} must hold integer token ids (an int, a list of ints or a 1-d integer tensor), "
                            f"got a {value.dim()}-d {value.dtype} tensor.")
        return [int(item) for item in value.reshape(-1).tolist()]
    items = list(value) if isinstance(value, (list, tuple, set, frozenset)) else [value]
    ids = []
    for item in items:
        if isinstance(item, torch.Tensor) and item.dim() == 0 and not item.dtype.is_floating_point:
            item = item.item()
        if isinstance(item, str):
            raise TypeError(f"{name} holds the string {item!r}: pass token ids, e.g. "
                            f"tokenizer.convert_tokens_to_ids({item!r}).")
        if isinstance(item, (list, tuple, torch.Tensor)):
            raise TypeError(f"{name} must be a flat list of token ids, got {value!r}; DFlash stops on single tokens "
                            "(a stop sequence of several tokens is not supported).")
        if isinstance(item, bool) or not isinstance(item, numbers.Integral):
            raise TypeError(f"{name} must hold integer token ids, got {item!r} ({type(item).__name__}).")
        ids.append(int(item))
    return ids


@dataclass(frozen=True)
class GenerationTokens:
    """The ids a generation needs besides the prompt."""

    stop_token_ids: list[int]  # every EOS id of the target's generation config and of the tokenizer
    pad_token_id: int  # fills rows that ended early
    mask_token_id: int | None  # the draft's mask id (None without a draft)


def stop_token_ids_of(target: torch.nn.Module, tokenizer: Any = None) -> list[int]:
    """Every id that ends a response: the target generation config's EOS ids and the tokenizer's EOS, sorted."""
    ids: set[int] = set()
    for source in (getattr(target, "generation_config", None), tokenizer):
        ids.update(token_id_list(getattr(source, "eos_token_id", None), "eos_token_id"))
    return sorted(ids)


def default_pad_token_id(target: torch.nn.Module, stop_token_ids: list[int] | None, tokenizer: Any = None) -> int:
    """Padding for rows that end early: the target's pad id, else the tokenizer's,
    else the first stop token, else 0."""
    for source in (getattr(target, "generation_config", None), tokenizer):
        configured = token_id_list(getattr(source, "pad_token_id", None), "pad_token_id")
        if configured:
            return configured[0]
    return stop_token_ids[0] if stop_token_ids else 0


def resolve_mask_token_id(draft: DFlashDraft, tokenizer: Any = None) -> int | None:
    """The draft's mask id; looked up in the tokenizer when the config names the mask token only as a string."""
    if draft.mask_token_id is not None or tokenizer is None:
        return draft.mask_token_id
    name = draft.config.dflash_config.get("mask_token")
    mask_token_id = tokenizer.convert_tokens_to_ids(name) if name is not None else None
    if mask_token_id is None or mask_token_id == tokenizer.unk_token_id:
        raise ValueError(f"The draft's mask token {name!r} is not in the target tokenizer's vocabulary.")
    return int(mask_token_id)


def generation_tokens(target: torch.nn.Module, tokenizer: Any = None, draft: DFlashDraft | None = None
                      ) -> GenerationTokens:
    """Stop, pad and mask ids for generating with `target` (and `draft`): bench, train, demo and users share it."""
    stop_token_ids = stop_token_ids_of(target, tokenizer)
    return GenerationTokens(
        stop_token_ids=stop_token_ids,
        pad_token_id=default_pad_token_id(target, stop_token_ids, tokenizer),
        mask_token_id=None if draft is None else resolve_mask_token_id(draft, tokenizer),
    )


# --- generate()'s conventions: settings from the target's generation config ------------------------------------------


def non_neutral_settings(settings: dict[str, Any]) -> dict[str, Any]:
    """The settings among `settings` that change `generate`'s decoding (a mode, a processor, a criterion, an output):
    set, and not at their neutral value."""
    return {name: settings[name] for name, neutral in NEUTRAL_GENERATION_SETTINGS.items()
            if settings.get(name) is not None and settings[name] != neutral
            and not (name == "guidance_scale" and settings[name] == 1)}


def neutral_overrides(generation_config: Any) -> dict[str, Any]:
    """The neutral value of every setting in `generation_config` that changes plain decoding (benchmarks compare
    like with like)."""
    settings = generation_config.to_dict() if generation_config is not None else {}
    return {name: NEUTRAL_GENERATION_SETTINGS[name] for name in non_neutral_settings(settings)}


@dataclass(frozen=True)
class GenerationChoices:
    """A call's arguments merged over the generation config: what `generate` would decode."""

    max_new_tokens: int
    temperature: float  # 0.0: greedy
    top_k: int | None  # None: no top-k filter
    top_p: float | None  # None: no top-p filter
    stop_token_ids: list[int]
    pad_token_id: int
    settings: dict[str, Any]  # every setting, the call's over the generation config's (processors read theirs)


def _real_number(value: Any, name: str) -> float:
    """A finite real number, or a TypeError / ValueError naming the setting."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {value!r} ({type(value).__name__}).")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}.")
    return float(value)


def resolve_generation_choices(target: torch.nn.Module, prompt_length: int, generation_config: Any = None,
                               **arguments: Any) -> GenerationChoices:
    """Merge a call's arguments over `generation_config` (default: the target's), the way `generate` does.

    `arguments`: max_new_tokens (or max_length), do_sample, temperature, top_k, top_p,
    stop_token_ids (or eos_token_id), pad_token_id (None: not given), and the GenerationConfig fields of processors,
    criteria and outputs (NEUTRAL_GENERATION_SETTINGS); a decoding mode (DECODING_MODES) is refused by name.
    """
    config = generation_config if generation_config is not None else getattr(target, "generation_config", None)
    unknown = sorted(key for key in arguments if key not in CALL_SETTINGS and key not in NEUTRAL_GENERATION_SETTINGS)
    if unknown:
        raise TypeError(f"spec_generate got unexpected keyword argument(s) {', '.join(unknown)}.")
    given = {key: value for key, value in arguments.items() if value is not None}
    settings = {k: v for k, v in (config.to_dict() if config is not None else {}).items() if v is not None}
    merged = {**GENERATE_DEFAULTS, **settings, **given}
    config_source = "the generation config" if generation_config is not None else "target.generation_config"
    for name, value in non_neutral_settings(merged).items():
        if name in DECODING_MODES:
            source = "the call" if name in given else config_source
            mode, reason = DECODING_MODES[name]
            raise ValueError(f"{source} sets {name}={value!r}: {mode} does not run inside DFlash speculative "
                             f"decoding ({reason}); pass {name}={NEUTRAL_GENERATION_SETTINGS[name]!r} to override "
                             "it.")
    temperature = _real_number(merged["temperature"], "temperature")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}.")
    if "temperature" in given and "do_sample" not in given:  # dflash-hf's own shorthand: temperature 0 is greedy
        merged["do_sample"] = temperature > 0
    if merged["do_sample"] and temperature == 0:
        raise ValueError("do_sample=True with temperature 0: pass a temperature > 0 to sample, or do_sample=False.")
    max_new_tokens = given.get("max_new_tokens", settings.get("max_new_tokens"))
    max_length = given.get("max_length", settings.get("max_length"))
    if "max_new_tokens" not in given and ("max_length" in given
                                          or max_new_tokens is None and max_length not in (None, 20)):
        max_new_tokens = max_length - prompt_length  # generate's max_length counts the prompt
        if max_new_tokens < 1:
            source = "the call" if "max_length" in given else config_source
            raise ValueError(f"{source} sets max_length={max_length}, which leaves no room after the prompt of "
                             f"{prompt_length} tokens; pass max_new_tokens instead.")
    stop = given.get("stop_token_ids", given.get("eos_token_id", merged.get("eos_token_id")))
    stop_token_ids = token_id_list(stop, "stop_token_ids" if "stop_token_ids" in given else "eos_token_id")
    top_k, top_p = merged.get("top_k"), merged.get("top_p")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, numbers.Integral)):
        raise TypeError(f"top_k must be an integer (0: no top-k filter), got {top_k!r}.")
    top_p = None if top_p is None else _real_number(top_p, "top_p")
    pad = token_id_list(merged.get("pad_token_id"), "pad_token_id")
    return GenerationChoices(
        max_new_tokens=DEFAULT_MAX_NEW_TOKENS if max_new_tokens is None else max_new_tokens,
        temperature=temperature if merged["do_sample"] else 0.0,
        top_k=None if top_k == 0 else None if top_k is None else int(top_k),
        top_p=None if top_p in (None, 1.0) else top_p,
        stop_token_ids=stop_token_ids,
        pad_token_id=pad[0] if pad else default_pad_token_id(target, stop_token_ids),
        settings=merged,
    )


# --- Checks ----------------------------------------------------------------------------------------------------------


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


def check_generation_inputs(target: torch.nn.Module, input_ids: Any, choices: GenerationChoices,
                            attention_mask: Any) -> None:
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
    vocabulary = target.get_input_embeddings().weight.shape[0]
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocabulary:
        raise ValueError(f"input_ids holds token id {low if low < 0 else high}, outside the target's vocabulary "
                         f"(0 to {vocabulary - 1}); was the prompt tokenized with the target's tokenizer?")
    max_new_tokens = choices.max_new_tokens
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an integer >= 1, got {max_new_tokens!r}.")
    if choices.top_k is not None and choices.top_k < 1:
        raise ValueError(f"top_k must be >= 0 (0: no top-k filter), got {choices.top_k}.")
    if choices.top_p is not None and not 0.0 < choices.top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {choices.top_p}.")
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


# --- Per-row inputs --------------------------------------------------------------------------------------------------


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


def resolve_block_size(block_size: Any, trained_block_size: int | None) -> int:
    """The block size a call verifies: `block_size`, else the draft's trained size; checked against it."""
    block_size = trained_block_size if block_size is None else block_size
    if block_size is None:
        raise ValueError("block_size is required with a proposer that is not a DFlash draft.")
    limit = trained_block_size if trained_block_size is not None else block_size
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or not 1 <= block_size <= limit:
        raise ValueError(f"block_size must be an integer from 1 to the draft's trained size {limit}, "
                         f"got {block_size!r}.")
    return int(block_size)


def resolve_settings(
    target: torch.nn.Module,
    input_ids: torch.Tensor,
    draft: DFlashDraft | None = None,
    *,
    attention_mask: torch.Tensor | None = None,
    generation_config: Any = None,
    block_size: int | None = None,
    mask_token_id: int | None = None,
    acceptance: str = "rejection",
    cpu_kernels: bool | None = None,
    generator: torch.Generator | Sequence[torch.Generator] | None = None,
    seed: int | None = None,
    streamer: Any = None,
    step_costs: StepCosts | None = None,
    draft_vocab: bool | Sequence[int] | torch.Tensor | None = None,
    tree_size: int | None = None,
    compile: bool | dict[str, Any] | None = False,
    logits_processor: Any = None,
    stopping_criteria: Any = None,
    prefix_allowed_tokens_fn: Any = None,
    tokenizer: Any = None,
    **generation_arguments: Any,
) -> DecodingSettings:
    """Every setting of one call, checked: the call's arguments over `generation_config` (default: the target's) as in
    `generate`, then the draft's (block size, mask id, draft vocabulary). `draft=None`: a proposer of the caller's,
    which needs `block_size`. `cpu_kernels=None`: on for a target that computes on the CPU."""
    check_target(target)
    if acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"acceptance must be 'rejection' or 'equality', got {acceptance!r}.")
    choices = resolve_generation_choices(
        target, input_ids.shape[-1] if isinstance(input_ids, torch.Tensor) else 0, generation_config,
        **generation_arguments)
    check_generation_inputs(target, input_ids, choices, attention_mask)
    num_rows, device = input_ids.shape[0], target_device(target)
    padding = [0] * num_rows if attention_mask is None else (attention_mask == 0).sum(dim=1).tolist()
    rules = position_rules(
        choices.settings, CallPrompts(input_ids.to(device), padding, input_ids.shape[1] + choices.max_new_tokens),
        temperature=choices.temperature, top_k=choices.top_k, top_p=choices.top_p,
        stop_token_ids=choices.stop_token_ids, device=device, logits_processor=logits_processor,
        stopping_criteria=stopping_criteria, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, tokenizer=tokenizer)
    if draft is not None:
        mask_token_id = check_draft_target(draft, target, mask_token_id, input_ids.shape[1] + choices.max_new_tokens)
    if step_costs is not None and not isinstance(step_costs, StepCosts):
        raise TypeError(f"step_costs must be a StepCosts (dflash_hf.cost_model.measure_verify_costs), got "
                        f"{type(step_costs).__name__}.")
    size = resolve_block_size(block_size, None if draft is None else draft.block_size)
    if step_costs is not None and len(step_costs.verify) < size:
        raise ValueError(f"step_costs times verify widths 1 .. {len(step_costs.verify)} but block_size is {size}; "
                         "measure them at this block size (dflash_hf.cost_model.measure_verify_costs).")
    vocabulary_size = target.get_output_embeddings().weight.shape[0] if draft is not None else 0
    check_tree_size(tree_size, target, draft, step_costs)
    compile = check_compile(compile)
    if compile is not False:
        refusal = compile_refusal(target, step_costs, cpu_kernels,
                                  None if draft is None else draft.target_layer_ids)
        if refusal is not None:
            raise ValueError(refusal)
        cpu_kernels = False
    return DecodingSettings(
        max_new_tokens=choices.max_new_tokens, block_size=size, temperature=choices.temperature,
        top_k=choices.top_k, top_p=choices.top_p, stop_token_ids=frozenset(choices.stop_token_ids),
        pad_token_id=choices.pad_token_id, mask_token_id=mask_token_id, acceptance=acceptance,
        cpu_kernels=device.type == "cpu" if cpu_kernels is None else bool(cpu_kernels),
        generators=row_generators(generator, num_rows, device, seed if choices.temperature > 0 else None),
        streamers=row_streamers(streamer, num_rows), step_costs=step_costs,
        draft_vocab=None if draft is None else draft_vocab_ids(draft, draft_vocab, vocabulary_size),
        tree_size=tree_size, compile=None if compile is False else compile_options(compile, device), rules=rules,
        return_dict=bool(choices.settings.get("return_dict_in_generate")),
    )


def check_tree_size(tree_size: Any, target: torch.nn.Module, draft: DFlashDraft | None,
                    step_costs: StepCosts | None) -> None:
    """Raise when `tree_size` is not a positive int (or None), or when the call cannot verify a tree."""
    if tree_size is None:
        return
    if tree_size == "auto":
        raise ValueError("tree_size='auto' is a choice timed on this machine, made once and not per call: pass the "
                         "size that dflash_hf.cost_model.choose_tree_size(draft, target, prompt, ...) returns (bench "
                         "and demo do this; docs/sampling.md, \"Trees\").")
    if isinstance(tree_size, bool) or not isinstance(tree_size, int) or tree_size < 1:
        raise ValueError(f"tree_size must be a positive int (drafted tokens per step) or None (a chain), got "
                         f"{tree_size!r}.")
    refusal = tree_refusal(target, draft, step_costs)
    if refusal is not None:
        raise ValueError(refusal)


def tree_refusal(target: torch.nn.Module, draft: DFlashDraft | None, step_costs: StepCosts | None = None
                 ) -> str | None:
    """Why calls with this target and draft cannot verify trees (`spec_generate(tree_size=N)` raises it), or None."""
    if step_costs is not None:
        return "tree_size and step_costs (verify widths chosen per step) cannot be combined; pass one."
    config = target_text_config(target)
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in MASKED_ATTENTION:
        return (f"tree_size needs the target's attention to take a 4-D mask ({', '.join(MASKED_ATTENTION)}); this "
                f"target uses {implementation!r}: load it with attn_implementation=\"sdpa\".")
    refusal = windowed_mask_refusal(config)
    if refusal is not None:
        return (f"tree_size is not supported with {type(target).__name__}: {refusal} (a tree's mask is built by "
                "position for full and sliding-window attention); pass tree_size=None.")
    return None


def compile_refusal(target: torch.nn.Module, step_costs: Any, cpu_kernels: bool | None,
                    layer_ids: list[int] | None) -> str | None:
    """Why `compile=True` cannot run this call (`spec_generate` raises it), or None."""
    config = target_text_config(target)
    implementation = getattr(config, "_attn_implementation", None)
    if step_costs is not None:
        return ("compile=True verifies at one fixed width, and step_costs chooses a width per step: pass "
                "step_costs=None (a tree, tree_size=N, verifies more candidates at a fixed width).")
    if cpu_kernels:
        return ("compile=True runs Transformers' own kernels inside the compiled graph: pass cpu_kernels=False (or "
                "leave it unset).")
    if recurrent_layers(config):
        refusal = target_refusal(target, config)  # what the eager loop refuses too (a family, Transformers 4.57)
        if refusal is not None:
            return refusal
        mixers = rollback_mixers(target, config_cache(config))  # a ValueError where no rollback could be exact
        others = sorted({type(mixer.module).__name__ for mixer in mixers if mixer.gated_delta is None})
        if others:
            return (f"compile=True is not supported with {type(target).__name__}: it rolls back Gated DeltaNet "
                    f"layers (Transformers >= 5.25) at fixed shapes, and this target's recurrent layers are "
                    f"{', '.join(others)}; pass compile=False (the eager loop runs it exactly, chains and trees; "
                    "README, \"Hybrid targets\").")
    refusal = windowed_mask_refusal(config)
    if refusal is not None:
        return (f"compile=True is not supported with {type(target).__name__}: {refusal}; pass compile=False.")
    if implementation not in MASKED_ATTENTION:
        return (f"compile=True needs the target's attention to be one of {', '.join(MASKED_ATTENTION)}; this "
                f"target uses {implementation!r}: load it with attn_implementation=\"sdpa\".")
    if layer_ids and feature_modules(target, layer_ids) is None:
        return (f"compile=True takes the draft's features from the target's decoder layers, which "
                f"{type(target).__name__} does not expose as a list of num_hidden_layers modules.")
    return torch_refusal("compile=True")


def check_compile(option: Any) -> bool | dict[str, Any]:
    """`compile=option` checked: True, False (None reads as False) or a dict of `torch.compile` keyword arguments
    whose names and backend torch knows; anything else is refused by name, before any forward."""
    if option is None or isinstance(option, bool):
        return bool(option)
    if not isinstance(option, dict):
        raise TypeError(f"compile must be True, False or a dict of torch.compile options, got {option!r}.")
    parameters = inspect.signature(torch.compile).parameters.values()
    accepted = [parameter.name for parameter in parameters if parameter.name != "model"]
    unknown = sorted(set(option) - set(accepted))
    if unknown and not any(parameter.kind is inspect.Parameter.VAR_KEYWORD for parameter in parameters):
        raise ValueError(f"compile={{...}} is passed to torch.compile, which takes no {', '.join(unknown)}; its "
                         f"options are {', '.join(accepted)}.")
    backend = option.get("backend")
    if isinstance(backend, str) and backend not in torch.compiler.list_backends(exclude_tags=()):
        raise ValueError(f"compile={{'backend': {backend!r}}} names no backend of this torch; it has "
                         f"{', '.join(torch.compiler.list_backends())} (torch.compiler.list_backends()).")
    return option


def compile_options(option: bool | dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The `torch.compile` options of `compile=option`: True gives inductor, with CUDA graphs on a GPU
    (`mode="reduce-overhead"`); a dict is passed to `torch.compile` with `fullgraph=True` unless it sets `fullgraph`
    itself (a whole graph by default: a graph break would run part of every verify eagerly, without a word). Each
    compiled function's graphs count apart against the recompile limit (`isolate_recompiles`, unless the dict sets it):
    the targets and drafts of one process do not add up."""
    if isinstance(option, dict):
        return {"fullgraph": True, "isolate_recompiles": True, **option}
    on_gpu = {"mode": "reduce-overhead"} if device.type == "cuda" else {}
    return {**on_gpu, "fullgraph": True, "isolate_recompiles": True}
