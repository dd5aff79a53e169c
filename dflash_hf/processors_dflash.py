"""`generate`'s logits processors, warpers and stopping criteria, applied at each verified position.

A verify holds the target's logits at every drafted position, and the prefix of each position is known: the row's
prompt as passed (left padding included, as `generate` sees it), its committed tokens, and the proposals before the
position (a tree: the node's path). `PositionRules` runs a call's processors on each position with that prefix, so a
greedy proposal is judged against the processed argmax and speculative sampling keeps the processed, warped
distribution; and it finds the first committed position at which a stopping criterion ends a row, so a row stops
where `generate` stops, also inside an accepted block.

The processors are built here, in `generate`'s order, from Transformers' public classes (`generate`'s own builder is
private and moves between releases). Each position is processed as a batch of one row, so a processor is called at
every verified position (rejected ones included) and must depend only on its arguments; `prefix_allowed_tokens_fn`
is still given its row's index in the call's batch. The draft's proposals go through the same processors
(`DraftRules`: Transformers' prefix rules, a user's own only when asked), so a token they forbid is never proposed
and a token they penalise is penalised in the draft too. README, "What generate's arguments do".

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch
from transformers.generation import (
    EncoderNoRepeatNGramLogitsProcessor,
    EncoderRepetitionPenaltyLogitsProcessor,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessorList,
    MaxTimeCriteria,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    PrefixConstrainedLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    StoppingCriteriaList,
    StopStringCriteria,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

from .versions_dflash import REPETITION_PENALTY_SKIPS_PADDING

# What the loop's own vectorised path (`sampling_dflash.process_logits`) already applies exactly.
VECTORISED = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper)
# Transformers' processors whose change to a position's scores is decided by the ids before it (with the call's
# prompts and lengths): the draft's proposals go through them too (`DraftRules`). Warpers are not among them (the
# draft's q takes the call's temperature, top-k and top-p, `proposer_dflash.draft_distribution`), nor is a user's own
# processor unless the call passes draft_processors="all" (it may be costly, or read state).
PREFIX_RULES = (
    SequenceBiasLogitsProcessor, EncoderRepetitionPenaltyLogitsProcessor, RepetitionPenaltyLogitsProcessor,
    NoRepeatNGramLogitsProcessor, EncoderNoRepeatNGramLogitsProcessor, NoBadWordsLogitsProcessor,
    MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor, PrefixConstrainedLogitsProcessor,
    ForcedBOSTokenLogitsProcessor, ForcedEOSTokenLogitsProcessor, InfNanRemoveLogitsProcessor,
    ExponentialDecayLengthPenalty, SuppressTokensLogitsProcessor, SuppressTokensAtBeginLogitsProcessor,
)
DRAFT_PROCESSORS = ("built", "all", "none")  # spec_generate(draft_processors=...): what shapes the draft's proposals


@dataclass(frozen=True)
class CallPrompts:
    """What the processors of one call are built from: its prompts as passed and their lengths."""

    input_ids: torch.Tensor  # [N, T], left padding kept
    padding: list[int]  # per row: its left padding
    max_length: int  # T + max_new_tokens: `generate`'s max_length


def _penalties(config: Mapping[str, Any], prompt: torch.Tensor, padding: int) -> list:
    """The processors `generate` adds before its length rules, for one row (prompt [1, T])."""
    processors: list = []
    if config.get("sequence_bias") is not None:
        processors.append(SequenceBiasLogitsProcessor(sequence_bias=config["sequence_bias"]))
    if config.get("encoder_repetition_penalty") not in (None, 1.0):
        processors.append(EncoderRepetitionPenaltyLogitsProcessor(config["encoder_repetition_penalty"], prompt))
    if config.get("repetition_penalty") not in (None, 1.0):
        processors.append(RepetitionPenaltyLogitsProcessor(config["repetition_penalty"],
                                                           **({"prompt_ignore_length": padding}
                                                              if REPETITION_PENALTY_SKIPS_PADDING else {})))
    if (config.get("no_repeat_ngram_size") or 0) > 0:
        processors.append(NoRepeatNGramLogitsProcessor(config["no_repeat_ngram_size"]))
    if (config.get("encoder_no_repeat_ngram_size") or 0) > 0:
        processors.append(EncoderNoRepeatNGramLogitsProcessor(config["encoder_no_repeat_ngram_size"], prompt))
    return processors


def _length_rules(config: Mapping[str, Any], prompts: CallPrompts, stop_token_ids: list[int], row: int,
                  prefix_allowed_tokens_fn: Callable | None, device: torch.device) -> list:
    """Bad words, length rules, the prefix constraint, forced and suppressed tokens, as `generate` orders them."""
    processors: list = []
    eos = stop_token_ids or None
    width = prompts.input_ids.shape[1]
    if config.get("bad_words_ids") is not None:
        processors.append(NoBadWordsLogitsProcessor(config["bad_words_ids"], eos))
    min_length = config.get("min_length")
    if config.get("min_new_tokens") is not None:  # as in generate: min_new_tokens sets min_length, the call's dropped
        min_length = width + config["min_new_tokens"]
    if eos is not None and (min_length or 0) > width:  # at most the prompts' width: it never masks
        processors.append(MinLengthLogitsProcessor(min_length, eos, device=device))
    if eos is not None and (config.get("min_new_tokens") or 0) > 0:
        processors.append(MinNewTokensLengthLogitsProcessor(width, config["min_new_tokens"], eos, device=device))
    if prefix_allowed_tokens_fn is not None:  # its batch index: the row's own, though each row is processed alone
        processors.append(PrefixConstrainedLogitsProcessor(
            lambda _, sequence: prefix_allowed_tokens_fn(row, sequence), 1))
    if config.get("forced_bos_token_id") is not None:
        processors.append(ForcedBOSTokenLogitsProcessor(config["forced_bos_token_id"]))
    if config.get("forced_eos_token_id") is not None:
        processors.append(ForcedEOSTokenLogitsProcessor(prompts.max_length, config["forced_eos_token_id"],
                                                        device=device))
    if config.get("remove_invalid_values") is True:
        processors.append(InfNanRemoveLogitsProcessor())
    if config.get("exponential_decay_length_penalty") is not None:
        processors.append(ExponentialDecayLengthPenalty(config["exponential_decay_length_penalty"], eos, width))
    if config.get("suppress_tokens") is not None:
        processors.append(SuppressTokensLogitsProcessor(config["suppress_tokens"], device=device))
    if config.get("begin_suppress_tokens") is not None:
        begin = width if width > 1 or config.get("forced_bos_token_id") is None else width + 1
        processors.append(SuppressTokensAtBeginLogitsProcessor(config["begin_suppress_tokens"], begin,
                                                               device=device))
    return processors


def _warpers(config: Mapping[str, Any], temperature: float, top_k: int | None, top_p: float | None,
             device: torch.device) -> list:
    """The sampling warpers, in `generate`'s order (none when decoding greedily: temperature 0)."""
    if temperature == 0.0:
        return []
    warpers: list = []
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if config.get("top_h") is not None:
        from transformers.generation import TopHLogitsWarper  # Transformers 5 only; its config field too

        warpers.append(TopHLogitsWarper(top_h=config["top_h"]))
    if top_k is not None:
        warpers.append(TopKLogitsWarper(top_k=top_k))
    if top_p is not None:
        warpers.append(TopPLogitsWarper(top_p=top_p))
    if config.get("min_p") is not None:
        warpers.append(MinPLogitsWarper(min_p=config["min_p"]))
    if config.get("typical_p") not in (None, 1.0):
        warpers.append(TypicalLogitsWarper(mass=config["typical_p"]))
    if 0.0 < (config.get("epsilon_cutoff") or 0.0) < 1.0:
        warpers.append(EpsilonLogitsWarper(epsilon=config["epsilon_cutoff"]))
    if 0.0 < (config.get("eta_cutoff") or 0.0) < 1.0:
        warpers.append(EtaLogitsWarper(epsilon=config["eta_cutoff"], device=device))
    return warpers


