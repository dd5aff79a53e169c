"""README's usage examples (and the hybrid and conversion examples of docs/hybrid.md and docs/hub.md) run as written,
against tiny local models: the Hub ids name local folders, the GPU settings become CPU float32 and the lengths short.
What the examples claim (the output is the target's own) is checked on what they computed."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import torch
import transformers
from helpers import make_draft, make_hybrid_target, make_target, make_tokenizer

from dflash_hf.cli import main
from dflash_hf.versions_dflash import torch_refusal

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
QUICKSTART = README.split("## GPU quickstart", 1)[1].split("\n## ", 1)[0]
USAGE = QUICKSTART + README.split("\n## Usage\n", 1)[1].split("\n## ", 1)[0]
HYBRID = (ROOT / "docs" / "hybrid.md").read_text(encoding="utf-8")
API = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
CONVERSION = (ROOT / "docs" / "hub.md").read_text(encoding="utf-8").split(
    "## Conversion: Transformers' own DFlash model", 1)[1].split("\n## ", 1)[0]
SWAPS = {'"cuda:0"': '"cpu"', "torch.bfloat16": "torch.float32", "max_new_tokens=2048": "max_new_tokens=12",
         "max_new_tokens=256": "max_new_tokens=12", "--vocab-size 151936": "--vocab-size 128"}
NEW_TOKENS = 12
HAS_HYBRID = hasattr(transformers, "Qwen3_5ForCausalLM")  # hybrid targets run on Transformers 5.x
HYBRID_TARGET = "Qwen/Qwen3.5-27B"


def blocks(text: str, language: str) -> list[str]:
    """The ```language blocks of `text`, with SWAPS applied."""
    found = re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.M | re.S)
    for old, new in SWAPS.items():
        found = [block.replace(old, new) for block in found]
    return found


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """Folders named like the README's Hub ids (a tiny Qwen3 target with a chat template, a tiny draft), as cwd."""
    target = make_target("qwen3", seed=3)
    target.generation_config.eos_token_id, target.generation_config.pad_token_id = 1, 0
    target.save_pretrained(tmp_path / "Qwen" / "Qwen3-8B")
    make_tokenizer().save_pretrained(tmp_path / "Qwen" / "Qwen3-8B")
    make_draft(3).save_pretrained(tmp_path / "z-lab" / "Qwen3-8B-DFlash-b16")
    if HAS_HYBRID:
        hybrid = make_hybrid_target("qwen3_5", seed=3)
        hybrid.generation_config.eos_token_id, hybrid.generation_config.pad_token_id = 1, 0
        hybrid.save_pretrained(tmp_path / "Qwen" / "Qwen3.5-27B")
        make_draft(4).save_pretrained(tmp_path / "z-lab" / "Qwen3.5-27B-DFlash")
    monkeypatch.chdir(tmp_path)
    return tmp_path


def plain(target: torch.nn.Module, input_ids: torch.Tensor, stop_token_ids: list[int], **kwargs) -> torch.Tensor:
    return target.generate(input_ids, do_sample=False, max_new_tokens=NEW_TOKENS, eos_token_id=stop_token_ids,
                           pad_token_id=0, **kwargs)


def test_the_usage_examples_run_and_give_the_targets_own_output(hub, capsys):
    namespace: dict = {}
    for block in blocks(USAGE, "python"):
        if "compile=True" in block and torch_refusal("compile=True") is not None:  # torch older than it needs
            with pytest.raises(ValueError, match="compile=True needs torch >= "):
                exec(compile(block, "README.md", "exec"), dict(namespace))
            block = block.replace(", compile=True", "")  # the rest of the example, as that torch runs it (eager)
        exec(compile(block, "README.md", "exec"), namespace)
    target, input_ids, stops = namespace["target"], namespace["input_ids"], namespace["stop_token_ids"]
    expected = plain(target, input_ids, stops)
    assert torch.equal(namespace["result"].output_ids, expected)  # the GPU quickstart, greedy
    assert torch.equal(namespace["out"], expected[:, : namespace["out"].shape[1]])  # generate(custom_generate=...)
    batch = namespace["res"]  # the sampling example's result; the batch's answers were decoded from its rows
    assert len(namespace["answers"]) == 2 and batch.num_new_tokens[0] >= 1
    assert "tau" in capsys.readouterr().out
    api = dict(namespace)  # docs/api.md's one-prompt example, on the quickstart's models and prompt
    exec(compile(blocks(API, "python")[0], "docs/api.md", "exec"), api)
    assert torch.equal(api["out"], expected[:, : api["out"].shape[1]]) and api["res"].tau >= 1.0
    if HAS_HYBRID:  # docs/hybrid.md's example: its own models, the quickstart's prompt and stop ids
        hybrid = dict(namespace)
        exec(compile(blocks(HYBRID, "python")[0], "docs/hybrid.md", "exec"), hybrid)
        output = hybrid["draft"].spec_generate(target=hybrid["target"], input_ids=hybrid["input_ids"],
                                               max_new_tokens=NEW_TOKENS, temperature=0.0,
                                               stop_token_ids=hybrid["stop_token_ids"])
        assert type(hybrid["target"]).__name__ == "Qwen3_5ForCausalLM" and HYBRID_TARGET in blocks(HYBRID, "python")[0]
        assert torch.equal(output, plain(hybrid["target"], hybrid["input_ids"], hybrid["stop_token_ids"]))


@pytest.mark.skipif(not hasattr(__import__("transformers"), "MuseGlimmerAssistantModel"),
                    reason="Transformers' native DFlash draft class is new in Transformers 5.24")
def test_the_conversion_example_runs_and_gives_the_targets_own_output(hub):
    for command in blocks(CONVERSION, "bash")[0].splitlines():
        arguments = shlex.split(command.split("#", 1)[0])
        assert arguments[0] == "dflash-hf" and main(arguments[1:]) in (None, 0)
    namespace: dict = {}
    exec(compile(blocks(QUICKSTART, "python")[0], "README.md", "exec"), namespace)
    exec(compile(blocks(CONVERSION, "python")[0], "docs/hub.md", "exec"), namespace)
    target, input_ids = namespace["target"], namespace["input_ids"]
    assert torch.equal(namespace["out"][:, : input_ids.shape[1] + NEW_TOKENS],
                       plain(target, input_ids, [])[:, : namespace["out"].shape[1]])
    assert type(namespace["draft"]).__name__ == "DFlashDraftModel"
    assert (hub / "qwen3-8b-dflash" / "config.json").is_file()
