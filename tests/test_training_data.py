"""Data generation: chat-rendered prompts, target-regenerated responses, resumable without loss or duplicates."""

from __future__ import annotations

import functools
import gzip
import json
import time

import pytest
import torch
from helpers import make_draft, make_target, make_tokenizer, plain_greedy

from dflash_hf.prompts import chat_prompt_ids
from dflash_hf.smollm2 import publish_folder
from dflash_hf.training.data import generate_responses, read_prompts, read_rows, rows_by_index
from dflash_hf.versions_dflash import continuous_batching_refusal


def in_order(path, count: int) -> list[dict]:
    """The rows of a response file for prompts 0 .. count - 1, in prompt order."""
    return list(rows_by_index(path, range(count)))


def test_prompts_are_tokenized_once_with_the_chat_template():
    tokenizer = make_tokenizer()
    assert chat_prompt_ids(tokenizer, [{"role": "user", "content": "w7 w9"}]) == [3, 7, 9, 1, 4]


def test_read_prompts_from_the_benchmark_fields(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in [{"question": "a"}, {"prompt": "b"}, {"turns": ["c", "d"]}]))
    assert read_prompts([path]) == ["a", "b", "c"]
    assert read_prompts([path], limit=2) == ["a", "b"]


def test_prompt_texts_are_read_one_line_when_asked_for(tmp_path):
    from dflash_hf.training.data import PromptTexts

    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text('{"question": "a1"}\n\n{"prompt": "a2"}\n{"turns": ["a3", "x"]}\n')  # a blank line
    second.write_text('{"question": "b1"}\n{"question": "b2"}')  # no newline at the end
    texts = PromptTexts([first, second], [None, None])
    assert len(texts) == 5 and list(texts) == read_prompts([first, second]) == ["a1", "a2", "a3", "b1", "b2"]
    assert [texts[i] for i in (4, 0, 2)] == ["b2", "a1", "a3"] and texts.file_counts() == [3, 2]
    limited = PromptTexts([first, second], [2, 1])
    assert list(limited) == ["a1", "a2", "b1"] and limited.file_counts() == [2, 1]
    with pytest.raises(IndexError):
        texts[5]
    first.write_text('{"question": "c1"}\n\n{"prompt": "c2"}\n{"turns": ["c3", "x"]}\n')  # the same offsets
    assert texts[1] == "c2"  # read from the file when asked for, not held
    second.write_text('{"question": "b1"}\n{"q": "b2"}\n')
    with pytest.raises(ValueError, match=r"second.jsonl:2: expected an object with a turns/question/.* list"):
        PromptTexts([first, second], [None, None])  # every line checked when built
    with pytest.raises(FileNotFoundError, match="No prompt file at .*missing.jsonl"):
        PromptTexts([tmp_path / "missing.jsonl"], [None])


def test_generation_runs_without_autograd(tmp_path, monkeypatch):
    """The answers are generated under no_grad (nothing is trained through them)."""
    import dflash_hf.training.data as data

    target, tokenizer = make_target("llama", seed=2), make_tokenizer()
    generate, grad_modes = data._generate_rows, []
    monkeypatch.setattr(data, "_generate_rows",
                        lambda *args: grad_modes.append(torch.is_grad_enabled()) or generate(*args))
    with torch.enable_grad():
        generate_responses(target, tokenizer, ["w5 w6", "w7"], tmp_path / "r.jsonl", batch_size=1, max_new_tokens=2,
                           progress=False)
    assert grad_modes == [False, False]


