"""Differential fuzzing of `spec_generate` against the target's own greedy `generate` (issue 67, item 8).

Each case is drawn from `random.Random(base_seed + index)`, so case N replays alone (`scripts/fuzz_generate.py
--case N`). A case picks a target family and seed, a vocabulary (128, or 16 so that random drafts get proposals
accepted), a draft family, a block size, a chain or a tree, 1-4 prompts left-padded with an attention mask (or passed
without one), `max_new_tokens`, stop settings and up to two of `generate`'s processors; decoding is greedy.

Comparison follows the tests' conventions: with a processor, or without an attention mask, the batch output equals
`target.generate` on the same batch, padding included (tests/test_generate_arguments.py); otherwise, and always with
stop strings, each row's new tokens equal `generate` on that row's prompt alone (tests/test_target_families.py); a
case with stop strings and a processor runs its first prompt only (`prompts_of_case`). An error raised by both
calls, or a documented refusal (KNOWN_REFUSALS, docs/api.md "Errors") raised by `spec_generate`, is "refused"; any
other error is "crashed".
"""

from __future__ import annotations

import random
import re
import tempfile
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import transformers
from helpers import (
    COMMON_DECODER,
    DRAFT_VARIANTS,
    FAMILIES,
    HIDDEN_SIZE,
    RECURRENT_FAMILIES,
    draft_config,
    make_char_tokenizer,
    make_hybrid_target,
    make_target,
    make_variant_draft,
)
from transformers import GenerationConfig, LogitsProcessor, LogitsProcessorList

from dflash_hf import DFlashDraftModel, left_pad
from dflash_hf.families_dflash import RECURRENT_REFUSALS
from dflash_hf.settings_dflash import StepCosts

ATTENTION_TARGETS = list(FAMILIES) + ["gpt2"]  # qwen3, llama, llama3_rope, qwen3_moe, mistral, gpt_oss, gemma3,
# gemma4, gemma4_unified (tests/helpers.py FAMILIES) and GPT-2 (tests/test_lossless.py)
HYBRID_TARGETS = ["qwen3_5", "qwen3_next", "qwen3_5_moe", "qwen3_5_vl"]
ROLLED_BACK_TARGETS = [name for name in RECURRENT_FAMILIES if name not in RECURRENT_REFUSALS]
REFUSED_TARGETS = list(RECURRENT_REFUSALS)  # refused before any forward: every case on them is "refused"
DEEPSPEC_KINDS = ("vanilla", "gated", "rnn")
# confidence_threshold="auto"'s step costs: a verify that costs more per token as it widens (widths 1 .. 32)
SCHEDULE_COSTS = StepCosts(draft=0.1, verify=tuple(1.0 + 0.2 * width ** 1.2 for width in range(32)))
DRAFT_FAMILIES = (["dflash", "draft_vocab", "own_head", "speculators", "deepspec_dflash", "muse_glimmer"]
                  + list(DRAFT_VARIANTS) + [f"dspark_{kind}" for kind in DEEPSPEC_KINDS])
PROCESSORS = ["repetition_penalty", "encoder_repetition_penalty", "no_repeat_ngram_size", "bad_words_ids",
              "sequence_bias", "suppress_tokens", "begin_suppress_tokens", "min_length", "min_new_tokens",
              "forced_eos_token_id", "exponential_decay_length_penalty", "renormalize_logits",
              "remove_invalid_values", "logits_processor"]

# Refusals that docs/api.md ("Errors", the argument table) and docs/support.md list: a ValueError or TypeError from
# spec_generate whose message matches one of these is "refused", not "crashed".
KNOWN_REFUSALS = [
    r"is not supported: its layers of type .* keep a recurrent state",  # RECURRENT_REFUSALS targets
    r"pad",  # no mask and a pad id after a prompt token; padding on the right
    r"tree_size",  # trees refused with confidence_threshold
    r"confidence",  # confidence_threshold without a confidence head
    r"no suppress|also in .?suppress_tokens|forced",  # forced BOS/EOS inside suppress_tokens
    r"exponential_decay_length_penalty",  # without an EOS id
]

