"""The flags of a real training job: sequence length, checkpoint interval and rotation, the process group's timeout,
the answer length that follows --max-length, all prompts and bf16 on a GPU by default (docs/training.md)."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace

import pytest
import torch
from helpers import make_draft, make_target, make_tokenizer, plain_greedy, save_tiny_target_and_prompts
from safetensors.torch import load_file

from dflash_hf.cli import build_parser, main
from dflash_hf.devices_dflash import GROUPED_QUERY_SDPA
from dflash_hf.prompts import chat_prompt_ids
from dflash_hf.training.command import training_settings, training_target_dtype
from dflash_hf.training.data import answer_cap, generate_responses, rows_by_index
from dflash_hf.training.plan import resolve_schedule
from dflash_hf.training.processes import process_group_kwargs
from dflash_hf.training.trainer import (
    CHECKPOINT_DIR,
    DRAFT_WEIGHTS_FILE,
    STATE_FILE,
    TrainingSettings,
    kept_checkpoints,
    train_draft,
)
from dflash_hf.versions_dflash import continuous_batching_refusal

SETTINGS = TrainingSettings(epochs=2, learning_rate=2e-3, num_anchors=8, checkpoint_every=2, keep_checkpoints=3)


def rows(count: int = 4) -> list[dict]:
    generator = torch.Generator().manual_seed(3)
    return [{"prompt_ids": torch.randint(0, 127, (5,), generator=generator).tolist(),
             "response_ids": torch.randint(0, 127, (12,), generator=generator).tolist()} for _ in range(count)]


def checkpoint_steps(folder) -> dict[str, int]:
    """{folder name: the step its checkpoint holds} of every checkpoint in `folder`."""
    return {path.name: json.loads((path / STATE_FILE).read_text())["steps"]
            for path in sorted(folder.iterdir()) if path.name.startswith(CHECKPOINT_DIR)}


def test_keep_checkpoints_rotates_and_a_kept_one_resumes_exactly(tmp_path):
    target = make_target("qwen3", seed=4)
    log = train_draft(make_draft(5, block_size=4), target, rows(), SETTINGS, tmp_path / "run", progress=False)
    assert log.steps == 8  # 4 rows, 2 epochs, saved at steps 2, 4, 6, 8: the three newest stay
    assert checkpoint_steps(tmp_path / "run") == {CHECKPOINT_DIR: 8, f"{CHECKPOINT_DIR}-6": 6,
                                                  f"{CHECKPOINT_DIR}-4": 4}
    assert [path.name for path in kept_checkpoints(tmp_path / "run" / CHECKPOINT_DIR)] == [
        f"{CHECKPOINT_DIR}-4", f"{CHECKPOINT_DIR}-6"]  # oldest first
    # an earlier checkpoint, put back as OUTPUT/checkpoint, resumes from its step to the same end
    shutil.copytree(tmp_path / "run" / f"{CHECKPOINT_DIR}-4", tmp_path / "again" / CHECKPOINT_DIR)
    resumed = train_draft(make_draft(6, block_size=4), target, rows(), SETTINGS, tmp_path / "again", progress=False)
    assert resumed.losses == log.losses and resumed.learning_rates == log.learning_rates
    final, again = (load_file(tmp_path / run / CHECKPOINT_DIR / DRAFT_WEIGHTS_FILE) for run in ("run", "again"))
    assert all(torch.equal(final[name], again[name]) for name in final)


def test_one_kept_checkpoint_leaves_no_other_folder(tmp_path):
    train_draft(make_draft(5, block_size=4), make_target("qwen3", seed=4), rows(),
                replace(SETTINGS, keep_checkpoints=1, checkpoint_every=3), tmp_path, progress=False)
    assert checkpoint_steps(tmp_path) == {CHECKPOINT_DIR: 8}  # saved at 3, 6 and the last step


def test_max_length_cuts_the_training_sequences(tmp_path):
    log = train_draft(make_draft(5, block_size=4), make_target("qwen3", seed=4), rows(),
                      replace(SETTINGS, max_length=10, epochs=1), tmp_path, progress=False)
    assert log.tokens == 4 * 10  # 4 sequences of 5 + 12 tokens, cut to 10


@pytest.mark.parametrize("field, value, message", [
    ("keep_checkpoints", 0, "keep_checkpoints (--keep-checkpoints) 0: expected >= 1"),
    ("checkpoint_every", 0, "checkpoint_every (--checkpoint-every) 0: expected >= 1"),
    ("max_length", 1, "max_length 1 (--max-length): expected >= 2"),
    ("process_group_timeout_minutes", 0.0, "(--process-group-timeout): expected minutes > 0"),
])
def test_settings_refuse_counts_that_cannot_run(field, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        TrainingSettings(**{field: value})


def test_the_default_answer_fills_what_max_length_leaves_after_its_prompt(tmp_path):
    target, tokenizer = make_target("llama", seed=2), make_tokenizer()
    prompts = ["w5 w6", "w7 w8 w9 w10 w11 w12", "w13"]  # prompts of different lengths in one batch
    generate_responses(target, tokenizer, prompts, tmp_path / "responses.jsonl", batch_size=3, max_new_tokens=None,
                       max_length=16, progress=False)
    rows = rows_by_index(tmp_path / "responses.jsonl", range(len(prompts)))
    for row, prompt in zip(rows, prompts):
        prompt_ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
        cap = 16 - len(prompt_ids)
        assert answer_cap(len(prompt_ids), None, 16) == cap
        # the target's own greedy answer with that cap (no stop token: random weights), alone
        alone = plain_greedy(target, torch.tensor([prompt_ids]), cap, stop_token_ids=[1])[0, len(prompt_ids):]
        assert row["response_ids"] == alone.tolist()
        assert len(prompt_ids) + len(row["response_ids"]) <= 16  # nothing training would cut
    assert answer_cap(20, None, 16) == 1 and answer_cap(5, 7, 16) == 7  # a full prompt; an explicit cap wins


def test_train_defaults_are_the_real_job_and_every_flag_reaches_the_settings():
    args = build_parser().parse_args(["train", "--output", "run"])
    assert args.num_prompts is None and args.gen_max_new_tokens is None  # every prompt, answers up to --max-length
    assert (args.gen_dtype, args.eval_dtype, args.target_dtype) == ("auto", "auto", "auto")
    for flag in ("gen_dtype", "eval_dtype"):  # bf16 on a GPU, float32 on the CPU
        assert training_target_dtype(getattr(args, flag), torch.device("cuda", 0)) == torch.bfloat16
        assert training_target_dtype(getattr(args, flag), torch.device("cpu")) == torch.float32
    assert args.checkpoint_every == "2%"  # 50 checkpoints, whatever the run's length
    settings = training_settings(resolve_schedule(args, 1000, None))  # the steps of a 1,000-step run
    assert (settings.max_length, settings.checkpoint_every, settings.keep_checkpoints,
            settings.process_group_timeout_minutes) == (3072, 20, 1, None)
    assert process_group_kwargs(None) == []
    args = build_parser().parse_args(["train", "--output", "run", "--max-length", "4096", "--checkpoint-every",
                                      "500", "--keep-checkpoints", "3", "--process-group-timeout", "90"])
    settings = training_settings(resolve_schedule(args, 1000, None))
    assert (settings.max_length, settings.checkpoint_every, settings.keep_checkpoints,
            settings.process_group_timeout_minutes) == (4096, 500, 3, 90.0)
    assert process_group_kwargs(90.0)[0].timeout.total_seconds() == 90 * 60


def test_every_prompt_is_answered_by_default_the_last_row_held_out_and_a_bf16_evaluation_saves_float32(tmp_path):
    prompts = save_tiny_target_and_prompts(tmp_path, 3)
    run = tmp_path / "run"
    main(["train", "--target", str(tmp_path / "target"), "--output", str(run), "--prompts", str(prompts),
          "--max-length", "14", "--draft-block-size", "4", "--draft-layers", "1", "--mask-token", "w127",
          "--epochs", "1", "--num-anchors", "4", "--eval-prompts", str(prompts), "--num-eval", "1",
          "--eval-max-new-tokens", "4", "--eval-dtype", "bfloat16", "--held-out-rows", "1", "--held-out-every", "1"])
    responses = [json.loads(line) for line in (run / "responses.jsonl").read_text().splitlines()]
    assert sorted(row["index"] for row in responses) == [0, 1, 2]  # no --num-prompts: all 3
    assert all(len(row["prompt_ids"]) + len(row["response_ids"]) == 14 for row in responses)  # up to --max-length
    log = json.loads((run / "training_log.json").read_text())
    assert log["steps"] == 2 and [entry["step"] for entry in log["held_out_losses"]] == [0, 1, 2]  # 2 rows trained
    trained = load_file(run / CHECKPOINT_DIR / DRAFT_WEIGHTS_FILE)
    saved = load_file(run / "draft" / "model.safetensors")
    for name, tensor in trained.items():  # measured in bfloat16 on a copy; saved as trained
        assert saved[name].dtype == torch.float32 and torch.equal(saved[name], tensor), name
    card = (run / "draft" / "README.md").read_text()
    assert "bfloat16" in card and "up to 14 tokens with the prompt" in card


@pytest.mark.skipif(continuous_batching_refusal(torch.device("cpu")) is not None,
                    reason="this Transformers' continuous batching runs on a GPU only")
def test_generate_only_through_continuous_batching_writes_generates_rows(tmp_path, monkeypatch):
    import dflash_hf.training.command as command

    prompts = save_tiny_target_and_prompts(tmp_path, 3)
    attention, generate = {}, command.generate_responses

    def recorded(target, *args, engine, **kwargs):  # the attention each engine generates with
        attention[engine] = target.config._attn_implementation
        return generate(target, *args, engine=engine, **kwargs)

    monkeypatch.setattr(command, "generate_responses", recorded)
    for engine in ("generate", "continuous"):
        main(["train", "--target", str(tmp_path / "target"), "--output", str(tmp_path / engine), "--prompts",
              str(prompts), "--gen-max-new-tokens", "6", "--gen-batch-size", "3", "--generate-only",
              "--gen-engine", engine])
    generated, continuous = (rows_by_index(tmp_path / engine / "responses.jsonl", range(3))
                             for engine in ("generate", "continuous"))
    assert list(continuous) == list(generated)
    assert attention == {"generate": GROUPED_QUERY_SDPA, "continuous": "sdpa"}  # the CPU target's, and paged sdpa's


def test_the_target_loads_straight_to_its_device_in_its_dtype(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    import dflash_hf.training.command as command
    from dflash_hf.loading import load_target

    prompts = save_tiny_target_and_prompts(tmp_path, 2)
    placed, from_pretrained = [], AutoModelForCausalLM.from_pretrained

    def recorded(*args, **kwargs):  # where and in what the weights are loaded (a GPU's: not here, the CPU's model)
        placed.append((kwargs.get("device_map"), kwargs["dtype"]))
        return from_pretrained(*args, **{**kwargs, "device_map": None})

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", recorded)
    load_target(str(tmp_path / "target"), torch.bfloat16, device=torch.device("cuda", 1))
    assert placed == [(torch.device("cuda", 1), torch.bfloat16)]  # straight onto a GPU
    placed.clear()
    target, _ = load_target(str(tmp_path / "target"), torch.bfloat16, device=torch.device("cpu"))
    assert placed == [(None, torch.bfloat16)]  # on the CPU no device_map: it would mark the model dispatched (4.57)
    assert getattr(target, "hf_device_map", None) is None
    assert {(p.device.type, p.dtype) for p in target.parameters()} == {("cpu", torch.bfloat16)}
    placed.clear()
    load_target(str(tmp_path / "target"), torch.float32)  # no device: loaded as before, on the host
    assert placed == [(None, torch.float32)]
    loads, load = [], command.load_target
    monkeypatch.setattr(command, "load_target", lambda *args, **kwargs: loads.append(kwargs) or load(*args, **kwargs))
    placed.clear()
    main(["train", "--target", str(tmp_path / "target"), "--output", str(tmp_path / "run"), "--prompts", str(prompts),
          "--gen-max-new-tokens", "4", "--generate-only"])
    assert loads == [{"device": torch.device("cpu")}]  # train's process device, straight from the loading
    assert placed == [(None, torch.float32)]  # --gen-dtype auto on the CPU, where it loads anyway


def stand_in_vllm(monkeypatch) -> dict:
    """A `vllm` module in sys.modules whose `LLM` loads the target folder with Transformers and whose `generate` runs
    its greedy `generate` on each prompt's ids alone (with its max_tokens and stop ids); returns what it was given."""
    import sys
    from types import ModuleType, SimpleNamespace

    from transformers import AutoModelForCausalLM

    given: dict = {"llm": [], "sampling": []}

    class SamplingParams:
        def __init__(self, **settings):
            self.settings = settings
            given["sampling"].append(settings)

    class LLM:
        def __init__(self, **settings):
            given["llm"].append(settings)
            self.model = AutoModelForCausalLM.from_pretrained(settings["model"], dtype=torch.float32).eval()

        def generate(self, prompts, sampling_params, use_tqdm=True):
            outputs = []
            for prompt, params in zip(prompts, sampling_params, strict=True):
                ids = torch.tensor([prompt["prompt_token_ids"]])
                assert params.settings["temperature"] == 0  # greedy
                generated = self.model.generate(ids, max_new_tokens=params.settings["max_tokens"], do_sample=False,
                                                eos_token_id=params.settings["stop_token_ids"], pad_token_id=0)
                answer = SimpleNamespace(token_ids=generated[0, ids.shape[1]:].tolist())
                outputs.append(SimpleNamespace(outputs=[answer]))
            return outputs

    vllm, inputs = ModuleType("vllm"), ModuleType("vllm.inputs")
    vllm.LLM, vllm.SamplingParams, vllm.inputs = LLM, SamplingParams, inputs
    inputs.TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    return given


