"""The processes of a run under `accelerate launch` or `torchrun`: what each one takes, and how their results meet.

One process (a plain `python` or `dflash-hf` run) is the case N = 1 of everything here: each function then returns
what the single-process code did before. Results travel between processes as JSON in uint8 tensors (no pickle).
"""

from __future__ import annotations

import json
import math
import os
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from accelerate import PartialState


def process_state() -> PartialState:
    """This process's Accelerate state: its device (its GPU under CUDA, else the CPU), index and the process count.

    `cpu=True` without CUDA: several CPU processes under `torchrun` form a gloo group, as GPUs form an NCCL one."""
    from accelerate import PartialState

    return PartialState(cpu=not torch.cuda.is_available())


def end_processes() -> None:
    """Shut the process group down, so that no communication thread is left running at exit (one process: nothing)."""
    state = process_state()
    if state.num_processes > 1:
        state.destroy_process_group()


def padded_shard(num_items: int, process_index: int, num_processes: int) -> list[int]:
    """The item indices process `process_index` of `num_processes` takes: every num_processes-th one from its index,
    wrapped round to the first items so that every process takes ceil(num_items / num_processes) of them.

    Equal shards keep the processes in step: data-parallel training does one collective per optimiser step, and a
    process that ran out of items first would leave the others waiting (8 items on 3 processes: 0 3 6 | 1 4 7 | 2 5 0).
    """
    if num_items == 0:
        return []
    per_process = math.ceil(num_items / num_processes)
    return [(process_index + k * num_processes) % num_items for k in range(per_process)]


def round_share(todo: list[int], batch_size: int, round_index: int, process_index: int,
                num_processes: int) -> list[int]:
    """This process's batch of round `round_index`: each round takes the next batch_size x num_processes items of
    `todo`, one batch per process in process order, so the rows gathered after each round are a prefix of `todo`."""
    start = (round_index * num_processes + process_index) * batch_size
    return todo[start : start + batch_size]


def num_rounds(num_items: int, batch_size: int, num_processes: int) -> int:
    """Rounds `round_share` needs for `num_items` items (the same on every process)."""
    return math.ceil(num_items / (batch_size * num_processes))


def gather_json(items: list[Any], state: PartialState) -> list[Any]:
    """Every process's `items` (JSON-ready values), concatenated in process order, on every process.

    Each process encodes its list as JSON in a uint8 tensor; the tensors are padded to the longest and all-gathered
    (a collective: every process must call this the same number of times). One process: `items` as they are."""
    if state.num_processes == 1:
        return list(items)
    from accelerate.utils import gather, pad_across_processes

    encoded = torch.tensor(list(json.dumps(items).encode("utf-8")), dtype=torch.uint8, device=state.device)  # [L]
    lengths = gather(torch.tensor([encoded.numel()], device=state.device)).tolist()  # [P]
    padded = pad_across_processes(encoded, dim=0)  # [max L]
    everyone = gather(padded).view(state.num_processes, -1).cpu()  # [P, max L]
    return [item for row, length in zip(everyone, lengths) for item in json.loads(bytes(row[:length].tolist()))]


def check_fsdp_applies(state: PartialState) -> None:
    """Refuse an FSDP launch (`accelerate launch --config_file` of a config with `distributed_type: FSDP`) that
    Accelerate would run unsharded: it applies its FSDP plugin to GPU processes only (CPU processes are
    `MULTI_CPU`, DDP), so the draft would not be sharded as asked."""
    from accelerate.utils import DistributedType

    asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if asked and state.device.type == "cpu" and state.distributed_type != DistributedType.FSDP:
        raise ValueError("the Accelerate config asks for FSDP, which Accelerate applies on GPUs only: these are CPU "
                         "processes, which would train unsharded. On a CPU launch without the FSDP config "
                         "(torchrun --nproc_per_node N -m dflash_hf.cli train ...); README, \"Train your own "
                         "draft\"")