EQUAL, MISMATCH, REFUSED, CRASHED = "equal", "mismatch", "refused", "crashed"


# --- Drawing a case --------------------------------------------------------------------------------------------------


def draw_case(index: int, base_seed: int = 0) -> dict[str, Any]:
    """The case `index` of the run seeded `base_seed`: a JSON-able dict of choices (stop ids and processor settings
    that need the plain continuation are drawn as positions in it, resolved by `run_case`)."""
    rng = random.Random(base_seed + index)
    target_family = rng.choices([ATTENTION_TARGETS, HYBRID_TARGETS, ROLLED_BACK_TARGETS, REFUSED_TARGETS],
                                weights=[70, 14, 12, 4])[0]
    target_family = rng.choice(target_family)
    draft_family = rng.choice(DRAFT_FAMILIES)
    trained_block = 7 if draft_family.startswith(("dspark", "deepspec")) else 8
    num_rows = rng.choices([1, 2, 3, 4], weights=[40, 25, 20, 15])[0]
    case: dict[str, Any] = {
        "index": index, "base_seed": base_seed,
        "target": target_family, "target_seed": rng.randrange(2), "vocab": rng.choice([128, 16]),
        # a target leaning to a bigram or to one token, which random drafts then guess: blocks get accepted
        "lean": rng.choices([None, "bigram", "constant"], weights=[50, 25, 25])[0],
        "draft": draft_family, "draft_seed": rng.randrange(4),
        "block_size": rng.choice([None, 1, 2, 3, 4, 5, trained_block]),
        "tree_size": rng.choice([None, None, None, 2, 4, 6, 10]),
        "prompt_lengths": [rng.randint(1, 24) for _ in range(num_rows)],
        "prompt_seed": rng.randrange(10**6),
        "mask": rng.random() < 0.85, "pad_in_prompt": rng.random() < 0.1,
        "max_new_tokens": rng.choice([1, 2, 3, 5, 8, 13, 20, 32]),
        "stop": None, "processors": [],
        "confidence_threshold": None,
    }
    if draft_family.startswith("dspark") and rng.random() < 0.5:
        case["confidence_threshold"] = rng.choice([0.2, 0.5, 0.8, 1.0, "auto"])  # "auto": with SCHEDULE_COSTS
    if case["confidence_threshold"] is not None and rng.random() < 0.75:
        case["tree_size"] = None  # trees are refused there (docs/api.md): drawn a quarter of the time only
    stop_kind = rng.choices(["none", "call", "stop_token_ids", "config", "stop_strings"],
                            weights=[30, 20, 20, 15, 15])[0]
    if stop_kind != "none":  # positions in row 0's plain continuation (random ids too, sometimes none is hit)
        picks = [rng.randrange(0, 12) for _ in range(rng.randint(1, 3))]
        case["stop"] = {"via": stop_kind, "positions": picks, "random_id": rng.random() < 0.2,
                        "random_value": rng.randrange(1, 15)}
    count = rng.choices([0, 1, 2], weights=[45, 35, 20])[0]
    for name in rng.sample(PROCESSORS, count):
        case["processors"].append({"name": name, "positions": [rng.randrange(0, 8) for _ in range(3)],
                                   "value": rng.random()})
    case["length_via"] = rng.choices(["max_new_tokens", "max_length"], weights=[80, 20])[0]
    # which processors shape the draft's proposals (docs/api.md): never the output
    case["draft_processors"] = rng.choice([None, "built", "all", "none"]) if count else None
    return case


# --- Building the models ---------------------------------------------------------------------------------------------

_TARGETS: dict[tuple, torch.nn.Module] = {}
_FOLDERS: list[tempfile.TemporaryDirectory] = []


