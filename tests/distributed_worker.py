"""The processes of two-process training runs (tests/test_training_distributed.py starts two with torchrun).

`python distributed_worker.py MODES FOLDER [CLI ARGS...]`: MODES, comma-separated, run one after the other in the
same two processes and process group (one launch, one import of the package), each in FOLDER/<mode>/run. MODE `train`
runs `train_draft` on tiny seeded models built here (two checkpoints kept); MODE `fsdp` the same under Accelerate's
FSDP (started by `accelerate launch --config_file examples/accelerate_fsdp.yaml`), MODE `fsdp-bf16` its first run in
bf16 mixed precision (`run_precision`), MODE `train-budget` a token budget per step (`run_budget`); MODEs
`train-batched` and
`fsdp-batched` train two sequences per process per optimiser step (`run_batched`); MODE `cli` runs `dflash-hf train`
with the CLI ARGS (their --output: FOLDER/cli/run). Every process records what it did in each mode in
FOLDER/<mode>/records/rank<i>.json (outside the run folder): the files it wrote under the run folder (seen by an audit
hook), the loss of each of its own sequences, the rows and anchor seed of each of its micro-batches (by phase: the
run, the interrupted and the resumed one), the prompts it generated, the collectives it joined while generating, the
evaluations it ran, every call that reads a pickle from a file (`pickle.load`, `torch.load`), the draft vocabulary it
chose (`--draft-vocab-size`) and (the first mode's record: the group starts once per launch) its process group's
timeout.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path
from typing import Any

import torch

import dflash_hf.training.command
import dflash_hf.training.data
import dflash_hf.training.trainer as trainer
from dflash_hf.training.processes import end_processes

WRITE_EVENTS = {"os.mkdir", "os.rename", "os.replace", "os.remove", "os.rmdir", "shutil.rmtree", "os.truncate"}
COLLECTIVES = ("barrier", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_reduce", "broadcast",
               "broadcast_object_list", "gather", "reduce", "scatter")  # torch.distributed's, as Accelerate calls them
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

RANK = int(os.environ.get("RANK", 0))  # set by torchrun
RECORD: dict[str, Any] = {}  # the current mode's record (`new_record`)
WATCHED = {"root": ""}  # the current mode's run folder, as an absolute path


def new_record() -> dict[str, Any]:
    """A mode's record before it runs."""
    return {"rank": RANK, "writes": [], "local_losses": [], "generated": [], "generation_collectives": [],
            "evaluations": 0, "recording": True,
            "phase": "run", "rows": {}, "process_group_timeouts": [], "unpickled": []}


def watch_writes() -> None:
    """Record every file-system write by this process under the current mode's run folder (`WATCHED`; Python's
    audit events)."""

    def hook(event: str, args: tuple) -> None:
        if event == "open":
            path, mode, flags = args
            paths = [path] if (any(c in mode for c in "wax+") if isinstance(mode, str)
                               else isinstance(flags, int) and flags & WRITE_FLAGS) else []
        elif event in WRITE_EVENTS:
            paths = args[:2] if event in ("os.rename", "os.replace") else args[:1]  # both ends of a rename
        else:
            return
        root = WATCHED["root"]
        if not root:  # between modes
            return
        for path in paths:
            if not isinstance(path, (str, os.PathLike)):  # a file descriptor
                continue
            path = os.path.abspath(path)
            if path == root or path.startswith(root + os.sep):
                RECORD["writes"].append([event, os.path.relpath(path, root)])

    sys.addaudithook(hook)


