"""`dflash-hf train` end to end on a tiny target: data, training, Hub-ready draft with a card, tau."""

from __future__ import annotations

import gzip
import json
import re

import pytest
import torch
from helpers import save_tiny_target_and_prompts
from safetensors.torch import load_file
from transformers import AutoModel

from dflash_hf.cli import main
from dflash_hf.training.store import STORE_DIR, SequenceStore


def test_train_command_writes_a_hub_ready_draft(tmp_path):
    prompts = save_tiny_target_and_prompts(tmp_path, 6)
    run = tmp_path / "run"
    argv = ["train", "--target", str(tmp_path / "target"), "--output", str(run), "--prompts", str(prompts),
            "--num-prompts", "4", "--gen-batch-size", "2", "--gen-max-new-tokens", "12", "--draft-block-size", "4",
            "--draft-layers", "1", "--mask-token", "w127", "--epochs", "2", "--num-anchors", "6", "--distill",
            "--init-from-target", "--mixed-precision", "bf16", "--draft-vocab-size", "40",
            "--eval-prompts", str(prompts), "--num-eval", "2", "--eval-max-new-tokens", "10",
            "--eval-dtype", "float32", "--eval-every", "4"]
    main(argv)
    assert len((run / "responses.jsonl").read_text().splitlines()) == 4
    evaluation = json.loads((run / "evaluation.json").read_text())
    assert evaluation["lossless"] is True and evaluation["num_prompts"] == 2 and evaluation["tau"] >= 1.0
    card = (run / "draft" / "README.md").read_text()
    assert "base_model:" in card and "dflash-hf train" in card and "tau" in card
    config = json.loads((run / "draft" / "config.json").read_text())
    assert config["dflash_config"]["mask_token_id"] == 127 and config["block_size"] == 4
    assert config["dflash_config"]["target_layer_ids"] == [2]  # one draft layer: [N // 2]
    responses = [json.loads(line)["response_ids"] for line in (run / "responses.jsonl").read_text().splitlines()]
    # --draft-vocab-size 40: its own LM head over 40 tokens, every response token among them (fewer than 40 here)
    assert config["draft_vocab_size"] == 40 and "draft_vocab" not in config["dflash_config"]
    draft = AutoModel.from_pretrained(run / "draft", trust_remote_code=True)
    assert type(draft).__name__ == "DFlashDraftModel" and len(draft.draft_vocab) == 40
    assert {t for r in responses for t in r} <= set(draft.draft_vocab)
    weights = load_file(run / "draft" / "model.safetensors")
    assert {name: tensor.dtype for name, tensor in weights.items() if tensor.dtype != torch.float32} == {
        "d2t": torch.int64, "t2d": torch.bool}
    assert weights["lm_head.weight"].shape == (40, draft.config.hidden_size)
    training_log = json.loads((run / "training_log.json").read_text())
    assert 0.0 <= training_log["outside_vocabulary"] < 1.0
    assert training_log["settings"]["mixed_precision"] == "bf16"
    assert [evaluation["step"] for evaluation in training_log["evaluations"]] == [0, 4, 8]  # --eval-every 4
    assert all(evaluation["lossless"] for evaluation in training_log["evaluations"])
    # a second run resumes: nothing is regenerated or retrained
    main(argv)
    assert json.loads((run / "training_log.json").read_text())["steps"] == 8