def build_target(family: str, seed: int, vocab: int, lean: str | None = None) -> torch.nn.Module:
    """A tiny float32 target of `family` (tests/helpers.py's tables), cached per (family, seed, vocab, lean). `lean`
    scales its embedding up and plants half its LM head, as tests/deepspec_fixture.py's golden target: "bigram", so
    that token v's embedding points to the row of token (5v + 3) mod V (followed about half the time); "constant", so
    that every embedding points to the row of token 6 (which then comes almost always, until a processor or a stop
    intervenes). Random drafts share the target's embedding and head, so they guess these and get blocks accepted."""
    key = (family, seed, vocab, lean)
    if key in _TARGETS:
        return _TARGETS[key]
    if family in ("qwen3", "llama"):
        target = make_target(family, seed=seed, vocab_size=vocab)
    elif family == "gpt2":
        torch.manual_seed(seed)
        target = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=vocab, n_embd=HIDDEN_SIZE, n_layer=4, n_head=4, n_positions=256, initializer_range=0.1,
            bos_token_id=None, eos_token_id=None)).eval()
        target.generation_config.eos_token_id = None
    elif family in FAMILIES:
        model_class, config_class, settings = FAMILIES[family]
        settings = dict(settings)
        if "vocab_size_per_layer_input" in settings:
            settings["vocab_size_per_layer_input"] = vocab
        torch.manual_seed(seed)
        config = getattr(transformers, config_class)(**{**COMMON_DECODER, **settings, "vocab_size": vocab})
        target = getattr(transformers, model_class)(config).eval()
        target.generation_config.eos_token_id = None
    else:
        target = make_hybrid_target(family, seed=seed, vocab_size=vocab)
    if lean:
        with torch.no_grad():
            embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
            embedding.mul_(10.0)
            unit = embedding / embedding.norm(dim=-1, keepdim=True)  # [V, H]
            planted = torch.zeros_like(head)  # [V, H]
            if lean == "bigram":
                planted[(5 * torch.arange(vocab) + 3) % vocab] = 8.0 * unit
            else:
                planted[6] = 8.0 * unit.sum(0)
            head.mul_(0.5).add_(0.5 * planted)
    _TARGETS[key] = target
    return target


def deepspec_settings(kind: str) -> dict:
    """Config overrides of a DeepSpec draft (`Qwen3DSparkModel`): rank 0 is DeepSpec's DFlash; DSpark's Markov head
    kinds with a confidence head, as tests/test_deepspec_drafts.py builds them."""
    settings = dict(architectures=["Qwen3DSparkModel"], block_size=7)
    if kind != "dflash":
        settings.update(markov_rank=8, markov_head_type=kind, enable_confidence_head=True,
                        confidence_head_with_markov=kind != "rnn")
    return settings


