"""What a GPU session must confirm: lossless decoding on CUDA in float32 (exact) and bfloat16 (exact up to near-ties),
left-padded batches, sampling with a CUDA generator, sdpa / eager / flash_attention_2 targets, `device_map="auto"`
loading, bf16 mixed-precision training, peak memory against the target's depth, and host syncs per step.

Every test is skipped on a machine without CUDA (flash_attention_2 also needs `flash_attn`). `scripts/gpu_check.sh`
runs this file first on a lent GPU; the numbers the tests print (memory, syncs per step) go to its log.
"""

from __future__ import annotations

import importlib.util
import json
import math
import shutil
import warnings
from collections import Counter
from pathlib import Path

import pytest
import torch
from helpers import (
    VOCAB_SIZE,
    WINDOW,
    ReferenceProposer,
    assert_equal_up_to_near_tie,
    build_target,
    make_draft,
    make_target,
    make_tokenizer,
    plain_greedy,
)
from sampling_checks import NUM_NEW, SAMPLING_VOCAB, assert_follows, exact_joint
from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3ForCausalLM

from dflash_hf import left_pad, speculative_decode

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device; this machine has none"),
]

DEVICE = "cuda"
HAS_FLASH_ATTN = importlib.util.find_spec("flash_attn") is not None
BATCH_LENGTHS = [1, 6, 23, 11]  # left-padded to 23


def random_prompt(length: int, seed: int, vocab_size: int = VOCAB_SIZE) -> torch.Tensor:
    """Ids [1, length] drawn on the host (the same on every machine), moved to the GPU."""
    return torch.randint(0, vocab_size - 1, (1, length), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def assert_lossless(target: torch.nn.Module, output: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """float32: token for token; bfloat16: equal, or diverging first at a near-tie of the target's two best logits."""
    if dtype == torch.float32:
        assert torch.equal(output, expected), (output.tolist(), expected.tolist())
    else:
        assert_equal_up_to_near_tie(target, output, expected)


def check_batch_rows(target: torch.nn.Module, draft: torch.nn.Module, dtype: torch.dtype, seed: int,
                     lengths: list[int] = BATCH_LENGTHS, max_new_tokens: int = 30, block_size: int = 8) -> None:
    """A left-padded batch through spec_generate: every row equals the target's greedy decode of that row alone."""
    prompts = [random_prompt(length, 300 + 17 * seed + index) for index, length in enumerate(lengths)]
    input_ids, attention_mask = left_pad([prompt[0].tolist() for prompt in prompts], pad_token_id=0, device=DEVICE)
    result = draft.spec_generate(target=target, input_ids=input_ids, attention_mask=attention_mask,
                                 max_new_tokens=max_new_tokens, block_size=block_size, return_stats=True)
    assert torch.equal(result.output_ids[:, : input_ids.shape[1]], input_ids)  # the prompts come back as passed
    assert result.num_new_tokens == [max_new_tokens] * len(prompts)
    for row, prompt in enumerate(prompts):
        expected = plain_greedy(target, prompt, max_new_tokens=max_new_tokens)
        output = torch.cat((prompt, torch.tensor([result.new_tokens(row)], device=DEVICE)), dim=1)
        assert_lossless(target, output, expected, dtype)


# --- Greedy, single rows and batches (Qwen3 and Llama shapes) --------------------------------------------------------


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", [0, 1])
def test_cuda_greedy_matches_plain(arch, dtype, seed):
    target = make_target(arch, seed).to(DEVICE, dtype)
    draft = make_draft(seed).to(DEVICE, dtype)
    input_ids = random_prompt(9, seed)
    expected = plain_greedy(target, input_ids, max_new_tokens=40)
    for block_size in (1, 4, 8):
        output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=40, block_size=block_size)
        assert output.device.type == "cuda"
        assert_lossless(target, output, expected, dtype)


def test_cuda_perfect_proposer_float32():
    target = make_target("qwen3", seed=3).to(DEVICE)
    input_ids = torch.tensor([[5, 6, 7, 8]], device=DEVICE)
    expected = plain_greedy(target, input_ids, max_new_tokens=33)
    result = speculative_decode(target, ReferenceProposer(expected), input_ids, max_new_tokens=33, block_size=8)
    assert torch.equal(result.output_ids, expected)
    assert result.acceptance_lengths == [[8, 8, 8, 8]]


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_left_padded_batch_rows_equal_each_row_alone(arch, dtype):
    target = make_target(arch, seed=1).to(DEVICE, dtype)
    draft = make_draft(1).to(DEVICE, dtype)
    for block_size in (2, 8):
        check_batch_rows(target, draft, dtype, seed=block_size, block_size=block_size)


# --- Attention implementations of the target (and the draft) ---------------------------------------------------------


def load_saved_target(folder: Path, arch: str, seed: int, **kwargs) -> torch.nn.Module:
    """A tiny target written with save_pretrained and loaded back with `from_pretrained(folder, **kwargs)`."""
    make_target(arch, seed).save_pretrained(folder)
    target = AutoModelForCausalLM.from_pretrained(folder, **kwargs).eval()
    target.generation_config.eos_token_id = None
    return target


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
@pytest.mark.parametrize("implementation,dtype", [
    ("sdpa", torch.float32), ("sdpa", torch.bfloat16), ("eager", torch.float32), ("flash_attention_2", torch.bfloat16),
])
def test_cuda_target_attention_implementations(tmp_path, arch, implementation, dtype):
    if implementation == "flash_attention_2" and not HAS_FLASH_ATTN:
        pytest.skip('flash_attn is not installed here (from a clone: pip install -e ".[flash]"); flash_attention_2 '
                    "not tested")
    target = load_saved_target(tmp_path, arch, seed=4, dtype=dtype, attn_implementation=implementation).to(DEVICE)
    assert target.config._attn_implementation == implementation
    draft = make_draft(4).to(DEVICE, dtype)  # sdpa
    input_ids = random_prompt(13, seed=4)
    expected = plain_greedy(target, input_ids, max_new_tokens=40)
    for block_size in (1, 4, 8):
        output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=40, block_size=block_size)
        assert_lossless(target, output, expected, dtype)
    check_batch_rows(target, draft, dtype, seed=4, lengths=[3, 17, 9])  # padded columns and holes under this kernel


