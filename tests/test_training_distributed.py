"""Training on two processes (torchrun, gloo on the CPU), each result compared with one process or the plain values.

Five runs in three launches, each run shared by the tests below it: `train_draft` on 5 sequences (an uneven split:
3 + 2) and two sequences per process per step packed data-parallel (one torchrun launch; a draft with its own LM
head); the same two under Accelerate's FSDP (started by `accelerate launch` with examples/accelerate_fsdp.yaml; the
second accumulated); and `dflash-hf train` end to end on a tiny saved target (its own launch: its process group starts
with its timeout flag; `--draft-vocab-size`).
tests/distributed_worker.py is the program of each process; it records what its process did in each run (files
written, per-micro-batch losses, generated prompts) next to the run's output.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from distributed_worker import own_head_draft, train_rows
from helpers import make_draft, make_target, save_tiny_target_and_prompts
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import get_cosine_schedule_with_warmup

from dflash_hf.training.data import process_share
from dflash_hf.training.processes import epoch_order, gather_json
from dflash_hf.training.store import PARTS, STORE_DIR, SequenceStore
from dflash_hf.training.trainer import (
    CHECKPOINT_DIR,
    DRAFT_WEIGHTS_FILE,
    OPTIMIZER_SCHEDULER_FILE,
    STATE_FILE,
    EpochPlan,
    TrainingLog,
    TrainingSettings,
    anchor_seed,
    train_draft,
    training_plan,
    training_sequences,
)

TESTS = Path(__file__).resolve().parent
NUM_SEQUENCES, EPOCHS, WARMUP_RATIO, LEARNING_RATE = 5, 2, 0.25, 2e-3  # as distributed_worker.run_train
RUN_TIMEOUT_S = 120  # per run; a run takes about 10 s on two cores


def free_port() -> int:
    """A TCP port no other process listens on now (one per run: parallel pytest workers do not collide)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


FSDP_CONFIG = TESTS.parent / "examples" / "accelerate_fsdp.yaml"


def run_two_processes(modes: list[str], folder: Path, *cli_args: str) -> dict[str, tuple[Path, list[dict]]]:
    """Run distributed_worker.py's MODES one after the other in one launch of two processes (`fsdp...`: through
    `accelerate launch` and the FSDP config, else torchrun); for each mode, (its run's output folder, each process's
    record)."""
    sharded = modes[0].startswith("fsdp")
    assert all(mode.startswith("fsdp") == sharded for mode in modes), "one launcher per launch"
    launcher = (["-m", "accelerate.commands.launch", "--config_file", str(FSDP_CONFIG), "--num_processes", "2",
                 "--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())] if sharded else
                ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2", "--master_addr",
                 "127.0.0.1", "--master_port", str(free_port())])
    command = [sys.executable, *launcher, str(TESTS / "distributed_worker.py"), ",".join(modes), str(folder),
               *cli_args]
    package_root = str(TESTS.parent)  # this checkout's dflash_hf, whatever is installed
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                   "CUDA_VISIBLE_DEVICES": "",  # CPU processes (gloo) on a GPU machine too: not two on one GPU
                   "PYTHONPATH": os.pathsep.join([package_root, str(TESTS), os.environ.get("PYTHONPATH", "")])}
    log, timeout = folder / "torchrun.log", RUN_TIMEOUT_S * len(modes)  # a file: workers cannot block on a pipe
    with open(log, "w") as handle:
        process = subprocess.Popen(command, stdout=handle, stderr=subprocess.STDOUT, env=environment, cwd=folder)
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:  # a hang (processes waiting on a collective): torchrun stops its workers
            process.send_signal(signal.SIGTERM)
            process.wait(timeout=60)
            pytest.fail(f"the two processes did not finish in {timeout} s (a hang): {log.read_text()[-3000:]}")
    assert process.returncode == 0, log.read_text()[-4000:]
    return {mode: (folder / mode / "run", [json.loads((folder / mode / "records" / f"rank{rank}.json").read_text())
                                           for rank in range(2)]) for mode in modes}