def test_generation_resumes_without_duplicating_or_losing_rows(tmp_path):
    target, tokenizer = make_target("llama", seed=2), make_tokenizer()
    prompts = [" ".join(f"w{5 + (i * 7 + j) % 100}" for j in range(2 + i % 3)) for i in range(7)]
    path = tmp_path / "responses.jsonl"
    assert generate_responses(target, tokenizer, prompts[:3], path, batch_size=2, max_new_tokens=6,
                              progress=False) == 3
    first = in_order(path, 3)
    with open(path, "a") as handle:  # an interruption in the middle of writing a row
        handle.write('{"index": 5, "prompt_ids": [3, ')
    generate_responses(target, tokenizer, prompts, path, batch_size=2, max_new_tokens=6, progress=False)
    rows = in_order(path, 7)
    assert rows[:3] == first
    stored = [json.loads(line) for line in path.read_text().splitlines()]
    assert sorted(row["index"] for row in stored) == list(range(7))  # each row once, none lost
    for row, prompt in zip(rows, prompts):
        prompt_ids = chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
        assert row["prompt_ids"] == prompt_ids
        # the response is the target's own greedy continuation (batched with left padding, cut at end-of-turn)
        alone = plain_greedy(target, torch.tensor([prompt_ids]), 6, stop_token_ids=[1])[0, len(prompt_ids):].tolist()
        assert row["response_ids"] == alone


def test_a_killed_runs_shards_are_merged_once_and_their_prompts_not_generated_again(tmp_path, monkeypatch):
    import dflash_hf.training.data as data

    target, tokenizer = make_target("llama", seed=2), make_tokenizer()
    prompts = ["w5 w6", "w7 w8", "w9 w10 w11", "w12"]
    path = tmp_path / "responses.jsonl"
    generate_responses(target, tokenizer, prompts[:2], path, batch_size=2, max_new_tokens=4, progress=False)
    first = in_order(path, 2)
    path.write_text(path.read_text()[:-1])  # the last row cut just before its newline
    ids = [chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}]) for prompt in prompts]
    marked = {"index": 2, "prompt_ids": ids[2], "response_ids": [9, 9, 9, 1]}  # no regeneration: kept as it is
    # a killed run of 2 processes: process 1's shard holds row 1 again (a merge cut after appending it), row 2, and a
    # line cut by the kill
    (tmp_path / "responses.rank-1-of-2.jsonl").write_text(
        json.dumps({**first[1], "response_ids": [8, 1]}) + "\n" + json.dumps(marked) + "\n" + '{"index": 3, "pro')
    (tmp_path / "responses.rank-0-of-2.jsonl.done").touch()  # a killed run's marker: would let a merge start too early
    generated, respond = [], data._respond

    def counted_respond(target, draft, input_ids, *args):
        generated.append(input_ids.tolist())
        return respond(target, draft, input_ids, *args)

    monkeypatch.setattr(data, "_respond", counted_respond)
    generate_responses(target, tokenizer, prompts, path, batch_size=2, max_new_tokens=4, progress=False)
    rows = in_order(path, 4)
    assert rows[:2] == first and rows[2] == marked  # kept, merged (not the duplicate of row 1), not regenerated
    assert generated == [[ids[3]]]  # only prompt 3
    assert [json.loads(line)["index"] for line in path.read_text().splitlines()] == [0, 1, 2, 3]  # each once
    assert sorted(item.name for item in tmp_path.iterdir()) == ["responses.jsonl"]  # no shard or marker left


def test_generation_through_a_draft_writes_the_same_rows_as_generate(tmp_path):
    target, tokenizer, draft = make_target("llama", seed=4), make_tokenizer(), make_draft(seed=3)
    prompts = [" ".join(f"w{5 + (i * 11 + j) % 100}" for j in range(2 + i % 4)) for i in range(6)]
    generate_responses(target, tokenizer, prompts, tmp_path / "plain.jsonl", batch_size=3, max_new_tokens=24,
                       progress=False)
    generate_responses(target, tokenizer, prompts, tmp_path / "drafted.jsonl", batch_size=3, max_new_tokens=24,
                       progress=False, draft=draft)
    plain, drafted = (in_order(tmp_path / f"{name}.jsonl", 6) for name in ("plain", "drafted"))
    assert drafted == plain
    assert {len(row["response_ids"]) for row in plain} == {15, 24}  # a row that stopped early, the others at the limit


