"""The training loop: AdamW, cosine schedule with warm-up, gradient clipping, resumable checkpoints.

An optimiser step is `batch_size` sequences (packed into one row) times `gradient_accumulation_steps` micro-batches per
process, many anchors per sequence (docs/training.md). Runs as is on one CPU or GPU and data-parallel under `accelerate
launch` or `torchrun` (Accelerate is the distributed engine): each epoch shuffles all sequences and strides them over
the N processes (as `DistributedSampler`), the gradients are averaged, the schedule counts optimiser steps, the log
holds global values and only the main process writes files. Under Accelerate's FSDP plugin (`accelerate launch
--config_file examples/accelerate_fsdp.yaml`) the draft is sharded over the processes, and each process writes its own
shards of the checkpoints (docs/training.md, "FSDP"). The target's signals are computed per micro-batch; the opt-in
cache keeps them on the host (pinned when CUDA is available), after a size check, and moves one micro-batch's to the
device at a time.
"""

from __future__ import annotations

import copy
import functools
import hashlib
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import torch
from safetensors.torch import load_file, save_file
from torch.optim.lr_scheduler import LRScheduler
from transformers import get_cosine_schedule_with_warmup

from ..loading import free_memory_bytes
from ..modeling_dflash import DFlashDraftModel
from .objective import LossWeights, StepResult, TargetSignals, packed_dflash_loss, target_signals, teacher_rows
from .processes import (
    check_fsdp_applies,
    check_fsdp_torch,
    check_token_budget,
    epoch_order,
    fsdp_precision,
    process_group_kwargs,
    token_budget_steps,
)
from .store import SequenceStore, row_tokens

if TYPE_CHECKING:
    from accelerate import Accelerator

CHECKPOINT_DIR = "checkpoint"  # OUTPUT/checkpoint/: the resumable state, no pickle
CHECKPOINT_FORMAT = 2  # 1 stored the optimiser and schedule with torch.save; 2 has no torch file at all
DRAFT_WEIGHTS_FILE = "draft.safetensors"
OPTIMIZER_TENSORS_FILE = "optimizer.safetensors"  # the optimiser's per-parameter tensors, keyed "<param>.<name>"
OPTIMIZER_SCHEDULER_FILE = "optimizer_scheduler.json"  # the rest of both state dicts: plain numbers and lists
STATE_FILE = "state.json"  # the TrainingLog and the format version; written last
LEGACY_CHECKPOINT_FILE = "checkpoint.pt"  # the pickled checkpoint of earlier versions, refused
TRACKER_DIR = "logs"  # OUTPUT/logs/: the trackers' files (--report-to); TensorBoard's in OUTPUT/logs/<TRACKER_RUN>/
TRACKER_RUN = "dflash-hf"
MIXED_PRECISION = {"no": None, "bf16": torch.bfloat16}  # --mixed-precision: the autocast dtype of the forward
# "auto" dtypes: bfloat16 for many-row work (training, batched regeneration) on a GPU, and on a CPU where a 512-row
# product at the model's width measures this many times faster than float32 (AMX); widths below BF16_MIN_WIDTH are
# overhead-bound and stay float32 (docs/training.md, "Precision on a CPU")
BF16_MIN_SPEEDUP = 1.3
BF16_MIN_WIDTH = 256


@dataclass
class TrainingSettings:
    """Hyper-parameters of a training run (paper values where the paper gives them)."""

    epochs: int = 6
    learning_rate: float = 6e-4
    warmup_ratio: float = 0.04
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    num_anchors: int = 512
    max_length: int = 3072
    distill: bool = True  # soft labels: the target's top-k next-token distribution (every documented recipe)
    teacher_top_k: int = 32
    l1_weight: float = 0.0  # the L1 (distribution-matching) term's share of the loss (`LossWeights.l1`)
    logit_weight: float = 0.0  # the raw-logit term's weight (`LossWeights.logits`; needs distill)
    # the cross-entropy to the sequence's token while L1 reads the teacher (DeepSpec's loss; needs distill)
    token_cross_entropy: bool = False
    # False: the target runs per micro-batch (memory bounded by one batch); True: once per sequence, its signals
    # cached in host RAM for every epoch, refused when they would not fit (`check_feature_cache`)
    cache_target: bool = False
    cache_limit_gib: float | None = None  # the cache's limit per process (None: the host's available memory)
    # "bf16": forward and loss under bf16 autocast, weights and optimiser float32; "auto": `autocast_dtype` decides
    mixed_precision: str = "auto"
    batch_size: int = 1  # sequences per process per micro-batch, packed into one row
    # tokens per optimiser step, every process's (None: batch_size x accumulation sequences per process): sequences of
    # similar length fill it, balanced over the processes' micro-batches (`TokenBudgetPlan`)
    tokens_per_step: int | None = None
    gradient_accumulation_steps: int = 1  # micro-batches per optimiser step (Accelerate's accumulation)
    # True: each draft layer is checkpointed, its activations recomputed in the backward (`activation_checkpointing`)
    gradient_checkpointing: bool = False
    seed: int = 0
    checkpoint_every: int = 200  # optimiser steps between resumable checkpoints
    keep_checkpoints: int = 1  # checkpoints kept on disk, the latest (OUTPUT/checkpoint) included
    process_group_timeout_minutes: float | None = None  # the process group's timeout (None: the backend's default)
    report_to: list[str] = field(default_factory=list)  # Accelerate's trackers (`log_with`), e.g. ["tensorboard"]

    def __post_init__(self) -> None:
        """Refuse a mixed precision the trainer does not know, counts below one, a length below two and a timeout
        that is not positive."""
        if self.mixed_precision not in ("auto", *MIXED_PRECISION):
            raise ValueError(f"mixed_precision {self.mixed_precision!r}: expected one of "
                             f"{['auto', *MIXED_PRECISION]}")
        counts = {"batch_size (--train-batch-size)": self.batch_size,
                  "gradient_accumulation_steps (--gradient-accumulation-steps)": self.gradient_accumulation_steps,
                  "checkpoint_every (--checkpoint-every)": self.checkpoint_every,
                  "keep_checkpoints (--keep-checkpoints)": self.keep_checkpoints}
        below = [f"{name} {value}" for name, value in counts.items() if value < 1]
        if below:
            raise ValueError(f"{', '.join(below)}: expected >= 1")
        if self.tokens_per_step is not None and (self.tokens_per_step < 1 or self.batch_size != 1):
            raise ValueError(f"tokens_per_step {self.tokens_per_step} (--tokens-per-step) with batch_size "
                             f"{self.batch_size} (--train-batch-size): a token budget >= 1 decides how many sequences "
                             "a micro-batch packs; leave --train-batch-size at 1")
        if self.logit_weight > 0 and not self.distill:
            raise ValueError("logit_weight (--logit-weight) matches the target's top-k logits, which only "
                             "distillation keeps: drop --no-distill")
        if self.token_cross_entropy and not self.distill:
            raise ValueError("token_cross_entropy (--token-cross-entropy) keeps the teacher for L1 only; without "
                             "distillation the cross-entropy is already to the tokens: drop one of them")
        LossWeights(self.l1_weight, self.logit_weight, self.token_cross_entropy)  # refuses weights out of range
        if self.max_length < 2:
            raise ValueError(f"max_length {self.max_length} (--max-length): expected >= 2 (a label follows a token)")
        if self.process_group_timeout_minutes is not None and self.process_group_timeout_minutes <= 0:
            raise ValueError(f"process_group_timeout_minutes {self.process_group_timeout_minutes} "
                             "(--process-group-timeout): expected minutes > 0")

    @property
    def loss_weights(self) -> LossWeights:
        """The loss terms' weights (`LossWeights`)."""
        return LossWeights(self.l1_weight, self.logit_weight, self.token_cross_entropy)

    @property
    def sequences_per_step(self) -> int:
        """Sequences each process trains on per optimiser step."""
        return self.batch_size * self.gradient_accumulation_steps


