"""The processes of a run under `accelerate launch` or `torchrun`: what each one takes, and how their results meet.

One process (a plain `python` or `dflash-hf` run) is the case N = 1 of everything here: each function then returns
what the single-process code did before. Results travel between processes as JSON in uint8 tensors (no pickle).
"""

from __future__ import annotations

import heapq
import itertools
import json
import math
import os
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from ..versions_dflash import torch_refusal

if TYPE_CHECKING:
    from accelerate import Accelerator, PartialState
    from accelerate.utils import InitProcessGroupKwargs


def process_state(timeout_minutes: float | None = None) -> PartialState:
    """This process's Accelerate state: its device (its GPU under CUDA, else the CPU), index and the process count.

    `cpu=True` without CUDA: several CPU processes under `torchrun` form a gloo group, as GPUs form an NCCL one. The
    first call of a process starts the group, with `timeout_minutes` (`process_group_kwargs`); later calls return the
    same state."""
    from accelerate import PartialState

    handlers = process_group_kwargs(timeout_minutes)
    return PartialState(cpu=not torch.cuda.is_available(), **({"timeout": handlers[0].timeout} if handlers else {}))


def process_group_kwargs(timeout_minutes: float | None) -> list[InitProcessGroupKwargs]:
    """Accelerate's handler that gives the process group a timeout of `timeout_minutes`: how long a process waits
    in a collective before the job is stopped (NCCL's default is 10 minutes, gloo's 30); none: the backend's
    default."""
    if timeout_minutes is None:
        return []
    from accelerate.utils import InitProcessGroupKwargs

    return [InitProcessGroupKwargs(timeout=timedelta(minutes=timeout_minutes))]


def end_processes() -> None:
    """Shut the process group down, so that no communication thread is left running at exit (one process: nothing)."""
    state = process_state()
    if state.num_processes > 1:
        state.destroy_process_group()