def build_draft(family: str, seed: int, vocab: int, target: torch.nn.Module) -> tuple[DFlashDraftModel, dict]:
    """A tiny random draft of `family` for `target`, and extra spec_generate arguments the family needs."""
    ids = {"mask_token_id": vocab - 1, "target_layer_ids": [0, 2]}
    own = list(range(0, vocab - 1, 3))
    if family == "dflash":
        torch.manual_seed(seed)
        return DFlashDraftModel(draft_config(vocab_size=vocab)).eval(), {}
    if family == "draft_vocab":
        torch.manual_seed(seed)
        return DFlashDraftModel(draft_config(vocab_size=vocab)).eval(), {"draft_vocab": own[::-1]}
    if family == "own_head":
        torch.manual_seed(seed)
        draft = DFlashDraftModel(draft_config(vocab_size=vocab, dflash_config=ids, draft_vocab_size=len(own))).eval()
        draft.set_draft_vocabulary(own)
        return draft, {}
    if family in DRAFT_VARIANTS:
        return make_variant_draft(family, seed=seed, vocab_size=vocab,
                                  dflash_config={"mask_token_id": vocab - 1}), {}
    if family == "deepspec_dflash" or family.startswith("dspark_"):
        kind = "dflash" if family == "deepspec_dflash" else family.removeprefix("dspark_")
        torch.manual_seed(seed)
        draft = DFlashDraftModel(draft_config(vocab_size=vocab, **deepspec_settings(kind))).eval()
        if draft.markov_head is not None:
            with torch.no_grad():
                draft.markov_head.markov_w2.weight.mul_(20.0)  # so that the bias moves the argmax
        return draft, {}
    folder = tempfile.TemporaryDirectory(prefix="fuzz_draft_")
    _FOLDERS.append(folder)
    if family == "speculators":
        from dflash_hf.conversion import to_speculators

        torch.manual_seed(seed)
        draft = DFlashDraftModel(draft_config(vocab_size=vocab, dflash_config=ids)).eval()
        to_speculators(draft, target, f"{folder.name}/speculators")
        return DFlashDraftModel.from_pretrained(f"{folder.name}/speculators").eval(), {}
    if family == "muse_glimmer":
        from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

        config = MuseGlimmerAssistantConfig(
            hidden_size=HIDDEN_SIZE, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, block_size=8, mask_token_id=vocab - 1,
            target_layer_ids=[0, 2], rope_parameters={"rope_type": "default", "rope_theta": 1e6},
            layer_types=["sliding_attention", "full_attention"], sliding_window=4)
        torch.manual_seed(seed)
        native = MuseGlimmerAssistantModel(config).eval()
        with torch.no_grad():
            for parameter in native.parameters():
                parameter.add_(0.1 * torch.randn_like(parameter))
        native.save_pretrained(f"{folder.name}/native")
        return DFlashDraftModel.from_pretrained(f"{folder.name}/native").eval(), {}
    raise ValueError(f"unknown draft family {family!r}")


def available_draft_families() -> list[str]:
    """DRAFT_FAMILIES that the installed Transformers can build (MuseGlimmer needs Transformers >= 5.24)."""
    families = list(DRAFT_FAMILIES)
    if not hasattr(transformers, "MuseGlimmerAssistantModel"):
        families.remove("muse_glimmer")
    return families


# --- Resolving and running a case ------------------------------------------------------------------------------------


def prompts_of_case(case: dict) -> list[list[int]]:
    """Row prompts; without a mask they avoid the pad id 0, so that generate's inferred mask hides only the padding
    (a pad id after a prompt token is a documented refusal, drawn rarely: `pad_in_prompt`)."""
    generator = torch.Generator().manual_seed(case["prompt_seed"])
    low = 0 if case["mask"] or case.get("pad_in_prompt") else 1
    lengths = case["prompt_lengths"]
    if stops_on_strings(case) and case["processors"]:
        # no reference for a batch: generate's batched stop-string check can miss a row's stop string, and a processor
        # that reads the prompt sees the batch's padding, which the row alone has not; so the first prompt alone
        lengths = lengths[:1]
    return [torch.randint(low, case["vocab"] - 1, (length,), generator=generator).tolist() for length in lengths]


def stops_on_strings(case: dict) -> bool:
    return bool(case["stop"]) and case["stop"]["via"] == "stop_strings"