def record_calls() -> None:
    """Wrap the loss, the generation and the evaluation so this process counts its own calls, and the two ways to
    read a pickle file (torch.distributed's object collectives unpickle in memory, through `pickle.Unpickler`)."""
    loss, respond = trainer.packed_dflash_loss, dflash_hf.training.data._respond
    evaluate, generate = dflash_hf.training.command.evaluate_draft, dflash_hf.training.command.generate_responses
    vocabulary = dflash_hf.training.command.training_vocabulary

    def counted_loss(draft, *args, **kwargs):
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        sharded = isinstance(draft, FSDPModule) and all(isinstance(p, DTensor) for p in draft.parameters())
        dtypes = [p.dtype for p in draft.parameters()]  # before the forward gathers them (FSDP: the shards')
        layer = getattr(draft, "layers", [None])[0]  # the dtype a layer computes with (FSDP: its gathered weights)
        hook = None if layer is None else layer.mlp.register_forward_hook(lambda module, inputs, output: seen(
            "gathered_dtypes", [module.gate_proj.weight.dtype]))
        try:
            result = loss(draft, *args, **kwargs)
        finally:
            if hook is not None:
                hook.remove()
        rows = [ROW_INDEX.get(tuple(input_ids.tolist())) for input_ids, _ in args[1]]  # this micro-batch's rows
        if not torch.is_grad_enabled():  # a held-out measurement, not a training step
            RECORD.setdefault("held_out_rows", []).append(rows)
            return result
        RECORD["rows"].setdefault(RECORD["phase"], []).append(rows)
        RECORD.setdefault("anchor_seeds", {}).setdefault(RECORD["phase"], []).append(args[3].initial_seed())
        if RECORD["recording"]:
            RECORD["local_losses"].append(float(result.loss.detach()))
            seen("parameter_dtypes", dtypes)
            RECORD["sharded_steps"] = RECORD.get("sharded_steps", 0) + sharded  # this step's draft held shards
        return result

    def counted_respond(target, draft, input_ids, *args, **kwargs):
        RECORD["generated"].append(input_ids.shape[0])
        return respond(target, draft, input_ids, *args, **kwargs)

    def counted_evaluate(*args, **kwargs):
        RECORD["evaluations"] += 1
        return evaluate(*args, **kwargs)

    def recorded_vocabulary(*args, **kwargs):
        RECORD["vocabulary"] = vocabulary(*args, **kwargs)
        return RECORD["vocabulary"]

    def counted_init(*args, **kwargs):  # the timeout the process group starts with (None: the backend's default)
        timeout = kwargs.get("timeout")
        RECORD["process_group_timeouts"].append(None if timeout is None else timeout.total_seconds())
        return init_process_group(*args, **kwargs)

    def recorded_unpickling(name: str, load: Any) -> Any:  # records the call (and its phase), then unpickles
        def recorded(*args, **kwargs):
            RECORD["unpickled"].append([name, RECORD["phase"]])
            return load(*args, **kwargs)
        return recorded

    pickle.load = recorded_unpickling("pickle.load", pickle.load)
    torch.load = torch.serialization.load = recorded_unpickling("torch.load", torch.load)
    init_process_group = torch.distributed.init_process_group
    torch.distributed.init_process_group = counted_init
    trainer.packed_dflash_loss = counted_loss
    dflash_hf.training.data._respond = counted_respond
    dflash_hf.training.command.evaluate_draft = counted_evaluate
    dflash_hf.training.command.generate_responses = counted_collectives(generate)
    dflash_hf.training.command.training_vocabulary = recorded_vocabulary


def seen(name: str, dtypes: list[torch.dtype]) -> None:
    """Add `dtypes` to the record's sorted list `name` of distinct dtypes."""
    RECORD[name] = sorted(set(RECORD.get(name, [])) | {str(dtype) for dtype in dtypes})


def counted_collectives(generate: Any) -> Any:
    """`generate` recording the collectives this process joins while it runs, in order."""

    def counted(name: str, collective: Any) -> Any:
        def call(*args, **kwargs):
            RECORD["generation_collectives"].append(name)
            return collective(*args, **kwargs)
        return call

    def generate_counted(*args, **kwargs):
        originals = {name: getattr(torch.distributed, name) for name in COLLECTIVES}
        for name, collective in originals.items():
            setattr(torch.distributed, name, counted(name, collective))
        try:
            return generate(*args, **kwargs)
        finally:
            for name, collective in originals.items():
                setattr(torch.distributed, name, collective)

    return generate_counted


def train_rows(count: int) -> list[dict]:
    """`count` seeded rows of a 5-token prompt and a 16-token response."""
    from helpers import VOCAB_SIZE

    generator = torch.Generator().manual_seed(3)
    return [{"prompt_ids": torch.randint(0, VOCAB_SIZE - 1, (5,), generator=generator).tolist(),
             "response_ids": torch.randint(0, VOCAB_SIZE - 1, (16,), generator=generator).tolist()}
            for _ in range(count)]


def budget_rows(count: int) -> list[dict]:
    """`count` seeded rows of a 4-token prompt and a 6- to 29-token response (`run_budget`'s lengths vary)."""
    from helpers import VOCAB_SIZE

    generator = torch.Generator().manual_seed(11)
    return [{"prompt_ids": torch.randint(0, VOCAB_SIZE - 1, (4,), generator=generator).tolist(),
             "response_ids": torch.randint(0, VOCAB_SIZE - 1, (int(length),), generator=generator).tolist()}
            for length in torch.randint(6, 30, (count,), generator=generator)]


BUDGET_ROWS = 12  # `run_budget`'s rows, recorded as BUDGET_ROW_OFFSET + their index
BUDGET_ROW_OFFSET = 100
ROW_INDEX = {tuple(row["prompt_ids"] + row["response_ids"]): index for index, row in enumerate(train_rows(8))}
ROW_INDEX.update({tuple(row["prompt_ids"] + row["response_ids"]): BUDGET_ROW_OFFSET + index
                  for index, row in enumerate(budget_rows(BUDGET_ROWS))})
