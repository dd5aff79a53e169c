"""`dflash-hf bench --synthetic`: exact shapes of the named pairs, width shrinking, the projection, clear errors."""

from __future__ import annotations

import json

import pytest
import torch

from dflash_hf.cli import main
from dflash_hf.synthetic import (
    PUBLISHED_CONFIGS,
    SYNTHETIC_PAIRS,
    TARGET_CONFIGS,
    build_synthetic_pair,
    parameter_count,
    shrink_configs,
    synthetic_spec,
)

# The published parameter totals of the targets (embeddings included) and of the z-lab drafts' layers.
PUBLISHED_SIZES = {"Qwen3-8B": (8_190_735_360, 1_048_626_432), "Qwen3-4B": (4_022_468_096, 537_427_200),
                   "LLaMA3.1-8B-Instruct": (8_030_261_248, 1_174_455_552),
                   # the draft: its published 3.96 GiB of bfloat16; the target: Qwen3.5-27B's language model as built
                   # from its text config (the checkpoint adds a vision encoder and an MTP layer)
                   "Qwen3.5-27B": (26_895_998_464, 2_128_682_496)}


HAS_QWEN3_5 = hasattr(__import__("transformers"), "Qwen3_5ForCausalLM")


@pytest.mark.parametrize("name", list(SYNTHETIC_PAIRS))
def test_named_pairs_are_built_with_the_exact_shape(name):
    spec = synthetic_spec(name)
    if name == "Qwen3.5-27B" and not HAS_QWEN3_5:  # Transformers 4.57: the refusal names the version to install
        with pytest.raises(ValueError, match=r"no model type 'qwen3_5_text'.*transformers>=5\.24"):
            build_synthetic_pair(spec.target_config, spec.draft_config, torch.device("meta"), torch.bfloat16)
        return
    target, draft = build_synthetic_pair(spec.target_config, spec.draft_config, torch.device("meta"), torch.bfloat16)
    assert (parameter_count(target), parameter_count(draft)) == PUBLISHED_SIZES[name]
    assert next(target.parameters()).dtype == next(draft.parameters()).dtype == torch.bfloat16
    assert draft.config.num_target_layers == target.config.num_hidden_layers
    assert draft.config.hidden_size == target.config.hidden_size
    assert max(draft.target_layer_ids) < target.config.num_hidden_layers
    assert target.config._attn_implementation == draft.config._attn_implementation == "sdpa"