def test_train_init_from_starts_at_a_trained_draft_and_keeps_its_architecture(tmp_path):
    prompts = save_tiny_target_and_prompts(tmp_path, 4)
    common = ["--target", str(tmp_path / "target"), "--prompts", str(prompts), "--num-prompts", "3",
              "--gen-batch-size", "3", "--gen-max-new-tokens", "10", "--num-anchors", "4", "--epochs", "1",
              "--eval-prompts", str(prompts), "--num-eval", "1", "--eval-max-new-tokens", "6"]
    main(["train", "--output", str(tmp_path / "first"), "--draft-block-size", "4", "--draft-layers", "2",
          "--target-layer-ids", "1", "3", "--mask-token", "w127", "--layer-types", "sliding_attention",
          "full_attention", "--sliding-window", "3", *common])
    trained = AutoModel.from_pretrained(tmp_path / "first" / "draft", trust_remote_code=True)
    assert (trained.config.layer_types, trained.config.sliding_window) == (["sliding_attention", "full_attention"], 3)
    assert [layer.attention_kind for layer in trained.layers] == [(True, 3), (False, None)]
    assert json.loads((tmp_path / "first" / "evaluation.json").read_text())["lossless"] is True

    # no steps: the saved draft is the trained one, with its block size, layers, target layers and mask token
    main(["train", "--output", str(tmp_path / "second"), "--init-from", str(tmp_path / "first" / "draft"),
          "--max-steps", "0", *common])
    started = AutoModel.from_pretrained(tmp_path / "second" / "draft", trust_remote_code=True)
    assert started.config.to_dict()["dflash_config"] == trained.config.to_dict()["dflash_config"]
    assert (started.block_size, len(started.layers)) == (4, 2)
    for name, tensor in trained.state_dict().items():
        torch.testing.assert_close(started.state_dict()[name], tensor, rtol=0, atol=0)
    assert "initialisation" in (tmp_path / "second" / "draft" / "README.md").read_text()

    # a later stage on the rows the draft has not seen: one epoch over prompts 1..2 is two steps
    # (with --draft-vocab-size: the draft gains its own LM head over the 30 most frequent labels of those rows)
    main(["train", "--output", str(tmp_path / "later"), "--init-from", str(tmp_path / "first" / "draft"),
          "--first-prompt", "1", "--draft-vocab-size", "30", *common])
    assert json.loads((tmp_path / "later" / "training_log.json").read_text())["steps"] == 2
    later = AutoModel.from_pretrained(tmp_path / "later" / "draft", trust_remote_code=True)
    labels = {token for ids, mask in SequenceStore(tmp_path / "later" / STORE_DIR, "train", 1)
              for token in ids[mask.bool()].tolist()}
    assert later.lm_head.weight.shape[0] == 30 and labels <= set(later.draft_vocab)
    assert (later.block_size, len(later.layers)) == (4, 2)
    for size, refusal in (("20", r"--draft-vocab-size 20 \(the draft has 30\)"),
                          ("200", "--draft-vocab-size 200: the target has 128 tokens")):
        with pytest.raises(SystemExit, match=refusal):
            main(["train", "--output", str(tmp_path / "later"), "--init-from", str(tmp_path / "later" / "draft"),
                  "--first-prompt", "1", "--draft-vocab-size", size, *common])
    assert "2 prompts (1-2) of prompts.jsonl" in (tmp_path / "later" / "draft" / "README.md").read_text()
    with pytest.raises(SystemExit, match="--first-prompt 3: expected 0 <= it < the 3 prompts of --num-prompts"):
        main(["train", "--output", str(tmp_path / "third"), "--first-prompt", "3", *common])

    # a stage on two prompt files with a count each: the first file's rows come from an earlier run's responses
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(json.dumps({"prompt": f"w{40 + i} w{50 + i}"}) for i in range(2)))
    two_files = [*common[:2], "--prompts", str(prompts), str(other), *common[6:]]
    main(["train", "--output", str(tmp_path / "mixed"), "--init-from", str(tmp_path / "first" / "draft"),
          "--num-prompts", "3", "2", "--first-prompt", "2", "--responses", str(tmp_path / "first" / "responses.jsonl"),
          *two_files])
    mixed = [json.loads(line) for line in (tmp_path / "mixed" / "responses.jsonl").read_text().splitlines()]
    assert mixed[:3] == [json.loads(line)
                         for line in (tmp_path / "first" / "responses.jsonl").read_text().splitlines()]
    assert sorted(row["index"] for row in mixed) == [0, 1, 2, 3, 4]
    assert json.loads((tmp_path / "mixed" / "training_log.json").read_text())["steps"] == 3  # prompts 2..4
    main(["train", "--output", str(tmp_path / "each"), "--num-prompts", "2", "--generate-only",  # 2 of each file
          "--responses", str(tmp_path / "mixed" / "responses.jsonl"), *two_files])
    each = [json.loads(line) for line in (tmp_path / "each" / "responses.jsonl").read_text().splitlines()]
    assert [row["prompt_ids"] for row in sorted(each, key=lambda row: row["index"])] == [
        row["prompt_ids"] for row in sorted(mixed, key=lambda row: row["index"]) if row["index"] in (0, 1, 3, 4)]
    card = " ".join((tmp_path / "mixed" / "draft" / "README.md").read_text().split())
    assert "3 prompts (2-4) of prompts.jsonl (its first 3), other.jsonl (its first 2)" in card
    with pytest.raises(SystemExit,
                       match="--num-prompts 3 2 1: give one count for all prompt files, or one per file \\(2\\)"):
        main(["train", "--output", str(tmp_path / "third"), "--num-prompts", "3", "2", "1", *two_files])
    with pytest.raises(SystemExit, match="--num-prompts 3 for .*other.jsonl: it holds only 2 prompts"):
        main(["train", "--output", str(tmp_path / "third"), "--num-prompts", "1", "3", *two_files])

    with pytest.raises(SystemExit, match="--draft-block-size 8 \\(the draft has 4\\)"):
        main(["train", "--output", str(tmp_path / "third"), "--init-from", str(tmp_path / "first" / "draft"),
              "--draft-block-size", "8", *common])
    with pytest.raises(SystemExit, match="train --block-size is now --draft-block-size 8"):
        main(["train", "--output", str(tmp_path / "third"), "--block-size", "8", *common])
    with pytest.raises(SystemExit, match="--causal True \\(the draft has None\\)"):
        main(["train", "--output", str(tmp_path / "third"), "--init-from", str(tmp_path / "first" / "draft"),
              "--causal", "true", *common])
    with pytest.raises(SystemExit, match="pass one"):
        main(["train", "--output", str(tmp_path / "third"), "--init-from", str(tmp_path / "first" / "draft"),
              "--init-from-target", *common])