def test_a_converted_folder_published_by_another_process_first_is_kept(tmp_path):
    cache = tmp_path / "cache"
    first, second = tmp_path / "first.partial", tmp_path / "second.partial"
    for folder, text in ((first, "first"), (second, "second")):
        folder.mkdir()
        (folder / "config.json").write_text(text)
    publish_folder(first, cache)
    publish_folder(second, cache)  # the slower process of two that converted at once
    assert (cache / "config.json").read_text() == "first" and not second.exists()
    lone = tmp_path / "lone.partial"
    lone.mkdir()
    (cache / "config.json").rename(cache / "model.safetensors")  # an incomplete folder in the way: an error
    with pytest.raises(OSError):
        publish_folder(lone, cache)


def test_rows_of_other_prompts_are_refused_not_trained_on(tmp_path):
    target, tokenizer = make_target("llama", seed=2), make_tokenizer()
    path = tmp_path / "responses.jsonl"
    generate_responses(target, tokenizer, ["w5 w6", "w7 w8"], path, batch_size=2, max_new_tokens=3, progress=False)
    with pytest.raises(ValueError, match="row 1 of .*responses.jsonl answers another prompt than prompt 1"):
        generate_responses(target, tokenizer, ["w5 w6", "w9 w9", "w10"], path, max_new_tokens=3, progress=False)
    # a seed file that answers none of the prompts (other prompts, another tokenizer) is refused before any copy
    fresh = tmp_path / "fresh.jsonl"
    with pytest.raises(ValueError, match="--responses .*responses.jsonl: none of its 2 rows answers one of these"):
        generate_responses(target, tokenizer, ["w9 w9", "w10"], fresh, max_new_tokens=3, progress=False,
                           seed_paths=[path])
    assert read_rows(fresh) == []
    with pytest.raises(FileNotFoundError, match="--responses .*missing.jsonl.gz: no such file"):
        generate_responses(target, tokenizer, ["w5 w6"], fresh, max_new_tokens=3, progress=False,
                           seed_paths=[path, tmp_path / "missing.jsonl.gz"])
    (tmp_path / "cut.jsonl.gz").write_bytes(gzip.compress(path.read_bytes())[:-12])
    with pytest.raises(ValueError, match="not a complete gzip archive"):
        read_rows(tmp_path / "cut.jsonl.gz")


def test_seed_rows_answer_their_prompts_wherever_they_sit(tmp_path):
    target, tokenizer = make_target("llama", seed=2), make_tokenizer()
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl.gz"
    generate_responses(target, tokenizer, ["w5 w6", "w7 w8"], first, max_new_tokens=4, progress=False)
    generate_responses(target, tokenizer, ["w11 w12 w13"], tmp_path / "second.jsonl", max_new_tokens=4, progress=False)
    second.write_bytes(gzip.compress((tmp_path / "second.jsonl").read_bytes()))
    marked = [{**row, "response_ids": [9, 9, 9, 1]} for row in read_rows(first)]  # rows that are not a regeneration
    first.write_text("".join(json.dumps(row) + "\n" for row in marked))
    prompts = ["w7 w8", "w9 w10", "w11 w12 w13", "w5 w6"]  # other order, other files, one prompt in no seed
    output = tmp_path / "run.jsonl"
    generate_responses(target, tokenizer, prompts, output, max_new_tokens=4, progress=False,
                       seed_paths=[first, second])
    rows = in_order(output, 4)
    assert [row["index"] for row in rows] == [0, 1, 2, 3]
    assert rows[0]["response_ids"] == rows[3]["response_ids"] == [9, 9, 9, 1]  # copied from the seed, not regenerated
    assert rows[2] == {**read_rows(second)[0], "index": 2}
    alone = plain_greedy(target, torch.tensor([rows[1]["prompt_ids"]]), 4, stop_token_ids=[1])
    assert rows[1]["response_ids"] == alone[0, len(rows[1]["prompt_ids"]):].tolist()  # the missing one generated
    stored = read_rows(output)
    assert sorted(row["index"] for row in stored) == [0, 1, 2, 3]  # each stored once, with its new index
    generate_responses(target, tokenizer, prompts, output, max_new_tokens=4, progress=False,
                       seed_paths=[first, second])
    assert read_rows(output) == stored  # a resumed run keeps its rows, and adds none


