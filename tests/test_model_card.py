"""Model cards (one template, Hub metadata) and `dflash-hf push` up to the network call."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import huggingface_hub
import pytest
from helpers import make_draft
from huggingface_hub import ModelCard

from dflash_hf.cli import main
from dflash_hf.configuration_dflash import REMOTE_CODE_FILES
from dflash_hf.model_card import CardInfo, published_card_infos, read_card_info, render_model_card, write_model_card
from dflash_hf.push import check_hub_folder, push_to_hub

ROOT = Path(__file__).resolve().parents[1]


def metadata(text: str) -> dict:
    return ModelCard(text).data.to_dict()


def test_published_cards_are_rendered_from_the_template_and_up_to_date():
    infos = published_card_infos(ROOT / "dflash_hf" / "published_configs")
    assert len(infos) == 4
    for name, info in infos.items():
        text = render_model_card(info)
        committed = (ROOT / "checkpoints_card" / name / "README.md").read_text(encoding="utf-8")
        assert committed == text, (f"checkpoints_card/{name} is stale: run "
                                   "`dflash-hf card --published checkpoints_card`")
        data = metadata(text)
        assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
        assert data["base_model"] == info.base_model and "dflash" in data["tags"]
        assert f"z-lab/{name}" in text and "vllm serve" in text and "sglang.launch_server" in text
        assert "trust_remote_code=True" in text and "@inproceedings{chen2026dflash" in text
    assert "Quoted from the paper" in render_model_card(infos["Qwen3-8B-DFlash-b16"])
    assert "| GSM8K | 5.15x | 6.54 |" in render_model_card(infos["Qwen3-8B-DFlash-b16"])


def test_card_command_renders_bench_results(tmp_path):
    info = CardInfo(repo_id="me/draft", base_model="org/target", title="T", description="D", block_size=4,
                    num_layers=1, target_layer_ids=[2], training={"command": "`dflash-hf train ...`"})
    write_model_card(tmp_path, info)
    assert read_card_info(tmp_path) == info
    bench = {"settings": {"device": "cpu", "dtype": "torch.float32", "threads": 2, "max_new_tokens": 256,
                          "temperature": 0.0},
             "results": [{"dataset": "gsm8k", "num_prompts": 3, "block_size": 4, "tau": 2.5,
                          "acceptance_histogram": [1, 1, 1, 1],
                          "tokens_per_s": {"plain": 10.0, "dflash": 15.0, "prompt_lookup": 11.0,
                                           "transformers_dflash": 12.0}, "speedup": 1.5,
                          "speedup_prompt_lookup": 1.1, "bound": 1.7, "lossless": True}]}
    (tmp_path / "bench.json").write_text(json.dumps(bench))
    main(["card", str(tmp_path), "--bench-json", str(tmp_path / "bench.json"),
          "--bench-command", "dflash-hf bench -x"])
    text = (tmp_path / "README.md").read_text()
    assert "| gsm8k | 3 | 4 | 2.50 | 10.0 | 15.0 | 11.0 | 12.0 | 1.50x | 1.70x | yes |" in text
    assert "`dflash-hf bench -x`" in text and metadata(text)["base_model"] == "org/target"


def test_push_dry_run_and_upload_calls(tmp_path, monkeypatch):
    draft = make_draft(seed=1, block_size=4)
    plain = tmp_path / "plain"  # weights, config and card only, like the shipped draft folder
    draft.save_pretrained(plain)
    for name in REMOTE_CODE_FILES:
        (plain / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match="missing README.md"):
        push_to_hub(plain, "me/draft", dry_run=True)
    write_model_card(plain, CardInfo(repo_id="me/draft", base_model="org/target", title="T", description="D",
                                     block_size=4, num_layers=2, target_layer_ids=draft.target_layer_ids))
    files = push_to_hub(plain, "me/draft", dry_run=True)
    assert {"config.json", "model.safetensors", "README.md", *REMOTE_CODE_FILES} <= set(files)

    calls = []
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")  # a token is required before anything goes to the network
    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo",
                        lambda self, repo_id, **kw: calls.append(("create", repo_id, kw)))
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder",
                        lambda self, folder_path, repo_id, **kw: calls.append(
                            ("upload", repo_id, sorted(p.name for p in Path(folder_path).iterdir()))))
    main(["push", str(plain), "--repo-id", "me/draft", "--private"])
    assert calls[0] == ("create", "me/draft", {"repo_type": "model", "private": True, "exist_ok": True})
    assert calls[1][0] == "upload" and "modeling_dflash.py" in calls[1][2] and "README.md" in calls[1][2]


def test_hub_check_names_missing_metadata(tmp_path):
    draft = make_draft(seed=1, block_size=4)
    draft.save_pretrained(tmp_path)
    (tmp_path / "README.md").write_text("---\nlibrary_name: transformers\n---\n# no base model\n")
    with pytest.raises(ValueError, match="lacks base_model, pipeline_tag, license, tags"):
        check_hub_folder(tmp_path)



def table_rows(text: str, first_cell: str) -> list[list[str]]:
    """The cells of the Markdown table rows of `text` whose first cell starts with `first_cell`."""
    return [[cell.strip() for cell in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|") and line.strip("| ").startswith(first_cell)]


def test_the_shipped_cards_gsm8k_numbers_are_readmes():
    """The shipped draft's card and README's results table come from the same bench run: same B, tau, speedup."""
    card = (ROOT / "dflash_hf" / "drafts" / "smollm2-135m-instruct" / "README.md").read_text(encoding="utf-8")
    card_rows = {(int(cells[2]), cells[3], cells[-3]) for cells in table_rows(card, "gsm8k") if cells[1] == "10"}
    results = (ROOT / "README.md").read_text(encoding="utf-8").split("## Results", 1)[1]
    bench_table = results.split("| block | tau |", 1)[1].split("\n\n", 1)[0]  # the first table: the bench run's
    readme_rows = {(int(cells[0].split()[0]), cells[1], cells[5]) for cells in table_rows(bench_table, "")
                   if cells[0].split()[0].isdigit()}
    assert card_rows and card_rows == readme_rows, (card_rows, readme_rows)


@pytest.mark.parametrize("name", ["smollm2-135m-instruct", "smollm2-135m-instruct-v7"])
def test_the_shipped_drafts_card_says_what_its_files_hold(name):
    """The shipped drafts' cards (v9, and v7 kept for comparison) are rendered from their dflash_card.json, which
    agrees with the config and weights: block size, layers, target layers, the draft vocabulary's size, the weights'
    dtype, and every `training_data/` file it names is in the repository."""
    import re

    from safetensors import safe_open

    folder = ROOT / "dflash_hf" / "drafts" / name
    info, config = read_card_info(folder), json.loads((folder / "config.json").read_text())
    assert (folder / "README.md").read_text(encoding="utf-8") == render_model_card(info), "re-render the card"
    dflash_config = config["dflash_config"]
    assert (info.block_size, info.num_layers, info.target_layer_ids) == (
        config["block_size"], config["num_hidden_layers"], dflash_config["target_layer_ids"])
    text = json.dumps(asdict(info))
    vocabulary = len(dflash_config.get("draft_vocab") or []) or config.get("draft_vocab_size")
    assert f"{info.num_layers} layers" in text and f"block size {info.block_size}" in text
    assert f"target layers {info.target_layer_ids}" in text
    assert f"{vocabulary:,} most frequent tokens" in text
    assert f"(id {dflash_config['mask_token_id']})" in text
    with safe_open(str(folder / "model.safetensors"), "pt") as weights:
        dtypes = {str(weights.get_slice(name).get_dtype()) for name in weights.keys()}
    assert dtypes <= {config["dtype"].replace("bfloat16", "BF16").replace("float32", "F32"), "I64", "BOOL"}
    named = set(re.findall(r"training_data/([\w.-]+\.\w+)", text))
    assert all((ROOT / "training_data" / name).is_file() for name in named), named

