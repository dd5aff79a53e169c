"""Hub model cards for DFlash drafts: one template (`model_card_template.md`), Hub YAML metadata, results tables."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

TEMPLATE = Path(__file__).resolve().parent / "model_card_template.md"
CARD_INFO_FILE = "dflash_card.json"  # what the card was rendered from, kept beside it so it can be re-rendered
TAGS = ["dflash", "speculative-decoding", "block-diffusion", "draft-model"]
PAPER = "Chen, Liang, Liu, DFlash (arXiv 2602.06036), Table 1"


@dataclass
class CardInfo:
    """Everything a draft's card says; `render_model_card` turns it into README.md."""

    repo_id: str  # where the draft lives (Hub id or a local folder name)
    base_model: str  # the target's Hub id
    title: str
    description: str
    block_size: int
    num_layers: int
    target_layer_ids: list[int]
    license: str = "apache-2.0"
    license_name: str | None = None  # with license "other": a short name and where the terms are
    license_link: str | None = None
    results_source: str = "No results yet: run `dflash-hf bench --json results.json` and render them into this card."
    results_table: str = ""
    training: dict[str, str] = field(default_factory=dict)
    limitations: list[str] = field(default_factory=list)
    mask_token_note: str | None = None
    has_custom_generate: bool = True  # the repo holds dflash-hf's export (custom_generate/generate.py); False: z-lab's
    usage_note: str | None = None  # where this draft runs, when that is not the GPU recipe of the published drafts


DEFAULT_LIMITATIONS = [
    "Speed depends on how well the draft predicts the target on your prompts (tau) and on the hardware: on GPUs a "
    "block verify costs about one decoding step; on CPUs without native bfloat16 matrix kernels it costs several.",
    "Output is exactly the target's own in float32; in bfloat16/float16 a block verify and a one-token step can "
    "round a near-tie differently, so outputs may differ from plain decoding from such a near-tie on.",
    "Batches in `spec_generate` take left-padded prompts and need an `sdpa` or `eager` draft attention; "
    "how much a batch gains depends on the hardware (see the dflash-hf README).",
]


def card_info_for_config(config: Any, repo_id: str, base_model: str, **fields: Any) -> CardInfo:
    """A CardInfo whose architecture fields come from a draft config (a DFlashConfig)."""
    dflash_config = config.dflash_config
    mask_token_note = None
    if dflash_config.get("mask_token_id") is None and dflash_config.get("mask_token"):
        mask_token_note = (f"The config names the mask token as `{dflash_config['mask_token']}`; pass "
                           f"`mask_token_id=tokenizer.convert_tokens_to_ids({dflash_config['mask_token']!r})` "
                           "to `spec_generate`.")
    fields.setdefault("limitations", list(DEFAULT_LIMITATIONS))
    return CardInfo(repo_id=repo_id, base_model=base_model, block_size=int(config.block_size),
                    num_layers=int(config.num_hidden_layers), target_layer_ids=list(dflash_config["target_layer_ids"]),
                    mask_token_note=mask_token_note, **fields)


def render_model_card(info: CardInfo) -> str:
    """README.md text of a draft: Hub YAML metadata, usage, serving commands, results, training, limitations."""
    from huggingface_hub import ModelCard, ModelCardData

    data = ModelCardData(license=info.license, license_name=info.license_name, license_link=info.license_link,
                         base_model=info.base_model, library_name="transformers", pipeline_tag="text-generation",
                         tags=TAGS)
    fields = {k: v for k, v in asdict(info).items() if k not in ("license", "license_name", "license_link")}
    return str(ModelCard.from_template(data, template_path=str(TEMPLATE), **fields))


def write_model_card(folder: str | Path, info: CardInfo) -> Path:
    """Write README.md (and the CardInfo it came from, as dflash_card.json) into a draft folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CARD_INFO_FILE).write_text(json.dumps(asdict(info), indent=2) + "\n", encoding="utf-8")
    path = folder / "README.md"
    path.write_text(render_model_card(info), encoding="utf-8")
    return path


def read_card_info(folder: str | Path) -> CardInfo:
    """The CardInfo a folder's card was rendered from."""
    return CardInfo(**json.loads((Path(folder) / CARD_INFO_FILE).read_text(encoding="utf-8")))