@pytest.mark.skipif(not HAS_FLASH_ATTN,
                    reason="flash_attn is not installed here; the flash_attention_2 draft is not tested")
def test_cuda_flash_attention_2_draft_single_row():
    target = make_target("qwen3", seed=5).to(DEVICE, torch.bfloat16)
    draft = make_draft(5).to(DEVICE, torch.bfloat16)
    draft.config._attn_implementation = "flash_attention_2"
    input_ids = random_prompt(11, seed=5)
    expected = plain_greedy(target, input_ids, max_new_tokens=40)
    for block_size in (4, 8):
        output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=40, block_size=block_size)
        assert_equal_up_to_near_tie(target, output, expected)


# --- Loading with device_map="auto" ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_device_map_auto_target(tmp_path, dtype):
    # use_kernels=False: Transformers 5.25 swaps in Hub kernels on a GPU by default, which needs the Hub (none here)
    target = load_saved_target(tmp_path, "qwen3", seed=6, dtype=dtype, device_map="auto", use_kernels=False)
    assert target.get_input_embeddings().weight.device.type == "cuda"
    print("hf_device_map", getattr(target, "hf_device_map", None))
    draft = make_draft(6).to(DEVICE, dtype)
    input_ids = random_prompt(10, seed=6)
    expected = plain_greedy(target, input_ids, max_new_tokens=40)
    output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=40, block_size=8)
    assert_lossless(target, output, expected, dtype)
    check_batch_rows(target, draft, dtype, seed=6, lengths=[4, 12])


# --- Sampling with a CUDA generator ----------------------------------------------------------------------------------

SAMPLED_TOKENS = NUM_NEW
SAMPLES = 1000  # 4 batches of 250 identical rows


