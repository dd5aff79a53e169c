"""Data preparation shared out over two processes (torchrun, gloo on the CPU), compared with one process.

One launch of `dflash-hf train` on 10 prompts whose rows come from everywhere a run finds them: rows already in
responses.jsonl, a killed run's shard, a --responses seed file, and the target (the rest).
tests/data_processes_worker.py is each process's program: it records the prompt texts its process rendered with the
chat template and the response rows it decoded from JSON.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import save_tiny_target_and_prompts

from dflash_hf.cli import main
from dflash_hf.training.data import read_prompts, rows_by_index
from dflash_hf.training.store import STORE_DIR, SequenceStore

TESTS = Path(__file__).resolve().parent
NUM_PROMPTS = 10
STORED, KILLED, SEEDED = (0, 5), (7,), (2, 8)  # the prompts whose rows the run finds


def free_port() -> int:
    """A TCP port no other process listens on now."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_run(folder: Path, rows: dict[int, dict]) -> Path:
    """A run folder as a killed run of two processes left it: the rows of STORED merged, KILLED's in process 1's
    shard (with a line the kill cut)."""
    run = folder / "run"
    run.mkdir(parents=True)
    (run / "responses.jsonl").write_text("".join(json.dumps(rows[index]) + "\n" for index in STORED))
    (run / "responses.rank-1-of-2.jsonl").write_text(
        "".join(json.dumps(rows[index]) + "\n" for index in KILLED) + '{"index": 3, "prompt_ids": [3, ')
    return run


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """The same command on one process (in this one) and on two (torchrun), each from the same killed run."""
    folder = tmp_path_factory.mktemp("data-processes")
    prompts = save_tiny_target_and_prompts(folder, NUM_PROMPTS)
    texts = read_prompts([prompts])
    # rows the run finds but the target did not write (it would answer otherwise): a generation would be visible
    from transformers import AutoTokenizer

    from dflash_hf.prompts import user_prompt_ids

    tokenizer = AutoTokenizer.from_pretrained(folder / "target")
    found = {index: {"index": index, "prompt_ids": user_prompt_ids(tokenizer, texts[index]),
                     "response_ids": [40 + index, 41, 1]} for index in range(NUM_PROMPTS)}
    seed = folder / "seed.jsonl"  # other indices, another order, a prompt that is not trained on
    seed.write_text("".join(json.dumps({**found[index], "index": 90 + index}) + "\n" for index in reversed(SEEDED))
                    + json.dumps({"index": 99, "prompt_ids": [3, 50, 1, 4], "response_ids": [5, 1]}) + "\n")
    arguments = ["train", "--target", str(folder / "target"), "--prompts", str(prompts), "--responses", str(seed),
                 "--gen-batch-size", "2", "--gen-max-new-tokens", "4", "--draft-block-size", "4", "--draft-layers",
                 "1", "--mask-token", "w127", "--epochs", "1", "--num-anchors", "4", "--max-steps", "1",
                 "--num-eval", "0", "--process-group-timeout", "10"]
    one = start_run(folder / "one", found)
    main([*arguments, "--output", str(one)])
    two = start_run(folder / "two", found)
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                   "CUDA_VISIBLE_DEVICES": "",
                   "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS), os.environ.get("PYTHONPATH", "")])}
    with open(folder / "torchrun.log", "w") as log:
        completed = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2", "--master_addr",
             "127.0.0.1", "--master_port", str(free_port()), str(TESTS / "data_processes_worker.py"),
             str(folder / "two"), *arguments, "--output", str(two)],
            env=environment, stdout=log, stderr=subprocess.STDOUT, timeout=600)
    assert completed.returncode == 0, (folder / "torchrun.log").read_text()[-4000:]
    records = [json.loads((folder / "two" / f"record-{rank}.json").read_text()) for rank in range(2)]
    return {"one": one, "two": two, "records": records, "texts": texts, "found": found}


def test_two_processes_write_the_rows_and_the_store_of_one(runs):
    one, two = runs["one"], runs["two"]
    rows = {name: list(rows_by_index(run / "responses.jsonl", range(NUM_PROMPTS))) for name, run in runs.items()
            if name in ("one", "two")}
    assert rows["two"] == rows["one"]
    for index in (*STORED, *KILLED, *SEEDED):  # found, not generated again
        assert rows["two"][index] == runs["found"][index]
    generated = [index for index in range(NUM_PROMPTS) if index not in (*STORED, *KILLED, *SEEDED)]
    assert all(rows["two"][index]["response_ids"] != runs["found"][index]["response_ids"] for index in generated)
    assert sorted(json.loads(line)["index"] for line in (two / "responses.jsonl").read_text().splitlines()) == list(
        range(NUM_PROMPTS))  # each row once
    assert sorted(path.name for path in two.glob("responses*")) == ["responses.jsonl"]  # no shard or marker left
    stores = {name: list(SequenceStore(run / STORE_DIR, "train", processes))
              for name, run, processes in (("one", one, 1), ("two", two, 2))}
    assert len(stores["two"]) == len(stores["one"]) == NUM_PROMPTS
    for (ids, mask), (one_ids, one_mask) in zip(stores["two"], stores["one"], strict=True):
        assert torch.equal(ids, one_ids) and torch.equal(mask, one_mask)


def test_each_process_renders_only_its_share_of_the_prompts(runs):
    texts, records = runs["texts"], runs["records"]
    shares = [{texts.index(text) for text in record["rendered"]} for record in records]
    assert not shares[0] & shares[1] and shares[0] | shares[1] == set(range(NUM_PROMPTS))  # each prompt by one
    # every second prompt of those with a row (checked) and of those without (seeded or answered), from its rank on
    answered, missing = [0, 5, 7], [1, 2, 3, 4, 6, 8, 9]
    assert shares == [{*answered[0::2], *missing[0::2]}, {*answered[1::2], *missing[1::2]}]


def test_response_rows_are_decoded_once(runs):
    """No process decodes responses.jsonl to check or index it: its rows are decoded once in all, by the process
    that writes each into the store; the seed rows a run copies, once each."""
    assert sum(record["decoded"] for record in runs["records"]) == NUM_PROMPTS + len(SEEDED)