def test_train_target_dtype_defaults_to_bfloat16_on_cuda_and_float32_on_cpu():
    from dflash_hf.cli import build_parser
    from dflash_hf.training.command import training_target_dtype
    from dflash_hf.training.trainer import autocast_dtype

    args = build_parser().parse_args(["train", "--output", "run"])
    assert (args.target_dtype, args.mixed_precision) == ("auto", "auto")
    assert autocast_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16  # the draft's forward: bf16 on a GPU
    assert autocast_dtype("auto", torch.device("cpu")) is None  # float32 on the CPU
    assert autocast_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert autocast_dtype("no", torch.device("cuda")) is None
    assert training_target_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert training_target_dtype("auto", torch.device("cpu")) == torch.float32
    assert training_target_dtype("float16", torch.device("cuda")) == torch.float16
    assert training_target_dtype("float32", torch.device("cuda")) == torch.float32
    train_help = " ".join(build_parser()._subparsers._group_actions[0].choices["train"].format_help().split())
    assert "auto: bfloat16 on CUDA, and on a CPU where" in train_help
    assert "bfloat16 autocast" in train_help and "stay float32" in train_help


@pytest.mark.parametrize("speedup", [0.6, 1.2, 4.0])
def test_auto_precision_on_a_cpu_follows_what_bf16_measures_at_the_models_width(monkeypatch, speedup):
    """On a CPU, "auto" is bf16 for many-row work (training, batched answers) only where a bf16 product at the
    model's width measures at least BF16_MIN_SPEEDUP times faster; narrow models and few-row work stay float32."""
    import dflash_hf.training.trainer as trainer
    from dflash_hf.training.command import training_target_dtype

    probed = []
    monkeypatch.setattr(trainer, "cpu_bf16_speedup", lambda width: probed.append(width) or speedup)
    cpu = torch.device("cpu")
    faster = speedup >= trainer.BF16_MIN_SPEEDUP
    assert trainer.autocast_dtype("auto", cpu, 576) == (torch.bfloat16 if faster else None)
    assert training_target_dtype("auto", cpu, 576) == (torch.bfloat16 if faster else torch.float32)
    assert probed == [576, 576]
    assert trainer.autocast_dtype("auto", cpu, 64) is None  # narrow: overhead-bound, not probed
    assert training_target_dtype("auto", cpu) == torch.float32  # the evaluation's decoding: no width, float32
    assert training_target_dtype("float32", cpu, 576) == torch.float32  # an explicit choice is kept
    assert trainer.autocast_dtype("no", cpu, 576) is None and probed == [576, 576]