def check_trackers(names: list[str]) -> None:
    """Refuse a tracker Accelerate does not know, or one whose package is missing (Accelerate would leave it out
    without a word)."""
    if not names:
        return
    from accelerate.tracking import get_available_trackers
    from accelerate.utils import LoggerType

    known = [name for name in LoggerType.list() if name != "all"]
    unknown = [name for name in names if name not in known]
    if unknown:
        raise ValueError(f"--report-to {unknown[0]}: not one of Accelerate's trackers ({', '.join(known)})")
    available = {str(tracker) for tracker in get_available_trackers()}
    missing = [name for name in names if name not in available]
    if missing:
        raise ValueError(f"--report-to {missing[0]}: its package is not installed here (pip install {missing[0]}), "
                         "or leave it out")


def tracker_config(settings: TrainingSettings) -> dict[str, Any]:
    """The settings as the trackers' run configuration (TensorBoard's hyper-parameters take numbers, strings, booleans
    and None: a list becomes its text)."""
    return {name: value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
            for name, value in asdict(settings).items()}


def held_out_loss(accelerator: Accelerator, model: torch.nn.Module, target: torch.nn.Module,
                  sequences: Sequence[tuple[torch.Tensor, torch.Tensor]], settings: TrainingSettings,
                  signals_of: Callable[[torch.Tensor, torch.Tensor], TargetSignals]) -> dict[str, Any]:
    """The training loss, block tau and accuracy per block position of the draft on held-out `sequences`, every
    process computing its share (entries p, p + N, ...; wrapped round to equal shares, the repeats weighted 0, so
    that every process runs as many forwards: FSDP gathers in each, and its shards are restored after) and one
    all-reduce. Each sequence draws the same anchors every time (`anchor_seed` of process -1 and its index), so the
    values compare across steps."""
    from torch.distributed.fsdp import FSDPModule

    processes, device = accelerator.num_processes, accelerator.device
    dtype = autocast_dtype(settings.mixed_precision, device)
    parts = []
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        for position in range(accelerator.process_index, math.ceil(len(sequences) / processes) * processes,
                              processes):
            index = position % len(sequences)
            input_ids, loss_mask = (t.to(device) for t in sequences[index])
            result = packed_dflash_loss(model, target, [(input_ids, loss_mask)], settings.num_anchors,
                                        torch.Generator().manual_seed(anchor_seed(settings.seed, -1, index)),
                                        [signals_of(input_ids, loss_mask)], loss_weights=settings.loss_weights)
            counts = torch.stack([result.loss.detach().float(), torch.ones((), device=device),
                                  result.leading_correct.float().sum(),
                                  torch.tensor(float(len(result.leading_correct)), device=device),
                                  result.expected_accepted.float().sum()])
            weight = float(position < len(sequences))  # a wrapped repeat counts for nothing
            parts.append(weight * torch.cat([counts, result.correct.float(), result.counted.float()]))
    # FSDP keeps units gathered after a forward with no backward: the root, and the unit Accelerate gives the output
    # embedding (a draft's own LM head) with reshard_after_forward=False
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()
    total = accelerator.reduce(torch.stack(parts).sum(0), reduction="sum").cpu()  # [5 + 2 (B-1)]
    correct, counted = total[5:].chunk(2)
    return {"loss": float(total[0] / total[1]), "block_tau": float(1 + total[2] / total[3].clamp(min=1)),
            "sampled_block_tau": float(1 + total[4] / total[3].clamp(min=1)),
            "position_accuracy": (correct / counted.clamp(min=1)).tolist()}


def step_metrics(log: TrainingLog, tokens_per_second: float) -> dict[str, float]:
    """What the trackers get for the step `log` just recorded: loss, learning rate, gradient norm, tokens per second,
    the epoch's block tau and accuracy per block position so far."""
    return {"train/loss": log.losses[-1], "train/learning_rate": log.learning_rates[-1],
            "train/grad_norm": log.grad_norms[-1], "train/tokens_per_second": tokens_per_second,
            "train/block_tau": log.block_tau,
            **({} if log.outside_vocabulary is None else {"train/outside_vocabulary": log.outside_vocabulary}),
            **{f"train/accuracy_position_{k}": accuracy for k, accuracy in enumerate(log.position_accuracy, 1)}}


@functools.lru_cache(maxsize=None)
def cpu_bf16_speedup(width: int, rows: int = 512) -> float:
    """How many times faster a `rows`-row product with a [width, 4 x width] weight runs in bfloat16 than in float32
    on this CPU, with torch's threads (the best of 3 timings each, after a warm-up)."""
    def best_seconds(dtype: torch.dtype) -> float:
        left, right = torch.randn(rows, width, dtype=dtype), torch.randn(width, 4 * width, dtype=dtype)
        left @ right  # warm-up: kernels chosen, pages touched
        times = []
        for _ in range(3):
            start = time.perf_counter()
            left @ right
            times.append(time.perf_counter() - start)
        return min(times)

    return best_seconds(torch.float32) / best_seconds(torch.bfloat16)


def prefers_bf16(device: torch.device, width: int | None) -> bool:
    """Whether "auto" picks bfloat16 for many-row work on `device` with a model `width` wide: on CUDA, and on a CPU
    where `cpu_bf16_speedup(width)` reaches BF16_MIN_SPEEDUP (None: a width not known, or few-row work: float32)."""
    if device.type == "cuda":
        return True
    return (device.type == "cpu" and width is not None and width >= BF16_MIN_WIDTH
            and cpu_bf16_speedup(width) >= BF16_MIN_SPEEDUP)


def autocast_dtype(mixed_precision: str, device: torch.device, width: int | None = None) -> torch.dtype | None:
    """The autocast dtype of the draft's forward and loss (None: float32): `mixed_precision`, where "auto" is bf16
    where `prefers_bf16(device, width)` (a GPU; a CPU whose bf16 products measure faster at the draft's `width`)."""
    if mixed_precision == "auto":
        return torch.bfloat16 if prefers_bf16(device, width) else None
    return MIXED_PRECISION[mixed_precision]


@dataclass
class TrainingLog:
    """What a run did: per-step loss, learning rate and gradient norm, per-position accuracy of the last epoch, steps
    and seconds.

    Global over the processes of a data-parallel run: one entry per optimiser step, the loss averaged over the
    processes, the accuracy counted over all of them."""

    losses: list[float] = field(default_factory=list)
    learning_rates: list[float] = field(default_factory=list)  # the rate each optimiser step applied
    grad_norms: list[float] = field(default_factory=list)  # each step's gradient norm, before clipping
    position_accuracy: list[float] = field(default_factory=list)
    block_tau: float = 0.0  # last epoch: 1 + mean correct predictions before the first miss (greedy tau estimate)
    steps: int = 0
    seconds: float = 0.0
    processes: int = 1  # data-parallel processes of the run (a checkpoint resumes on as many)
    tokens: int = 0  # tokens of the trained sequences, every process's
    evaluations: list[dict] = field(default_factory=list)  # held-out results: {"step", "tau", "lossless", ...}
    # {"step", "loss", "block_tau", "sampled_block_tau", "position_accuracy"}
    held_out_losses: list[dict] = field(default_factory=list)
    # last epoch, a draft with its own LM head: the fraction of response labels outside its vocabulary (not in its
    # loss; None: a draft that borrows the target's head)
    outside_vocabulary: float | None = None