@pytest.fixture(scope="module")
def torchrun_runs(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """`train_run`, the packed data-parallel run of `batched_runs` and the token-budget run (`train-budget`), in one
    torchrun launch."""
    return run_two_processes(["train", "train-batched", "train-budget"], tmp_path_factory.mktemp("torchrun"))


@pytest.fixture(scope="module")
def fsdp_runs(tmp_path_factory) -> dict[str, tuple[Path, list[dict]]]:
    """`fsdp_run`, the accumulated FSDP run of `batched_runs` and `fsdp_run`'s first run in bf16 (`fsdp-bf16`), in
    one `accelerate launch`."""
    return run_two_processes(["fsdp", "fsdp-batched", "fsdp-bf16"], tmp_path_factory.mktemp("fsdp"))


@pytest.fixture(scope="module")
def train_run(torchrun_runs) -> tuple[Path, list[dict]]:
    """`train_draft` on 5 sequences, 2 epochs, on two processes."""
    return torchrun_runs["train"]


@pytest.fixture(scope="module")
def fsdp_run(fsdp_runs) -> tuple[Path, list[dict]]:
    """The run of `train_run` under Accelerate's FSDP plugin (FSDP 2, one shard unit per decoder layer)."""
    return fsdp_runs["fsdp"]


@pytest.fixture(scope="module")
def batched_runs(torchrun_runs, fsdp_runs) -> dict[str, tuple[Path, list[dict]]]:
    """Two sequences per process per step on two processes: packed data-parallel, accumulated under FSDP."""
    return {"train-batched": torchrun_runs["train-batched"], "fsdp-batched": fsdp_runs["fsdp-batched"]}


@pytest.fixture(scope="module")
def cli_run(tmp_path_factory) -> tuple[Path, list[dict], Path]:
    """`dflash-hf train` on 5 prompts (generation, training, evaluation) on two processes; also the target folder.

    Before it, one process generates the 5 rows alone (`alone.jsonl`, beside the target folder), and a killed run of
    three processes is simulated: its process 2's shard holds the row of prompt 3 and a line cut by the kill."""
    from dflash_hf.loading import load_target
    from dflash_hf.training.data import generate_responses, read_prompts, rows_by_index

    folder = tmp_path_factory.mktemp("cli")
    prompts = save_tiny_target_and_prompts(folder, 5)
    target, tokenizer = load_target(str(folder / "target"), torch.float32)
    generate_responses(target, tokenizer, read_prompts([prompts]), folder / "alone.jsonl", batch_size=2,
                       max_new_tokens=8, progress=False)
    alone = list(rows_by_index(folder / "alone.jsonl", range(5)))
    (folder / "cli" / "run").mkdir(parents=True)
    (folder / "cli" / "run" / "responses.rank-2-of-3.jsonl").write_text(
        json.dumps(alone[3]) + "\n" + json.dumps(alone[1])[:20])
    output, records = run_two_processes(
        ["cli"], folder, "train", "--target", str(folder / "target"), "--output", str(folder / "cli" / "run"),
        "--prompts", str(prompts), "--num-prompts", "5", "--gen-batch-size", "2", "--gen-max-new-tokens", "8",
        "--draft-block-size", "4", "--draft-layers", "1", "--mask-token", "w127", "--epochs", "1",
        "--num-anchors", "6", "--eval-prompts", str(prompts), "--num-eval", "2", "--eval-max-new-tokens", "6",
        "--eval-dtype", "float32", "--process-group-timeout", "45", "--report-to", "tensorboard",
        "--draft-vocab-size", "12")["cli"]
    return output, records, folder / "target"


def checkpoint_weights(folder: Path) -> dict[str, torch.Tensor]:
    """The draft's whole weights in a checkpoint: its safetensors file, or (sharded) its shards read back whole by
    torch.distributed.checkpoint in this one process."""
    if (folder / DRAFT_WEIGHTS_FILE).exists():
        return load_file(folder / DRAFT_WEIGHTS_FILE)
    import torch.distributed.checkpoint as dcp

    reader = dcp.HuggingFaceStorageReader(str(folder))
    stored = reader.read_metadata().state_dict_metadata
    weights = {key.removeprefix("model."): torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
               for key, entry in stored.items() if key.startswith("model.")}
    with warnings.catch_warnings():  # that it loads in one process, as meant
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        dcp.load({"model": weights}, storage_reader=reader, no_dist=True)
    return weights


def assert_no_pickle(folder: Path) -> None:
    """Every file of a checkpoint `folder` is JSON or safetensors (whose header is JSON): none is a pickle."""
    for path in folder.iterdir():
        if path.suffix == ".json":
            json.loads(path.read_text())
        else:
            assert path.suffix == ".safetensors", path
            with safe_open(path, framework="pt") as handle:  # a pickle fails here: its first 8 bytes are no length
                assert len(handle.keys()) > 0


def training_log(output: Path) -> dict:
    return json.loads((output / "training_log.json").read_text())


def test_the_learning_rate_follows_the_single_process_schedule(train_run):
    output, _ = train_run
    total_steps = math.ceil(NUM_SEQUENCES / 2) * EPOCHS  # 6 optimiser steps of two sequences each
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=LEARNING_RATE)
    schedule = get_cosine_schedule_with_warmup(optimizer, math.ceil(WARMUP_RATIO * total_steps), total_steps)
    expected = []
    for _ in range(total_steps):  # the rate each optimiser step applies, stepping the schedule once per step
        expected.append(schedule.get_last_lr()[0])
        optimizer.step()
        schedule.step()
    log = training_log(output)
    assert log["learning_rates"] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    state = json.loads((output / CHECKPOINT_DIR / "optimizer_scheduler.json").read_text())["scheduler"]
    assert state["last_epoch"] == total_steps  # not 2 x total_steps: the schedule stepped once per optimiser step


