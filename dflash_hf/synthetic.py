"""`dflash-hf bench --synthetic`: what a target and draft pair's steps cost on this device, with no weights to fetch.

Target and draft are built from their configs with random weights (a step costs the same whatever the weights), a
random context is prefilled, and t(1 token), t(B-token verify), t(draft pass) and, with tree sizes, t(verify of a tree
of N drafted nodes) are timed with the loop's own stages (`cost_model.time_step_stages`). The projected speedup is the
cost model's bound at a tau (default: the paper's tau for that pair, a chain's at the trained block; trees are
projected only at a `--tau` passed). `shrink` divides the widths (hidden size, FFN, heads, vocabulary) so a CPU can
run the same code.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from .configuration_dflash import DFlashConfig, is_dflash2
from .cost_model import cost_model_bound, time_step_stages
from .loading import PUBLISHED_CONFIGS, device_description
from .modeling_dflash import DFlash2DraftModel, DFlashDraftModel
from .settings_dflash import resolve_block_size
from .tree_dflash import tree_refusal

PACKAGE = Path(__file__).resolve().parent
TARGET_CONFIGS = PACKAGE / "target_configs"


@dataclass(frozen=True)
class SyntheticPair:
    """A target shape, the published draft for it, and the tau the DFlash paper reports for the pair."""

    target_config: str  # a file of target_configs/
    draft_config: str  # a file of published_configs/
    paper_tau: float | None  # None: no published tau for the pair (`--tau` projects one)
    tau_source: str


SYNTHETIC_PAIRS = {
    "Qwen3-8B": SyntheticPair("Qwen3-8B.json", "Qwen3-8B-DFlash-b16.json", 6.49,
                              "paper v2 Table 1: greedy average of 7 benchmarks, B=16, Transformers on one H200"),
    "Qwen3-4B": SyntheticPair("Qwen3-4B.json", "Qwen3-4B-DFlash-b16.json", 6.54,
                              "paper v2 Table 1: greedy average, B=16"),
    "LLaMA3.1-8B-Instruct": SyntheticPair("Llama-3.1-8B-Instruct.json", "LLaMA3.1-8B-Instruct-DFlash-UltraChat.json",
                                          4.32, "paper v2: GSM8K, B=10, SGLang, concurrency 1"),
    # A hybrid target (48 Gated DeltaNet + 16 full-attention layers); its step costs include the state rollback.
    "Qwen3.5-27B": SyntheticPair("Qwen3.5-27B.json", "Qwen3.5-27B-DFlash.json", None, ""),
}
DEFAULT_SYNTHETIC = "Qwen3-8B"
CPU_SHRINK = 8  # --shrink auto on a CPU: widths / 8 (Qwen3-8B becomes about 0.13B parameters); 1 on a GPU
WIDTH_FIELDS = ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size", "vocab_size",
                "linear_num_key_heads", "linear_num_value_heads")


@dataclass(frozen=True)
class SyntheticSpec:
    """What to build: the two config dicts, where they came from, and the tau to project at."""

    name: str
    target_config: dict[str, Any]
    draft_config: dict[str, Any]
    tau: float | None
    tau_source: str


def synthetic_spec(model: str, draft_config: str | Path | None = None) -> SyntheticSpec:
    """The pair `model` names (a key of SYNTHETIC_PAIRS), or a target config.json with the draft
    config.json to pair."""
    if model in SYNTHETIC_PAIRS:
        pair = SYNTHETIC_PAIRS[model]
        if draft_config:  # another draft for this target: the paper's tau is not its tau
            return SyntheticSpec(model, _read_json(TARGET_CONFIGS / pair.target_config),
                                 _read_json(Path(draft_config)), None, "")
        return SyntheticSpec(model, _read_json(TARGET_CONFIGS / pair.target_config),
                             _read_json(PUBLISHED_CONFIGS / pair.draft_config), pair.paper_tau, pair.tau_source)
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"--synthetic {model!r}: not a known pair ({', '.join(SYNTHETIC_PAIRS)}) and no such "
                         "config.json; pass a pair name or a target's config.json with --draft-config.")
    if draft_config is None:
        raise ValueError(f"--synthetic {model}: a target config needs the draft to pair it with: --draft-config "
                         f"DRAFT/config.json (the published ones are in {PUBLISHED_CONFIGS}).")
    return SyntheticSpec(path.stem, _read_json(path), _read_json(Path(draft_config)), None, "")


def shrink_configs(target: dict[str, Any], draft: dict[str, Any], factor: int
                   ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Both configs with widths divided by `factor` (heads, hidden size, FFN, vocabulary); depths and head size kept.

    The draft's mask id moves to the last id of the smaller vocabulary; special ids beyond it are dropped.
    """
    if factor < 1:
        raise ValueError(f"shrink must be >= 1, got {factor}")
    target, draft = dict(target), dict(draft)
    for name, config in (("target", target), ("draft", draft)):
        missing = [field for field in ("hidden_size", "num_attention_heads", "vocab_size") if not config.get(field)]
        if missing:
            raise ValueError(f"the {name} config has no top-level {', '.join(missing)}: pass a text model's config "
                             "(a multimodal one nests it in text_config) "
                             "and a draft config with its target's vocab_size")
    if draft["hidden_size"] != target["hidden_size"]:
        raise ValueError(f"the draft's hidden size {draft['hidden_size']} is not the target's {target['hidden_size']} "
                         "(hidden sizes differ): this draft was not built for this target")
    if factor == 1:
        return target, draft
    for config in (target, draft):
        heads = config["num_attention_heads"]
        head_dim = config.get("head_dim") or config["hidden_size"] // heads
        key_value_heads = config.get("num_key_value_heads") or heads
        config["num_attention_heads"] = max(1, heads // factor)
        config["num_key_value_heads"] = max(1, key_value_heads // factor)
        if config["num_attention_heads"] % config["num_key_value_heads"]:
            raise ValueError(f"shrink {factor} leaves {config['num_attention_heads']} query heads for "
                             f"{config['num_key_value_heads']} key/value heads; pick a factor dividing both")
        config["head_dim"] = head_dim
        config["hidden_size"] = max(1, config["hidden_size"] // factor)
        for field in WIDTH_FIELDS:
            if config.get(field):
                config[field] = max(1, config[field] // factor)
    vocab_size = target["vocab_size"]
    for field in ("bos_token_id", "eos_token_id", "pad_token_id"):
        target.pop(field, None)
    dflash = {key: value for key, value in draft.get("dflash_config", {}).items() if key != "draft_vocab"}
    draft["dflash_config"] = {**dflash, "mask_token_id": vocab_size - 1}
    draft["vocab_size"] = vocab_size
    return target, draft


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Modules built inside are created in `dtype` (restored after)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def build_synthetic_pair(target_config: dict[str, Any], draft_config: dict[str, Any], device: torch.device,
                         dtype: torch.dtype, seed: int = 0) -> tuple[torch.nn.Module, DFlashDraftModel]:
    """(target, draft) with random weights of these configs, created on `device` in `dtype`, sdpa attention."""
    from transformers import AutoConfig, AutoModelForCausalLM

    saved_dtype = ("torch_dtype", "dtype")  # a config's dtype would override `dtype` in `from_config`
    values = {key: value for key, value in target_config.items() if key not in saved_dtype}
    model_type = values.pop("model_type")
    try:
        config = AutoConfig.for_model(model_type, **values)
    except (KeyError, ValueError) as error:  # a model type this Transformers does not ship
        import transformers

        raise ValueError(f"Transformers {transformers.__version__} has no model type {model_type!r} ({error}); "
                         "Qwen3.5-style hybrid targets need transformers>=5.24") from error
    config._attn_implementation = "sdpa"
    draft_values = DFlashConfig.from_dict({key: value for key, value in draft_config.items()
                                           if key not in saved_dtype})
    draft_values._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    with torch.device(device), default_dtype(dtype):
        target = AutoModelForCausalLM.from_config(config).eval()
        draft = (DFlash2DraftModel if is_dflash2(draft_values) else DFlashDraftModel)(draft_values).eval()
    built = {next(target.parameters()).dtype, next(draft.parameters()).dtype}
    if built != {dtype}:
        raise ValueError(f"asked for {dtype}, built {sorted(map(str, built))}")
    return target, draft


def parameter_count(model: torch.nn.Module) -> int:
    """Distinct parameters (tied ones counted once)."""
    return sum(parameter.numel() for parameter in {id(p): p for p in model.parameters()}.values())


@torch.no_grad()
def run_synthetic_bench(spec: SyntheticSpec, device: torch.device, dtype: torch.dtype, block_sizes: list[int | None],
                        batch_sizes: list[int], context_length: int = 512, tau: float | None = None,
                        shrink: int = 1, repeats: int = 5, seed: int = 0, tree_sizes: tuple[int, ...] = ()
                        ) -> dict[str, Any]:
    """Step costs and projected speedups of the pair for every (batch size, block size), and for each of those every
    tree of `tree_sizes` drafted nodes, as a JSON-ready dict."""
    paper_tau = tau is None  # the paper's tau holds at the draft's own block size only
    tau = tau if tau is not None else spec.tau
    if tau is not None and tau < 1:
        raise ValueError(f"--tau must be >= 1, got {tau}")
    if context_length < 1:
        raise ValueError(f"--context-length must be >= 1, got {context_length}")
    target_config, draft_config = shrink_configs(spec.target_config, spec.draft_config, shrink)
    target, draft = build_synthetic_pair(target_config, draft_config, device, dtype, seed)
    generator = torch.Generator().manual_seed(seed)
    context = torch.randint(0, target_config["vocab_size"], (1, context_length), generator=generator)  # [1, T]
    rows = []
    refusal = tree_refusal(target, draft) if tree_sizes else None
    if refusal is not None:
        raise ValueError(refusal)
    for batch_size in batch_sizes:
        for block_size in block_sizes:
            block = resolve_block_size(block_size, draft.block_size)
            timings = time_step_stages(draft, target, context.to(device), block, draft.mask_token_id, [block],
                                       repeats, batch_size, tree_sizes if block > 1 else ())
            verifies = {None: timings["verify"][block], **timings["tree_verify"]}  # None: the chain
            for tree_size, verify_seconds in verifies.items():
                costs = {"target_1": timings["target_1"], "target_block": verify_seconds, "draft": timings["draft"]}
                projected = None if tau is None or (paper_tau and (block != draft.block_size or tree_size)) else \
                    cost_model_bound(min(tau, block), costs)
                drafted = tree_size or block - 1  # the tokens the verify checks after the pending one
                rows.append({"batch_size": batch_size, "block_size": block, "tree_size": tree_size, **costs,
                             "verify_over_one_token": verify_seconds / timings["target_1"],
                             "seconds_per_drafted_token": (verify_seconds - timings["target_1"]) / max(drafted, 1),
                             "projected_speedup": projected})
    return {"model": spec.name, "device": device_description(target), "dtype": str(dtype).removeprefix("torch."),
            "shrink": shrink, "context_length": context_length, "tau": tau,
            "tau_source": spec.tau_source if paper_tau else "", "trained_block_size": draft.block_size,
            "parameters": {"target": parameter_count(target), "draft": parameter_count(draft)}, "rows": rows}


def synthetic_table(result: dict[str, Any]) -> str:
    """The result as a markdown table with a line saying what was measured."""
    lines = ["| batch | block | tree | t(1 token) ms | t(verify) ms | t(draft) ms | verify / 1 token | "
             "ms per drafted token | projected |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in result["rows"]:
        lines.append(f"| {row['batch_size']} | {row['block_size']} | {row['tree_size'] or 'chain'} | "
                     f"{row['target_1'] * 1e3:.2f} | {row['target_block'] * 1e3:.2f} | {row['draft'] * 1e3:.2f} | "
                     f"{row['verify_over_one_token']:.2f} | {row['seconds_per_drafted_token'] * 1e3:.2f} | "
                     f"{_times(row['projected_speedup'])} |")
    widths = "" if result["shrink"] == 1 else f", widths / {result['shrink']}"
    source = f" ({result['tau_source']})" if result["tau_source"] else ""
    lines.append(f"\n{result['model']} with random weights{widths}: "
                 f"target {result['parameters']['target'] / 1e9:.3f}B "
                 f"and draft {result['parameters']['draft'] / 1e9:.3f}B parameters, {result['dtype']} on "
                 f"{result['device']}, context {result['context_length']} tokens; projected = tau * t(1) / "
                 + (f"(t(verify) + t(draft)) at tau {result['tau']}{source}, capped at the block size; a tree "
                    "verifies its N drafted nodes and the pending token, each node at the position of its depth"
                    if result["tau"] is not None else "(t(verify) + t(draft)): no published tau for this pair, "
                    "pass --tau to project")
                 + (f"; the paper's tau is for chains of {result['trained_block_size']} only (other rows: pass "
                    "--tau)."
                    if result["tau_source"] else "."))
    return "\n".join(lines)


def _times(speedup: float | None) -> str:
    return "-" if speedup is None else f"{speedup:.2f}x"


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8"))