def processor_arguments(spec: dict, plain: list[int], width: int, vocab: int) -> dict:
    """generate's keyword arguments for one drawn processor; ids come from row 0's plain continuation."""
    a, b, c = (plain[p % len(plain)] for p in spec["positions"])
    value = spec["value"]
    return {
        "repetition_penalty": {"repetition_penalty": round(1.1 + 1.5 * value, 3)},
        "encoder_repetition_penalty": {"encoder_repetition_penalty": round(0.4 + 0.5 * value, 3)},
        "no_repeat_ngram_size": {"no_repeat_ngram_size": 2 + int(value * 2)},
        "bad_words_ids": {"bad_words_ids": [[a], [b, c]] if b != c else [[a]]},
        "sequence_bias": {"sequence_bias": {(a,): -20.0, (b, c): -20.0 + 30.0 * value}},
        "suppress_tokens": {"suppress_tokens": sorted({a, b})},
        "begin_suppress_tokens": {"begin_suppress_tokens": [a]},
        "min_length": {"min_length": width + 1 + int(value * 12), "eos_token_id": a},
        "min_new_tokens": {"min_new_tokens": 1 + int(value * 12), "eos_token_id": a},
        "forced_eos_token_id": {"forced_eos_token_id": (a + 1) % (vocab - 1), "eos_token_id": (a + 1) % (vocab - 1)},
        "exponential_decay_length_penalty": {"exponential_decay_length_penalty": (2 + int(4 * value), 1.5),
                                             "eos_token_id": b},
        "renormalize_logits": {"renormalize_logits": True, "repetition_penalty": 1.3},
        "remove_invalid_values": {"remove_invalid_values": True, "no_repeat_ngram_size": 3},
        "logits_processor": {"logits_processor": LogitsProcessorList([FavourLastTokenResidue(3 + int(value * 8))])},
    }[spec["name"]]


class FavourLastTokenResidue(LogitsProcessor):
    """A user's processor that reads the prefix: the token (last token * factor) mod V gains 8."""

    def __init__(self, factor: int) -> None:
        self.factor = factor

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        scores = scores.clone()
        scores[torch.arange(scores.shape[0]), (input_ids[:, -1] * self.factor) % scores.shape[1]] += 8.0
        return scores

    def __repr__(self) -> str:
        return f"FavourLastTokenResidue({self.factor})"


def resolve_arguments(case: dict, target: torch.nn.Module, prompts: list[list[int]], width: int) -> tuple[dict, dict]:
    """(generate's keyword arguments, spec_generate's extra ones) with every stop id and processor setting made
    concrete."""
    first = torch.tensor([prompts[0]])
    with torch.no_grad():
        plain = target.generate(first, attention_mask=torch.ones_like(first), max_new_tokens=12, min_new_tokens=12,
                                do_sample=False, pad_token_id=0)[0, first.shape[1]:].tolist()
    shared: dict[str, Any] = {}
    for spec in case["processors"]:
        for name, value in processor_arguments(spec, plain, width, case["vocab"]).items():
            if name == "eos_token_id" and "eos_token_id" in shared:  # two processors name an EOS: keep both
                value = sorted({*map(int, torch.tensor(shared[name]).flatten().tolist()), value})
            shared[name] = value
    extra: dict[str, Any] = {}
    stop = case["stop"]
    if stop and stop["via"] == "stop_strings":  # two consecutive tokens of row 0's plain continuation, as text
        start = stop["positions"][0] % (len(plain) - 1)
        text = tokenizer().decode(plain[start : start + 2])
        return {**shared, "stop_strings": [text], "tokenizer": tokenizer()}, extra
    if stop:
        ids = sorted({plain[p % len(plain)] for p in stop["positions"]})
        if stop["random_id"]:
            ids = [stop["random_value"] % (case["vocab"] - 1)]
        if "eos_token_id" in shared:
            ids = sorted({*torch.tensor(shared["eos_token_id"]).flatten().tolist(), *ids})
        shared.pop("eos_token_id", None)
        if stop["via"] == "config":
            return ({**shared, "generation_config": GenerationConfig(eos_token_id=ids, do_sample=False,
                                                                     pad_token_id=0)}, extra)
        if stop["via"] == "stop_token_ids":
            extra["stop_token_ids"] = ids
            return {**shared, "eos_token_id": ids}, {**extra, "spec_only_keys": ["eos_token_id"]}
        shared["eos_token_id"] = ids
    return shared, extra


_TOKENIZER: list = []


def tokenizer():
    """The character-level tokenizer of tests/helpers.py (built once): its pieces join without spaces, as stop strings
    need."""
    if not _TOKENIZER:
        _TOKENIZER.append(make_char_tokenizer())
    return _TOKENIZER[0]


