"""The training loop: AdamW, cosine schedule with warm-up, gradient clipping, resumable checkpoints.

One sequence per optimiser step, many anchors per sequence (design doc section 4). Runs as is on
one CPU or GPU and data-parallel under `accelerate launch` (Accelerate is the distributed engine).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import get_cosine_schedule_with_warmup

from ..modeling_dflash import DFlashDraftModel
from .objective import TargetSignals, dflash_loss, target_signals

CHECKPOINT_FILE = "checkpoint.pt"


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
    distill: bool = False  # soft labels: the target's top-k next-token distribution
    teacher_top_k: int = 32
    cache_target: bool = True  # run the target once per sequence, not once per epoch
    seed: int = 0
    checkpoint_every: int = 200  # optimiser steps between resumable checkpoints


@dataclass
class TrainingLog:
    """What a run did: per-step loss, per-position accuracy of the last epoch, steps and seconds."""

    losses: list[float] = field(default_factory=list)
    position_accuracy: list[float] = field(default_factory=list)
    block_tau: float = 0.0  # last epoch: 1 + mean correct predictions before the first miss (greedy tau estimate)
    steps: int = 0
    seconds: float = 0.0


def training_sequences(rows: list[dict], max_length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input_ids [T], loss_mask [T]) per generated row; only response tokens count in the loss."""
    sequences = []
    for row in rows:
        ids = (row["prompt_ids"] + row["response_ids"])[:max_length]
        mask = ([0] * len(row["prompt_ids"]) + [1] * len(row["response_ids"]))[:max_length]
        if sum(mask[1:]) > 0:
            sequences.append((torch.tensor(ids), torch.tensor(mask)))
    return sequences


def _epoch_order(num_sequences: int, epoch: int, seed: int) -> list[int]:
    return torch.randperm(num_sequences, generator=torch.Generator().manual_seed(seed * 1000 + epoch)).tolist()


def train_draft(
    draft: DFlashDraftModel,
    target: torch.nn.Module,
    rows: list[dict],
    settings: TrainingSettings,
    output_dir: str | Path,
    progress: bool = True,
    max_steps: int | None = None,
) -> TrainingLog:
    """Train `draft` on the target's regenerated rows; resumes from `output_dir/checkpoint.pt` if present.

    `max_steps` stops early (the schedule still spans all epochs), e.g. to interrupt a run on purpose.
    """
    from accelerate import Accelerator
    from tqdm.auto import tqdm

    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    target.requires_grad_(False)
    target.to(accelerator.device)
    sequences = training_sequences(rows, settings.max_length)
    shard = sequences[accelerator.process_index :: accelerator.num_processes]
    steps_per_epoch = len(shard)
    total_steps = steps_per_epoch * settings.epochs
    draft.train()
    optimizer = torch.optim.AdamW(draft.parameters(), lr=settings.learning_rate, weight_decay=settings.weight_decay)
    scheduler = get_cosine_schedule_with_warmup(optimizer, math.ceil(settings.warmup_ratio * total_steps), total_steps)
    draft, optimizer, scheduler = accelerator.prepare(draft, optimizer, scheduler)

    log = TrainingLog()
    checkpoint_path = output_dir / CHECKPOINT_FILE
    if checkpoint_path.exists():
        state = torch.load(checkpoint_path, map_location="cpu", weights_only=False)
        accelerator.unwrap_model(draft).load_state_dict(state["draft"])
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        log = TrainingLog(**state["log"])
    started = time.perf_counter() - log.seconds

    def save_checkpoint() -> None:
        log.seconds = time.perf_counter() - started
        if accelerator.is_main_process:
            state = {"draft": accelerator.unwrap_model(draft).state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "log": asdict(log)}
            torch.save(state, checkpoint_path.with_suffix(".tmp"))
            checkpoint_path.with_suffix(".tmp").replace(checkpoint_path)

    last = total_steps if max_steps is None else min(total_steps, max_steps)
    layer_ids = accelerator.unwrap_model(draft).target_layer_ids
    top_k = settings.teacher_top_k if settings.distill else None

    def signals_of(input_ids: torch.Tensor) -> TargetSignals:
        return target_signals(target, input_ids.to(accelerator.device), layer_ids, top_k)

    cached: list[TargetSignals] | None = None
    if settings.cache_target and log.steps < last:
        cached = [signals_of(ids) for ids, _ in tqdm(shard, desc="target features", disable=not progress)]
    bar = tqdm(total=total_steps, initial=log.steps, disable=not (progress and accelerator.is_main_process), desc="training")
    block_size = accelerator.unwrap_model(draft).block_size
    correct, counted = torch.zeros(block_size - 1), torch.zeros(block_size - 1)
    leading_correct, blocks = 0.0, 0
    order_epoch, order = -1, []
    while log.steps < last:
        epoch, index = divmod(log.steps, steps_per_epoch)
        if epoch != order_epoch:  # a new (or resumed) epoch: its order, fresh accuracy counts
            order_epoch, order = epoch, _epoch_order(steps_per_epoch, epoch, settings.seed)
            correct.zero_()
            counted.zero_()
            leading_correct, blocks = 0.0, 0
        sequence = order[index]
        input_ids, loss_mask = (t.to(accelerator.device) for t in shard[sequence])
        anchors_generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + log.steps)
        signals = cached[sequence] if cached is not None else signals_of(input_ids)
        result = dflash_loss(draft, target, input_ids, loss_mask, settings.num_anchors, anchors_generator, signals)
        optimizer.zero_grad()
        accelerator.backward(result.loss)
        accelerator.clip_grad_norm_(draft.parameters(), settings.max_grad_norm)
        optimizer.step()
        scheduler.step()
        log.steps += 1
        log.losses.append(float(result.loss.detach()))
        correct += result.correct.cpu()
        counted += result.counted.cpu()
        log.position_accuracy = (correct / counted.clamp(min=1)).tolist()
        leading_correct += float(result.leading_correct.sum())
        blocks += len(result.leading_correct)
        log.block_tau = 1.0 + leading_correct / max(blocks, 1)
        accuracy = " ".join(f"{a:.2f}" for a in log.position_accuracy[:4])
        bar.set_postfix_str(f"loss {log.losses[-1]:.3f} acc@1..4 {accuracy} block tau {log.block_tau:.2f}")
        bar.update(1)
        if log.steps % settings.checkpoint_every == 0 or log.steps == last:
            save_checkpoint()
    bar.close()
    log.seconds = time.perf_counter() - started
    draft = accelerator.unwrap_model(draft)
    draft.eval()
    (output_dir / "training_log.json").write_text(json.dumps({"settings": asdict(settings), **asdict(log)}))
    return log