def test_the_vllm_engine_is_refused_by_name_where_vllm_is_missing(tmp_path, monkeypatch):
    import importlib.util

    import dflash_hf.training.command as command
    from dflash_hf.training.vllm_engine import vllm_refusal

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    prompts = save_tiny_target_and_prompts(tmp_path, 2)
    monkeypatch.setattr(command, "load_target", lambda *args, **kwargs: pytest.fail("loaded a model before the check"))
    with pytest.raises(SystemExit, match=r"--gen-engine vllm: vLLM is not installed here \(import vllm fails\)\. "
                                         r"Install it on a CUDA machine \(pip install vllm.*--gen-engine generate"):
        main(["train", "--target", str(tmp_path / "target"), "--output", str(tmp_path / "run"), "--prompts",
              str(prompts), "--generate-only", "--gen-engine", "vllm"])
    assert not (tmp_path / "run" / "responses.jsonl").exists()
    stand_in_vllm(monkeypatch)  # installed: what else it refuses
    two_steps = (r"run `dflash-hf train --generate-only --gen-engine vllm --output OUTPUT \.\.\.` \(on one process "
                 r"or under accelerate launch / torchrun, an engine per process\), then train on its rows")
    assert re.search(r"needs --generate-only .*" + two_steps, vllm_refusal(str(tmp_path / "target"), False))
    assert "HuggingFaceTB/SmolLM2-135M-Instruct" in vllm_refusal("smollm2", True)
    assert vllm_refusal(str(tmp_path / "target"), True) is None  # on any number of processes
    for engine in ("vllm", "continuous"):  # a draft answers through spec_generate only: refused before any load
        with pytest.raises(SystemExit, match=f"--gen-draft runs spec_generate on its own batches: leave --gen-engine "
                                             f"{engine} out"):
            main(["train", "--target", str(tmp_path / "target"), "--output", str(tmp_path / "run"), "--prompts",
                  str(prompts), "--generate-only", "--gen-engine", engine, "--gen-draft", "shipped"])
    with pytest.raises(SystemExit, match="--gen-tensor-parallel-size 2: vLLM's tensor parallelism.*--gen-engine vllm"):
        main(["train", "--target", str(tmp_path / "target"), "--output", str(tmp_path / "run"), "--prompts",
              str(prompts), "--generate-only", "--gen-tensor-parallel-size", "2"])