def _merged(defaults: list, custom: LogitsProcessorList | StoppingCriteriaList | None, kind: type) -> list:
    """`generate`'s merge of a user's list into its own: a user's item replaces a built one of the same class; the
    others follow."""
    custom = list(custom or [])
    merged = [next((item for item in custom if type(item) is type(default)), default) for default in defaults]
    return kind(merged + [item for item in custom if item not in merged])


@dataclass(frozen=True)
class DraftRules:
    """The processors that shape a draft's proposals (`PREFIX_RULES`, and a user's with draft_processors="all"), per
    row of the call, with the prompts as passed: a proposal's prefix is its row's prompt (left padding kept), its
    committed tokens and the proposals before it, the prefix the verify will give its position."""

    row_processors: list[LogitsProcessorList]  # per row of the call
    input_ids: torch.Tensor  # [N, T] as passed
    vocabulary_size: int  # V: the width of the scores they process

    def scores(self, logits: torch.Tensor, rows: list[int], prefixes: list[torch.Tensor]) -> torch.Tensor:
        """Processed scores [n, V] (float32) of the draft's logits [n, V] at one position of rows `rows` (the call's
        row of each); prefixes[i] [L]: the ids before that row's position."""
        processed = logits.to(torch.float32, copy=True)  # processors may write in place
        for index, (row, prefix) in enumerate(zip(rows, prefixes)):
            processed[index] = self.row_processors[row](prefix[None], processed[index][None])[0]
        return processed

    def forbidden(self, row: int, prefixes: list[torch.Tensor], tokens: list[int]) -> list[bool]:
        """Whether row `row`'s processors rule tokens[i] out after prefixes[i] [L_i]: Transformers' own
        (`PREFIX_RULES`) give it -inf whatever the logits (a mask: bad words, n-grams, lengths, suppression, a prefix
        constraint), so the target's p is 0 there; read from the device at once. A user's processor is not asked:
        what it does may depend on the logits."""
        if not tokens:
            return []
        masks = []
        for prefix, token in zip(prefixes, tokens):
            scores = torch.zeros((1, self.vocabulary_size), dtype=torch.float32, device=prefix.device)
            for processor in self.row_processors[row]:
                if type(processor) in PREFIX_RULES:
                    scores = processor(prefix[None], scores)
            masks.append(scores[0, token])
        return (torch.stack(masks) == float("-inf")).tolist()