def results_from_bench(bench: dict[str, Any], command: str) -> tuple[str, str]:
    """(results_source, results_table) for a card, from the JSON that `dflash-hf bench --json` wrote."""
    from .evaluation import markdown_table

    settings = bench.get("settings", {})
    setup = ", ".join(f"{key} {settings[key]}"
                      for key in ("machine", "date", "device", "dtype", "threads", "max_new_tokens", "temperature")
                      if key in settings)
    source = (f"Measured with dflash-hf ({setup}); plain decoding is `target.generate` in the same process and dtype. "
              f"Command: `{command}`. `bound` is the cost model tau * t(1 token) / (t(block verify) + t(draft)) "
              "measured on the same machine.")
    return source, markdown_table(bench["results"])


# --------------------------------------------------------------------------------------------------
# The published drafts (results quoted from the paper, not measured here)
# --------------------------------------------------------------------------------------------------

PAPER_QWEN3_8B = {"GSM8K": (5.15, 6.54), "MATH-500": (6.08, 7.87), "AIME25": (5.62, 7.08), "HumanEval": (5.14, 6.50),
                  "MBPP": (4.65, 5.95), "LiveCodeBench": (5.51, 7.27), "MT-Bench": (2.75, 4.24),
                  "average": (4.86, 6.49)}


def _paper_table(rows: dict[str, tuple[float, float]]) -> str:
    lines = ["| dataset | speedup | tau |", "|---|---:|---:|"]
    lines += [f"| {name} | {speedup:.2f}x | {tau:.2f} |" for name, (speedup, tau) in rows.items()]
    return "\n".join(lines)


PUBLISHED = {
    "Qwen3-8B-DFlash-b16": ("Qwen/Qwen3-8B", (
        f"Quoted from the paper ({PAPER}), not measured by dflash-hf: Transformers backend, one H200, greedy, "
        "thinking off, up to 2048 new tokens. EAGLE-3 on the same setup: 1.76x / tau 2.96 on average (tree of 16)."),
        _paper_table(PAPER_QWEN3_8B)),
    "Qwen3-4B-DFlash-b16": ("Qwen/Qwen3-4B", (
        f"Quoted from the paper ({PAPER}), not measured by dflash-hf: Transformers backend, one H200, greedy, "
        "thinking off; the paper's average over its seven benchmarks."), _paper_table({"average": (4.91, 6.54)})),
    "Qwen3-Coder-30B-A3B-DFlash": ("Qwen/Qwen3-Coder-30B-A3B-Instruct", (
        "The paper reports results for this draft that dflash-hf does not quote here; measure them with "
        "`dflash-hf bench --target Qwen/Qwen3-Coder-30B-A3B-Instruct --draft z-lab/Qwen3-Coder-30B-A3B-DFlash "
        "--dataset humaneval mbpp`."), ""),
    "LLaMA3.1-8B-Instruct-DFlash-UltraChat": ("meta-llama/Llama-3.1-8B-Instruct", (
        f"Quoted from the paper ({PAPER}), not measured by dflash-hf: SGLang backend, "
        "block size 10, concurrency 1, greedy."),
        _paper_table({"GSM8K": (2.4, 4.32), "HumanEval": (2.8, 4.91)})),
}


def published_card_infos(configs_dir: str | Path) -> dict[str, CardInfo]:
    """CardInfo of every published draft in `configs_dir` (`dflash_hf/published_configs/`), keyed by its Hub name."""
    from .configuration_dflash import DFlashConfig

    infos = {}
    for name, (base_model, source, table) in PUBLISHED.items():
        config = DFlashConfig.from_json_file(Path(configs_dir) / f"{name}.json")  # normalised on construction
        infos[name] = card_info_for_config(
            config, f"z-lab/{name}", base_model, license="other", license_name="upstream",
            license_link=f"https://huggingface.co/z-lab/{name}",  # the authors' weights, under the authors' terms
            title=f"DFlash draft for {base_model}",
            description=f"The published DFlash draft `z-lab/{name}`, described by dflash-hf. "
                        "The weights are the authors'; "
                        "the config layout is the one in dflash-hf's `dflash_hf/published_configs/` "
                        "(check it against the downloaded file).",
            results_source=source, results_table=table, has_custom_generate=False,
            training={"recipe": "the authors' (not released): see the DFlash paper, "
                                "docs/training.md in the dflash-hf repository",
                      "training data": "see the paper"},
        )
    return infos