def test_the_vllm_engine_writes_generates_rows_through_a_stand_in(tmp_path, monkeypatch):
    import dflash_hf.training.command as command
    from dflash_hf.training.vllm_engine import VllmTarget

    save_tiny_target_and_prompts(tmp_path, 1)
    texts = ["w10 w11", "w12 w13 w14 w15 w16", "w17", "w18 w19 w20"]  # caps of their own: max_length - prompt
    prompts = tmp_path / "varied.jsonl"
    prompts.write_text("".join(json.dumps({"question": text}) + "\n" for text in texts))
    common = ["train", "--target", str(tmp_path / "target"), "--prompts", str(prompts), "--max-length", "24",
              "--gen-batch-size", "3", "--generate-only"]
    main([*common, "--output", str(tmp_path / "generate")])
    given = stand_in_vllm(monkeypatch)
    monkeypatch.setattr(command, "load_target", lambda *args, **kwargs: pytest.fail("vLLM loads the target itself"))
    targets, generate = [], command.generate_responses

    def recorded(target, *args, **kwargs):
        targets.append(target)
        return generate(target, *args, **kwargs)

    monkeypatch.setattr(command, "generate_responses", recorded)
    main([*common, "--output", str(tmp_path / "vllm"), "--gen-engine", "vllm", "--seed", "5",
          "--gen-tensor-parallel-size", "2"])
    rows = {engine: list(rows_by_index(tmp_path / engine / "responses.jsonl", range(4)))
            for engine in ("generate", "vllm")}
    assert rows["vllm"] == rows["generate"]
    assert isinstance(targets[0], VllmTarget)
    assert given["llm"] == [{"model": str(tmp_path / "target"), "dtype": "float32", "seed": 5,
                             "tensor_parallel_size": 2}]
    tokenizer = make_tokenizer()
    caps = [answer_cap(len(chat_prompt_ids(tokenizer, [{"role": "user", "content": text}])), None, 24)
            for text in texts]
    assert len(set(caps)) == 4 and sorted(settings["max_tokens"] for settings in given["sampling"]) == sorted(caps)
    assert all(settings["stop_token_ids"] == [1] and settings["seed"] is None and "top_k" not in settings
               for settings in given["sampling"])  # the tokenizer's EOS (w1); greedy: no seed, no nucleus
    assert [len(row["response_ids"]) for row in rows["vllm"]] == caps  # each answer to its own cap, none stopped


