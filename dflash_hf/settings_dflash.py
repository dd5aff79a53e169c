"""What one generation call does, decided once: `resolve_settings` merges the call's arguments over the generation
config (as `generate` does, `resolve_generation_choices`) and the draft's, checks every input (validation_dflash) and
whether the call can verify trees (`tree_dflash.tree_refusal`) or run compiled (`static_dflash.compile_refusal`), and
returns one frozen `DecodingSettings`. Stop, pad and mask ids, the block size, sampling, the acceptance rule, the CPU
kernels and the step costs are decided here and nowhere else (docs/architecture.md, "Where each setting is decided").

Hub remote code: imports only torch, transformers and its sibling files.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from transformers import GenerationConfig

from .devices_dflash import target_device
from .kernels_dflash import cpu_kernel_mode
from .processors_dflash import CallPrompts, PositionRules, position_rules
from .proposer_dflash import DFlashDraft, draft_vocab_ids
from .static_dflash import check_compile, compile_options, compile_refusal
from .tokens_dflash import default_pad_token_id, token_id_list
from .tree_dflash import check_tree_size
from .validation_dflash import check_draft_target, check_prompt, check_target, row_generators, row_streamers

# where neither the call nor the generation config sets a length (generate: max_length 20)
DEFAULT_MAX_NEW_TOKENS = 256
UNSET_MAX_LENGTH = GenerationConfig().max_length  # a config's max_length when nobody set it (20 on Transformers 4)
GENERATE_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0}  # generate's, for unset fields
ACCEPTANCE_RULES = ("rejection", "equality")
# The generation config's settings besides the length, sampling and token ids, with the values at which they change
# nothing: the decoding modes among them are refused (DECODING_MODES), the others are applied (processors_dflash).
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
    cpu_kernels: bool | str = True  # few-row products by the kernel timed fastest here: one of CPU_KERNEL_MODES
    generators: tuple[torch.Generator | None, ...] = ()  # one per row
    streamers: tuple[Any, ...] | None = None  # one per row
    step_costs: StepCosts | None = None  # given: each step verifies only the prefix of proposals worth its cost
    draft_vocab: torch.Tensor | None = None  # [K]: the ids the draft proposes from (None: every token)
    tree_size: int | None = None  # given: each step verifies a tree of this many drafted tokens (None: a chain)
    # given: torch.compile options of the static-shape verify (static_dflash) and of the draft's forward
    # (draft_backends_dflash)
    compile: dict[str, Any] | None = None
    rules: PositionRules | None = None  # generate's processors and criteria at each position (None: none to apply)
    attention_mask: torch.Tensor | None = None  # [N, T]: the prompts' mask, given or as generate infers it (None: all)
    return_dict: bool = False  # return_dict_in_generate: the call returns its output object, not the ids alone

    @property
    def greedy(self) -> bool:
        """Whether the call decodes greedily."""
        return self.temperature == 0.0


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
    criteria and outputs (NEUTRAL_GENERATION_SETTINGS); a decoding mode (DECODING_MODES) is refused by name, and so
    is a temperature, top_k, top_p or max_length out of its range.
    """
    target_config = getattr(target, "generation_config", None)
    unknown = sorted(key for key in arguments if key not in CALL_SETTINGS and key not in NEUTRAL_GENERATION_SETTINGS)
    if unknown:
        raise TypeError(f"spec_generate got unexpected keyword argument(s) {', '.join(unknown)}.")
    given = {key: value for key, value in arguments.items() if value is not None}
    # a passed config's unset fields come from the target's, as in generate
    settings = {key: value for config in (target_config, generation_config) if config is not None
                for key, value in config.to_dict().items() if value is not None}
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
    if max_new_tokens is None and ("max_length" in given or max_length not in (None, UNSET_MAX_LENGTH)):
        # max_new_tokens wins wherever it is set, as in generate; a max_length the call passes always counts
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
    if top_k is not None and top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0: no top-k filter), got {top_k}.")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
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