def test_uneven_shards_take_the_same_number_of_steps_on_every_process(train_run):
    output, records = train_run  # 5 sequences, 3 per process: the epoch's shuffle wraps round to repeat one
    steps = math.ceil(NUM_SEQUENCES / 2) * EPOCHS
    assert [len(record["local_losses"]) for record in records] == [steps, steps]  # one sequence per step each
    assert [record["log_steps"] for record in records] == [steps, steps]
    assert training_log(output)["steps"] == steps and training_log(output)["processes"] == 2
    assert training_log(output)["tokens"] == steps * 2 * (5 + 16)  # both processes' sequences, the repeated one too
    assert records[0]["weights_sum"] == records[1]["weights_sum"]  # the gradients were averaged: one draft


def test_the_logged_loss_is_the_mean_over_the_processes(train_run):
    output, records = train_run
    log = training_log(output)
    means = [(a + b) / 2 for a, b in zip(records[0]["local_losses"], records[1]["local_losses"], strict=True)]
    assert log["losses"] == pytest.approx(means, rel=1e-6)
    assert log["losses"] != pytest.approx(records[0]["local_losses"], rel=1e-6)  # not the main process's own
    assert len(log["losses"]) == len(log["learning_rates"]) == log["steps"]  # one entry per optimiser step


def test_a_resumed_run_equals_the_uninterrupted_one(train_run):
    output, records = train_run  # the same run stopped after 3 of its 6 steps, then resumed from its checkpoint
    log = training_log(output)
    for record in records:
        resumed = record["resumed"]
        assert resumed["losses"] == log["losses"] and resumed["learning_rates"] == log["learning_rates"]
        assert resumed["weights_sum"] == records[0]["weights_sum"]
        assert resumed["held_out"] == record["held_out"]  # the held-out curve continues across the resume


def test_every_process_evaluates_held_out_prompts_during_training(train_run):
    """`evaluate` runs on every process at each evaluation (`dflash-hf train`'s measures each process's share of the
    prompts: tests/test_training_plan.py), none waiting while another evaluates."""
    output, records = train_run
    assert [record.get("held_out_calls", 0) for record in records] == [3 + 2 + 1] * 2  # 3 runs: 6, 0-3, 3-6 steps
    held_out = records[0]["held_out"]
    assert [evaluation["step"] for evaluation in held_out] == [0, 3, 6] and records[1]["held_out"] == held_out
    assert held_out[-1]["weights_sum"] == records[0]["weights_sum"]  # it evaluated the trained draft
    assert training_log(output)["evaluations"] == held_out


def test_a_checkpoint_resumes_on_its_own_number_of_processes(train_run, tmp_path):
    output, _ = train_run
    shutil.copytree(output / CHECKPOINT_DIR, tmp_path / CHECKPOINT_DIR)  # written by 2 processes; this test is 1
    with pytest.raises(ValueError, match=r"run on 2 process\(es\), this one has 1.*--nproc_per_node 2"):
        train_draft(make_draft(5, block_size=4), make_target("qwen3", seed=4), train_rows(5),
                    TrainingSettings(epochs=2, num_anchors=8), tmp_path, progress=False)