BUDGET_SETTINGS = dict(epochs=2, learning_rate=2e-3, num_anchors=8, tokens_per_step=160, checkpoint_every=1)


def own_head_draft(seed: int) -> torch.nn.Module:
    """The batched runs' draft: `make_draft(seed, block_size=4)` with an LM head of its own over the even token ids
    (started from the target's rows), so FSDP shards and checkpoints it too and about half the labels fall outside."""
    from helpers import VOCAB_SIZE, make_draft, make_target

    from dflash_hf.training.recipe import initialize_draft_vocabulary

    draft = make_draft(seed, block_size=4, draft_vocab_size=VOCAB_SIZE // 2)
    initialize_draft_vocabulary(draft, make_target("qwen3", seed=4), list(range(0, VOCAB_SIZE, 2)))
    return draft


def weights_sum(draft: torch.nn.Module) -> float:
    """The sum of all the draft's weights (equal on every process when they train one draft)."""
    return float(sum(p.detach().double().sum() for p in draft.parameters()))


def run_train(output: Path) -> None:
    """`train_draft` on 5 rows (an uneven split over two processes), 2 epochs, a visible warm-up, a held-out
    evaluation every 3 steps (it records the whole draft's weight sum), the trained draft saved by the main process
    (`save_pretrained`, in OUTPUT's sibling `exported`); then the same run interrupted after 3 steps
    and resumed (in OUTPUT's sibling `resumed`, seen by no audit hook)."""
    from helpers import make_draft, make_target

    settings = trainer.TrainingSettings(epochs=2, learning_rate=2e-3, num_anchors=8, warmup_ratio=0.25,
                                        checkpoint_every=2, keep_checkpoints=2)
    target, rows = make_target("qwen3", seed=4), train_rows(5)

    def evaluate(draft: torch.nn.Module) -> dict:  # what the held-out evaluation sees: the whole draft's weights
        RECORD["held_out_calls"] = RECORD.get("held_out_calls", 0) + 1
        return {"weights_sum": weights_sum(draft)}

    def train(draft: torch.nn.Module, folder: Path, max_steps: int | None = None) -> trainer.TrainingLog:
        return trainer.train_draft(draft, target, rows, settings, folder, progress=False, max_steps=max_steps,
                                   evaluate=evaluate, eval_every=3)

    draft = make_draft(5, block_size=4)
    log = train(draft, output)
    RECORD["log_steps"], RECORD["weights_sum"], RECORD["held_out"] = log.steps, weights_sum(draft), log.evaluations
    if RANK == 0:  # the trained draft as `dflash-hf train` exports it (beside OUTPUT, seen by no audit hook)
        draft.save_pretrained(output.parent / "exported")
    RECORD["recording"], RECORD["phase"] = False, "interrupted"
    resumed = output.parent / "resumed"
    train(make_draft(5, block_size=4), resumed, max_steps=3)
    RECORD["phase"] = "resumed"
    draft = make_draft(6, block_size=4)  # other initial weights: the checkpoint's replace them
    log = train(draft, resumed)
    RECORD["resumed"] = {"losses": log.losses, "learning_rates": log.learning_rates, "weights_sum": weights_sum(draft),
                         "held_out": log.evaluations}


def run_batched(output: Path, sharded: bool) -> None:
    """`train_draft` on 5 rows, 2 epochs, two sequences per process per optimiser step: one packed micro-batch of two
    data-parallel, or (`sharded`, under FSDP) two accumulated micro-batches of one. Anchors cover every label, so the
    split cannot change them. Then the same run interrupted after 1 step and resumed (in OUTPUT's sibling
    `resumed`). Rows 5, 6 and 7 are held out: their loss is measured at every step. The draft has its own LM head
    (`own_head_draft`)."""
    from helpers import make_target

    split = {"batch_size": 1, "gradient_accumulation_steps": 2} if sharded else {"batch_size": 2}
    settings = trainer.TrainingSettings(epochs=2, learning_rate=2e-3, num_anchors=64, warmup_ratio=0.25,
                                        checkpoint_every=1, **split)
    target, rows, held_out = make_target("qwen3", seed=4), train_rows(5), train_rows(8)[5:]

    def train(draft: torch.nn.Module, folder: Path, max_steps: int | None = None) -> trainer.TrainingLog:
        return trainer.train_draft(draft, target, rows, settings, folder, progress=False, max_steps=max_steps,
                                   held_out_rows=held_out, held_out_every=1)

    draft = own_head_draft(5)
    log = train(draft, output)
    RECORD["log_steps"], RECORD["weights_sum"], RECORD["held_out_losses"] = (log.steps, weights_sum(draft),
                                                                             log.held_out_losses)
    RECORD["recording"], RECORD["phase"] = False, "interrupted"
    resumed = output.parent / "resumed"
    train(own_head_draft(5), resumed, max_steps=1)
    RECORD["phase"] = "resumed"
    draft = own_head_draft(6)  # other initial weights: the checkpoint's replace them
    log = train(draft, resumed)
    RECORD["resumed"] = {"losses": log.losses, "tokens": log.tokens, "weights_sum": weights_sum(draft),
                         "held_out_losses": log.held_out_losses}


def run_budget(output: Path) -> None:
    """`train_draft` on `budget_rows` with a token budget per step (BUDGET_SETTINGS), then the same run interrupted
    in the middle of its first epoch and resumed (in OUTPUT's sibling `resumed`)."""
    from helpers import make_draft, make_target

    settings = trainer.TrainingSettings(**BUDGET_SETTINGS)
    target, rows = make_target("qwen3", seed=4), budget_rows(BUDGET_ROWS)
    draft = make_draft(5, block_size=4)
    log = trainer.train_draft(draft, target, rows, settings, output, progress=False)
    RECORD["log_steps"], RECORD["weights_sum"] = log.steps, weights_sum(draft)
    RECORD["recording"], RECORD["phase"] = False, "interrupted"
    resumed = output.parent / "resumed"
    trainer.train_draft(make_draft(5, block_size=4), target, rows, settings, resumed, progress=False, max_steps=1)
    RECORD["phase"] = "resumed"
    draft = make_draft(6, block_size=4)  # other initial weights: the checkpoint's replace them
    log = trainer.train_draft(draft, target, rows, settings, resumed, progress=False)
    RECORD["resumed"] = {"losses": log.losses, "tokens": log.tokens, "weights_sum": weights_sum(draft)}


def run_precision(output: Path) -> None:
    """`run_train`'s first run (same rows, seed and schedule) under bf16 mixed precision (`--mixed-precision bf16`:
    FSDP gathers bf16 weights from float32 shards; bf16 autocast) with the draft's layers checkpointed."""
    from helpers import make_draft, make_target

    settings = trainer.TrainingSettings(epochs=2, learning_rate=2e-3, num_anchors=8, warmup_ratio=0.25,
                                        checkpoint_every=2, mixed_precision="bf16", gradient_checkpointing=True)
    draft = make_draft(5, block_size=4)
    log = trainer.train_draft(draft, make_target("qwen3", seed=4), train_rows(5), settings, output, progress=False)
    RECORD["log_steps"], RECORD["weights_sum"] = log.steps, weights_sum(draft)
    RECORD["exported_dtypes"] = sorted({str(p.dtype) for p in draft.parameters()})


def force_fsdp() -> None:
    """Make these CPU processes FSDP ones, as a GPU launch with the same config file is. Accelerate applies its FSDP
    plugin to GPU processes only (accelerate/state.py: CPU processes are MULTI_CPU, and `train` refuses the FSDP
    config there: recorded first); the plugin set here is Accelerate's own, built from the config's FSDP_*
    environment, and `prepare` then shards the draft with torch's `fully_shard` over the gloo group."""
    from accelerate import Accelerator, PartialState
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    from dflash_hf.training.processes import check_fsdp_applies

    try:
        check_fsdp_applies(PartialState(cpu=True))
    except ValueError as error:
        RECORD["refused"] = str(error)
    Accelerator(cpu=True)
    state = AcceleratorState()
    state.fsdp_plugin = FullyShardedDataParallelPlugin()
    state.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def run_mode(mode: str, output: Path, cli_args: list[str]) -> None:
    """One mode's run in `output`."""
    if mode in ("train", "fsdp"):
        run_train(output)
    elif mode == "fsdp-bf16":
        run_precision(output)
    elif mode == "train-budget":
        run_budget(output)
    elif mode in ("train-batched", "fsdp-batched"):
        run_batched(output, sharded=mode.startswith("fsdp"))
    else:
        from dflash_hf.cli import main as cli

        cli(cli_args)


def main() -> None:
    modes, folder = sys.argv[1].split(","), Path(sys.argv[2])
    torch.set_num_threads(1)
    watch_writes()
    record_calls()
    for index, mode in enumerate(modes):
        RECORD.clear()
        RECORD.update(new_record())
        output = folder / mode / "run"
        WATCHED["root"] = str(output.resolve())
        if mode.startswith("fsdp") and index == 0:  # the process group's state, once per launch
            force_fsdp()
        run_mode(mode, output, sys.argv[3:])
        WATCHED["root"] = ""
        records = folder / mode / "records"
        records.mkdir(parents=True, exist_ok=True)
        (records / f"rank{RANK}.json").write_text(json.dumps(RECORD))
    end_processes()  # the process group, before the interpreter exits


if __name__ == "__main__":
    main()