@dataclass
class PositionRules:
    """A call's processors (one list per row: its prompt, padding and index) and stopping criteria, applied at each
    verified position; what the call returns besides the ids."""

    row_processors: list[LogitsProcessorList]  # per row, `generate`'s list for that row
    stopping: StoppingCriteriaList | None  # None: only stop tokens and max_new_tokens end rows
    output_scores: bool
    output_logits: bool
    draft: DraftRules | None = None  # what shapes the draft's proposals (None: nothing)

    @property
    def keeps_scores(self) -> bool:
        """Whether a verify's processed scores are read after it (criteria or outputs)."""
        return self.stopping is not None or self.output_scores

    def scores(self, logits: torch.Tensor, prefixes: list[list[torch.Tensor | None]], rows: list[int]) -> torch.Tensor:
        """Processed scores [n, w, V] (float32) of logits [n, w, V]; prefixes[i][j]: the ids [L] before position j
        of row rows[i], or None where the row cannot commit that position (its scores stay the logits, never read)."""
        processed = logits.to(torch.float32, copy=True)  # processors may write in place
        for index, row in enumerate(rows):
            processors = self.row_processors[row]
            for column, prefix in enumerate(prefixes[index]):
                if prefix is not None:
                    processed[index, column] = processors(prefix[None], processed[index, column][None])[0]
        return processed

    def first_stop(self, sequence: torch.Tensor, num_new: int, scores: torch.Tensor) -> int | None:
        """The first of a row's `num_new` newly committed tokens (the last ones of `sequence` [L]) after which a
        stopping criterion ends the row, or None; scores [num_new, V]: the processed scores each was chosen from."""
        if self.stopping is None:
            return None
        start = sequence.shape[0] - num_new
        for index in range(num_new):
            if bool(self.stopping(sequence[None, : start + index + 1], scores[index : index + 1]).any()):
                return index
        return None


