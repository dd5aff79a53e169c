"""Multi-turn regeneration (`--regenerate-turns all`): every assistant turn re-answered by the target, turn by turn."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import make_char_tokenizer, make_target, make_tokenizer, plain_greedy

from dflash_hf.training.data import conversation_row, regenerate_conversations, rows_by_index

CONVERSATIONS = [
    [{"role": "system", "content": "w9 w9"}, {"role": "user", "content": "w5 w6"},
     {"role": "assistant", "content": "w7"}, {"role": "user", "content": "w8 w10 w11"},
     {"role": "assistant", "content": "w12"}, {"role": "user", "content": "w13"},
     {"role": "assistant", "content": "w14"}],
    [{"role": "user", "content": "w20 w21 w22 w23"}, {"role": "assistant", "content": "w24"}],
    [{"role": "user", "content": "w30"}, {"role": "assistant", "content": "w31"},
     {"role": "user", "content": "w32 w33"}, {"role": "assistant", "content": "w34"}],
    [{"role": "user", "content": "w40 w41"}, {"role": "assistant", "content": "w42"},
     {"role": "user", "content": "w43"}, {"role": "assistant", "content": "w44"}, {"role": "user", "content": "w45"}],
]


def write_conversations(path, conversations) -> None:
    path.write_text("".join(json.dumps({"messages": messages}) + "\n" for messages in conversations))


def labelled_runs(row: dict) -> list[list[int]]:
    """The ids of each contiguous run of labelled tokens of a training row."""
    runs, current = [], []
    for token, label in zip(row["input_ids"], row["loss_mask"]):
        if label:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


def template_ids(tokenizer, messages: list[dict], answers: list[list[int]], opening: list[int],
                 closing: list[int]) -> list[int]:
    """The ids of a template that writes `opening`, the content and `closing` for each turn: each assistant turn the
    ids the target generated (its stop id dropped: the template's closing follows), the others tokenized."""
    ids, answers = [], iter(answers)
    for message in messages:
        if message["role"] == "assistant":
            answer = next(answers)
            content = answer[:-1] if answer[-1] == 1 else answer
        else:
            content = tokenizer(message["content"], add_special_tokens=False)["input_ids"]
        ids += opening + content + closing
    return ids


def check_turn_by_turn(target, tokenizer, row: dict, source: list[dict], cap: int, history_ids) -> None:
    """Each assistant turn of a regenerated row is the target's greedy answer on the history before it, where the
    earlier assistant turns are the target's own answers; the system and user turns are the source's."""
    turns = [k for k, message in enumerate(row["messages"]) if message["role"] == "assistant"]
    assert len(turns) == len(row["answer_ids"]) >= 1
    for k, message in enumerate(row["messages"]):
        assert message["role"] == source[k]["role"]
        if message["role"] != "assistant":
            assert message["content"] == source[k]["content"]
    for number, position in enumerate(turns):
        prompt = history_ids(row["messages"][:position], row["answer_ids"][:number])
        alone = plain_greedy(target, torch.tensor([prompt]), cap, stop_token_ids=[1])[0, len(prompt):].tolist()
        assert row["answer_ids"][number] == alone
        text = alone[:-1] if alone[-1] == 1 else alone
        assert row["messages"][position]["content"] == tokenizer.decode(text, clean_up_tokenization_spaces=False)


def test_every_assistant_turn_is_the_targets_greedy_answer_on_the_history_it_gave(tmp_path, monkeypatch):
    import dflash_hf.training.data as data

    target, tokenizer = make_target("llama", seed=1), make_tokenizer()
    source = tmp_path / "chat.jsonl"
    write_conversations(source, CONVERSATIONS)
    batches, generate_rows = [], data._generate_rows

    def counted(target, draft, prompts, *args):
        batches.append([index for index, _ in prompts])
        return generate_rows(target, draft, prompts, *args)

    monkeypatch.setattr(data, "_generate_rows", counted)
    output = tmp_path / "conversations.jsonl"
    assert regenerate_conversations(target, tokenizer, [source], output, batch_size=3, max_new_tokens=8,
                                    progress=False) == 4
    rows = list(rows_by_index(output, range(4)))

    def rendered(messages, answers):  # the template's "w3 {content} w1 " per turn and "w4", the answers as generated
        return template_ids(tokenizer, messages, answers, [3], [1]) + [4]

    for row, messages in zip(rows, CONVERSATIONS):
        check_turn_by_turn(target, tokenizer, row, messages, 8, rendered)
    assert [len(row["answer_ids"]) for row in rows] == [3, 1, 2, 2]
    assert rows[3]["messages"][-1]["role"] == "assistant"  # the trailing user turn has no answer to train on
    lengths = {len(answer) for row in rows for answer in row["answer_ids"]}
    assert {8, 1} <= lengths and any(answer[-1] == 1 for row in rows for answer in row["answer_ids"])  # cut, stopped
    # longest first (by turns, then characters), batched across conversations at the same turn: [0, 3, 2] answer
    # their turns 0, 1, then 0 its turn 2; then [1]
    assert batches == [[0, 3, 2], [0, 3, 2], [0], [1]]
    # the training row: the loss on every assistant turn, exactly the generated ids; the end-of-turn token counts
    # only after an answer that stopped
    for row in rows:
        training = conversation_row(tokenizer, row["messages"], [1], "row", row["answer_ids"])
        assert labelled_runs(training) == row["answer_ids"]
        assert training["input_ids"] == template_ids(tokenizer, row["messages"], row["answer_ids"], [3], [1])
    # the word tokenizer's text does not always come back as the ids generated ("w116" tokenizes as w1, w2, w1):
    # the rows hold the generated ones, where the chat template's text would not
    assert any(conversation_row(tokenizer, row["messages"], [1], "row")["input_ids"]
               != conversation_row(tokenizer, row["messages"], [1], "row", row["answer_ids"])["input_ids"]
               for row in rows)


def test_a_killed_regeneration_resumes_where_it_stopped(tmp_path, monkeypatch):
    import dflash_hf.training.data as data

    target, tokenizer = make_target("llama", seed=2), make_tokenizer()
    source = tmp_path / "chat.jsonl"
    write_conversations(source, CONVERSATIONS)
    whole = tmp_path / "whole.jsonl"
    regenerate_conversations(target, tokenizer, [source], whole, batch_size=2, max_new_tokens=4, progress=False)
    answer_turns, groups = data._answer_turns, []

    def killed_after_one_group(target, tokenizer, draft, group, *args):
        if groups:
            raise KeyboardInterrupt
        groups.append([position for position, _ in group])
        return answer_turns(target, tokenizer, draft, group, *args)

    monkeypatch.setattr(data, "_answer_turns", killed_after_one_group)
    output = tmp_path / "conversations.jsonl"
    with pytest.raises(KeyboardInterrupt):
        regenerate_conversations(target, tokenizer, [source], output, batch_size=2, max_new_tokens=4, progress=False)
    assert groups == [[0, 3]]  # one group written to the shard before the kill
    monkeypatch.setattr(data, "_answer_turns", lambda target, tokenizer, draft, group, *args: (
        groups.append([position for position, _ in group]) or answer_turns(target, tokenizer, draft, group, *args)))
    regenerate_conversations(target, tokenizer, [source], output, batch_size=2, max_new_tokens=4, progress=False)
    assert groups[1:] == [[2, 1]]  # only the conversations not written
    assert list(rows_by_index(output, range(4))) == list(rows_by_index(whole, range(4)))
    assert sorted(json.loads(line)["index"] for line in output.read_text().splitlines()) == [0, 1, 2, 3]
    assert sorted(path.name for path in tmp_path.iterdir()) == ["chat.jsonl", "conversations.jsonl", "whole.jsonl"]
    write_conversations(source, [CONVERSATIONS[1], *CONVERSATIONS[1:]])  # conversation 0 is another one now
    with pytest.raises(ValueError, match="row 0 of .*conversations.jsonl answers another conversation"):
        regenerate_conversations(target, tokenizer, [source], output, batch_size=2, max_new_tokens=4, progress=False)


def char_chat_tokenizer():
    """Characters and two-letter pieces ("et", ...) that tokenizing text never gives (each character is split
    alone): an answer with a piece does not come back from its text as the ids the target generated."""
    tokenizer = make_char_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}#{{ m['content'] }}<eos>{% endfor %}"
                               "{% if add_generation_prompt %}#{% endif %}")
    return tokenizer