def test_prompts_batched_by_length_give_generates_greedy_rows_with_less_padding(tmp_path, monkeypatch):
    import dflash_hf.training.data as data

    target, tokenizer = make_target("llama", seed=2), make_tokenizer()
    prompts = ["w5 w6", "w40 w41 w42 w43 w44", "w33 w34 w35", "w50 w51 w52 w53 w54", "w60 w61", "w70 w71 w72 w73"]
    lengths = [len(chat_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])) for prompt in prompts]
    padding, respond = {}, data._respond

    def counted_respond(target, draft, input_ids, attention_mask, *args):  # the padding of each batch
        padding.setdefault(order, []).append(int((attention_mask == 0).sum()))
        return respond(target, draft, input_ids, attention_mask, *args)

    monkeypatch.setattr(data, "_respond", counted_respond)
    rows = {}
    for order in ("file", "length"):
        generate_responses(target, tokenizer, prompts, tmp_path / f"{order}.jsonl", batch_size=2, max_new_tokens=6,
                           progress=False, by_length=order == "length")
        rows[order] = in_order(tmp_path / f"{order}.jsonl", len(prompts))
    assert rows["length"] == rows["file"]  # in prompt order, the same greedy rows
    for row in rows["length"]:  # each the target's own greedy answer, generated alone
        alone = plain_greedy(target, torch.tensor([row["prompt_ids"]]), 6, stop_token_ids=[1])
        assert row["response_ids"] == alone[0, len(row["prompt_ids"]):].tolist()
    longest_first = sorted(range(len(prompts)), key=lambda i: -lengths[i])
    stored = [json.loads(line)["index"] for line in (tmp_path / "length.jsonl").read_text().splitlines()]
    assert stored == longest_first == [1, 3, 5, 2, 0, 4]  # a resumed run reads them back by index

    def pads(batches: list[list[int]]) -> list[int]:
        return [sum(max(lengths[i] for i in batch) - lengths[i] for i in batch) for batch in batches]

    assert padding["file"] == pads([[0, 1], [2, 3], [4, 5]]) == [3, 2, 2]
    assert padding["length"] == pads([longest_first[k:k + 2] for k in (0, 2, 4)]) == [0, 1, 0]


