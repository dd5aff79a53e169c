"""One resolver for stop, pad and mask ids: bench, train (data and evaluation) and demo stop on the same ids."""

from __future__ import annotations

import json

import pytest
from helpers import make_draft, make_target, make_tokenizer
from transformers import LlamaForCausalLM

import dflash_hf.demo as demo
import dflash_hf.generation_dflash as generation_dflash
from dflash_hf import generation_tokens
from dflash_hf.benchmark import run_benchmark
from dflash_hf.cli import main
from dflash_hf.evaluation import BenchSettings

EOS_IDS = [1, 5, 9]  # the tokenizer's EOS is 1 ("w1"); the generation config adds two more, as LLaMA-3.1's does


@pytest.fixture
def several_eos_target():
    target = make_target("llama", seed=3)
    target.generation_config.eos_token_id = [9, 5, 1]
    return target


def test_the_resolver_takes_every_eos_id(several_eos_target):
    tokenizer = make_tokenizer()
    draft = make_draft(3, block_size=4, mask_token_id=None, dflash_config={"mask_token": "w127"})
    tokens = generation_tokens(several_eos_target, tokenizer, draft)
    assert tokens.stop_token_ids == EOS_IDS
    assert tokens.pad_token_id == tokenizer.pad_token_id == 0  # the target names no pad: the tokenizer's
    assert tokens.mask_token_id == 127  # the config names the mask token only as a string
    several_eos_target.generation_config.pad_token_id = 7
    assert generation_tokens(several_eos_target, tokenizer).pad_token_id == 7


def test_bench_train_and_demo_stop_on_the_same_ids(several_eos_target, tmp_path, monkeypatch):
    seen: dict[str, list[list[int]]] = {}
    caller = ["bench"]
    spec_generate, generate = generation_dflash.spec_generate, LlamaForCausalLM.generate

    def spy_spec_generate(draft, target, input_ids, **kwargs):
        seen.setdefault(caller[0], []).append(sorted(kwargs["stop_token_ids"]))
        return spec_generate(draft, target, input_ids, **kwargs)

    def spy_generate(self, *args, **kwargs):
        seen.setdefault(caller[0] + " generate", []).append(sorted(kwargs["eos_token_id"]))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(generation_dflash, "spec_generate", spy_spec_generate)
    monkeypatch.setattr(LlamaForCausalLM, "generate", spy_generate)
    tokenizer, draft = make_tokenizer(), make_draft(3, block_size=4, mask_token_id=127)
    run_benchmark(draft, several_eos_target, tokenizer, {"gsm8k": [["w10 w11 w12"]]},
                  BenchSettings(max_new_tokens=6, prompt_lookup_tokens=None), progress=False)

    caller[0] = "demo"
    monkeypatch.setattr(demo, "load_demo", lambda dtype, draft_path: (several_eos_target, tokenizer, draft))
    demo.run_demo(max_new_tokens=4)

    caller[0] = "train"
    several_eos_target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"question": f"w{10 + i} w{20 + i}"}) for i in range(2)))
    main(["train", "--target", str(tmp_path / "target"), "--output", str(tmp_path / "run"), "--prompts", str(prompts),
          "--num-prompts", "2", "--gen-max-new-tokens", "6", "--draft-block-size", "4", "--draft-layers", "1",
          "--mask-token", "w127", "--epochs", "1", "--num-anchors", "4", "--eval-prompts", str(prompts),
          "--num-eval", "1", "--eval-max-new-tokens", "6"])

    assert set(seen) == {"bench", "bench generate", "demo", "demo generate", "train", "train generate"}
    assert all(ids == EOS_IDS for calls in seen.values() for ids in calls), seen
    assert len(seen["train generate"]) == 3  # the data (one batch), the evaluation's warm-up and its prompt