@pytest.mark.parametrize("acceptance,temperature,top_k,top_p", [
    ("rejection", 1.0, None, None), ("rejection", 0.8, 3, None), ("rejection", 1.2, None, 0.8),
    ("equality", 1.0, None, None),
])
def test_cuda_sampling_follows_the_target_distribution(acceptance, temperature, top_k, top_p):
    target = make_target("llama", seed=11, vocab_size=SAMPLING_VOCAB, init_std=0.4).to(DEVICE)
    draft = make_draft(12, block_size=4, vocab_size=SAMPLING_VOCAB, mask_token_id=SAMPLING_VOCAB - 1).to(DEVICE)
    prompt = torch.tensor([[1, 4, 2, 5]], device=DEVICE)
    generator = torch.Generator(device=DEVICE).manual_seed(1234)
    counts: Counter = Counter()
    accepted_drafts = 0
    for _ in range(4):
        result = draft.spec_generate(target=target, input_ids=prompt.repeat(SAMPLES // 4, 1),
                                     max_new_tokens=SAMPLED_TOKENS,
                                     block_size=4, temperature=temperature, top_k=top_k, top_p=top_p,
                                     acceptance=acceptance, generator=generator, return_stats=True)
        counts.update(tuple(row) for row in result.new_token_ids.tolist())
        accepted_drafts += sum(length - 1 for lengths in result.acceptance_lengths for length in lengths)
    assert sum(counts.values()) == SAMPLES
    assert accepted_drafts > SAMPLES // 10  # proposals were accepted: the acceptance path ran on the GPU
    print(f"sampling {acceptance} T={temperature} top_k={top_k} top_p={top_p}: accepted {accepted_drafts}")
    # one CUDA generator shared by the batch (sampled_counts gives each row its own); power: T x 1.5 is rejected
    assert_follows(counts, exact_joint(target, prompt, temperature, top_k, top_p),
                   exact_joint(target, prompt, temperature * 1.5, top_k, top_p), SAMPLES)


def test_cuda_sampling_generators_and_seeds():
    target = make_target("qwen3", seed=13).to(DEVICE)
    draft = make_draft(13).to(DEVICE)
    input_ids = random_prompt(7, seed=13)
    runs = [draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=24, temperature=1.0, seed=s)
            for s in (7, 7, 8)]
    assert torch.equal(runs[0], runs[1]) and not torch.equal(runs[0], runs[2])
    with_generator = [draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=24, temperature=1.0,
                                          generator=torch.Generator(device=DEVICE).manual_seed(5)) for _ in range(2)]
    assert torch.equal(with_generator[0], with_generator[1])
    with pytest.raises(ValueError, match="generator"):  # a host generator for a CUDA target is refused by name
        draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=4, temperature=1.0,
                            generator=torch.Generator().manual_seed(5))


# --- Training in bf16 mixed precision --------------------------------------------------------------------------------


def train_argv(tmp_path: Path, output: str, *extra: str) -> list[str]:
    """`dflash-hf train` on a tiny saved Llama target (as tests/test_cli.py does), 2 epochs x 4 sequences."""
    if not (tmp_path / "target").exists():
        make_target("llama", seed=3).save_pretrained(tmp_path / "target")
        make_tokenizer().save_pretrained(tmp_path / "target")
        (tmp_path / "prompts.jsonl").write_text(
            "\n".join(json.dumps({"question": f"w{10 + i} w{20 + i} w{30 + i}"}) for i in range(6)))
    prompts = str(tmp_path / "prompts.jsonl")
    return ["train", "--target", str(tmp_path / "target"), "--output", str(tmp_path / output), "--prompts", prompts,
            "--num-prompts", "4", "--gen-batch-size", "2", "--gen-max-new-tokens", "12", "--draft-block-size", "4",
            "--draft-layers", "1", "--mask-token", "w127", "--epochs", "2", "--num-anchors", "6",
            "--eval-prompts", prompts, "--num-eval", "2", "--eval-max-new-tokens", "10", "--eval-dtype", "float32",
            *extra]