def position_rules(config: Mapping[str, Any], prompts: CallPrompts, *, temperature: float, top_k: int | None,
                   top_p: float | None, stop_token_ids: list[int], device: torch.device,
                   logits_processor: LogitsProcessorList | None = None,
                   stopping_criteria: StoppingCriteriaList | None = None,
                   prefix_allowed_tokens_fn: Callable | None = None, tokenizer: Any = None,
                   draft_processors: str = "built", vocabulary_size: int = 0) -> PositionRules | None:
    """The call's `PositionRules` from `config` (the call's settings merged over the generation config), or None
    when the loop's vectorised path already does what `generate` would (no processor beyond temperature, top-k and
    top-p, no stopping criterion, no scores asked for). `draft_processors`: which of them shape the draft's proposals
    (`DRAFT_PROCESSORS`: "built", Transformers' prefix rules; "all", a user's too; "none")."""
    if draft_processors not in DRAFT_PROCESSORS:
        raise ValueError(f"draft_processors must be one of {DRAFT_PROCESSORS} (README, \"What generate's arguments "
                         f"do\"), got {draft_processors!r}.")
    if config.get("stop_strings") is not None and tokenizer is None:
        raise ValueError("stop_strings needs the target's tokenizer: pass tokenizer=... as you would to generate.")
    criteria: list = []
    if config.get("max_time") is not None:
        criteria.append(MaxTimeCriteria(max_time=config["max_time"], initial_timestamp=time.time()))
    if config.get("stop_strings") is not None:
        criteria.append(StopStringCriteria(tokenizer=tokenizer, stop_strings=config["stop_strings"]))
    stopping = _merged(criteria, stopping_criteria, StoppingCriteriaList)
    warpers = _warpers(config, temperature, top_k, top_p, device)
    row_processors, draft_row_processors = [], []
    for row in range(prompts.input_ids.shape[0]):
        prompt = prompts.input_ids[row : row + 1]  # [1, T]
        built = (_penalties(config, prompt, prompts.padding[row])
                 + _length_rules(config, prompts, stop_token_ids, row, prefix_allowed_tokens_fn, device))
        merged = list(_merged(built, logits_processor, LogitsProcessorList))
        row_processors.append(LogitsProcessorList(merged + warpers + ([LogitNormalization()]
                                                                      if config.get("renormalize_logits") else [])))
        draft_row_processors.append(LogitsProcessorList(
            [] if draft_processors == "none" else
            [item for item in merged if draft_processors == "all" or type(item) in PREFIX_RULES]))
    returned = bool(config.get("return_dict_in_generate"))  # generate returns scores only inside its output
    output_scores = returned and bool(config.get("output_scores"))
    output_logits = returned and bool(config.get("output_logits"))
    beyond_vectorised = any(not isinstance(item, VECTORISED) for item in row_processors[0])  # every row: alike
    if not (beyond_vectorised or stopping or output_scores or output_logits):
        return None
    draft = (DraftRules(draft_row_processors, prompts.input_ids, vocabulary_size)
             if any(draft_row_processors) else None)
    return PositionRules(row_processors, stopping or None, output_scores, output_logits, draft)