def describe(value: Any) -> Any:
    """JSON-able form of an argument (tensors as lists, configs as their diff dicts, tuple keys as strings)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, GenerationConfig):
        return {"GenerationConfig": value.to_diff_dict()}
    if isinstance(value, dict):
        return {str(key): describe(item) for key, item in value.items()}
    if isinstance(value, LogitsProcessorList):
        return repr(list(value))
    if isinstance(value, transformers.PreTrainedTokenizerBase):
        return "the character tokenizer of tests/helpers.py"
    if isinstance(value, (list, tuple)):
        return [describe(item) for item in value]
    return value


def is_known_refusal(error: BaseException) -> bool:
    return isinstance(error, (ValueError, TypeError)) and any(
        re.search(pattern, str(error)) for pattern in KNOWN_REFUSALS)


@dataclass
class CaseResult:
    """What one case gave: `outcome` is equal / mismatch / refused / crashed."""

    index: int
    outcome: str
    case: dict
    arguments: dict = field(default_factory=dict)
    detail: str = ""
    tau: float | None = None  # spec_generate's mean tokens committed per verify: how much of the drafts was accepted


def run_case(case: dict) -> CaseResult:
    """Run one drawn case: `spec_generate` and `generate` on the same inputs, compared by the tests' conventions."""
    result = CaseResult(case["index"], CRASHED, case)
    try:
        return _run(case, result)
    except Exception as error:  # a crash of the harness or of a model build is reported, not raised
        result.outcome, result.detail = CRASHED, "".join(traceback.format_exception(error))[-3000:]
        return result


def _run(case: dict, result: CaseResult) -> CaseResult:
    target = build_target(case["target"], case["target_seed"], case["vocab"], case["lean"])
    prompts = prompts_of_case(case)
    input_ids, attention_mask = left_pad(prompts, pad_token_id=0)  # [N, T], [N, T]
    try:
        generate_arguments, extra = resolve_arguments(case, target, prompts, input_ids.shape[1])
    except Exception as error:  # the target's own generate refuses (e.g. a refused recurrent family)
        generate_arguments, extra = {}, {"generate_error": error}
    spec_only = extra.pop("spec_only_keys", [])
    generate_error = extra.pop("generate_error", None)
    draft, draft_arguments = build_draft(case["draft"], case["draft_seed"], case["vocab"], target)
    common = dict(pad_token_id=0, do_sample=False)
    if case.get("length_via") == "max_length":  # prompt width included, as generate counts it
        common["max_length"] = input_ids.shape[1] + case["max_new_tokens"]
    else:
        common["max_new_tokens"] = case["max_new_tokens"]
    if case["mask"]:
        common["attention_mask"] = attention_mask
    spec_arguments = {**common, **{k: v for k, v in generate_arguments.items() if k not in spec_only}, **extra,
                      **draft_arguments, "block_size": case["block_size"], "tree_size": case["tree_size"]}
    if case["confidence_threshold"] is not None:
        spec_arguments["confidence_threshold"] = case["confidence_threshold"]
    if case["confidence_threshold"] == "auto":
        spec_arguments["step_costs"] = SCHEDULE_COSTS
    if case.get("draft_processors"):
        spec_arguments["draft_processors"] = case["draft_processors"]
    result.arguments = describe({"input_ids": input_ids, **{k: v for k, v in spec_arguments.items()
                                                             if k != "attention_mask"}})
    # stop strings: each row alone (Transformers 5.25's batched stop-string check can miss a row's stop string that the
    # same row alone meets, tests/test_generate_arguments.py)
    batch_reference = (bool(case["processors"]) or not case["mask"]) and not stops_on_strings(case)
    result.arguments["compared_with"] = "generate on the batch" if batch_reference else "generate on each row alone"
    with torch.no_grad():
        output, spec_error = attempt(lambda: draft.spec_generate(target=target, input_ids=input_ids,
                                                                 return_stats=True, **spec_arguments))
        expected = None
        if generate_error is None:
            expected, generate_error = attempt(lambda: reference_output(
                target, input_ids, prompts, batch_reference, common, generate_arguments))
    if spec_error is not None or generate_error is not None:
        return classify_errors(result, spec_error, generate_error)
    result.tau = round(float(output.tau), 3)
    if batch_reference:
        if not torch.equal(output.output_ids, expected):
            result.detail = f"spec_generate {output.output_ids.tolist()} != generate {expected.tolist()}"
    else:
        rows = [output.new_tokens(row) for row in range(len(prompts))]
        result.detail = "; ".join(f"row {row}: spec_generate {got} != generate {want}"
                                  for row, (got, want) in enumerate(zip(rows, expected)) if got != want)
    result.outcome = MISMATCH if result.detail else EQUAL
    return result