def check_token_settings(choices: GenerationChoices, vocabulary_size: int) -> None:
    """Raise a ValueError naming a token setting no decode can follow: a forced token (BOS or EOS) outside the
    vocabulary, or every forced token also suppressed (no token left at the forcing step; `generate` refuses it from
    Transformers 5), or `exponential_decay_length_penalty` without a stop id to favour."""
    settings = choices.settings
    suppressed = set(token_id_list(settings.get("suppress_tokens"), "suppress_tokens"))
    for name in ("forced_bos_token_id", "forced_eos_token_id"):
        forced = set(token_id_list(settings.get(name), name))
        outside = sorted(token for token in forced if not 0 <= token < vocabulary_size)
        if outside and vocabulary_size:
            raise ValueError(f"{name} {outside[0]} is outside the target's vocabulary (0 to {vocabulary_size - 1}).")
        if forced and forced <= suppressed:
            raise ValueError(f"Every token of {name} ({sorted(forced)}) is also in suppress_tokens, so no token is "
                             f"left at the forcing step; remove it from {name} or from suppress_tokens "
                             "(min_new_tokens keeps an early EOS back).")
    if settings.get("exponential_decay_length_penalty") is not None and not choices.stop_token_ids:
        raise ValueError("exponential_decay_length_penalty raises the EOS score, and this call has no eos_token_id: "
                         "pass eos_token_id (or stop_token_ids).")


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
    cpu_kernels: bool | str | None = None,
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
    draft_processors: str = "built",
    **generation_arguments: Any,
) -> DecodingSettings:
    """Every setting of one call, checked: the call's arguments over `generation_config` (default: the target's) as in
    `generate`, then the draft's (block size, mask id, draft vocabulary). `draft=None`: a proposer of the caller's,
    which needs `block_size`. `cpu_kernels=None`: on for a target that computes on the CPU
    (`kernels_dflash.cpu_kernel_mode`)."""
    check_target(target)
    kernels = cpu_kernel_mode(cpu_kernels, target_device(target).type)  # None: on for a CPU target
    if acceptance not in ACCEPTANCE_RULES:
        raise ValueError(f"acceptance must be 'rejection' or 'equality', got {acceptance!r}.")
    choices = resolve_generation_choices(
        target, input_ids.shape[-1] if isinstance(input_ids, torch.Tensor) else 0, generation_config,
        **generation_arguments)
    attention_mask = inferred_attention_mask(input_ids, attention_mask, choices)
    check_prompt(target, input_ids, attention_mask, choices.max_new_tokens)
    num_rows, device = input_ids.shape[0], target_device(target)
    padding = [0] * num_rows if attention_mask is None else (attention_mask == 0).sum(dim=1).tolist()
    lm_head = target.get_output_embeddings()
    vocabulary_size = 0 if lm_head is None else lm_head.weight.shape[0]  # the logits' width
    check_token_settings(choices, vocabulary_size)
    rules = position_rules(
        choices.settings, CallPrompts(input_ids.to(device), padding, input_ids.shape[1] + choices.max_new_tokens),
        temperature=choices.temperature, top_k=choices.top_k, top_p=choices.top_p,
        stop_token_ids=choices.stop_token_ids, device=device, logits_processor=logits_processor,
        stopping_criteria=stopping_criteria, prefix_allowed_tokens_fn=prefix_allowed_tokens_fn, tokenizer=tokenizer,
        draft_processors=draft_processors, vocabulary_size=vocabulary_size)
    if draft is not None:
        mask_token_id = check_draft_target(draft, target, mask_token_id, input_ids.shape[1] + choices.max_new_tokens)
    if step_costs is not None and not isinstance(step_costs, StepCosts):
        raise TypeError(f"step_costs must be a StepCosts (dflash_hf.cost_model.measure_verify_costs), got "
                        f"{type(step_costs).__name__}.")
    size = resolve_block_size(block_size, None if draft is None else draft.block_size)
    if step_costs is not None and len(step_costs.verify) < size:
        raise ValueError(f"step_costs times verify widths 1 .. {len(step_costs.verify)} but block_size is {size}; "
                         "measure them at this block size (dflash_hf.cost_model.measure_verify_costs).")
    check_tree_size(tree_size, target, draft, step_costs is not None)
    compile = check_compile(compile)
    if compile is not False:
        refusal = compile_refusal(target, step_costs, cpu_kernels,
                                  None if draft is None else draft.target_layer_ids)
        if refusal is not None:
            raise ValueError(refusal)
        kernels = False
    return DecodingSettings(
        max_new_tokens=choices.max_new_tokens, block_size=size, temperature=choices.temperature,
        top_k=choices.top_k, top_p=choices.top_p, stop_token_ids=frozenset(choices.stop_token_ids),
        pad_token_id=choices.pad_token_id, mask_token_id=mask_token_id, acceptance=acceptance,
        cpu_kernels=kernels,
        generators=row_generators(generator, num_rows, device, seed if choices.temperature > 0 else None),
        streamers=row_streamers(streamer, num_rows), step_costs=step_costs,
        draft_vocab=None if draft is None else draft_vocab_ids(draft, draft_vocab, vocabulary_size),
        tree_size=tree_size, compile=None if compile is False else compile_options(compile, device), rules=rules,
        return_dict=bool(choices.settings.get("return_dict_in_generate")), attention_mask=attention_mask,
    )


def inferred_attention_mask(input_ids: Any, attention_mask: Any, choices: GenerationChoices) -> Any:
    """The prompts' attention mask [N, T] as `generate` takes it: the one given; else, as `generate` infers it, 1
    where input_ids is not the call's `pad_token_id`, when one is set (by the call or the generation config), occurs
    in input_ids and is neither an `eos_token_id` (the call's or the config's) nor a stop id; else None (every token
    attends). A pad id inside a prompt, which `generate` would hide and a left-padded batch cannot, is refused."""
    pad = token_id_list(choices.settings.get("pad_token_id"), "pad_token_id")
    eos = {*token_id_list(choices.settings.get("eos_token_id"), "eos_token_id"), *choices.stop_token_ids}
    if attention_mask is not None or not pad or pad[0] in eos:
        return attention_mask
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or not bool((input_ids == pad[0]).any()):
        return None  # check_prompt names a malformed input_ids
    mask = (input_ids != pad[0]).long()  # [N, T]
    inside = ((mask[:, 1:] < mask[:, :-1]).any(dim=1)).nonzero().flatten().tolist()
    if inside:
        raise ValueError(f"Row {inside[0]} of input_ids holds pad_token_id {pad[0]} after a prompt token, and no "
                         "attention_mask was given: generate would infer a mask that hides it, which a left-padded "
                         "batch cannot. Pass attention_mask (the tokenizer's, padding_side='left'), or a pad_token_id "
                         "that does not occur in the prompts.")
    return mask