def test_the_vllm_engine_gets_the_targets_repetition_penalty_and_refuses_processors_it_is_not_given(monkeypatch):
    from types import SimpleNamespace

    from transformers import GenerationConfig

    from dflash_hf.training.vllm_engine import VllmTarget, check_generation_config, vllm_responses

    given = stand_in_vllm(monkeypatch)
    check_generation_config("t", GenerationConfig(repetition_penalty=1.05, temperature=0.7, top_k=20))  # given
    check_generation_config("t", GenerationConfig(min_new_tokens=0, no_repeat_ngram_size=0))  # at neutral values
    with pytest.raises(ValueError, match="t's generation config sets no_repeat_ngram_size, suppress_tokens, which "
                                         "generate applies and this engine does not give vLLM"):
        check_generation_config("t", GenerationConfig(no_repeat_ngram_size=3, suppress_tokens=[4]))
    llm = SimpleNamespace(generate=lambda prompts, settings, use_tqdm: [
        SimpleNamespace(outputs=[SimpleNamespace(token_ids=[7, 1])]) for _ in prompts])
    target = VllmTarget(llm, GenerationConfig(repetition_penalty=1.05))
    tokens = SimpleNamespace(stop_token_ids=[1])
    assert vllm_responses(target, [(0, [5, 6])], tokens, [4], 0.0, 0) == [[7, 1]]
    assert given["sampling"] == [{"temperature": 0.0, "max_tokens": 4, "stop_token_ids": [1], "seed": None,
                                  "repetition_penalty": 1.05}]  # greedy: no top-k / top-p, the penalty given