def test_the_store_holds_the_rows_in_prompt_order_then_the_conversations_cut_as_training_cuts_them(tmp_path):
    from dflash_hf.training.data import conversation_row, training_rows
    from dflash_hf.training.store import SequenceStore, part_file, write_sequences
    from dflash_hf.training.trainer import training_sequences

    rows = [{"index": i, "prompt_ids": [5 + i, 6], "response_ids": [7, 8 + i, 9][:3 - i % 2]} for i in range(5)]
    rows.append({"index": 5, "prompt_ids": [5, 6, 7, 8, 9, 10], "response_ids": [9]})  # no label within 6 tokens
    responses = tmp_path / "responses.jsonl"  # written in another order than the prompts', a line cut at the end
    responses.write_text("".join(json.dumps(rows[i]) + "\n" for i in (3, 0, 5, 1, 4, 2)) + '{"index": 9, "pro')
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "user", "content": "w10"},
                                             {"role": "assistant", "content": "w11 w12"}]}) + "\n\n")
    tokenizer = make_tokenizer()
    folder = tmp_path / "data"
    folder.mkdir()
    # two writers, as two processes: positions 0-3 and 4-6 of the 6 response rows from prompt 0 and the conversation
    for shard, positions in enumerate((range(0, 4), range(4, 7))):
        write_sequences(part_file(folder, "train", shard),
                        training_rows(responses, range(6), [str(chat)], tokenizer, [1], positions), 6)
    store = SequenceStore(folder, "train", 2)
    chat_row = conversation_row(tokenizer, json.loads(chat.read_text())["messages"], [1], "chat.jsonl:1")
    expected = training_sequences(rows + [chat_row], 6)  # row 5 left out
    assert len(store) == len(expected) == 6
    for (ids, mask), (expected_ids, expected_mask) in zip(store, expected, strict=True):
        assert ids.dtype == torch.long and ids.tolist() == expected_ids.tolist()
        assert mask.tolist() == expected_mask.tolist()
    with pytest.raises(ValueError, match="no row for prompt 6: generate it again"):
        list(training_rows(responses, range(8), [], tokenizer, [1], range(6, 8)))


def test_training_without_datasets_names_the_install(monkeypatch):
    import sys

    from dflash_hf.training.store import check_datasets_installed

    check_datasets_installed()
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"pip install 'dflash-hf\[train\]'"):
        check_datasets_installed()


@pytest.mark.skipif(continuous_batching_refusal(torch.device("cpu")) is not None,
                    reason="this Transformers' continuous batching runs on a GPU only")
def test_continuous_batching_gives_generates_greedy_rows(tmp_path, monkeypatch):
    import dflash_hf.training.data as data

    target, tokenizer = make_target("llama", seed=2), make_tokenizer()
    prompts = ["w5 w6", "w40 w41 w42 w43 w44", "w33 w34 w35", "w5 w6", "w60 w61 w62 w63 w64 w65 w66"]  # one twice
    calls, generate_batch = [], target.generate_batch

    @functools.wraps(generate_batch)  # its signature stays visible (generate_batch_arguments reads it)
    def counted_generate_batch(inputs, **kwargs):
        calls.append(len(inputs))
        return generate_batch(inputs, **kwargs)

    monkeypatch.setattr(target, "generate_batch", counted_generate_batch)
    monkeypatch.setattr(data, "_respond", None)  # batched generate is not called
    generate_responses(target, tokenizer, prompts, tmp_path / "rows.jsonl", batch_size=len(prompts), max_new_tokens=6,
                       progress=False, engine="continuous")
    assert calls == [len(prompts)]  # one call: the engine schedules the prompts itself
    rows = in_order(tmp_path / "rows.jsonl", len(prompts))
    for row in rows:  # each the target's own greedy answer, generated alone (cut after its stop token)
        alone = plain_greedy(target, torch.tensor([row["prompt_ids"]]), 6, stop_token_ids=[1])
        assert row["response_ids"] == alone[0, len(row["prompt_ids"]):].tolist()
    assert rows[0]["response_ids"] == rows[3]["response_ids"]  # a prompt given twice: each copy answered