def test_fsdp_trains_the_sharded_draft_as_ddp_does_and_resumes_exactly(fsdp_run, train_run):
    output, records = fsdp_run
    steps = math.ceil(NUM_SEQUENCES / 2) * EPOCHS
    assert [record["sharded_steps"] for record in records] == [steps, steps]  # every step on DTensor shards
    assert "asks for FSDP" in records[0]["refused"]  # unforced, CPU processes refuse the FSDP config
    log = training_log(output)
    assert log["steps"] == steps and log["processes"] == 2
    assert records[0]["weights_sum"] == records[1]["weights_sum"]  # the shards gathered back into each whole draft
    for record in records:  # stopped after 3 steps and resumed from the checkpoint gathered from the shards
        assert record["resumed"]["losses"] == log["losses"]
        assert record["resumed"]["weights_sum"] == records[0]["weights_sum"]
    # a sharded checkpoint: each process wrote its own shard (torch.distributed.checkpoint), nothing was gathered
    shards = [f"shard-0000{rank}-model-00001-of-00001.safetensors" for rank in (1, 2)]  # HuggingFaceStorageWriter's
    assert {path for _, path in records[1]["writes"]} == {  # dcp.save's mkdir(exist_ok) of the folder, and its shard
        f"{CHECKPOINT_DIR}.tmp", os.path.join(f"{CHECKPOINT_DIR}.tmp", shards[1])}
    for checkpoint in (CHECKPOINT_DIR, f"{CHECKPOINT_DIR}-4"):  # rotated as a whole checkpoint is (keep 2)
        assert {path.name for path in (output / checkpoint).iterdir()} == {*shards, OPTIMIZER_SCHEDULER_FILE,
                                                                          STATE_FILE}
        assert json.loads((output / checkpoint / STATE_FILE).read_text())["sharded"] is True
        assert_no_pickle(output / checkpoint)
    # no pickle: no process read one from a file (pickle.load, torch.load), in the run or the resumed one
    assert [record["unpickled"] for record in records] == [[], []]
    # the held-out evaluation saw the whole draft, gathered from the shards: the weights data-parallel training had
    held_out, ddp_held_out = records[0]["held_out"], train_run[1][0]["held_out"]
    assert [evaluation["step"] for evaluation in held_out] == [0, 3, 6] and records[1]["held_out"] == held_out
    assert held_out[-1]["weights_sum"] == records[0]["weights_sum"]
    assert [e["weights_sum"] for e in held_out] == pytest.approx([e["weights_sum"] for e in ddp_held_out], rel=1e-6)
    # the same optimisation as data-parallel training: the losses and the saved weights agree to rounding
    ddp_output, _ = train_run
    assert log["losses"] == pytest.approx(training_log(ddp_output)["losses"], rel=1e-4)
    sharded, whole = (checkpoint_weights(run / CHECKPOINT_DIR) for run in (output, ddp_output))
    exported = load_file(output.parent / "exported" / "model.safetensors")  # the trained draft: one safetensors file
    assert sharded.keys() == whole.keys() == exported.keys()
    for name, tensor in whole.items():
        torch.testing.assert_close(sharded[name], tensor, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(exported[name], sharded[name], rtol=0, atol=0)


def test_a_token_budget_spreads_each_step_over_both_processes_and_resumes_exactly(torchrun_runs):
    from distributed_worker import BUDGET_ROW_OFFSET, BUDGET_ROWS, BUDGET_SETTINGS, budget_rows

    output, records = torchrun_runs["train-budget"]
    settings = TrainingSettings(**BUDGET_SETTINGS)
    sequences = training_sequences(budget_rows(BUDGET_ROWS), settings.max_length)
    plan = training_plan(sequences, 2, settings)
    total, lengths = plan.total_steps(settings.epochs), [len(ids) for ids, _ in sequences]
    log = training_log(output)
    assert log["steps"] == total and log["processes"] == 2
    for step in range(total):  # each step fills at most the budget, over both processes, no sequence on both
        assert sum(lengths[i] for i in plan.step_items(step)) <= settings.tokens_per_step
        shares = [set(plan.micro_batches(step, rank)[0]) for rank in range(2)]
        assert shares[0] and shares[1] and not shares[0] & shares[1]
    for rank, record in enumerate(records):  # each process trained its micro-batches of the plan, in order
        expected = [[BUDGET_ROW_OFFSET + i for i in batch] for step in range(total)
                    for batch in plan.micro_batches(step, rank)]
        assert record["rows"]["run"] == expected
        assert record["rows"]["interrupted"] + record["rows"]["resumed"] == expected
        assert record["resumed"]["losses"] == log["losses"]  # stopped after 1 step and resumed: bit for bit
        assert record["resumed"]["tokens"] == log["tokens"] == sum(
            lengths[i] for step in range(total) for i in plan.step_items(step))
        assert record["resumed"]["weights_sum"] == records[0]["weights_sum"]


BF16_LOSS_TOLERANCE = 2e-3  # relative, per step (measured: at most 2.8e-4 over the 6 steps, torch 2.15 on the CPU)


def test_fsdp_in_bf16_gathers_bf16_from_float32_shards_and_follows_the_float32_loss_curve(fsdp_runs):
    (output, records), (float32_output, float32_records) = fsdp_runs["fsdp-bf16"], fsdp_runs["fsdp"]
    log, float32_log = training_log(output), training_log(float32_output)
    assert log["steps"] == float32_log["steps"] == math.ceil(NUM_SEQUENCES / 2) * EPOCHS
    for record, float32_record in zip(records, float32_records):
        assert record["sharded_steps"] == log["steps"]
        assert record["gathered_dtypes"] == ["torch.bfloat16"]  # each unit gathers and computes in bf16
        assert float32_record["gathered_dtypes"] == ["torch.float32"]  # --mixed-precision no (CPU's auto): float32
        assert record["parameter_dtypes"] == ["torch.float32"]  # the shards, the master weights the optimiser steps
        assert record["exported_dtypes"] == ["torch.float32"]  # the trained draft, gathered whole
    # the checkpoint: every process's float32 shards of the weights and of AdamW's moments
    keys = {}
    for shard in sorted((output / CHECKPOINT_DIR).glob("*.safetensors")):
        with safe_open(shard, "pt") as handle:
            keys.update({key: handle.get_slice(key).get_dtype() for key in handle.keys()})
    moments = [key for key in keys if key.endswith(("exp_avg", "exp_avg_sq"))]
    assert moments and any(key.startswith("model.") for key in keys)
    assert {dtype for key, dtype in keys.items() if not key.endswith(".step")} == {"F32"}
    # the same loss curve as float32 to bf16's rounding, and not the float32 run itself
    assert log["losses"] == pytest.approx(float32_log["losses"], rel=BF16_LOSS_TOLERANCE)
    assert log["losses"] != float32_log["losses"]


def test_a_sharded_checkpoint_resumes_on_its_own_number_of_processes(fsdp_run, tmp_path):
    output, _ = fsdp_run
    shutil.copytree(output / CHECKPOINT_DIR, tmp_path / CHECKPOINT_DIR)  # 2 processes' shards; this test is 1
    with pytest.raises(ValueError, match=r"run on 2 process\(es\), this one has 1.*--num_processes 2"):
        train_draft(make_draft(5, block_size=4), make_target("qwen3", seed=4), train_rows(5),
                    TrainingSettings(epochs=2, num_anchors=8), tmp_path, progress=False)


def test_fsdp_accumulation_steps_as_packed_data_parallel_training_and_counts_every_sequence(batched_runs):
    (packed_output, packed), (fsdp_output, fsdp) = batched_runs["train-batched"], batched_runs["fsdp-batched"]
    steps = EPOCHS * math.ceil(math.ceil(NUM_SEQUENCES / 2) / 2)  # 3 sequences per process, 2 per step, wrapped
    packed_log, fsdp_log = training_log(packed_output), training_log(fsdp_output)
    assert packed_log["steps"] == fsdp_log["steps"] == steps
    assert [len(record["local_losses"]) for record in packed] == [steps, steps]  # one packed micro-batch per step
    assert [len(record["local_losses"]) for record in fsdp] == [2 * steps, 2 * steps]  # two accumulated ones
    assert [record["sharded_steps"] for record in fsdp] == [2 * steps, 2 * steps]  # every micro-batch on shards
    state = json.loads((fsdp_output / CHECKPOINT_DIR / "optimizer_scheduler.json").read_text())["scheduler"]
    assert state["last_epoch"] == steps  # the schedule stepped once per optimiser step, not per micro-batch
    assert fsdp_log["learning_rates"] == packed_log["learning_rates"]
    tokens = steps * 2 * 2 * (5 + 16)  # both processes' two sequences a step, the repeated ones too
    assert packed_log["tokens"] == fsdp_log["tokens"] == tokens
    assert fsdp_log["losses"] == pytest.approx(packed_log["losses"], rel=1e-4)
    assert fsdp[0]["weights_sum"] == fsdp[1]["weights_sum"]
    sharded, whole = (checkpoint_weights(run / CHECKPOINT_DIR) for run in (fsdp_output, packed_output))
    assert {"lm_head.weight", "d2t", "t2d"} <= set(whole) == set(sharded)  # the draft's own head, trained and kept
    for name, tensor in whole.items():
        torch.testing.assert_close(sharded[name], tensor, rtol=1e-4, atol=1e-5)
    # about half the labels lie outside its vocabulary (the even ids): left out of the loss, logged alike
    assert fsdp_log["outside_vocabulary"] == pytest.approx(packed_log["outside_vocabulary"])
    assert 0.3 < fsdp_log["outside_vocabulary"] < 0.7
    for record in fsdp:  # stopped after 1 step and resumed: the uninterrupted run's losses, tokens and weights
        assert record["resumed"]["losses"] == fsdp_log["losses"] and record["resumed"]["tokens"] == tokens
        assert record["resumed"]["weights_sum"] == fsdp[0]["weights_sum"]


def test_only_the_main_process_writes_the_training_files(train_run):
    output, records = train_run
    assert records[1]["writes"] == []
    written = {path.split(os.sep)[0] for _, path in records[0]["writes"]}
    assert {"training_log.json", CHECKPOINT_DIR, f"{CHECKPOINT_DIR}.tmp"} <= written


def test_the_command_generates_each_response_once_and_only_the_main_process_writes(cli_run):
    output, records, target_folder = cli_run
    rows = [json.loads(line) for line in (output / "responses.jsonl").read_text().splitlines()]
    assert sorted(row["index"] for row in rows) == list(range(5))  # each prompt once
    assert rows[0]["index"] == 3  # the killed run's shard, merged first: prompt 3 was not generated again
    # the 4 others (one length: file order) shared out by stride, each process's own batches: 0 2 | 1 4
    assert [record["generated"] for record in records] == [[2], [2]]
    assert [row["index"] for row in rows[1:]] == [0, 2, 1, 4]  # the shards merged in process order
    from dflash_hf.training.data import rows_by_index

    assert sorted(rows, key=lambda row: row["index"]) == list(rows_by_index(target_folder.parent / "alone.jsonl",
                                                                            range(5)))  # one process's rows
    assert not list(output.glob("responses.rank-*"))  # every shard merged and removed
    # no collective while generating: two barriers before the killed run's merge (every process has looked for the
    # main shard before the merge removes it; the others wait for the merge by a marker file), the pass that finds
    # where each stored row starts, one barrier after the merge at the end (the processes wait for each other's
    # shards by marker files, outside any collective)
    assert [record["generation_collectives"] for record in records] == [
        ["barrier", "barrier", "all_reduce", "barrier"]] * 2
    assert not list(output.glob("responses.rank-*.jsonl.done"))
    shards = {f"responses.rank-{rank}-of-2.jsonl" for rank in range(2)}
    assert shards | {"responses.rank-2-of-3.jsonl", "responses.jsonl"} <= {path for _, path in records[0]["writes"]}

    # each process tokenized its own range of the rows into the store (data/), and wrote nothing else but its shard
    # and the marker that says it is complete
    own = {"responses.rank-1-of-2.jsonl", "responses.rank-1-of-2.jsonl.done"}
    assert {path for _, path in records[1]["writes"]} == own | {
        os.path.join(STORE_DIR, name) for part in PARTS for name in (f"{part}-00001.arrow", f"{part}-00001.arrow.tmp")}
    assert records[1]["evaluations"] == 0 and records[0]["evaluations"] == 1  # one evaluation
    store = SequenceStore(output / STORE_DIR, "train", 2)  # what both processes trained on: every row, in order
    expected = training_sequences(sorted(rows, key=lambda row: row["index"]), 3072)
    assert len(store) == len(expected) == 5
    for (ids, mask), (expected_ids, expected_mask) in zip(store, expected):
        assert ids.tolist() == expected_ids.tolist() and mask.tolist() == expected_mask.tolist()
    written = {path.split(os.sep)[0] for _, path in records[0]["writes"]}
    assert {"responses.jsonl", "training_log.json", "evaluation.json", "draft", CHECKPOINT_DIR} <= written
    assert training_log(output)["steps"] == 3 and json.loads((output / "evaluation.json").read_text())["lossless"]


def test_every_process_trains_the_draft_vocabulary_one_process_would_choose(cli_run):
    """--draft-vocab-size 12: both processes chose the same 12 ids before training, the 12 most frequent labels of
    all the training sequences (each process counted its own half), and the saved draft carries them in d2t / t2d."""
    def most_frequent(sequences: list[tuple[torch.Tensor, torch.Tensor]]) -> list[int]:  # ties: the lower id
        counts = torch.bincount(torch.cat([ids[mask.bool()] for ids, mask in sequences]), minlength=128)
        return sorted(range(128), key=lambda token: (-int(counts[token]), token))[:12]

    output, records, _ = cli_run
    sequences = list(SequenceStore(output / STORE_DIR, "train", 2))
    expected = most_frequent(sequences)
    halves = [most_frequent(sequences[:len(sequences) // 2]), most_frequent(sequences[len(sequences) // 2:])]
    assert records[0]["vocabulary"] == records[1]["vocabulary"] == expected and expected not in halves  # power
    weights = load_file(output / "draft" / "model.safetensors")
    assert (weights["d2t"] + torch.arange(12)).tolist() == sorted(expected)
    assert weights["t2d"].nonzero().flatten().tolist() == sorted(expected)
    assert weights["lm_head.weight"].shape == (12, weights["fc.weight"].shape[0])
    assert 0.0 < training_log(output)["outside_vocabulary"] < 1.0  # labels outside the 12 were left out and counted


def test_an_fsdp_config_on_cpu_processes_is_refused_before_anything_loads(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from accelerate.utils import DistributedType

    import dflash_hf.training.command
    from dflash_hf.cli import main
    from dflash_hf.training.processes import check_fsdp_applies

    def state(device: str, distributed_type: DistributedType) -> SimpleNamespace:
        return SimpleNamespace(device=torch.device(device), distributed_type=distributed_type, num_processes=2)

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # what `accelerate launch --config_file <FSDP config>` sets
    check_fsdp_applies(state("cuda", DistributedType.MULTI_GPU))  # GPUs: Accelerate shards (its state says so later)
    check_fsdp_applies(state("cpu", DistributedType.FSDP))
    cpu_processes = state("cpu", DistributedType.MULTI_CPU)
    monkeypatch.setattr(dflash_hf.training.command, "process_state", lambda *args: cpu_processes)
    with pytest.raises(ValueError, match="asks for FSDP, which Accelerate applies on GPUs only") as error:
        main(["train", "--target", str(tmp_path / "no-such-target"), "--output", str(tmp_path / "run"),
              "--prompts", str(save_tiny_target_and_prompts(tmp_path, 2))])
    assert "torchrun --nproc_per_node N" in str(error.value) and not (tmp_path / "run").exists()
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    check_fsdp_applies(cpu_processes)  # no FSDP config: CPU processes train data-parallel


def test_the_readme_fsdp_command_uses_the_tested_config_and_parses():
    import shlex

    from dflash_hf.cli import build_parser

    readme = (TESTS.parent / "README.md").read_text().replace("\\\n", " ")
    command = next(line for line in readme.splitlines() if line.startswith("accelerate launch --config_file"))
    words = shlex.split(command)
    assert words[3] == str(FSDP_CONFIG.relative_to(TESTS.parent))  # the config the FSDP test launches with
    arguments = words[words.index("dflash_hf.cli") + 1:]
    assert build_parser().parse_args(arguments).process_group_timeout == 60  # every flag exists


def epoch_rows(record: dict, phase: str, epoch: int, steps_per_epoch: int) -> list[int]:
    """The rows one process trained on in `epoch` of `phase` (its micro-batches' rows, in order)."""
    batches = record["rows"][phase][epoch * steps_per_epoch:(epoch + 1) * steps_per_epoch]
    return [row for batch in batches for row in batch]


def test_each_epoch_is_one_global_shuffle_strided_over_the_processes_as_distributed_sampler(train_run):
    from torch.utils.data import DistributedSampler

    _, records = train_run  # 5 rows, 2 processes, one row per process per step: 3 steps an epoch
    steps_per_epoch = math.ceil(NUM_SEQUENCES / 2)
    for epoch in range(EPOCHS):
        taken = [epoch_rows(record, "run", epoch, steps_per_epoch) for record in records]
        for rank, rows in enumerate(taken):
            sampler = DistributedSampler(range(NUM_SEQUENCES), num_replicas=2, rank=rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            assert rows == list(sampler)  # torch's own sampler gives this process these rows, in this order
        everyone = [row for step in zip(*taken) for row in step]  # step by step, process 0's row first
        assert sorted(set(everyone)) == list(range(NUM_SEQUENCES)) and len(everyone) == 6  # every row; one again
        assert everyone[-1] == everyone[0]  # the wrap repeats the permutation's first row to even the shards
    first, second = ([frozenset(step) for step in zip(*(epoch_rows(record, "run", epoch, steps_per_epoch)
                                                        for record in records))] for epoch in range(EPOCHS))
    assert set(first) != set(second)  # the second epoch groups the rows into other steps
    assert epoch_rows(records[0], "run", 0, steps_per_epoch) != epoch_rows(records[0], "run", 1, steps_per_epoch)


def test_every_process_draws_its_own_anchors(train_run):
    _, records = train_run
    seeds = [record["anchor_seeds"]["run"] for record in records]
    assert seeds == [[anchor_seed(0, rank, step) for step in range(len(seeds[0]))] for rank in range(2)]
    assert all(a != b for a, b in zip(*seeds)) and len(set(seeds[0])) == len(seeds[0])


def test_a_run_resumed_mid_epoch_trains_the_same_rows_in_the_same_order(batched_runs):
    for mode, (_, records) in batched_runs.items():  # 2 steps an epoch; stopped after 1, resumed to the end
        for record in records:
            assert record["rows"]["interrupted"] + record["rows"]["resumed"] == record["rows"]["run"], mode
            assert (record["anchor_seeds"]["interrupted"] + record["anchor_seeds"]["resumed"]
                    == record["anchor_seeds"]["run"]), mode


def test_the_two_newest_checkpoints_are_kept(train_run):
    output, records = train_run  # checkpoints every 2 of 6 steps, keep_checkpoints=2
    for run, steps in [(output, 6), (output.parent / "resumed", 6)]:  # resumed: saved at 2, 3 (stop), 4 and 6
        assert sorted(path.name for path in run.iterdir() if path.name.startswith(CHECKPOINT_DIR)) == [
            CHECKPOINT_DIR, f"{CHECKPOINT_DIR}-4"]
        assert json.loads((run / CHECKPOINT_DIR / STATE_FILE).read_text())["steps"] == steps
        assert json.loads((run / f"{CHECKPOINT_DIR}-4" / STATE_FILE).read_text())["steps"] == 4
    assert records[1]["writes"] == []  # the main process alone rotates


def test_the_process_group_starts_with_the_timeout_flag(cli_run, train_run):
    _, records, _ = cli_run
    assert [record["process_group_timeouts"] for record in records] == [[45 * 60.0]] * 2
    assert [record["process_group_timeouts"] for record in train_run[1]] == [[None]] * 2  # none: the default


def test_every_process_measures_its_share_of_the_held_out_loss(batched_runs):
    from test_training_evaluation import held_out_reference

    for mode, (output, records) in batched_runs.items():  # 3 held-out rows, measured before each step and after
        log = training_log(output)
        assert [entry["step"] for entry in log["held_out_losses"]] == list(range(log["steps"] + 1)), mode
        measurements = (log["steps"] + 1) + 2 + (log["steps"] - 1)  # the run; the interrupted one (0, 1); the rest
        # equal shares: process 0 rows 5 and 7, process 1 row 6 and (wrapped, weighted 0) row 5
        assert [record["held_out_rows"] for record in records] == [[[5], [7]] * measurements,
                                                                   [[6], [5]] * measurements], mode
        for record in records:
            assert record["held_out_losses"] == log["held_out_losses"], mode  # one value, every process's
            resumed = record["resumed"]["held_out_losses"]  # the interrupted run's entries, then its own
            assert [entry["step"] for entry in resumed] == [entry["step"] for entry in log["held_out_losses"]]
            assert [entry["loss"] for entry in resumed] == pytest.approx(
                [entry["loss"] for entry in log["held_out_losses"]], rel=1e-5), mode
        reference = held_out_reference(own_head_draft(5), make_target("qwen3", seed=4), train_rows(8)[5:],
                                       TrainingSettings(num_anchors=64))
        assert log["held_out_losses"][0]["loss"] == pytest.approx(reference, rel=1e-5), mode  # before training


def test_the_main_process_alone_reports_to_tensorboard_the_global_values(cli_run):
    from test_training_trackers import scalars

    from dflash_hf.training.trainer import TRACKER_DIR, TRACKER_RUN

    output, records, _ = cli_run
    log, found = training_log(output), scalars(output / TRACKER_DIR / TRACKER_RUN)
    assert [value for _, value in found["train/loss"]] == pytest.approx(log["losses"], rel=1e-6)  # the mean
    assert [value for _, value in found["train/grad_norm"]] == pytest.approx(log["grad_norms"], rel=1e-6)
    assert len(log["grad_norms"]) == log["steps"] and all(norm > 0 for norm in log["grad_norms"])
    assert found["train/outside_vocabulary"][-1][1] == pytest.approx(log["outside_vocabulary"])  # the epoch's
    assert TRACKER_DIR in {path.split(os.sep)[0] for _, path in records[0]["writes"]}
    assert {path.split(os.sep)[0] for _, path in records[1]["writes"]} == {STORE_DIR, "responses.rank-1-of-2.jsonl",
                                                                           "responses.rank-1-of-2.jsonl.done"}


def test_an_epoch_order_is_distributed_samplers_and_wraps_round_to_whole_steps():
    from torch.utils.data import DistributedSampler

    for num_items, num_processes, epoch, seed in [(5, 2, 0, 0), (8, 3, 1, 4), (1, 2, 0, 0), (7, 1, 2, 1)]:
        per_process = math.ceil(num_items / num_processes)
        order = epoch_order(num_items, epoch, seed, num_processes, per_process)
        for rank in range(num_processes):
            sampler = DistributedSampler(range(num_items), num_replicas=num_processes, rank=rank, seed=seed)
            sampler.set_epoch(epoch)
            assert order[rank::num_processes] == list(sampler)
        longer = epoch_order(num_items, epoch, seed, num_processes, per_process + 2)  # wrapped to whole steps
        assert longer[:len(order)] == order and len(longer) == (per_process + 2) * num_processes
    assert epoch_order(0, 0, 0, 2, 0) == []
    plan = EpochPlan(num_sequences=6, num_processes=2, per_step=2, seed=0)  # 2 steps an epoch, 4 rows each
    assert plan.steps_per_epoch == 2
    assert plan.step_items(0) + plan.step_items(1) == epoch_order(6, 0, 0, 2, 4)
    assert plan.step_items(2) + plan.step_items(3) == epoch_order(6, 1, 0, 2, 4)
    assert plan.process_items(1, 3, 1) == sorted(set(plan.step_items(1)[1::2] + plan.step_items(2)[1::2]))
    assert len({anchor_seed(seed, rank, step) for seed in range(3) for rank in range(4) for step in range(50)}) == 600


def test_each_process_takes_prompts_of_every_length():
    from array import array

    todo, lengths = array("i", [2, 3, 5, 7, 11, 13]), array("i", [4, 9, 1, 9, 6, 2])  # longest first: 3 7 11 2 13 5
    assert [process_share(todo, lengths, rank, 2).tolist() for rank in range(2)] == [[3, 11, 13], [7, 2, 5]]
    assert [process_share(todo, lengths, rank, 4).tolist() for rank in range(4)] == [[3, 13], [7, 5], [11], [2]]
    assert process_share(todo, array("i"), 1, 2).tolist() == [3, 7, 13]  # file order: a stride of the list
    assert process_share(todo, lengths, 0, 1).tolist() == [3, 7, 11, 2, 13, 5]  # one process: all, longest first
    assert process_share(array("i"), array("i"), 0, 2).tolist() == []


def test_gather_on_one_process_and_the_log_of_an_older_checkpoint():
    class Alone:
        num_processes = 1

    assert gather_json([{"index": 1}], Alone()) == [{"index": 1}]
    assert TrainingLog(steps=2).processes == 1 and TrainingLog().learning_rates == []  # older state.json: defaults
