"""Regeneration sized to the device: the continuous engine's paged cache comes from the free device memory and the
blocks the rows need, never from the rows times their caps alone."""

from __future__ import annotations

import functools
import sys

import pytest
import torch
from helpers import make_target, make_tokenizer, save_tiny_target_and_prompts
from transformers import Qwen3Config

from dflash_hf.prompts import user_prompt_ids
from dflash_hf.training.data import generate_responses
from dflash_hf.versions_dflash import (
    CONTINUOUS_BATCHING_PAGE,
    CONTINUOUS_CACHE_MEMORY,
    TRANSFORMERS_RELEASE,
    continuous_batching_refusal,
    paged_cache_plan,
)

GIB = 2**30


def qwen3_8b_config() -> Qwen3Config:
    """Qwen3-8B's decoder shape (a config only, no weights)."""
    return Qwen3Config(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, vocab_size=151936)


def h100_free_bytes() -> int:
    """An 80 GB H100 with Qwen3-8B's 16.4 GB of bf16 weights loaded and 2 GiB of CUDA context and workspace."""
    return 80 * 10**9 - 16_400_000_000 - 2 * GIB


def test_the_continuous_cache_for_256_rows_of_an_8b_target_fits_the_device():
    rows = [200 + 2872] * 256  # the docs' batch: 256 prompts of 200 tokens, each may answer up to --max-length 3,072
    free = h100_free_bytes()
    plan = paged_cache_plan(qwen3_8b_config(), torch.bfloat16, rows, free)
    cache_token = 36 * 2 * 8 * 128 * 2  # layers x (key, value) x kv heads x head dim x bf16 bytes: 144 KiB
    assert cache_token == 144 * 1024
    assert plan.needed_blocks == 256 * 12 + 1  # 3,072 tokens are 12 blocks of 256
    assert plan.needed_blocks * CONTINUOUS_BATCHING_PAGE * cache_token > 100 * GIB > free  # the old sizing: ~108 GiB
    assert plan.footprint <= plan.budget == int(free * CONTINUOUS_CACHE_MEMORY)  # within the device
    assert plan.num_blocks < plan.needed_blocks
    # the budget is spent, not wasted: the cache alone takes most of it
    assert plan.num_blocks * CONTINUOUS_BATCHING_PAGE * cache_token > 0.65 * plan.budget
    assert plan.tokens >= 60 * 3072  # 60 rows at their whole cap at once (most answer sooner and free their blocks)
    smaller = paged_cache_plan(qwen3_8b_config(), torch.bfloat16, rows, free // 2)  # half the memory: fewer blocks
    assert smaller.footprint <= smaller.budget and smaller.num_blocks < plan.num_blocks


@pytest.mark.skipif(TRANSFORMERS_RELEASE < (5, 25), reason="Transformers 5.25's paged cache checks its footprint")
@pytest.mark.parametrize("attention, asynchronous", [("sdpa", False), ("flash_attention_2", True)])
@pytest.mark.parametrize("logits_to_keep", [False, True])
def test_transformers_own_paged_cache_accepts_the_plan(monkeypatch, attention, asynchronous, logits_to_keep):
    """Transformers 5.25 builds the planned cache (on the meta device, so nothing is allocated) and finds it within
    the memory it sees (its footprint check raises MemoryError otherwise), with sdpa's mask or flash attention's
    doubled buffers (asynchronous batching, which 5.25 turns on only without a mask)."""
    from transformers.generation import ContinuousBatchingConfig
    from transformers.generation.continuous_batching import cache as paged
    from transformers.generation.continuous_batching.distributed import DistributedHelper

    config, free = qwen3_8b_config(), h100_free_bytes()
    config._attn_implementation_internal = attention
    plan = paged_cache_plan(config, torch.bfloat16, [3072] * 256, free)
    monkeypatch.setattr(paged, "get_device_and_memory_breakdown", lambda: (torch.device("meta"), free, 0, 0))

    def build(num_blocks: int):
        settings = ContinuousBatchingConfig(page_size=plan.page_size, num_blocks=num_blocks,
                                            max_batch_tokens=plan.max_batch_tokens,
                                            max_memory_percent=CONTINUOUS_CACHE_MEMORY,
                                            use_async_batching=asynchronous)
        return paged.PagedAttentionCache(config, settings, "meta", DistributedHelper(None, None),
                                         dtype=torch.bfloat16, model_supports_logits_to_keep=logits_to_keep)

    assert build(plan.num_blocks).num_blocks == plan.num_blocks
    with pytest.raises(MemoryError):  # the old sizing: every row at its whole cap
        build(plan.needed_blocks)


def test_rows_that_fit_get_the_blocks_they_need_and_a_row_that_cannot_is_refused():
    config = qwen3_8b_config()
    rows = [300, 700, 257]
    plan = paged_cache_plan(config, torch.bfloat16, rows, 40 * GIB)
    assert plan.num_blocks == plan.needed_blocks == 2 + 3 + 2 + 1
    assert plan.max_batch_tokens == sum(rows)  # a forward needs no more than all the rows' tokens
    with pytest.raises(ValueError, match=r"one row needs 3072 \(its prompt and its answer cap\).*"
                                         r"--gen-max-new-tokens.*--gen-engine generate"):
        paged_cache_plan(config, torch.bfloat16, [3072], 2 * GIB)


@pytest.mark.skipif(continuous_batching_refusal(torch.device("cpu")) is not None,
                    reason="this Transformers' continuous batching runs on a GPU only")
def test_the_engine_passes_the_planned_cache_sized_by_the_free_memory(tmp_path, monkeypatch):
    import dflash_hf.training.data as data

    target, tokenizer = make_target("llama", seed=2), make_tokenizer()
    seen, generate_batch = [], target.generate_batch

    @functools.wraps(generate_batch)  # its signature stays visible (generate_batch_arguments reads it)
    def recorded_generate_batch(inputs, **kwargs):
        seen.append(kwargs["continuous_batching_config"])
        return generate_batch(inputs, **kwargs)

    monkeypatch.setattr(target, "generate_batch", recorded_generate_batch)
    asked = []
    monkeypatch.setattr(data, "free_memory_bytes", lambda device: asked.append(device) or 8 * GIB)
    prompts = ["w5 w6", "w40 w41 w42"]
    generate_responses(target, tokenizer, prompts, tmp_path / "rows.jsonl", batch_size=2, max_new_tokens=6,
                       progress=False, engine="continuous")
    assert asked == [torch.device("cpu")]  # the target's device
    rows = [len(user_prompt_ids(tokenizer, text)) + 6 for text in prompts]
    expected = paged_cache_plan(target.config, target.dtype, rows, 8 * GIB)
    assert [(config.num_blocks, config.max_batch_tokens, config.max_memory_percent) for config in seen] == [
        (expected.num_blocks, expected.max_batch_tokens, CONTINUOUS_CACHE_MEMORY)]


def test_each_process_engine_takes_its_own_gpus():
    from dflash_hf.training.vllm_engine import engine_gpus

    assert engine_gpus(0, 1, None, 8) == ["0"] and engine_gpus(7, 1, None, 8) == ["7"]
    assert engine_gpus(3, 2, None, 8) == ["6", "7"]  # 4 processes, tensor-parallel over 2 GPUs each
    assert engine_gpus(1, 2, "4,5,6,7", 4) == ["6", "7"]  # of the GPUs the launch made visible
    with pytest.raises(ValueError, match=r"process 4 of this machine needs GPUs 8\.\.9 \(--gen-tensor-parallel-size 2 "
                                         r"each\), but 8 are visible"):
        engine_gpus(4, 2, None, 8)


def test_an_engine_starts_on_its_gpus_without_the_launch_variables(tmp_path, monkeypatch):
    import os

    from test_training_job_flags import stand_in_vllm

    from dflash_hf.training.vllm_engine import load_vllm_target

    save_tiny_target_and_prompts(tmp_path, 1)
    given = stand_in_vllm(monkeypatch)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3")
    seen = []
    llm_class = sys.modules["vllm"].LLM
    monkeypatch.setattr(sys.modules["vllm"], "LLM", lambda **settings: seen.append(
        (os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("RANK"))) or llm_class(**settings))
    load_vllm_target(str(tmp_path / "target"), torch.float32, 0, 1, ["3"])
    assert seen == [("3", None)]  # the engine process vLLM spawns sees its GPU and no process group of the launch
    assert (os.environ["CUDA_VISIBLE_DEVICES"], os.environ["RANK"]) == ("0,1,2,3", "3")  # restored after
    load_vllm_target(str(tmp_path / "target"), torch.float32, 0, 1, None)  # one process: as it is
    assert seen[1] == ("0,1,2,3", "3") and len(given["llm"]) == 2
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    with pytest.raises(ValueError, match="unset VLLM_ENABLE_V1_MULTIPROCESSING=0"):
        load_vllm_target(str(tmp_path / "target"), torch.float32, 0, 1, ["3"])


# A `vllm` package for the two processes of `test_two_processes_answer_their_own_shares_through_vllm`: its `LLM` loads
# the target folder with Transformers and answers each prompt with greedy `generate` alone; each engine records the
# prompts it answered in VLLM_STAND_IN_RECORDS/<pid>.json.
STAND_IN_VLLM = '''
import json, os
import torch
from transformers import AutoModelForCausalLM


class SamplingParams:
    def __init__(self, **settings):
        self.settings = settings


class LLM:
    def __init__(self, **settings):
        self.model = AutoModelForCausalLM.from_pretrained(settings["model"], dtype=torch.float32).eval()
        self.record = os.path.join(os.environ["VLLM_STAND_IN_RECORDS"], f"{os.getpid()}.json")
        self.prompts = []

    def generate(self, prompts, sampling_params, use_tqdm=True):
        class Output:
            pass
        outputs = []
        for prompt, params in zip(prompts, sampling_params, strict=True):
            ids = torch.tensor([prompt["prompt_token_ids"]])
            generated = self.model.generate(ids, max_new_tokens=params.settings["max_tokens"], do_sample=False,
                                            eos_token_id=params.settings["stop_token_ids"], pad_token_id=0)
            answer, output = Output(), Output()
            answer.token_ids, output.outputs = generated[0, ids.shape[1]:].tolist(), [answer]
            outputs.append(output)
            self.prompts.append(prompt["prompt_token_ids"])
        with open(self.record, "w") as handle:
            json.dump(self.prompts, handle)
        return outputs
'''


def test_two_processes_answer_their_own_shares_through_vllm(tmp_path, monkeypatch):
    """`--gen-engine vllm` under torchrun on two (CPU) processes: each process starts one engine and answers its own
    share of the prompts into its own shard; the merged rows are one process's `generate` rows."""
    import json

    from test_training_distributed import run_two_processes

    from dflash_hf.loading import load_target
    from dflash_hf.training.data import read_prompts, rows_by_index

    prompts = save_tiny_target_and_prompts(tmp_path, 5)
    target, tokenizer = load_target(str(tmp_path / "target"), torch.float32)
    generate_responses(target, tokenizer, read_prompts([prompts]), tmp_path / "alone.jsonl", batch_size=2,
                       max_new_tokens=8, progress=False)
    package, records = tmp_path / "stand_in" / "vllm", tmp_path / "engines"
    package.mkdir(parents=True)
    records.mkdir()
    (package / "__init__.py").write_text(STAND_IN_VLLM)
    (package / "inputs.py").write_text("def TokensPrompt(prompt_token_ids):\n"
                                       "    return {'prompt_token_ids': prompt_token_ids}\n")
    monkeypatch.setenv("PYTHONPATH", str(package.parent))
    monkeypatch.setenv("VLLM_STAND_IN_RECORDS", str(records))
    output, _ = run_two_processes(
        ["cli"], tmp_path, "train", "--target", str(tmp_path / "target"), "--output", str(tmp_path / "cli" / "run"),
        "--prompts", str(prompts), "--gen-batch-size", "2", "--gen-max-new-tokens", "8", "--generate-only",
        "--gen-engine", "vllm")["cli"]
    assert list(rows_by_index(output / "responses.jsonl", range(5))) == list(
        rows_by_index(tmp_path / "alone.jsonl", range(5)))
    answered = [json.loads(path.read_text()) for path in sorted(records.iterdir())]
    assert len(answered) == 2 and all(answered)  # one engine per process, each answered some
    every = sorted(ids for engine in answered for ids in engine)
    alone = sorted(row["prompt_ids"] for row in rows_by_index(tmp_path / "alone.jsonl", range(5)))
    assert every == alone  # the shares are disjoint and cover every prompt: each answered once
    assert not list(output.glob("responses.rank-*"))  # the shards were merged and removed