def test_cuda_train_bf16_mixed_precision(tmp_path):
    # DEPENDS ON `dflash-hf train --mixed-precision bf16` (dflash_hf/cli.py; TrainingSettings.mixed_precision, bf16
    # autocast in dflash_hf/training/trainer.py), written in parallel with this test: without it argparse exits 2.
    # `--target-dtype` is left at `auto` (a bfloat16 target on CUDA) in both runs below.
    from dflash_hf.cli import main

    main(train_argv(tmp_path, "bf16", "--mixed-precision", "bf16"))
    log = json.loads((tmp_path / "bf16" / "training_log.json").read_text())
    assert log["steps"] == 8 and all(math.isfinite(loss) for loss in log["losses"])
    evaluation = json.loads((tmp_path / "bf16" / "evaluation.json").read_text())
    assert evaluation["lossless"] is True  # the draft trained in bf16, evaluated in float32 on the GPU
    config = json.loads((tmp_path / "bf16" / "draft" / "config.json").read_text())
    assert config["block_size"] == 4

    # the same run without autocast, in the same process: same weights, data and anchors, so step 1 nearly agrees
    (tmp_path / "fp32").mkdir()
    shutil.copy(tmp_path / "bf16" / "responses.jsonl", tmp_path / "fp32" / "responses.jsonl")  # the same data
    main(train_argv(tmp_path, "fp32"))
    full = json.loads((tmp_path / "fp32" / "training_log.json").read_text())
    print("first losses bf16", log["losses"][:3], "fp32", full["losses"][:3])
    assert full["losses"][0] != log["losses"][0], "the bf16 run computed exactly the float32 losses: no autocast?"
    assert full["losses"][0] == pytest.approx(log["losses"][0], rel=0.05)


# --- Peak memory against the target's depth --------------------------------------------------------------------------

MEMORY_PROMPT = 1024
MEMORY_NEW_TOKENS = 32
MEMORY_HIDDEN, MEMORY_KV_HEADS, MEMORY_HEAD_DIM = 256, 2, 64


def deep_target(num_layers: int) -> torch.nn.Module:
    """A float32 Qwen3 target of `num_layers` layers, hidden size 256, on the GPU."""
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=VOCAB_SIZE, hidden_size=MEMORY_HIDDEN, intermediate_size=512,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=MEMORY_KV_HEADS,
                         head_dim=MEMORY_HEAD_DIM, max_position_embeddings=2048, initializer_range=0.1,
                         tie_word_embeddings=False)
    model = Qwen3ForCausalLM(config)
    model.generation_config.eos_token_id = None
    return model.to(DEVICE).eval()


def generation_peak(num_layers: int) -> int:
    """Peak bytes allocated above what was allocated before (weights, workspaces) during one spec_generate."""
    target = deep_target(num_layers)
    draft = make_draft(0, hidden_size=MEMORY_HIDDEN, intermediate_size=512, num_target_layers=num_layers,
                       max_position_embeddings=2048,
                       dflash_config={"mask_token_id": VOCAB_SIZE - 1, "target_layer_ids": [1, 3]}).to(DEVICE)
    input_ids = random_prompt(MEMORY_PROMPT, seed=21)
    run = lambda: draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=MEMORY_NEW_TOKENS,
                                      block_size=8)
    run()  # warm-up: kernels, cuBLAS workspaces, the head probe
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    run()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    return peak


def test_cuda_peak_memory_keeps_only_the_draft_layers_hidden_states():
    """From 4 to 12 target layers the peak may grow by the 8 layers' KV cache, not by their hidden states.

    Keeping every layer's hidden state of a 1024-token prompt (output_hidden_states=True) would add 8 x 1 MiB here
    on top of the KV cache's 8 x 1.03 MiB; the assertion allows half of that, the draft reads 2 layers either way.
    """
    peaks = {layers: generation_peak(layers) for layers in (4, 12)}
    bytes_per_value = 4
    kv_per_layer = 2 * MEMORY_KV_HEADS * MEMORY_HEAD_DIM * (MEMORY_PROMPT + MEMORY_NEW_TOKENS) * bytes_per_value
    hidden_per_layer = MEMORY_PROMPT * MEMORY_HIDDEN * bytes_per_value
    growth = peaks[12] - peaks[4]
    mib = 2**20
    print(f"peak above weights: 4 layers {peaks[4] / mib:.2f} MiB, 12 layers {peaks[12] / mib:.2f} MiB "
          f"(x{peaks[12] / peaks[4]:.2f} for x3 layers); growth {growth / mib:.2f} MiB = KV cache of 8 layers "
          f"{8 * kv_per_layer / mib:.2f} MiB + {(growth - 8 * kv_per_layer) / mib:.2f} MiB "
          f"(every hidden state kept would add {8 * hidden_per_layer / mib:.2f} MiB)")
    assert peaks[12] / peaks[4] < 3
    assert growth < 8 * kv_per_layer + 0.5 * 8 * hidden_per_layer, (
        "the peak grows with the target's depth beyond its KV cache: the prefill or a verify keeps every layer's "
        "hidden state, not only the draft's target_layer_ids")