def training_sequences(rows: list[dict] | SequenceStore,
                       max_length: int) -> Sequence[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids [T], loss_mask [T]) per row (`row_tokens`), cut to `max_length`; rows with no label are left out.
    A `SequenceStore` is returned as it is (`store.write_sequences` cut and filtered its rows)."""
    if isinstance(rows, SequenceStore):
        return rows
    sequences = []
    for row in rows:
        ids, mask = (values[:max_length] for values in row_tokens(row))
        if sum(mask[1:]) > 0:
            sequences.append((torch.tensor(ids), torch.tensor(mask)))
    return sequences


def host_copy(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """`tensor` in host memory, pinned if `pin` (page-locked: uploads can overlap compute); no copy if already so."""
    if tensor.device.type == "cpu" and tensor.is_pinned() == pin:
        return tensor
    return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pin).copy_(tensor)


def on_host(signals: TargetSignals) -> TargetSignals:
    """A sequence's target signals in host memory, pinned when CUDA is available: the device holds one step's."""
    pin = torch.cuda.is_available()
    return signals.apply(lambda tensor: host_copy(tensor, pin))


class StepPlan:
    """What a plan of optimiser steps gives the trainer (`EpochPlan`, `TokenBudgetPlan`): pure functions of the
    plan's fields, so a resumed run (or any process) finds the same sequences for a step."""

    def total_steps(self, epochs: int) -> int:
        """Optimiser steps of `epochs` epochs."""
        raise NotImplementedError

    def epoch_of(self, step: int) -> int:
        """The epoch optimiser step `step` (counted from the run's start) belongs to."""
        raise NotImplementedError

    def step_items(self, step: int) -> list[int]:
        """The sequences of optimiser step `step`, every process's."""
        raise NotImplementedError

    def micro_batches(self, step: int, process_index: int) -> list[list[int]]:
        """Process `process_index`'s micro-batches of step `step`: the sequences each packs into one row."""
        raise NotImplementedError

    def process_items(self, first_step: int, last_step: int, process_index: int) -> list[int]:
        """The sequences process `process_index` trains on in steps `first_step` .. `last_step` - 1, each once."""
        return sorted({i for step in range(first_step, last_step)
                       for batch in self.micro_batches(step, process_index) for i in batch})


@dataclass
class EpochPlan(StepPlan):
    """Which sequences each optimiser step trains on, every process's: each epoch one `epoch_order` of all of them
    (`DistributedSampler`'s: seed + epoch, strided over the processes), wrapped round to whole steps, `batch_size`
    of them per micro-batch. A pure function of its fields, so a resumed run (or any process) finds the same
    sequences for a step."""

    num_sequences: int
    num_processes: int
    per_step: int  # sequences per process per optimiser step
    seed: int
    batch_size: int = 1  # sequences per micro-batch (per_step / batch_size micro-batches a step)
    _epoch: tuple[int, list[int]] = field(default=(-1, []), init=False, repr=False)  # the last epoch's order

    @property
    def steps_per_epoch(self) -> int:
        """Optimiser steps of an epoch: every process takes ceil(sequences / processes), in whole steps."""
        return math.ceil(math.ceil(self.num_sequences / self.num_processes) / self.per_step)

    def epoch_items(self, epoch: int) -> list[int]:
        """Every process's sequences of `epoch` (`epoch_order`, drawn once per epoch): process p takes entries p,
        p + N, ..."""
        if self._epoch[0] != epoch:
            self._epoch = (epoch, epoch_order(self.num_sequences, epoch, self.seed, self.num_processes,
                                              self.steps_per_epoch * self.per_step))
        return self._epoch[1]

    def step_items(self, step: int) -> list[int]:
        """The sequences of optimiser step `step` (counted from the run's start), every process's: process p takes
        entries p, p + N, ... of them."""
        epoch, index = divmod(step, self.steps_per_epoch)
        width = self.per_step * self.num_processes
        return self.epoch_items(epoch)[index * width:(index + 1) * width]

    def total_steps(self, epochs: int) -> int:
        """Optimiser steps of `epochs` epochs: as many in each."""
        return self.steps_per_epoch * epochs

    def epoch_of(self, step: int) -> int:
        """The epoch of optimiser step `step`."""
        return step // self.steps_per_epoch

    def micro_batches(self, step: int, process_index: int) -> list[list[int]]:
        """Process `process_index`'s entries p, p + N, ... of the step, `batch_size` per micro-batch."""
        items = self.step_items(step)[process_index::self.num_processes]
        return [items[start:start + self.batch_size] for start in range(0, len(items), self.batch_size)]


@dataclass
class TokenBudgetPlan(StepPlan):
    """Optimiser steps that fill a token budget (`--tokens-per-step`, all processes together), sequences of similar
    length grouped into a step and balanced over the processes' micro-batches (`processes.token_budget_steps`): each
    epoch one permutation of all sequences (seed + epoch), so the number of steps may differ between epochs. A pure
    function of its fields, so a resumed run (or any process) finds the same sequences for a step."""

    lengths: list[int]  # tokens of each sequence
    num_processes: int
    accumulation: int  # micro-batches per process per step
    budget: int  # tokens per optimiser step, every process's
    seed: int
    _epoch: tuple[int, list[list[list[int]]]] = field(default=(-1, []), init=False, repr=False)  # the last epoch's
    _counts: list[int] = field(default_factory=list, init=False, repr=False)  # steps of each epoch so far

    def epoch_steps(self, epoch: int) -> list[list[list[int]]]:
        """The steps of `epoch`, each as its N x accumulation micro-batches (drawn once per epoch)."""
        if self._epoch[0] != epoch:
            self._epoch = (epoch, token_budget_steps(self.lengths, epoch, self.seed,
                                                     self.num_processes * self.accumulation, self.budget))
        return self._epoch[1]

    def _epoch_starts(self, epochs: int) -> list[int]:
        """The first step of each of `epochs` epochs and, last, the step after them (one plan per epoch not yet
        counted)."""
        while len(self._counts) < epochs:
            self._counts.append(len(self.epoch_steps(len(self._counts))))
        return [sum(self._counts[:epoch]) for epoch in range(epochs + 1)]

    def total_steps(self, epochs: int) -> int:
        """Optimiser steps of `epochs` epochs (each epoch's plan is drawn once to count them)."""
        return self._epoch_starts(epochs)[-1]

    def epoch_of(self, step: int) -> int:
        """The epoch of optimiser step `step`."""
        epoch = 0
        while self._epoch_starts(epoch + 1)[-1] <= step:
            epoch += 1
        return epoch

    def _step(self, step: int) -> list[list[int]]:
        """Step `step`'s micro-batches, every process's."""
        epoch = self.epoch_of(step)
        return self.epoch_steps(epoch)[step - self._epoch_starts(epoch)[-1]]

    def step_items(self, step: int) -> list[int]:
        """The sequences of step `step`, every process's, micro-batch by micro-batch."""
        return [item for batch in self._step(step) for item in batch]

    def micro_batches(self, step: int, process_index: int) -> list[list[int]]:
        """Process `process_index`'s micro-batches of step `step` (bins p x accumulation ...)."""
        first = process_index * self.accumulation
        return self._step(step)[first:first + self.accumulation]