def test_shrinking_divides_widths_and_keeps_depths():
    spec = synthetic_spec("Qwen3-8B")
    target, draft = shrink_configs(spec.target_config, spec.draft_config, 8)
    assert (target["hidden_size"], target["intermediate_size"], target["vocab_size"]) == (512, 1536, 18992)
    assert (target["num_attention_heads"], target["num_key_value_heads"], target["head_dim"]) == (4, 1, 128)
    assert target["num_hidden_layers"] == 36 and draft["num_hidden_layers"] == 5
    assert draft["hidden_size"] == 512 and draft["vocab_size"] == 18992
    assert draft["dflash_config"]["mask_token_id"] == 18991  # the published 151669 would not exist
    assert draft["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert "eos_token_id" not in target
    assert spec.target_config["hidden_size"] == 4096  # the spec itself is untouched
    with pytest.raises(ValueError,
                       match="target config has no top-level hidden_size, num_attention_heads, vocab_size"):
        shrink_configs({"model_type": "gemma4", "text_config": spec.target_config}, spec.draft_config, 1)
    with pytest.raises(ValueError, match="key/value heads"):
        shrink_configs({**spec.target_config, "num_key_value_heads": 12}, spec.draft_config, 2)


def test_cli_projects_the_cost_model_bound_from_the_measured_steps(tmp_path, capsys):
    path = tmp_path / "synthetic.json"
    main(["bench", "--synthetic", "Qwen3-4B", "--shrink", "32", "--context-length", "24", "--batch-size", "1", "2",
          "--block-size", "4", "16", "--tau", "5", "--json", str(path)])
    result = json.loads(path.read_text())
    assert (result["model"], result["shrink"], result["tau"], result["dtype"]) == ("Qwen3-4B", 32, 5.0, "float32")
    assert [(row["batch_size"], row["block_size"]) for row in result["rows"]] == [(1, 4), (1, 16), (2, 4), (2, 16)]
    for row in result["rows"]:
        assert min(row["target_1"], row["target_block"], row["draft"]) > 0
        tau = min(5.0, row["block_size"])  # a block of 4 commits at most 4 tokens a step
        assert row["projected_speedup"] == pytest.approx(tau * row["target_1"] / (row["target_block"] + row["draft"]))
    assert result["parameters"]["target"] < PUBLISHED_SIZES["Qwen3-4B"][0] / 100
    assert "| 2 | 16 |" in capsys.readouterr().out


def test_the_pair_is_built_in_the_asked_dtype_not_the_configs():
    spec = synthetic_spec("Qwen3-8B")  # both configs say torch_dtype bfloat16
    target_config, draft_config = shrink_configs(spec.target_config, spec.draft_config, 32)
    target, draft = build_synthetic_pair(target_config, draft_config, torch.device("cpu"), torch.float32)
    assert {parameter.dtype for model in (target, draft) for parameter in model.parameters()} == {torch.float32}


def test_the_papers_tau_projects_only_the_block_it_was_measured_at(tmp_path, capsys):
    path = tmp_path / "paper.json"
    main(["bench", "--synthetic", "Qwen3-4B", "--shrink", "32", "--context-length", "16", "--block-size", "8", "16",
          "--json", str(path)])
    result = json.loads(path.read_text())
    assert result["tau"] == SYNTHETIC_PAIRS["Qwen3-4B"].paper_tau and result["trained_block_size"] == 16
    eight, sixteen = result["rows"]
    assert eight["projected_speedup"] is None and sixteen["projected_speedup"] > 0
    table = capsys.readouterr().out.splitlines()
    assert next(line for line in table if line.startswith("| 1 | 8 |")).endswith("| - |")
    assert next(line for line in table if line.startswith("| 1 | 16 |")).endswith("x |")


def test_a_target_config_file_pairs_with_a_draft_config(tmp_path):
    path = tmp_path / "out.json"
    main(["bench", "--synthetic", str(TARGET_CONFIGS / "Llama-3.1-8B-Instruct.json"), "--draft-config",
          str(PUBLISHED_CONFIGS / "LLaMA3.1-8B-Instruct-DFlash-UltraChat.json"), "--shrink", "32",
          "--context-length", "16", "--tau", "3", "--json", str(path)])
    result = json.loads(path.read_text())
    assert result["model"] == "Llama-3.1-8B-Instruct" and [row["block_size"] for row in result["rows"]] == [10]


@pytest.mark.parametrize("arguments, message", [
    (["--synthetic", "Qwen9-1B"], "not a known pair"),
    (["--synthetic", str(TARGET_CONFIGS / "Qwen3-8B.json")], "--draft-config"),
    (["--synthetic", "Qwen3-8B", "--shrink", "32", "--tau", "0.5"], "--tau must be >= 1"),
    (["--synthetic", "--block-size", "auto"], "integers"),
    (["--synthetic", "Qwen3-4B", "--shrink", "32", "--block-size", "17"], "from 1 to the draft's trained size 16"),
    (["--synthetic", "Qwen3-4B", "--draft-config", str(PUBLISHED_CONFIGS / "Qwen3-8B-DFlash-b16.json")],
     "hidden sizes differ"),
    (["--synthetic", "--target", "some/model"], "drop --target"),
    (["--draft-config", str(PUBLISHED_CONFIGS / "Qwen3-8B-DFlash-b16.json")], "belong to --synthetic"),
    (["--synthetic", "--shrink", "half"], "--shrink"),
])
def test_bad_synthetic_arguments_are_refused_with_the_fix(arguments, message):
    with pytest.raises(SystemExit, match=message):
        main(["bench", *arguments])


def test_tree_rows_time_a_verify_of_the_tree_and_project_only_at_a_given_tau(tmp_path, capsys):
    path = tmp_path / "trees.json"
    main(["bench", "--synthetic", "Qwen3-4B", "--shrink", "32", "--context-length", "16", "--block-size", "8",
          "--tree-size", "0", "4", "12", "--json", str(path)])
    rows = json.loads(path.read_text())["rows"]
    assert [(row["block_size"], row["tree_size"]) for row in rows] == [(8, None), (8, 4), (8, 12)]
    assert all(row["projected_speedup"] is None for row in rows)  # the paper's tau is a chain's at block 16
    for row in rows:
        drafted = row["tree_size"] or 7
        assert row["seconds_per_drafted_token"] == pytest.approx((row["target_block"] - row["target_1"]) / drafted)
    assert "| 1 | 8 | 12 |" in capsys.readouterr().out
    main(["bench", "--synthetic", "Qwen3-4B", "--shrink", "32", "--context-length", "16", "--block-size", "8",
          "--tree-size", "4", "--tau", "3", "--json", str(path)])
    tree = json.loads(path.read_text())["rows"][1]
    assert tree["projected_speedup"] == pytest.approx(3 * tree["target_1"] / (tree["target_block"] + tree["draft"]))
    with pytest.raises(SystemExit, match="given tree sizes"):
        main(["bench", "--synthetic", "Qwen3-4B", "--tree-size", "auto"])


def test_the_tree_stage_verifies_the_root_and_the_trees_nodes_at_the_depths_positions():
    from dflash_hf.cost_model import time_step_stages
    from dflash_hf.tree_dflash import tree_refusal

    spec = synthetic_spec("Qwen3-8B")
    target_config, draft_config = shrink_configs(spec.target_config, spec.draft_config, 32)
    target, draft = build_synthetic_pair(target_config, draft_config, torch.device("cpu"), torch.float32)
    assert tree_refusal(target, draft) is None
    seen = []
    handle = target.model.register_forward_pre_hook(
        lambda module, args, kwargs: seen.append((kwargs["input_ids"].shape[1], kwargs.get("position_ids"))),
        with_kwargs=True)
    try:
        timings = time_step_stages(draft, target, torch.arange(10, 30)[None], 8, draft.mask_token_id, [8], repeats=1,
                                   tree_sizes=(5,))
    finally:
        handle.remove()
    assert set(timings["tree_verify"]) == {5} and timings["tree_verify"][5] > 0
    trees = [positions for width, positions in seen if width == 6]  # the root and 5 nodes
    assert trees and all(positions[0, 0] == 20 and positions[0, 1:].min() == 21 for positions in trees)
    assert any(len(set(positions[0, 1:].tolist())) < 5 for positions in trees)  # siblings share a depth
