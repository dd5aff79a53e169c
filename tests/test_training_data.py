"""Data generation: chat-rendered prompts, target-regenerated responses, resumable without loss or duplicates."""

from __future__ import annotations

import json

import torch

from dflash_hf.prompts import chat_prompt_ids
from dflash_hf.training.data import generate_responses, read_prompts
from helpers import make_target, make_tokenizer, plain_greedy


def test_prompts_are_tokenized_once_with_the_chat_template():
    tokenizer = make_tokenizer()
    assert chat_prompt_ids(tokenizer, [{"role": "user", "content": "w7 w9"}]) == [3, 7, 9, 1, 4]


def test_read_prompts_from_the_benchmark_fields(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"question": "a"}, {"prompt": "b"}, {"turns": ["c", "d"]}]))
    assert read_prompts([path]) == ["a", "b", "c"]
    assert read_prompts([path], limit=2) == ["a", "b"]


def test_generation_resumes_without_duplicating_or_losing_rows(tmp_path):
    target, tokenizer = make_target("llama", seed=2), make_tokenizer()
    prompts = [" ".join(f"w{5 + (i * 7 + j) % 100}" for j in range(2 + i % 3)) for i in range(7)]
    path = tmp_path / "responses.jsonl"
    first = generate_responses(target, tokenizer, prompts[:3], path, batch_size=2, max_new_tokens=6, progress=False)
    with open(path, "a") as handle:  # an interruption in the middle of writing a row
        handle.write('{"index": 5, "prompt_ids": [3, ')
    rows = generate_responses(target, tokenizer, prompts, path, batch_size=2, max_new_tokens=6, progress=False)
    assert rows[:3] == first
    stored = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(row["index"] for row in stored) == list(range(7))  # each row once, none lost
    for row, prompt in zip(rows, prompts):
        prompt_ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
        assert row["prompt_ids"] == prompt_ids
        # the response is the target's own greedy continuation (batched with left padding, cut at end-of-turn)
        alone = plain_greedy(target, torch.tensor([prompt_ids]), 6, stop_token_ids=[1])[0, len(prompt_ids):].tolist()
        assert row["response_ids"] == alone