def epoch_order(num_items: int, epoch: int, seed: int, num_processes: int, per_process: int) -> list[int]:
    """Every process's items of one epoch, in the order `torch.utils.data.DistributedSampler` gives them: a
    permutation of all items drawn with `seed + epoch` (a fresh one each epoch, the same on every process), wrapped
    round to `per_process` x `num_processes` entries. Process p takes entries p, p + N, p + 2N, ... (`order[p::N]`).

    So an optimiser step of S items per process trains on S x N consecutive entries, rows from all over the data
    rather than neighbours in the file, and every process takes `per_process` items: none waits on a collective the
    others never reach (5 items on 2 processes, 3 each, seed 0, epoch 0: order 4 0 1 3 2 4 gives 4 1 2 | 0 3 4).
    """
    if num_items == 0:
        return []
    order = torch.randperm(num_items, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    length = per_process * num_processes
    return (order * math.ceil(length / num_items))[:length]


# Sequences sorted by length together before a token-budget epoch is cut into steps (`token_budget_steps`): a window
# of the shuffled order, so that a step's sequences are of similar length yet still drawn from all over the data.
LENGTH_GROUP_WINDOW = 4096


def token_budget_steps(lengths: Sequence[int], epoch: int, seed: int, bins: int, budget: int,
                       window: int = LENGTH_GROUP_WINDOW) -> list[list[list[int]]]:
    """One epoch's optimiser steps under a token budget: each step a list of `bins` lists of items (process p's
    micro-batch m is bin p x accumulation + m), every bin non-empty, the step's tokens (`lengths` of its items) at
    most `budget` (given that `budget` >= `bins` x the longest item, `check_token_budget`).

    The items are `epoch_order`'s permutation (seed + epoch), sorted longest first within windows of `window` entries
    (length grouping), then cut in that order into steps that fill the budget with at least `bins` items; the last
    step wraps round to the permutation's first entries it does not hold yet, up to `bins` items. Each step's items
    go to its bins longest first, each to the bin with the fewest tokens so far (ties: the lower bin), so the bins'
    tokens differ by at most the step's longest item: the processes' micro-batches finish together. The steps are
    then shuffled (the same generator), so that an epoch does not run from long sequences to short ones. A pure
    function of its arguments: every process, and a resumed run, finds the same steps."""
    if not lengths:
        return []
    generator = torch.Generator().manual_seed(seed + epoch)
    permutation = torch.randperm(len(lengths), generator=generator)  # [n]
    permuted_lengths = torch.as_tensor(lengths, dtype=torch.int64)[permutation]  # [n]
    longest = int(permuted_lengths.max())
    # within each window of the permutation, longest first (a stable sort: ties keep the permutation's order)
    key = torch.arange(len(lengths)) // window * (longest + 1) + (longest - permuted_lengths)  # [n]
    grouped = permutation[torch.sort(key, stable=True).indices].tolist()
    order = permutation.tolist()
    steps, current, tokens = [], [], 0
    for item in grouped:
        if len(current) >= bins and tokens + lengths[item] > budget:
            steps.append(current)
            current, tokens = [], 0
        current.append(item)
        tokens += lengths[item]
    if len(current) < bins:  # the last step: sequences it does not hold yet, from the permutation's start
        held = set(current)
        fill = itertools.chain((item for item in order if item not in held), itertools.cycle(order))
        current += list(itertools.islice(fill, bins - len(current)))
    steps.append(current)
    shuffled = torch.randperm(len(steps), generator=generator).tolist()
    return [balanced_bins(steps[index], lengths, bins) for index in shuffled]


def balanced_bins(items: list[int], lengths: Sequence[int], bins: int) -> list[list[int]]:
    """`items` in `bins` lists of similar tokens: longest first, each to the bin with the fewest tokens so far (ties:
    the lower bin); each bin keeps its items in the order they came."""
    heap = [(0, index) for index in range(bins)]
    chosen: list[list[int]] = [[] for _ in range(bins)]
    for item in sorted(items, key=lambda item: -lengths[item]):
        tokens, index = heapq.heappop(heap)
        chosen[index].append(item)
        heapq.heappush(heap, (tokens + lengths[item], index))
    return chosen


def check_token_budget(budget: int, longest: int, num_processes: int, accumulation: int) -> None:
    """Refuse a token budget per optimiser step that cannot give every process's every micro-batch one sequence
    within it: it needs `num_processes` x `accumulation` x the longest sequence."""
    needed = num_processes * accumulation * longest
    if budget < needed:
        raise ValueError(f"--tokens-per-step {budget}: a step gives each of the {num_processes} process(es) "
                         f"{accumulation} micro-batch(es) of at least one sequence, and the longest has {longest} "
                         f"tokens: pass at least {needed}, or fewer --gradient-accumulation-steps, or a smaller "
                         "--max-length")


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


def sum_over_processes(tensor: torch.Tensor, state: PartialState) -> torch.Tensor:
    """`tensor` summed over every process, on every process, on the host (a collective: every process calls it;
    one process: `tensor` as it is)."""
    if state.num_processes == 1:
        return tensor
    from accelerate.utils import reduce

    return reduce(tensor.to(state.device), reduction="sum").cpu()


def check_fsdp_torch() -> None:
    """Refuse FSDP training, whose checkpoints are sharded safetensors, on a torch without their storage
    (`versions_dflash.torch_refusal`, feature "FSDP training")."""
    refusal = torch_refusal("FSDP training")
    if refusal is not None:
        raise ValueError(refusal)


def fsdp_precision(accelerator: Accelerator, dtype: torch.dtype | None) -> None:
    """Give Accelerate's FSDP plugin (its run configuration, read when `prepare` shards the draft) the mixed precision
    of the autocast `dtype` (`trainer.autocast_dtype`, the one place that decides): the sharded parameters, which are
    the master weights the optimiser steps, and so AdamW's state stay float32; each unit's all-gather casts its
    parameters to `dtype` (half the bytes gathered, and the forward and backward compute in it), and the gradients
    are reduce-scattered in float32 into the float32 shards. None: float32 throughout. An Accelerate config with a
    mixed precision of its own is refused: dflash-hf's `--mixed-precision` decides (docs/training.md, "FSDP")."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if accelerator.mixed_precision != "no":
        raise ValueError(f"the Accelerate config sets mixed_precision {accelerator.mixed_precision!r}: dflash-hf "
                         "sets FSDP's precision from its own --mixed-precision (auto: bf16 on GPUs, with float32 "
                         "master weights); set mixed_precision: 'no' in the config (as examples/accelerate_fsdp.yaml "
                         "does)")
    accelerator.state.fsdp_plugin.mixed_precision_policy = MixedPrecisionPolicy(
        param_dtype=dtype, reduce_dtype=None if dtype is None else torch.float32)


def check_fsdp_applies(state: PartialState) -> None:
    """Refuse an FSDP launch (`accelerate launch --config_file` of a config with `distributed_type: FSDP`) on a torch
    too old for its sharded checkpoints (`check_fsdp_torch`), or one that Accelerate would run unsharded: it applies
    its FSDP plugin to GPU processes only (CPU processes are `MULTI_CPU`, DDP), so the draft would not be sharded as
    asked."""
    from accelerate.utils import DistributedType

    asked = os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"
    if asked or state.distributed_type == DistributedType.FSDP:
        check_fsdp_torch()
    if asked and state.device.type == "cpu" and state.distributed_type != DistributedType.FSDP:
        raise ValueError("the Accelerate config asks for FSDP, which Accelerate applies on GPUs only: these are CPU "
                         "processes, which would train unsharded. On a CPU launch without the FSDP config "
                         "(torchrun --nproc_per_node N -m dflash_hf.cli train ...); README, \"Train your own "
                         "draft\"")