def attempt(call) -> tuple[Any, Exception | None]:
    """(call(), None), or (None, the exception it raised)."""
    try:
        return call(), None
    except Exception as error:
        return None, error


def reference_output(target: torch.nn.Module, input_ids: torch.Tensor, prompts: list[list[int]], batch: bool,
                     common: dict, arguments: dict) -> torch.Tensor | list[list[int]]:
    """generate's output ids [N, T + W] on the batch, or each row's new tokens from its prompt alone."""
    if batch:
        return target.generate(input_ids, **common, **arguments)
    alone, common = [], dict(common)
    if "max_length" in common:  # the batch's max_length counts its padded width: the same new tokens for each row
        common["max_new_tokens"] = common.pop("max_length") - input_ids.shape[1]
    for row in prompts:
        ids = torch.tensor([row])
        alone.append(target.generate(ids, **{**common, "attention_mask": torch.ones_like(ids)},
                                     **arguments)[0, len(row):].tolist())
    return alone


def classify_errors(result: CaseResult, spec_error: Exception | None,
                    generate_error: Exception | None) -> CaseResult:
    """Refused: both calls raised, spec_generate raised a documented refusal, or only generate raised (noted as
    such); crashed: spec_generate raised anything else."""
    if spec_error is None:
        result.outcome = REFUSED
        result.detail = f"generate refused what spec_generate ran: {type(generate_error).__name__}: {generate_error}"
        return result
    both = generate_error is not None
    result.outcome = REFUSED if both or is_known_refusal(spec_error) else CRASHED
    result.detail = (f"spec_generate: {type(spec_error).__name__}: {spec_error}"
                     + (f" | generate: {type(generate_error).__name__}: {generate_error}" if both else ""))
    if result.outcome == CRASHED:
        result.detail += "\n" + "".join(traceback.format_exception(spec_error))[-3000:]
    return result


def run_cases(indices: list[int], base_seed: int = 0, draft_families: list[str] | None = None) -> list[CaseResult]:
    """Run the cases `indices` of the run seeded `base_seed` (one thread: tiny models gain nothing from more); a
    case whose draft family is not in `draft_families` (default: those this Transformers can build) is skipped."""
    allowed = set(available_draft_families() if draft_families is None else draft_families)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cases = [draw_case(index, base_seed) for index in indices]
        return [run_case(case) for case in cases if case["draft"] in allowed]
    finally:
        torch.set_num_threads(threads)


def ci_slice(count: int = 24, base_seed: int = 0, per_family: int = 2) -> list[int]:
    """Case indices for the test suite: the first cases of the run, at most `per_family` per draft family (of those
    this Transformers can build), until `count`; so every draft family is drawn."""
    families = available_draft_families()
    taken: dict[str, int] = {}
    indices, index = [], 0
    while len(indices) < count and index < 100 * count:
        family = draw_case(index, base_seed)["draft"]
        if family in families and taken.get(family, 0) < per_family:
            taken[family] = taken.get(family, 0) + 1
            indices.append(index)
        index += 1
    return indices


def summary(results: list[CaseResult]) -> dict[str, int]:
    """Counts per outcome."""
    counts = {EQUAL: 0, MISMATCH: 0, REFUSED: 0, CRASHED: 0}
    for result in results:
        counts[result.outcome] += 1
    return counts