def test_the_ids_the_target_generated_are_kept_where_their_text_tokenizes_otherwise(tmp_path):
    target, tokenizer = make_target("llama", seed=5), char_chat_tokenizer()
    pieces = set(range(len(tokenizer) - 30, len(tokenizer)))  # the two-letter pieces
    conversations = [[{"role": "user", "content": "ab"}, {"role": "assistant", "content": "x"},
                      {"role": "user", "content": "cd e"}, {"role": "assistant", "content": "y"},
                      {"role": "user", "content": "f"}, {"role": "assistant", "content": "z"}],
                     [{"role": "user", "content": "gh"}, {"role": "assistant", "content": "x"},
                      {"role": "user", "content": "i"}, {"role": "assistant", "content": "y"}]]
    source = tmp_path / "chat.jsonl"
    write_conversations(source, conversations)
    output = tmp_path / "conversations.jsonl"
    regenerate_conversations(target, tokenizer, [source], output, batch_size=2, max_new_tokens=6, progress=False)
    rows = list(rows_by_index(output, range(2)))
    answers = [answer for row in rows for answer in row["answer_ids"]]
    assert any(set(answer) & pieces for answer in answers[:-1])  # a round trip that changes ids is exercised

    def spliced(messages, answers):  # the history holding the generated ids
        return conversation_row(tokenizer, messages, [1], "history", answers, add_generation_prompt=True)["input_ids"]

    for row, messages in zip(rows, conversations):
        check_turn_by_turn(target, tokenizer, row, messages, 6, spliced)
        training = conversation_row(tokenizer, row["messages"], [1], "row", row["answer_ids"])
        assert labelled_runs(training) == row["answer_ids"]  # the training row holds the target's own ids
        history = spliced(row["messages"][:-1], row["answer_ids"][:-1])
        assert training["input_ids"][:len(history)] == history  # the last turn's context is what the target saw
    assert any(conversation_row(tokenizer, row["messages"], [1], "row")["input_ids"]
               != conversation_row(tokenizer, row["messages"], [1], "row", row["answer_ids"])["input_ids"]
               for row in rows)  # the text alone would have given other ids