# --- Host syncs per step ---------------------------------------------------------------------------------------------


def count_sync_warnings(call) -> tuple[object, Counter]:
    """Run `call` under torch.cuda.set_sync_debug_mode("warn"): its result and the sync warnings by source line."""
    sites: Counter = Counter()
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    for warning in caught:
        if "synchroniz" in str(warning.message).lower():
            sites[f"{Path(warning.filename).name}:{warning.lineno}"] += 1
    return result, sites


@pytest.mark.parametrize("case", ["greedy", "greedy_batch", "sampling"])
def test_cuda_loop_runs_under_sync_debug_mode(case):
    """The loop runs with sync warnings on; the count per draft/verify step is printed (no bound asserted)."""
    target = make_target("qwen3", seed=7).to(DEVICE)
    draft = make_draft(7).to(DEVICE)
    if case == "greedy_batch":
        input_ids, attention_mask = left_pad([random_prompt(n, 70 + n)[0].tolist() for n in (5, 12, 9)], 0,
                                             device=DEVICE)
    else:
        input_ids, attention_mask = random_prompt(9, seed=7), None
    settings = dict(temperature=1.0, seed=3) if case == "sampling" else {}
    call = lambda: draft.spec_generate(target=target, input_ids=input_ids, attention_mask=attention_mask,
                                       max_new_tokens=64, block_size=8, return_stats=True, **settings)
    reference = call()  # warm-up: one-time syncs (the LM-head probe, lazy initialisation) are not counted
    result, sites = count_sync_warnings(call)
    assert torch.equal(result.output_ids, reference.output_ids)
    steps = max(len(lengths) for lengths in result.acceptance_lengths)
    total = sum(sites.values())
    print(f"host syncs ({case}): {total} over {steps} steps = {total / max(steps, 1):.1f} per step "
          f"(rows {input_ids.shape[0]}, tau {result.tau:.2f}); by site: {dict(sites.most_common(12))}")


# --- The compiled path: CUDA graphs ----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_compiled_path_runs_cuda_graphs_exactly_without_recompiling(dtype):
    """`compile=True` on a GPU: inductor with CUDA graphs (`mode="reduce-overhead"`); the target's greedy tokens
    (bfloat16: up to near-ties), a left-padded batch too, and no new graph for a second call."""
    from torch._dynamo.utils import counters

    target = make_target("qwen3", seed=2).to(DEVICE, dtype)
    draft = make_draft(2).to(DEVICE, dtype)
    torch._dynamo.reset()
    counters.clear()
    for seed in (0, 1):
        input_ids = random_prompt(9 + seed, seed)
        expected = plain_greedy(target, input_ids, max_new_tokens=40)
        output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=40, compile=True)
        assert_lossless(target, output, expected, dtype)
        print(f"{dtype}: graphs after call {seed + 1}: {counters['stats']['unique_graphs']}")
    assert counters["stats"]["unique_graphs"] == 2  # the verify and the draft forward, compiled once
    # Both run as CUDA graphs: inductor skips them for a graph that writes into an input without a fixed address
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


@pytest.mark.parametrize("family,tree_size", [("qwen3", 8), ("gemma3", None), ("gpt_oss", 6)])
def test_cuda_compiled_trees_and_sliding_windows_run_cuda_graphs_exactly(family, tree_size):
    """`compile=True` beyond a chain on a full-attention target: a tree (the 4-D mask and positions are graph inputs)
    and sliding-window targets (the window counted by position), float32, prompts past the window: the target's own
    greedy tokens, CUDA graphs with no skip, no new graph for a second call."""
    from torch._dynamo.utils import counters

    target = build_target(family).to(DEVICE)
    draft = make_draft(3).to(DEVICE)
    torch._dynamo.reset()
    counters.clear()
    for seed in (0, 1):
        input_ids = random_prompt(2 * WINDOW + 3 + seed, seed)
        expected = plain_greedy(target, input_ids, max_new_tokens=32)
        output = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=32, compile=True,
                                     tree_size=tree_size)
        assert_lossless(target, output, expected, torch.float32)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