def training_plan(sequences: Sequence[tuple[torch.Tensor, torch.Tensor]], num_processes: int,
                  settings: TrainingSettings) -> StepPlan:
    """The run's plan of optimiser steps: a token budget per step (`settings.tokens_per_step`: `TokenBudgetPlan`,
    refused when it cannot hold a sequence per micro-batch, `check_token_budget`), or `batch_size` x accumulation
    sequences per process (`EpochPlan`)."""
    if settings.tokens_per_step is None:
        return EpochPlan(len(sequences), num_processes, settings.sequences_per_step, settings.seed,
                         settings.batch_size)
    lengths = (sequences.lengths() if isinstance(sequences, SequenceStore)
               else [len(input_ids) for input_ids, _ in sequences])
    check_token_budget(settings.tokens_per_step, max(lengths, default=0), num_processes,
                       settings.gradient_accumulation_steps)
    return TokenBudgetPlan(lengths, num_processes, settings.gradient_accumulation_steps, settings.tokens_per_step,
                           settings.seed)


def anchor_seed(seed: int, process_index: int, micro_step: int) -> int:
    """The seed of one micro-batch's anchor draws: distinct for every (run seed, process, micro-batch), so the
    processes draw different anchors, and a resumed run draws the same ones again (a 64-bit hash of the three)."""
    digest = hashlib.blake2b(f"{seed}/{process_index}/{micro_step}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def feature_cache_bytes(target: torch.nn.Module, sequences: Sequence[tuple[torch.Tensor, torch.Tensor]],
                        num_features: int, teacher_top_k: int | None, teacher_logits: bool = False) -> int:
    """Host bytes the target-signal cache takes for `sequences`: per token, `num_features` hidden states in the
    target's dtype, and with a teacher its top-k probabilities (float32), ids (int64) and, for the raw-logit term,
    logits (float32)."""
    hidden_size = target.get_input_embeddings().weight.shape[1]
    itemsize = next(target.parameters()).dtype.itemsize
    per_token = num_features * hidden_size * itemsize + (teacher_top_k or 0) * (4 + 8 + 4 * teacher_logits)
    return per_token * sum(len(input_ids) for input_ids, _ in sequences)


def check_feature_cache(cache_bytes: int, limit_gib: float | None) -> None:
    """Refuse a target-signal cache over `limit_gib` (None: over the host's available memory), before it is built."""
    limit = free_memory_bytes(torch.device("cpu")) if limit_gib is None else int(limit_gib * 2**30)
    if cache_bytes > limit:
        where = "the host's available memory" if limit_gib is None else "--cache-limit-gib"
        raise ValueError(f"The target feature cache would take {cache_bytes / 2**30:.2f} GiB in this process, over "
                         f"{where} ({limit / 2**30:.2f} GiB): drop --cache-target-features (the target then runs "
                         "per batch and memory stays bounded), or train on fewer or shorter sequences "
                         "(docs/training.md, 'Memory')")


def host_feature_cache(target: torch.nn.Module, sequences: Sequence[tuple[torch.Tensor, torch.Tensor]],
                       indices: list[int], num_features: int, settings: TrainingSettings,
                       signals_of: Callable[[torch.Tensor, torch.Tensor], TargetSignals],
                       progress: bool) -> dict[int, TargetSignals]:
    """The target's signals of the sequences at `indices` (those this process trains on), by index, on the host (the
    device holds one micro-batch's at a time); refused before the target runs when they would exceed
    `settings.cache_limit_gib` (`check_feature_cache`)."""
    from tqdm.auto import tqdm

    check_feature_cache(feature_cache_bytes(target, [sequences[i] for i in indices], num_features,
                                            settings.teacher_top_k if settings.distill else None,
                                            settings.logit_weight > 0), settings.cache_limit_gib)
    return {i: on_host(signals_of(*sequences[i]))
            for i in tqdm(indices, desc="target features", disable=not progress)}


def _sibling(folder: Path, suffix: str) -> Path:
    """`folder` with `suffix` added to its name, in the same parent (checkpoint -> checkpoint.tmp)."""
    return folder.with_name(folder.name + suffix)


def save_checkpoint(folder: str | Path, draft: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: LRScheduler, log: TrainingLog, run_facts: dict[str, Any] | None = None,
                    main_process: bool = True, keep: int = 1, sharded: bool = False) -> None:
    """Write draft weights, optimiser and schedule states and the log to `folder`, replacing it atomically.

    Every process of a run calls this. Whole (the default): the states are gathered (under FSDP, from the shards) and
    only `main_process` writes them, as safetensors. `sharded` (under FSDP): each process writes its own shards of
    the weights and the optimiser's tensors through torch.distributed.checkpoint (`save_sharded_state`), nothing is
    gathered, and the main process adds the rest. `run_facts` (`resume_facts`): what a resumed run must share with
    this one. `keep` > 1: the checkpoint `folder` held before is kept beside it as `<folder>-<its step>`, and only
    the `keep` - 1 newest of those stay."""
    folder = Path(folder)
    staging = _sibling(folder, ".tmp")
    if sharded:
        optimizer_rest = save_sharded_state(staging, draft, optimizer, main_process)
    else:
        weights, optimizer_state = whole_state(draft, optimizer)
    if not main_process:
        return
    if not sharded:
        optimizer_rest = save_whole_state(staging, weights, optimizer_state)
    (staging / OPTIMIZER_SCHEDULER_FILE).write_text(
        json.dumps({"optimizer": optimizer_rest, "scheduler": scheduler.state_dict()}))
    run = {} if run_facts is None else {"run": run_facts}
    (staging / STATE_FILE).write_text(json.dumps({"format": CHECKPOINT_FORMAT, "sharded": sharded, **run,
                                                  **asdict(log)}))
    replace_checkpoint(folder, staging, keep)


def save_whole_state(staging: Path, weights: dict[str, torch.Tensor], optimizer_state: dict[str, Any]
                     ) -> dict[str, Any]:
    """Write the whole weights and the optimiser's tensors (`whole_state`) into a new `staging` folder as
    safetensors; returns the rest of the optimiser's state (JSON-ready)."""
    shutil.rmtree(staging, ignore_errors=True)  # a stale one from a save that was interrupted
    staging.mkdir(parents=True)
    # save_file refuses tensors that share memory; the draft has none (its embeddings and head are the target's)
    weights = {name: tensor.detach().cpu().contiguous() for name, tensor in weights.items()}
    save_file(weights, staging / DRAFT_WEIGHTS_FILE, metadata={"format": "pt"})
    optimizer_tensors, optimizer_rest = split_optimizer_state(optimizer_state)
    save_file(optimizer_tensors, staging / OPTIMIZER_TENSORS_FILE, metadata={"format": "pt"})
    return optimizer_rest