def test_the_bf16_probe_measures_this_cpu():
    from dflash_hf.training.trainer import cpu_bf16_speedup

    speedup = cpu_bf16_speedup(64, rows=16)
    assert 0 < speedup < float("inf")
    assert cpu_bf16_speedup(64, rows=16) == speedup  # measured once per width in a process


def test_train_defaults_are_the_published_recipe():
    """Without flags a new draft has the published Qwen3-8B draft's shape (5 layers, blocks of 16) and trains with
    the paper's 512 anchors per sequence and gamma 7."""
    from helpers import make_target, make_tokenizer

    from dflash_hf.cli import build_parser
    from dflash_hf.loading import PUBLISHED_CONFIGS
    from dflash_hf.training.command import build_draft
    from dflash_hf.training.objective import loss_decay_gamma

    args = build_parser().parse_args(["train", "--output", "run", "--mask-token", "w127"])
    assert args.num_anchors == 512
    draft, _ = build_draft(args, make_target("llama", seed=3), make_tokenizer())
    published = json.loads((PUBLISHED_CONFIGS / "Qwen3-8B-DFlash-b16.json").read_text())
    shape = (len(draft.layers), draft.block_size)
    assert shape == (published["num_hidden_layers"], published["block_size"]) == (5, 16)
    assert loss_decay_gamma(draft.block_size) == 7.0