def test_a_short_content_is_found_where_the_template_puts_it_not_in_the_markup():
    tokenizer = make_char_tokenizer()
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    messages = [{"role": "user", "content": "s"}, {"role": "assistant", "content": "t"}]  # both in "<assistant>"
    row = conversation_row(tokenizer, messages, [1], "row")
    assert labelled_runs(row) == [tokenizer.convert_tokens_to_ids(["t", "<eos>"])]


def test_train_regenerates_every_turn_then_trains_on_the_targets_answers(tmp_path):
    from helpers import save_tiny_target_and_prompts
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_hf.cli import main
    from dflash_hf.training.store import STORE_DIR, SequenceStore

    prompts = save_tiny_target_and_prompts(tmp_path, 1)
    source = tmp_path / "chat.jsonl"
    write_conversations(source, CONVERSATIONS)
    run = tmp_path / "run"
    command = ["train", "--target", str(tmp_path / "target"), "--output", str(run), "--conversations", str(source),
               "--regenerate-turns", "all", "--gen-max-new-tokens", "6", "--draft-block-size", "4",
               "--draft-layers", "1", "--mask-token", "w127", "--epochs", "1", "--num-anchors", "4",
               "--eval-prompts", str(prompts), "--num-eval", "0"]
    with pytest.raises(SystemExit, match="--regenerate-turns all re-answers the assistant turns of --conversations"):
        main([*command[:5], *command[7:]])  # no --conversations
    main(command)
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "target").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "target")
    rows = list(rows_by_index(run / "conversations.jsonl", range(4)))

    def rendered(messages, answers):
        return template_ids(tokenizer, messages, answers, [3], [1]) + [4]

    for row, messages in zip(rows, CONVERSATIONS):
        check_turn_by_turn(target, tokenizer, row, messages, 6, rendered)
    store = SequenceStore(run / STORE_DIR, "train", 1)
    assert len(store) == 4
    for (ids, mask), row in zip(store, rows):  # trained on the target's answers, the loss on each of them
        expected = conversation_row(tokenizer, row["messages"], [1], "row", row["answer_ids"])
        assert ids.tolist() == expected["input_ids"] and mask.tolist() == expected["loss_mask"]
        assert labelled_runs({"input_ids": ids.tolist(), "loss_mask": mask.tolist()}) == row["answer_ids"]
    assert "every assistant turn re-answered by the target" in (run / "draft" / "README.md").read_text()