def sharded_state(draft: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """({"model": the weights, "optimizer": the optimiser's per-parameter tensors}, the optimiser's param groups),
    each process's shards as they are (DTensors under FSDP; nothing gathered), keyed by parameter name
    (torch.distributed.checkpoint.state_dict's `get_state_dict`)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    weights, named = get_state_dict(draft, optimizer)
    return {"model": weights, "optimizer": named["state"]}, {"param_groups": named["param_groups"]}


def save_sharded_state(staging: Path, draft: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       main_process: bool) -> dict[str, Any]:
    """Every process writes its shards of the weights and the optimiser's tensors into a new `staging` folder as one
    safetensors file (`dcp.save` through `HuggingFaceStorageWriter(save_distributed=True)`: keys "model.<param>",
    "optimizer.<param>.<name>", each shard's offsets in the file's metadata; no index file, nothing pickled); a
    collective. Returns the optimiser's param groups (JSON-ready), which stay out of it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    check_fsdp_torch()
    if main_process:
        shutil.rmtree(staging, ignore_errors=True)  # a stale one from a save that was interrupted
        staging.mkdir(parents=True)
    dist.barrier()  # the folder is new before any process writes into it
    tensors, rest = sharded_state(draft, optimizer)
    dcp.save(tensors, storage_writer=dcp.HuggingFaceStorageWriter(str(staging), save_distributed=True))
    return rest


def load_sharded_state(folder: Path, draft: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       rest: dict[str, Any]) -> None:
    """Load a checkpoint `save_sharded_state` wrote into the draft and its optimiser: each process reads its own
    shards from the safetensors files (`dcp.load` through `HuggingFaceStorageReader`, which finds the shards from the
    files' own headers), then `set_state_dict`; a collective."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    check_fsdp_torch()
    tensors, _ = sharded_state(draft, optimizer)  # the shapes and shards to read into
    dcp.load(tensors, storage_reader=dcp.HuggingFaceStorageReader(str(folder)))
    set_state_dict(draft, optimizer, model_state_dict=tensors["model"],
                   optim_state_dict={"state": tensors["optimizer"], "param_groups": rest["param_groups"]})


def replace_checkpoint(folder: Path, staging: Path, keep: int) -> None:
    """Put the checkpoint written in `staging` in `folder`'s place; the one it replaces is kept as `<folder>-<its
    step>` when `keep` > 1, and only the `keep` - 1 newest of those stay (whole or sharded alike)."""
    previous = _sibling(folder, ".old")
    if folder.exists():  # a folder cannot replace a non-empty one: move it aside first
        shutil.rmtree(previous, ignore_errors=True)
        folder.replace(previous)
    staging.replace(folder)
    if keep > 1 and (previous / STATE_FILE).exists():
        earlier = _sibling(folder, f"-{json.loads((previous / STATE_FILE).read_text())['steps']}")
        shutil.rmtree(earlier, ignore_errors=True)
        previous.replace(earlier)
    shutil.rmtree(previous, ignore_errors=True)
    kept = kept_checkpoints(folder)
    for path in kept[:max(len(kept) - (keep - 1), 0)]:  # the oldest beyond `keep` in all
        shutil.rmtree(path)


def kept_checkpoints(folder: str | Path) -> list[Path]:
    """The earlier checkpoints kept beside `folder` (`<folder>-<step>`, `save_checkpoint(keep=...)`), oldest first."""
    folder = Path(folder)
    steps = {path: path.name[len(folder.name) + 1:] for path in folder.parent.glob(f"{folder.name}-*")}
    return sorted((path for path, step in steps.items() if step.isdigit()), key=lambda path: int(steps[path]))


def load_checkpoint(folder: str | Path, draft: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    scheduler: LRScheduler, run_facts: dict[str, Any] | None = None,
                    processes: int | None = None) -> TrainingLog | None:
    """Restore draft, optimiser and schedule from `folder` and return its log; None when there is no checkpoint.

    Every process of a run calls this: from a whole checkpoint, under FSDP each keeps its shard of the whole states;
    from a sharded one (`save_checkpoint(sharded=True)`), each reads its own shards. A checkpoint written on another
    number of `processes` or with other `run_facts` (`resume_facts`) is refused before anything is loaded."""
    folder = Path(folder)
    legacy = folder.parent / LEGACY_CHECKPOINT_FILE
    if legacy.exists():
        raise ValueError(f"{legacy} is an old pickle checkpoint that dflash-hf no longer loads: "
                         "delete it (or start a new --output) to retrain")
    if not (folder / STATE_FILE).exists():
        folder = _sibling(folder, ".old")  # a save interrupted between its two renames leaves only this one
        if not (folder / STATE_FILE).exists():
            return None
    state = json.loads((folder / STATE_FILE).read_text())
    checkpoint_format = state.pop("format", None)
    if checkpoint_format == 1:
        raise ValueError(f"{folder} is a checkpoint of an earlier dflash-hf whose optimiser state is a torch pickle "
                         f"file, which this version does not load: delete {folder} to restart the run (its draft "
                         f"weights, {DRAFT_WEIGHTS_FILE}, can seed a new one with --init-from)")
    if checkpoint_format != CHECKPOINT_FORMAT:
        raise ValueError(f"{folder / STATE_FILE}: unknown checkpoint format {checkpoint_format!r}, "
                         f"expected {CHECKPOINT_FORMAT}")
    if processes is not None:
        check_processes(folder, state.get("processes", 1), processes)
    check_run_facts(folder, state.pop("run", None), run_facts)
    optimizer_scheduler = json.loads((folder / OPTIMIZER_SCHEDULER_FILE).read_text())
    stored = optimizer_scheduler["optimizer"]
    if state.pop("sharded", False):
        load_sharded_state(folder, draft, optimizer, stored)
    else:
        positional = join_optimizer_state(load_file(folder / OPTIMIZER_TENSORS_FILE), stored, optimizer.state_dict())
        load_whole_state(draft, optimizer, load_file(folder / DRAFT_WEIGHTS_FILE),
                         named_optimizer_state(positional, stored.get("parameter_names") or parameter_names(draft)))
    scheduler.load_state_dict(optimizer_scheduler["scheduler"])
    return TrainingLog(**state)


# Settings a resumed run may change: they do not change what is trained (how often it is saved and how many
# checkpoints stay, how long a process waits in a collective, where the metrics are reported, where the target's
# signals are kept and how much host memory their cache may take, whether the layers' activations are recomputed).
# Any other difference (the batch size and the accumulation steps among them) changes the data, the schedule or the
# loss.
CHANGEABLE_ON_RESUME = ("checkpoint_every", "keep_checkpoints", "process_group_timeout_minutes", "report_to",
                        "cache_target", "cache_limit_gib", "gradient_checkpointing")


def resume_facts(settings: TrainingSettings, num_sequences: int) -> dict[str, Any]:
    """What a resumed run must share with the run that wrote the checkpoint: the settings (but
    CHANGEABLE_ON_RESUME) and the number of training sequences (the schedule's length depends on it)."""
    facts = {name: value for name, value in asdict(settings).items() if name not in CHANGEABLE_ON_RESUME}
    return {**facts, "sequences": num_sequences}


def check_run_facts(folder: Path, stored: dict[str, Any] | None, current: dict[str, Any] | None) -> None:
    """Refuse to resume `folder` when a fact both runs record differs (a checkpoint without facts: nothing to
    check)."""
    if stored is None or current is None:
        return
    changed = [f"{name} {stored[name]!r} there, {current[name]!r} here" for name in stored
               if name in current and stored[name] != current[name]]
    if changed:
        raise ValueError(f"{folder} was written by a run with other settings ({'; '.join(changed)}): a resumed run "
                         "must repeat them (the schedule, the data and the loss depend on them); pass the same "
                         "flags and prompts again, or start a new --output")


def check_processes(folder: Path, written_by: int, resumed_by: int) -> None:
    """Refuse to resume a checkpoint on another number of processes (the shards and the schedule would differ)."""
    if written_by != resumed_by:
        raise ValueError(f"{folder} was written by a run on {written_by} process(es), this one has {resumed_by}: "
                         f"the shards and the schedule differ; resume on {written_by} (accelerate launch "
                         f"--num_processes {written_by}, torchrun --nproc_per_node {written_by}), or start a new "
                         "--output")


def whole_state(draft: torch.nn.Module, optimizer: torch.optim.Optimizer
                ) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the draft's weights, the optimiser's state dict), whole and on the host; the optimiser's parameters keyed by
    position as in one process's `optimizer.state_dict()`, their names in `parameter_names`.

    torch.distributed.checkpoint gathers them: under FSDP every process holds a shard, so every process calls this
    (a collective) and the main process gets the values, the others empty dicts; one process or DDP: the
    state dicts as they are."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    weights = get_model_state_dict(draft, options=options)
    named = get_optimizer_state_dict(draft, optimizer, options=options)
    if not named:
        return weights, {}
    names = [name for group in named["param_groups"] for name in group["params"]]
    position = {name: index for index, name in enumerate(names)}
    return weights, {"state": {position[name]: values for name, values in named["state"].items()},
                     "param_groups": [{**group, "params": [position[name] for name in group["params"]]}
                                      for group in named["param_groups"]],
                     "parameter_names": names}


def named_optimizer_state(state_dict: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimiser state dict keyed by position (`optimizer.state_dict()`) keyed by the parameters' `names`."""
    return {"state": {names[position]: values for position, values in state_dict["state"].items()},
            "param_groups": [{**group, "params": [names[position] for position in group["params"]]}
                             for group in state_dict["param_groups"]]}


def parameter_names(draft: torch.nn.Module) -> list[str]:
    """The draft's parameter names in the optimiser's order (it was built on `draft.parameters()`)."""
    return [name for name, _ in draft.named_parameters()]


def load_whole_state(draft: torch.nn.Module, optimizer: torch.optim.Optimizer, weights: dict[str, torch.Tensor],
                     optimizer_state: dict[str, Any]) -> None:
    """Load whole weights and optimiser state (parameters keyed by name) into the draft and its optimiser; under FSDP
    each process keeps its shard."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True)
    set_model_state_dict(draft, weights, options=options)
    set_optimizer_state_dict(draft, optimizer, optimizer_state, options=options)


def split_optimizer_state(state_dict: dict[str, Any]) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """An optimiser's state dict as (its tensors keyed "<param>.<name>", everything else as JSON-ready values)."""
    tensors, rest = {}, {}
    for param, values in state_dict["state"].items():
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{param}.{name}"] = value.detach().cpu().contiguous()
            else:
                rest.setdefault(str(param), {})[name] = value
    others = {key: value for key, value in state_dict.items() if key not in ("state", "param_groups")}
    return tensors, {"state": rest, "param_groups": state_dict["param_groups"], **others}


def join_optimizer_state(tensors: dict[str, torch.Tensor], rest: dict[str, Any],
                         template: dict[str, Any]) -> dict[str, Any]:
    """Inverse of `split_optimizer_state`; `template` (the optimiser's own state dict) gives back tuples JSON lost."""
    state: dict[int, dict[str, Any]] = {int(param): dict(values) for param, values in rest["state"].items()}
    for key, tensor in tensors.items():
        param, name = key.split(".", 1)
        state.setdefault(int(param), {})[name] = tensor
    param_groups = [{name: tuple(value) if isinstance(template_group.get(name), tuple) else value
                     for name, value in group.items()}
                    for group, template_group in zip(rest["param_groups"], template["param_groups"], strict=True)]
    return {"state": dict(sorted(state.items())), "param_groups": param_groups}  # safetensors sorts keys as text


def _optimizer_and_schedule(draft: torch.nn.Module, settings: TrainingSettings,
                            total_steps: int) -> tuple[torch.optim.Optimizer, LRScheduler]:
    """AdamW over the draft's parameters and its cosine schedule with warm-up over `total_steps`."""
    optimizer = torch.optim.AdamW(draft.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay)
    warmup_steps = math.ceil(settings.warmup_ratio * total_steps)
    return optimizer, get_cosine_schedule_with_warmup(optimizer, warmup_steps, total_steps)


@dataclass
class StepTotals:
    """One optimiser step over all processes: the mean loss and the accuracy counts summed."""

    loss: float  # mean over the processes of each one's micro-batch loss
    correct: torch.Tensor  # [B-1]: correct argmax predictions per block position, on the host
    counted: torch.Tensor  # [B-1]: labels per block position, on the host
    leading_correct: float  # sum over blocks of correct predictions before the first miss
    blocks: int  # blocks of the step's sequences
    outside: float  # labels outside the draft's own vocabulary (0 without one)

    @staticmethod
    def combined(parts: list[StepTotals]) -> StepTotals:
        """The totals of an optimiser step from those of its micro-batches: the mean loss, the counts summed."""
        return StepTotals(sum(part.loss for part in parts) / len(parts), sum(part.correct for part in parts),
                          sum(part.counted for part in parts), sum(part.leading_correct for part in parts),
                          sum(part.blocks for part in parts), sum(part.outside for part in parts))


def step_totals(accelerator: Accelerator, result: StepResult) -> StepTotals:
    """`result` of this process's micro-batch summed with the other processes' (one all-reduce; none on one
    process)."""
    local = torch.cat([result.loss.detach().float().reshape(1), result.correct.float(), result.counted.float(),
                       torch.stack([result.leading_correct.float().sum(),
                                    torch.tensor(float(len(result.leading_correct)), device=result.loss.device),
                                    result.outside.float()])])
    total = accelerator.reduce(local, reduction="sum").cpu()  # [1 + 2 (B-1) + 3]
    positions = len(result.correct)
    return StepTotals(float(total[0] / accelerator.num_processes), total[1 : 1 + positions],
                      total[1 + positions : 1 + 2 * positions], float(total[-3]), int(total[-2]), float(total[-1]))


@dataclass
class StepUpdate:
    """What an optimiser step applied: its learning rate and the norm of the (averaged) gradients before clipping."""

    learning_rate: float
    grad_norm: float


class _Progress:
    """What a run shows as it goes: the main process's progress bar, and the trackers (`settings.report_to`, main
    process only) that get every step's metrics and every held-out evaluation."""

    def __init__(self, accelerator: Accelerator, settings: TrainingSettings, log: TrainingLog, total_steps: int,
                 shown: bool) -> None:
        from tqdm.auto import tqdm

        self.accelerator, self.reporting = accelerator, bool(settings.report_to)
        if self.reporting:
            accelerator.init_trackers(TRACKER_RUN, config=tracker_config(settings))
        self.bar = tqdm(total=total_steps, initial=log.steps, disable=not shown, desc="training", unit="step")
        self.started, self.tokens = time.perf_counter(), log.tokens  # tok/s: of the steps this call runs

    def step(self, log: TrainingLog, text: str) -> None:
        """Show the step `log` just recorded (`text`: its loss and accuracy)."""
        tokens_per_second = (log.tokens - self.tokens) / (time.perf_counter() - self.started)
        self.bar.set_postfix_str(f"{text}, {tokens_per_second:,.0f} tok/s")
        self.bar.update(1)
        if self.reporting:
            self.accelerator.log(step_metrics(log, tokens_per_second), step=log.steps)

    def evaluation(self, results: dict[str, Any], step: int) -> None:
        """Report an evaluation's `results` at `step`: its numbers as held_out/<name>, a list's items as
        held_out/<name>_<k> (k from 1)."""
        if self.reporting:
            numbers = {f"held_out/{name}": value for name, value in results.items()
                       if name != "step" and isinstance(value, (int, float))}
            for name, values in results.items():
                if isinstance(values, list):
                    numbers.update((f"held_out/{name}_{k}", value) for k, value in enumerate(values, 1))
            self.accelerator.log(numbers, step=step)

    def close(self) -> None:
        """Close the bar, and the trackers' files (not through `end_training`, which would end the process group)."""
        self.bar.close()
        for tracker in self.accelerator.trackers:
            tracker.finish()


class _EpochAccuracy:
    """Per-position accuracy and block tau of the current epoch, accumulated step by step, and with `own_vocabulary`
    (a draft with its own LM head) the fraction of labels outside its vocabulary."""

    def __init__(self, block_size: int, own_vocabulary: bool) -> None:
        self.correct = torch.zeros(block_size - 1)  # [B-1]: correct argmax predictions per block position
        self.counted = torch.zeros(block_size - 1)  # [B-1]: labels per block position
        self.leading_correct, self.blocks, self.outside = 0.0, 0, 0.0
        self.own_vocabulary = own_vocabulary

    def record(self, totals: StepTotals, update: StepUpdate, log: TrainingLog) -> str:
        """Log one finished step (count, loss, learning rate, gradient norm, the epoch's accuracy so far) and return
        the progress-bar text."""
        log.steps += 1
        log.losses.append(totals.loss)
        log.learning_rates.append(update.learning_rate)
        log.grad_norms.append(update.grad_norm)
        self.correct += totals.correct
        self.counted += totals.counted
        self.leading_correct += totals.leading_correct
        self.blocks += totals.blocks
        log.position_accuracy = (self.correct / self.counted.clamp(min=1)).tolist()
        log.block_tau = 1.0 + self.leading_correct / max(self.blocks, 1)
        accuracy = " ".join(f"{a:.2f}" for a in log.position_accuracy[:4])
        text = (f"loss {log.losses[-1]:.3f} grad norm {update.grad_norm:.2f} acc@1..4 {accuracy} "
                f"block tau {log.block_tau:.2f}")
        if not self.own_vocabulary:
            return text
        self.outside += totals.outside
        log.outside_vocabulary = self.outside / max(float(self.counted.sum()), 1.0)
        return f"{text} outside vocab {log.outside_vocabulary:.1%}"


def _micro_batch_step(accelerator: Any, draft: torch.nn.Module, target: torch.nn.Module,
                      batch: list[tuple[torch.Tensor, torch.Tensor, TargetSignals]], optimization: tuple[Any, Any],
                      settings: TrainingSettings, micro_step: int) -> tuple[StepResult, StepUpdate | None]:
    """The loss on one micro-batch (input ids, loss mask, target signals per sequence, packed into one row) under the
    settings' autocast and its backward, inside Accelerate's accumulation; on the micro-batch that completes an
    optimiser step, the clipped step of the optimiser and the schedule. The loss's result and the step's update
    (None while accumulating)."""
    optimizer, scheduler = optimization
    dtype = autocast_dtype(settings.mixed_precision, accelerator.device)
    with accelerator.accumulate(draft):
        with torch.autocast(accelerator.device.type, dtype=dtype, enabled=dtype is not None):
            result = packed_dflash_loss(draft, target, [(ids, mask) for ids, mask, _ in batch], settings.num_anchors,
                                        torch.Generator().manual_seed(
                                            anchor_seed(settings.seed, accelerator.process_index, micro_step)),
                                        [signals for _, _, signals in batch], loss_weights=settings.loss_weights)
        accelerator.backward(result.loss)  # divided by the accumulation steps: the step sees their mean
        if not accelerator.sync_gradients:
            return result, None
        learning_rate = scheduler.get_last_lr()[0]
        grad_norm = accelerator.clip_grad_norm_(draft.parameters(), settings.max_grad_norm)  # the averaged gradients'
        optimizer.step()
        scheduler.step()  # once per optimiser step, whatever the number of processes (not handed to Accelerate)
        optimizer.zero_grad()
    return result, StepUpdate(learning_rate, float(grad_norm))


def _micro_batches(sequences: Sequence[tuple[torch.Tensor, torch.Tensor]], batches: list[list[int]],
                   device: torch.device, cached: dict[int, TargetSignals] | None,
                   signals_of: Callable[[torch.Tensor, torch.Tensor], TargetSignals]
                   ) -> Iterator[list[tuple[torch.Tensor, torch.Tensor, TargetSignals]]]:
    """The micro-batches of one optimiser step, one at a time: the `sequences` at each of `batches`' indices, on
    `device`, with their target signals (from the host cache, or `signals_of` computes them now)."""
    for indices in batches:
        batch = []
        for index in indices:
            input_ids, loss_mask = (t.to(device) for t in sequences[index])
            signals = cached[index] if cached is not None else signals_of(input_ids, loss_mask)
            batch.append((input_ids, loss_mask, signals.to(device, non_blocking=True)))
        yield batch


def _accumulated_step(accelerator: Any, draft: torch.nn.Module, target: torch.nn.Module,
                      micro_batches: Iterator[list[tuple[torch.Tensor, torch.Tensor, TargetSignals]]],
                      optimization: tuple[Any, Any], settings: TrainingSettings, step: int
                      ) -> tuple[StepTotals, StepUpdate]:
    """Optimiser step `step` over its micro-batches (`_micro_batch_step`; the last one steps): its totals over all
    processes and its update."""
    parts, update = [], None
    for micro, batch in enumerate(micro_batches):
        result, update = _micro_batch_step(accelerator, draft, target, batch, optimization, settings,
                                           step * settings.gradient_accumulation_steps + micro)
        parts.append(step_totals(accelerator, result))
    return StepTotals.combined(parts), update


def train_draft(
    draft: DFlashDraftModel,
    target: torch.nn.Module,
    rows: list[dict] | SequenceStore,
    settings: TrainingSettings,
    output_dir: str | Path,
    progress: bool = True,
    max_steps: int | None = None,
    evaluate: Callable[[DFlashDraftModel], dict[str, Any]] | None = None,
    eval_every: int = 0,
    held_out_rows: list[dict] | SequenceStore | None = None,
    held_out_every: int = 0,
) -> TrainingLog:
    """Train `draft` on the target's regenerated rows; resumes from `output_dir/checkpoint/` if present.

    `rows` and `held_out_rows`: row dicts (`row_tokens`), or a `SequenceStore` every process memory-maps (what
    `dflash-hf train` passes: each step reads only its own sequences). `max_steps` stops early (the schedule still
    spans all epochs), e.g. to interrupt a run on purpose. Under `accelerate launch` / `torchrun` every process calls
    this with the same rows: each epoch is one shuffle of all of them, strided over the processes (`epoch_order`, as
    `DistributedSampler`), an optimiser step is `settings.sequences_per_step` sequences per process (the epoch wrapped
    round to whole steps), each process draws its own anchors (`anchor_seed`), and only the main process writes
    `output_dir` (under FSDP each process writes its own checkpoint shards); all return the same log once it is
    written. Under Accelerate's FSDP a copy of the draft is sharded over the processes and the trained weights are
    gathered back into `draft` at the end. `evaluate(draft)` (held-out tau and losslessness; JSON-ready values) runs on
    every process (each its share of the prompts, `record_evaluation`) before the first step, every `eval_every`
    optimiser steps and after the last; its results go to every process's `log.evaluations`. `held_out_rows` (never
    trained on): every process computes its share of their training loss (`held_out_loss`) at the same steps, every
    `held_out_every` steps, into `log.held_out_losses`."""
    from accelerate import Accelerator
    from accelerate.utils import DistributedType

    check_trackers(settings.report_to)
    check_held_out(held_out_rows, held_out_every)
    output_dir = Path(output_dir)
    accelerator = Accelerator(cpu=not torch.cuda.is_available(),
                              gradient_accumulation_steps=settings.gradient_accumulation_steps,
                              kwargs_handlers=process_group_kwargs(settings.process_group_timeout_minutes),
                              log_with=settings.report_to or None,
                              project_dir=output_dir / TRACKER_DIR if settings.report_to else None)
    check_fsdp_applies(accelerator.state)
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
    requested = settings  # "auto" precision is decided once, here, at the draft's width (a resume compares requests)
    settings = replace(settings, mixed_precision="no" if autocast_dtype(
        settings.mixed_precision, accelerator.device, draft.config.hidden_size) is None else "bf16")
    target.requires_grad_(False).to(accelerator.device)
    sequences = training_sequences(rows, settings.max_length)
    held_out_sequences = training_sequences(held_out_rows or [], settings.max_length)
    rank, processes = accelerator.process_index, accelerator.num_processes
    plan = training_plan(sequences, processes, settings)
    total_steps = plan.total_steps(settings.epochs)
    draft.train()
    sharded = accelerator.distributed_type == DistributedType.FSDP
    model = training_module(accelerator, draft, settings, sharded)
    optimizer, scheduler = _optimizer_and_schedule(model, settings, total_steps)
    model, prepared_optimizer = accelerator.prepare(model, optimizer)  # not the scheduler: Accelerate's steps it
    unwrapped = accelerator.unwrap_model(model)                        # once per process
    checkpoint_dir, facts = output_dir / CHECKPOINT_DIR, resume_facts(requested, len(sequences))
    log = load_checkpoint(checkpoint_dir, unwrapped, optimizer, scheduler, facts,
                          accelerator.num_processes) or TrainingLog(processes=accelerator.num_processes)
    started, last = (time.perf_counter() - log.seconds,
                     total_steps if max_steps is None else min(total_steps, max_steps))

    def signals_of(input_ids: torch.Tensor, loss_mask: torch.Tensor) -> TargetSignals:
        return target_signals(target, input_ids.to(accelerator.device), draft.target_layer_ids,
                              settings.teacher_top_k if settings.distill else None, teacher_rows(loss_mask),
                              keep_logits=settings.logit_weight > 0)

    def held_out(first: bool = False) -> None:  # the held-out measurements due now (`first`: before training)
        if evaluate is not None and (first or _due(log.steps, eval_every, last)):
            record_evaluation(accelerator, model if sharded else None, draft, evaluate, log)
            shows.evaluation(log.evaluations[-1], log.steps)
        if held_out_sequences and (first or _due(log.steps, held_out_every, last)):  # every process: its share
            log.held_out_losses.append({"step": log.steps, **held_out_loss(
                accelerator, model, target, held_out_sequences, settings, signals_of)})
            shows.evaluation(log.held_out_losses[-1], log.steps)

    shown = progress and accelerator.is_main_process  # one progress bar, the main process's
    cached = (host_feature_cache(target, sequences, plan.process_items(log.steps, last, rank),
                                 len(draft.target_layer_ids), settings, signals_of, shown)
              if settings.cache_target and log.steps < last else None)
    shows = _Progress(accelerator, settings, log, total_steps, shown)
    if log.steps == 0 and last > 0:
        held_out(first=True)  # the draft before training: the baseline of the curve
    own_vocabulary = draft.lm_head is not None  # its own LM head: log the labels outside its vocabulary
    accuracy_epoch, accuracy = -1, _EpochAccuracy(draft.block_size, own_vocabulary)
    while log.steps < last:
        if plan.epoch_of(log.steps) != accuracy_epoch:  # a new (or resumed) epoch: fresh accuracy counts
            accuracy_epoch = plan.epoch_of(log.steps)
            accuracy = _EpochAccuracy(draft.block_size, own_vocabulary)
        step_items = plan.step_items(log.steps)  # every process's sequences of the step
        micro_batches = _micro_batches(sequences, plan.micro_batches(log.steps, rank), accelerator.device, cached,
                                       signals_of)
        totals, update = _accumulated_step(accelerator, model, target, micro_batches,
                                           (prepared_optimizer, scheduler), settings, log.steps)
        text = accuracy.record(totals, update, log)
        log.tokens += sum(len(sequences[i][0]) for i in step_items)
        shows.step(log, text)
        held_out()
        if log.steps % settings.checkpoint_every == 0 or log.steps == last:
            log.seconds = time.perf_counter() - started
            save_checkpoint(checkpoint_dir, unwrapped, optimizer, scheduler, log, facts, accelerator.is_main_process,
                            settings.keep_checkpoints, sharded=sharded)
    shows.close()
    log.seconds = time.perf_counter() - started
    activation_checkpointing(draft, False)  # the draft leaves with its layers' activations kept, as usual
    if sharded:  # every process's `draft` gets the trained weights, gathered from the shards
        draft.load_state_dict(whole_weights(model, every_process=True))
        draft.to(accelerator.device)
    draft.eval()
    if accelerator.is_main_process:
        (output_dir / "training_log.json").write_text(json.dumps({"settings": asdict(settings), **asdict(log)}))
    accelerator.wait_for_everyone()  # no process leaves before the log and the last checkpoint are written
    return log


def training_module(accelerator: Accelerator, draft: DFlashDraftModel, settings: TrainingSettings,
                    sharded: bool) -> DFlashDraftModel:
    """The module that trains, before `prepare`: `draft` itself, or under FSDP a copy (FSDP shards its module in
    place: `draft` stays whole) with the FSDP plugin given the precision of the autocast dtype (`fsdp_precision`:
    float32 shards, gathered and computed in bf16 under bf16); its layers checkpointed if the settings say so."""
    model = copy.deepcopy(draft) if sharded else draft
    if sharded:
        fsdp_precision(accelerator, autocast_dtype(settings.mixed_precision, accelerator.device))
    activation_checkpointing(model, settings.gradient_checkpointing)
    return model


def activation_checkpointing(model: DFlashDraftModel, enabled: bool) -> None:
    """Switch activation checkpointing of the draft's layers on or off (Transformers' `GradientCheckpointingLayer`,
    through torch's non-reentrant `checkpoint`): in training, each layer then keeps only its inputs for the backward,
    which recomputes its activations (one more forward of the layers). Transformers 5 names the switch
    `activation_checkpointing_enable` (`gradient_checkpointing_enable` is its deprecated alias), 4.57 only the
    latter."""
    if enabled:
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable({"use_reentrant": False})
    else:
        (getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable)()


def check_held_out(rows: list[dict] | SequenceStore | None, every: int) -> None:
    """Refuse held-out rows without a number of steps between their measurements."""
    if rows and every < 1:
        raise ValueError(f"held_out_every {every}: held-out rows are measured every N >= 1 optimiser steps")


def _due(step: int, every: int, last: int) -> bool:
    """Whether a measurement taken every `every` optimiser steps (0: never) and after the last is due at `step`."""
    return every > 0 and (step % every == 0 or step == last)


def whole_weights(model: torch.nn.Module, every_process: bool) -> dict[str, torch.Tensor]:
    """The draft's whole weights gathered from FSDP's shards (a collective: every process calls it): on every process,
    on its device; or (`every_process` False) on the main process only, on the host (the others get an empty
    dict)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=not every_process))


def record_evaluation(accelerator: Accelerator, sharded_model: torch.nn.Module | None, draft: DFlashDraftModel,
                      evaluate: Callable[[DFlashDraftModel], dict[str, Any]], log: TrainingLog) -> None:
    """Evaluate the whole draft on every process and append `{"step", **results}` to its log: `evaluate` measures
    this process's share of the prompts and combines the shares (a collective: `dflash-hf train`'s
    `command.held_out_evaluation`), so no process waits while another evaluates them all. Under FSDP
    (`sharded_model`) every process first gathers the shards into its `draft`."""
    if sharded_model is not None:
        draft.load_state_dict(whole_weights(sharded_model, every_process=True))
    draft.eval()
    with torch.no_grad():
        results = evaluate(draft)
    draft.train()
    log.evaluations.append({"step": log.steps, **results})