@pytest.mark.parametrize("flags, message", [
    (["--train-batch-size", "0"], "--train-batch-size 0 and --gradient-accumulation-steps 1: both must be >= 1"),
    (["--gradient-accumulation-steps", "0"],
     "--train-batch-size 1 and --gradient-accumulation-steps 0: both must be >= 1"),
    (["--cache-limit-gib", "2"], "pass it with --cache-target-features"),
    (["--keep-checkpoints", "0"], "keep_checkpoints \\(--keep-checkpoints\\) 0"),
    (["--max-length", "1"], "max_length 1 \\(--max-length\\)"),
    (["--gen-max-new-tokens", "0"], "--gen-max-new-tokens 0: expected >= 1"),
    (["--process-group-timeout", "-5"], "--process-group-timeout"),
    (["--held-out-rows", "2"], "--held-out-rows 2 and --held-out-every 0: pass both >= 1"),
    (["--held-out-every", "5"], "--held-out-rows 0 and --held-out-every 5: pass both >= 1"),
    (["--draft-vocab-size", "0"], "--draft-vocab-size 0: expected K >= 1"),
])
def test_train_refuses_flags_it_cannot_run_before_anything_loads(tmp_path, monkeypatch, flags, message):
    import dflash_hf.training.command as command

    monkeypatch.setattr(command, "load_target", lambda *args, **kwargs: pytest.fail("loaded a model before the check"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "w5"}\n')
    with pytest.raises(SystemExit, match=message):
        main(["train", "--output", str(tmp_path / "run"), "--prompts", str(prompts), "--num-eval", "0", *flags])
    assert not (tmp_path / "run").exists()


def test_train_generate_only_writes_the_rows_a_draft_regenerates_and_stops(tmp_path):
    from helpers import make_draft

    prompts = save_tiny_target_and_prompts(tmp_path, 5)
    make_draft(seed=1).save_pretrained(tmp_path / "gen_draft")
    common = ["train", "--target", str(tmp_path / "target"), "--prompts", str(prompts), "--num-prompts", "5",
              "--gen-batch-size", "2", "--gen-max-new-tokens", "8", "--generate-only"]
    main([*common, "--output", str(tmp_path / "plain")])
    main([*common, "--output", str(tmp_path / "drafted"), "--gen-draft", str(tmp_path / "gen_draft")])
    plain = (tmp_path / "plain" / "responses.jsonl").read_text().splitlines()
    assert len(plain) == 5 and (tmp_path / "drafted" / "responses.jsonl").read_text().splitlines() == plain
    assert sorted(path.name for path in (tmp_path / "drafted").iterdir()) == ["responses.jsonl"]  # nothing trained

    # rows shipped as an archive seed a new run: kept as they are (even one that differs), only the rest generated
    rows = [json.loads(line) for line in plain]
    rows[1]["response_ids"] = [7, 7, 1]
    (tmp_path / "rows.jsonl.gz").write_bytes(gzip.compress("".join(json.dumps(row) + "\n"
                                                                   for row in rows[:3]).encode()))
    main([*common, "--output", str(tmp_path / "seeded"), "--responses", str(tmp_path / "rows.jsonl.gz")])
    seeded = sorted((json.loads(line) for line in (tmp_path / "seeded" / "responses.jsonl").read_text().splitlines()),
                    key=lambda row: row["index"])
    assert seeded == sorted(rows, key=lambda row: row["index"])


def test_a_flag_that_several_subcommands_take_means_the_same_in_each():
    import argparse

    from dflash_hf.cli import SHARED_OPTIONS, build_parser

    commands = next(action for action in build_parser()._actions if isinstance(action, argparse._SubParsersAction))
    seen: dict[str, list[tuple[str, argparse.Action]]] = {}
    for name, parser in commands.choices.items():
        for action in parser._actions:
            for flag in action.option_strings:
                if action.help != argparse.SUPPRESS and flag not in ("-h", "--help"):
                    seen.setdefault(flag, []).append((name, action))
    shared = {flag: actions for flag, actions in seen.items() if len(actions) > 1}
    assert {"--block-size", "--prompts", "--draft", "--target", "--num-prompts"} <= set(shared)
    assert set(shared) <= set(SHARED_OPTIONS), "define a flag that several subcommands take in SHARED_OPTIONS"
    for flag, actions in shared.items():
        described = {(action.help, action.type, tuple(action.choices or ())) for _, action in actions}
        assert len(described) == 1, f"{flag} differs between {[name for name, _ in actions]}"
    assert [name for name, _ in seen["--block-size"]] == ["demo", "chat", "bench"]  # train's is --draft-block-size


def test_bench_reads_several_prompt_files_with_a_count_each(tmp_path):
    from dflash_hf.cli import bench_datasets, build_parser

    turns, question = tmp_path / "turns.jsonl", tmp_path / "questions.jsonl"
    turns.write_text("\n".join(json.dumps({"turns": [f"a{i}", f"b{i}"]}) for i in range(3)))
    question.write_text("\n".join(json.dumps({"question": f"q{i}"}) for i in range(3)))
    args = build_parser().parse_args(["bench", "--prompts", str(turns), str(question), "--num-prompts", "2", "1"])
    assert bench_datasets(args) == {"turns": [["a0", "b0"], ["a1", "b1"]], "questions": [["q0"]]}
    args = build_parser().parse_args(["bench", "--prompts", str(turns), str(question), "--num-prompts", "2"])
    assert {name: len(rows) for name, rows in bench_datasets(args).items()} == {"turns": 2, "questions": 2}
    with pytest.raises(SystemExit, match="--num-prompts 1 2 3: give one count for all prompt files"):
        bench_datasets(build_parser().parse_args(["bench", "--prompts", str(turns), "--num-prompts", "1", "2", "3"]))


def test_version(capsys):
    from dflash_hf.configuration_dflash import DFLASH_HF_VERSION

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.strip() == f"dflash-hf {DFLASH_HF_VERSION}"


def test_demo_prompt_and_chat_flags_reach_their_functions(monkeypatch):
    import dflash_hf.chat as chat
    import dflash_hf.demo as demo

    seen: dict[str, tuple] = {}
    monkeypatch.setattr(demo, "run_demo", lambda *args, **kwargs: seen.update(demo=(args, kwargs)))
    monkeypatch.setattr(chat, "run_chat", lambda *args, **kwargs: seen.update(chat=(args, kwargs)))
    main(["demo", "--prompt", "Why is the sky blue?", "--prompt", "Write a haiku."])
    assert seen["demo"][1]["prompts"] == ["Why is the sky blue?", "Write a haiku."]
    main(["demo", "--prompt", "One text."])
    assert seen["demo"][1]["prompts"] == ["One text."]
    main(["demo"])
    assert seen["demo"][1]["prompts"] is None  # the demo's own three
    with pytest.raises(SystemExit, match="--prompt number 2 is empty: give each --prompt some text"):
        main(["demo", "--prompt", "fine", "--prompt", "  "])

    main(["chat"])  # greedy, chosen on this machine, colour where the terminal has it
    assert seen["chat"][0] == (256, torch.float32, None, "auto", None, None, 0.0, 0, "auto")
    main(["chat", "--block-size", "3", "--tree-size", "8", "--cpu-kernels", "on", "--temperature", "0.7",
          "--seed", "5", "--color", "never", "--max-new-tokens", "64", "--draft", "my_draft"])
    assert seen["chat"][0] == (64, torch.float32, "my_draft", 3, 8, True, 0.7, 5, "never")
    main(["chat", "--tree-size", "auto"])
    assert seen["chat"][0][4] == "auto"
    with pytest.raises(SystemExit, match="chat --temperature -1.0: expected >= 0"):
        main(["chat", "--temperature", "-1"])
    with pytest.raises(SystemExit):
        main(["chat", "--color", "sometimes"])


def test_demo_answers_the_users_prompts_and_checks_them_against_generate(monkeypatch, capsys):
    from helpers import make_draft, make_target, make_tokenizer

    import dflash_hf.demo as demo

    models = make_target("llama", seed=5), make_tokenizer(), make_draft(5, block_size=4, mask_token_id=127)
    monkeypatch.setattr(demo, "load_demo", lambda dtype, draft_path: models)
    main(["demo", "--prompt", "w35 w36 w37", "--prompt", "w38", "--max-new-tokens", "6", "--block-size", "4",
          "--tree-size", "0", "--cpu-kernels", "off"])
    printed = capsys.readouterr().out
    assert "### w35 w36 w37\n" in printed and "### w38\n" in printed and "Janet" not in printed
    assert "identical to generate: True" in printed and "block size 4 of 4, chain" in printed


def test_chat_command_streams_answers_until_quit(monkeypatch, capsys):
    from helpers import make_draft, make_target, make_tokenizer

    import dflash_hf.chat as chat

    models = make_target("llama", seed=6), make_tokenizer(), make_draft(6, block_size=4, mask_token_id=127)
    monkeypatch.setattr(chat, "load_demo", lambda dtype, draft_path: models)
    lines = iter(["w35 w36", "/quit"])
    monkeypatch.setattr("builtins.input", lambda prompt: print(prompt, end="") or next(lines))
    main(["chat", "--block-size", "4", "--cpu-kernels", "off", "--max-new-tokens", "5", "--color", "always"])
    printed = capsys.readouterr().out
    assert "block size 4, a chain, greedy" in printed and "are \033[32mgreen\033[0m" in printed
    assert "you> w35 w36\n" in printed  # input that is not a terminal is echoed
    assert len(re.findall(r"\[5 tokens \| [\d.]+ tokens/s \| tau [\d.]+ \| \d+ draft tokens accepted", printed)) == 1