def test_an_engine_is_refused_where_it_cannot_run(tmp_path, monkeypatch):
    import dflash_hf.versions_dflash as versions_dflash

    target, tokenizer = make_target("llama", seed=2), make_tokenizer()
    with pytest.raises(ValueError, match=r"--gen-engine 'sglang': expected one of \[.*'vllm'\]"):
        generate_responses(target, tokenizer, ["w5"], tmp_path / "rows.jsonl", progress=False, engine="sglang")
    with pytest.raises(ValueError, match="engine 'vllm' with a LlamaForCausalLM target: vllm answers through a "):
        generate_responses(target, tokenizer, ["w5"], tmp_path / "rows.jsonl", progress=False, engine="vllm")
    with pytest.raises(ValueError, match="--gen-draft runs spec_generate on its own batches"):
        generate_responses(target, tokenizer, ["w5"], tmp_path / "rows.jsonl", progress=False, engine="continuous",
                           draft=make_draft(0))
    monkeypatch.setattr(versions_dflash, "TRANSFORMERS_RELEASE", (4, 57))
    monkeypatch.setattr(versions_dflash, "TRANSFORMERS_VERSION", "4.57.6")
    refused = (r"continuous on the cpu: Transformers 4\.57\.6.s continuous batching sizes its cache from GPU memory "
               r"only \(4\.57\.6 fails on the CPU\); use --gen-engine generate here")
    with pytest.raises(ValueError, match=refused):
        generate_responses(target, tokenizer, ["w5"], tmp_path / "rows.jsonl", progress=False, engine="continuous")
    assert not (tmp_path / "rows.jsonl").exists()  # refused before anything is generated or written


@pytest.mark.parametrize("name", ["responses.jsonl", "responses"])
def test_processes_hand_their_shards_over_by_marker_files_whatever_the_output_is_named(tmp_path, name):
    """Two processes (threads with a shared barrier): the one that finishes first waits outside any collective, the
    main process merges both shards once both markers are there, and no marker or shard is left; also for an output
    name without an extension, whose markers must still differ per process."""
    import threading
    from types import SimpleNamespace

    from dflash_hf.training.data import finish_shards, shard_path

    output, barrier, errors = tmp_path / name, threading.Barrier(2), []

    def process(index: int, delay: float) -> None:
        state = SimpleNamespace(process_index=index, num_processes=2, is_main_process=index == 0,
                                wait_for_everyone=barrier.wait)
        time.sleep(delay)  # the slower process writes its shard later
        shard_path(output, index, 2).write_text(json.dumps({"index": index}) + "\n")
        try:
            finish_shards(output, state, poll_seconds=0.01)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=process, args=(index, 0.3 * index)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert not errors and [json.loads(line)["index"] for line in output.read_text().splitlines()] == [0, 1]
    assert [path.name for path in tmp_path.iterdir()] == [name]  # no shard or marker left


def test_a_slow_process_still_sees_the_main_shard_when_a_killed_runs_shards_are_merged(tmp_path):
    """A killed run left a shard: the main process merges it (and removes the shards) while process 1 is still on
    its way out of the barrier. Process 1 must find the main shard there (no 'not on a file system every process
    sees' error for a process that was merely slow) and both end with the killed run's row in the output."""
    import threading
    from types import SimpleNamespace

    from dflash_hf.training.data import prepare_output, shard_path

    output, barrier, errors = tmp_path / "responses.jsonl", threading.Barrier(2), []
    shard_path(output, 2, 3).write_text(json.dumps({"index": 3}) + "\n")  # the killed run's process 2

    def process(index: int) -> None:
        def wait_for_everyone() -> None:
            barrier.wait()
            if index == 1:
                time.sleep(0.5)  # process 1 leaves the barrier late: the main process has merged by then

        state = SimpleNamespace(process_index=index, num_processes=2, is_main_process=index == 0,
                                wait_for_everyone=wait_for_everyone)
        try:
            prepare_output(output, state, poll_seconds=0.01)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=process, args=(index,)) for index in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert not errors, errors
    assert [json.loads(line)["index"] for line in output.read_text().splitlines()] == [3]


def test_a_wait_in_which_no_shard_grows_stops_with_an_error(tmp_path):
    from dflash_hf.training.data import wait_for_files

    with pytest.raises(RuntimeError, match="waited 0.001 minutes for process 1's shard with no shard growing: a "
                                           "process stopped"):
        wait_for_files(lambda: False, [tmp_path / "shard.jsonl"], 0.01, 0.001, lambda: "process 1's shard")
    wait_for_files(lambda: True, [tmp_path / "shard.jsonl"], 0.01, 0.001, lambda: "nothing")  # done: no wait
