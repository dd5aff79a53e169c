"""What a training run will cost, computed before any model loads (`dflash-hf train --plan`), and the intervals of
checkpoints and held-out measurements given by steps, by a fraction of the run or by time.

The cost model (docs/training.md, "The cost of a run"): a sequence costs the draft's training step (`step_flops`,
dense training mask: an upper bound of the block-sparse one) plus, with `--gradient-checkpointing`, one more forward
of the draft's layers, plus the frozen target's forward for its features (2 x its parameters x tokens); a GPU runs
them at UTILISATION of its dense bf16 peak (`GPUS`). Every sequence is taken at `--max-length` tokens (the answers'
lengths are not known before they are generated), so the times are upper bounds. Checkpoints, the held-out loss
(`--held-out-every`) and the decode evaluation (`--eval-every`) are priced on the same terms; the plan says when they
take more than OVERHEAD_LIMIT of the training time.
"""

from __future__ import annotations

import copy
import math
import os
import re
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..configuration_dflash import DFlashConfig
from ..loading import SMOLLM2, SMOLLM2_HUB_ID
from ..modeling_dflash import DFlashDraftModel
from ..synthetic import TARGET_CONFIGS
from .objective import LOSS_CHUNK_ROWS
from .recipe import DEFAULT_DRAFT_BLOCK_SIZE, DEFAULT_DRAFT_LAYERS, draft_config_for
from .trainer import training_plan, training_sequences


@dataclass(frozen=True)
class GpuSpec:
    """What the cost model reads of a GPU."""

    name: str
    bf16_flops: float  # dense bf16 peak, FLOP/s
    memory_bytes: float
    bandwidth: float  # HBM bytes/s


GPUS = {  # the vendors' data sheets (SXM parts)
    "h100": GpuSpec("H100 SXM 80GB", 989e12, 80e9, 3.35e12),
    "h200": GpuSpec("H200 SXM 141GB", 989e12, 141e9, 4.8e12),
    "a100": GpuSpec("A100 SXM 80GB", 312e12, 80e9, 2.0e12),
}
UTILISATION = 0.40  # share of the dense bf16 peak a training step reaches (assumed, not measured)
CHECKPOINT_BYTES_PER_SECOND = 1e9  # what one process writes to the output folder per second (assumed)
# Decoding one token eagerly at batch 1 is launch-bound on a GPU: about this long per decoder layer (assumed: some 15
# kernels of ~40 us), or the weights' read time where that is longer
EAGER_SECONDS_PER_LAYER = 6e-4
EVALUATION_TAU = 3.0  # tokens a draft in training commits per verify step (assumed; a trained one does better)
DRAFT_PASS_SHARE = 0.2  # a draft pass's time against a target forward's (assumed)
OVERHEAD_LIMIT = 0.05  # checkpoints and held-out measurements above this share of the training time are called out
# activations autograd keeps per draft layer, float32, at hidden 4096 (scripts/training_step_cost.py measured 7.3 MB
# per anchor of 16 block rows and 44 MB per 256 context tokens): floats per hidden unit of each block row / context
# token
SAVED_FLOATS_PER_BLOCK_ROW = 7.3e6 / (16 * 4096 * 4)
SAVED_FLOATS_PER_CONTEXT_TOKEN = 44e6 / (256 * 4096 * 4)
DEFAULT_CHECKPOINT_EVERY = "2%"  # --checkpoint-every: 50 checkpoints in a run, whatever its length

INTERVAL = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(%|s|m|h|)\s*$")
SECONDS = {"s": 1, "m": 60, "h": 3600}


@dataclass(frozen=True)
class Interval:
    """How often something happens in a run: every `value` optimiser steps (`unit` ""), every `value` % of the run's
    steps ("%"), or every `value` seconds, minutes or hours of training ("s", "m", "h")."""

    value: float
    unit: str

    def __str__(self) -> str:
        return f"{self.value:g}{self.unit}"


def parse_interval(text: str, flag: str) -> Interval:
    """`--checkpoint-every` / `--held-out-every` / `--eval-every`'s value: N steps, P% of the run, or a time (30m,
    2h, 90s); 0 is never (where the flag allows it). A ValueError names the forms."""
    match = INTERVAL.match(str(text))
    if match is None or (match.group(2) == "" and not float(match.group(1)).is_integer()):
        raise ValueError(f"{flag} {text}: expected optimiser steps (500), a share of the run (5%) or a time of "
                         "training (30m, 2h, 90s)")
    value, unit = float(match.group(1)), match.group(2)
    if unit == "%" and value > 100:
        raise ValueError(f"{flag} {text}: a share of the run is at most 100%")
    return Interval(value, unit)


def interval_steps(interval: Interval, total_steps: int, step_seconds: float | None, flag: str) -> int:
    """Optimiser steps between two events of `interval` in a run of `total_steps` whose steps take `step_seconds`
    (the plan's estimate; None where no GPU of `GPUS` runs it): at least 1, or 0 for an interval of 0 (never)."""
    if interval.value == 0:
        return 0
    if interval.unit == "":
        return int(interval.value)
    if interval.unit == "%":
        return max(1, math.ceil(total_steps * interval.value / 100))
    if step_seconds is None:
        raise ValueError(f"{flag} {interval}: a time needs the step time of a GPU the cost model knows "
                         f"({', '.join(GPUS)}); give optimiser steps or a share of the run (5%) instead")
    return max(1, round(interval.value * SECONDS[interval.unit] / step_seconds))


def events(every: int, total_steps: int, before_and_after: bool) -> int:
    """How often an event every `every` steps (0: never) happens in `total_steps` steps: at each multiple, after the
    last step, and (`before_and_after`) also before the first."""
    if every <= 0 or total_steps <= 0:
        return 0
    return total_steps // every + (total_steps % every != 0) + before_and_after


def step_flops(config: Any, layers: int, anchors: int, tokens: int) -> float:
    """FLOPs of one draft training step (forward, backward) on a sequence of `tokens` whose every position may anchor
    (a DFlashConfig `config`): R = anchors x B block rows attend to T context rows and their own block under a dense
    mask; the LM head runs on the anchors x (B - 1) supervised rows three times (forward, checkpoint recompute, input
    gradient: it is frozen); trained layers and `fc` three times their forward (forward, input and weight gradients;
    `fc` has no input gradient: two). scripts/training_step_cost.py checks it against torch's FLOP counter."""
    hidden, block = config.hidden_size, config.block_size
    rows, supervised = anchors * block, anchors * (block - 1)
    fc = 2 * tokens * len(config.dflash_config["target_layer_ids"]) * hidden * hidden
    head = 2 * supervised * hidden * config.vocab_size
    return 2 * fc + 3 * layers * layer_forward_flops(config, rows, tokens) + 3 * head


def layer_forward_flops(config: Any, rows: int, tokens: int) -> float:
    """FLOPs of one draft layer's forward over `rows` block rows that attend to `tokens` context rows (dense)."""
    hidden, heads = config.hidden_size, config.num_attention_heads
    kv_heads, head_dim = config.num_key_value_heads, config.head_dim
    projections = 2 * rows * hidden * heads * head_dim * 2 + 2 * (rows + tokens) * hidden * kv_heads * head_dim * 2
    attention = 2 * 2 * rows * (tokens + rows) * heads * head_dim
    return projections + attention + 2 * rows * 3 * hidden * config.intermediate_size


def target_config(name: str) -> Any:
    """The decoder config of the target `name` without loading it: a known target's shipped config.json (by the last
    part of its Hub id, e.g. Qwen/Qwen3-8B), else Transformers' `AutoConfig` (a folder, or the Hub)."""
    hub_id = SMOLLM2_HUB_ID if name == SMOLLM2 else name
    shipped = TARGET_CONFIGS / f"{hub_id.rstrip('/').split('/')[-1]}.json"
    config = AutoConfig.from_pretrained(str(shipped) if shipped.is_file() else hub_id)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def model_shapes(name: str, draft_layers: int, block_size: int, target_layer_ids: list[int] | None,
                 draft_vocab_size: int | None, init_from: str | None = None) -> tuple[Any, int, Any, int]:
    """(the target's decoder config, its parameters, the draft's config, the draft's trained parameters): both built
    on the meta device, so nothing is allocated or loaded; the draft shaped like the target by these settings, or
    `init_from`'s (a trained draft's folder or Hub id: its config only)."""
    config = target_config(name)
    with torch.device("meta"):
        target = AutoModelForCausalLM.from_config(config)
        draft_config = DFlashConfig.from_pretrained(init_from) if init_from else draft_config_for(
            target, draft_layers, block_size, 0, target_layer_ids, draft_vocab_size=draft_vocab_size)
        draft = DFlashDraftModel(draft_config)
    count = sum(p.numel() for p in target.parameters())
    trained = sum(p.numel() for p in draft.parameters() if p.requires_grad)
    return config, count, draft_config, trained


@dataclass(frozen=True)
class RunInputs:
    """What the plan reads of a `train` command."""

    sequences: int  # training sequences (after --held-out-rows)
    tokens: int  # tokens per sequence (--max-length: an upper bound)
    epochs: int
    processes: int
    gpu: GpuSpec
    anchors: int
    per_process: float  # sequences each process trains on per optimiser step
    per_micro_batch: float  # sequences packed into one micro-batch (trained together)
    gradient_checkpointing: bool
    checkpoint_every: Interval
    held_out_rows: int
    held_out_every: Interval
    num_eval: int
    eval_every: Interval
    eval_max_new_tokens: int


@dataclass(frozen=True)
class RunPlan:
    """The cost of a run (`plan_run`): counts, bytes and seconds."""

    steps: int
    tokens: float
    step_seconds: float
    training_seconds: float
    checkpoint_every: int
    checkpoints: int
    checkpoint_bytes: float  # one checkpoint: the draft's float32 weights and AdamW's two moments
    checkpoint_seconds: float  # all of them (each written whole by the main process: an upper bound)
    held_out_every: int
    held_out_measurements: int
    held_out_seconds: float
    eval_every: int
    evaluations: int  # during training, sharded over the processes
    evaluation_seconds: float  # those and the one after training on the main process
    memory: dict[str, dict[str, float]]  # bytes per GPU: {"fsdp" | "data-parallel": {part: bytes}}

    @property
    def overhead(self) -> float:
        """Checkpoints and held-out measurements' share of the training time."""
        return (self.checkpoint_seconds + self.held_out_seconds + self.evaluation_seconds) / self.training_seconds


def plan_run(run: RunInputs, target: Any, target_parameters: int, draft: Any, draft_parameters: int) -> RunPlan:
    """The cost of `run` for a target of this decoder config and parameter count and a draft of this DFlashConfig and
    trained parameter count (docs/training.md, "The cost of a run")."""
    gpu, tokens, layers = run.gpu, run.tokens, draft.num_hidden_layers
    anchors = min(run.anchors, max(tokens - 1, 1))
    rate = UTILISATION * gpu.bf16_flops
    target_forward = 2 * target_parameters * tokens
    recompute = layers * layer_forward_flops(draft, anchors * draft.block_size, tokens) if \
        run.gradient_checkpointing else 0.0
    sequence_seconds = (step_flops(draft, layers, anchors, tokens) + recompute + target_forward) / rate
    steps = run.epochs * math.ceil(math.ceil(run.sequences / run.processes) / run.per_process)
    step_seconds = sequence_seconds * run.per_process
    checkpoint_every = interval_steps(run.checkpoint_every, steps, step_seconds, "--checkpoint-every")
    held_out_every = interval_steps(run.held_out_every, steps, step_seconds, "--held-out-every")
    eval_every = interval_steps(run.eval_every, steps, step_seconds, "--eval-every")
    checkpoint_bytes = 12.0 * draft_parameters
    checkpoints = events(checkpoint_every, steps, before_and_after=False)
    held_out = events(held_out_every, steps, before_and_after=True) if run.held_out_rows else 0
    row_seconds = (target_forward + step_flops(draft, layers, anchors, tokens) / 3) / rate  # forwards only
    forward = max(layers_of(target) * EAGER_SECONDS_PER_LAYER, 2 * target_parameters / gpu.bandwidth)
    prompt_seconds = run.eval_max_new_tokens * forward * (1 + (1 + DRAFT_PASS_SHARE) / EVALUATION_TAU)
    evaluations = events(eval_every, steps, before_and_after=True) if run.num_eval else 0
    return RunPlan(
        steps=steps, tokens=float(run.epochs * run.sequences * tokens), step_seconds=step_seconds,
        training_seconds=steps * step_seconds, checkpoint_every=checkpoint_every, checkpoints=checkpoints,
        checkpoint_bytes=checkpoint_bytes,
        checkpoint_seconds=checkpoints * checkpoint_bytes / CHECKPOINT_BYTES_PER_SECOND,
        held_out_every=held_out_every, held_out_measurements=held_out,
        held_out_seconds=held_out * math.ceil(run.held_out_rows / run.processes) * row_seconds,
        eval_every=eval_every, evaluations=evaluations,
        evaluation_seconds=(evaluations * math.ceil(run.num_eval / run.processes) + run.num_eval) * prompt_seconds,
        memory=memory_per_gpu(run, target, target_parameters, draft, draft_parameters, anchors))


def layers_of(config: Any) -> int:
    """A decoder config's layer count."""
    return config.num_hidden_layers


def memory_per_gpu(run: RunInputs, target: Any, target_parameters: int, draft: Any, draft_parameters: int,
                   anchors: int) -> dict[str, dict[str, float]]:
    """Bytes per GPU while training, by part, sharded (FSDP) and data-parallel: the bf16 target (a whole copy per
    process), the draft's float32 weights, gradients and AdamW moments (16 bytes a parameter; FSDP: a 1/N shard and one
    layer gathered), the activations the backward keeps (float32, as measured; with gradient checkpointing each layer's
    inputs and one layer's activations), the logits of LOSS_CHUNK_ROWS rows and the target's features."""
    hidden, layers, rows = draft.hidden_size, draft.num_hidden_layers, anchors * draft.block_size
    per_micro_batch = max(1.0, run.per_micro_batch)
    layer_saved = 4 * hidden * (rows * SAVED_FLOATS_PER_BLOCK_ROW + run.tokens * SAVED_FLOATS_PER_CONTEXT_TOKEN)
    saved = layer_saved * (1 if run.gradient_checkpointing else layers)
    if run.gradient_checkpointing:
        saved += layers * 4 * hidden * (rows + run.tokens)
    other = {"target (bf16)": 2.0 * target_parameters,
             "activations kept for the backward": saved * per_micro_batch,
             "logits and features": 4.0 * LOSS_CHUNK_ROWS * target.vocab_size
             + 2.0 * len(draft.dflash_config["target_layer_ids"]) * hidden * run.tokens * per_micro_batch}
    state = 16.0 * draft_parameters
    return {"fsdp": {"draft training state (sharded)": state / run.processes,
                     "one draft layer gathered": 4.0 * draft_parameters / max(layers, 1), **other},
            "data-parallel": {"draft training state": state, **other}}


def this_machine() -> tuple[int, str | None]:
    """(processes, GPU kind of GPUS) of this launch: WORLD_SIZE (torchrun / accelerate launch) or the GPUs here, and
    the kind whose name this machine's first GPU carries (None: no such GPU)."""
    count = int(os.environ.get("WORLD_SIZE", 0)) or (torch.cuda.device_count() if torch.cuda.is_available() else 1)
    name = torch.cuda.get_device_name(0).lower() if torch.cuda.is_available() else ""
    return max(count, 1), next((kind for kind in GPUS if kind in name), None)


def parse_hardware(text: str | None) -> tuple[int, str]:
    """`--plan`'s hardware: "8xh100" (N GPUs of a kind of GPUS), "h200" (this launch's processes), or None (this
    machine: its processes and GPU, an H100 where it has none the model knows)."""
    processes, kind = this_machine()
    if not text:
        return processes, kind or "h100"
    match = re.fullmatch(r"(?:(\d+)x)?([a-z0-9]+)", text.strip().lower())
    if match is None or match.group(2) not in GPUS or (match.group(1) is not None and int(match.group(1)) < 1):
        raise ValueError(f"--plan {text}: expected GPUs as NxKIND or KIND, KIND one of {', '.join(GPUS)} (e.g. "
                         "8xh100)")
    return (int(match.group(1)) if match.group(1) else processes), match.group(2)


def gib(value: float) -> str:
    """Bytes as GB with one decimal."""
    return f"{value / 1e9:,.1f} GB"


def hours(seconds: float) -> str:
    """Seconds as hours or minutes."""
    return f"{seconds / 3600:,.1f} h" if seconds >= 3600 else f"{seconds / 60:,.1f} min"


def format_plan(run: RunInputs, plan: RunPlan, target_name: str, target_parameters: int,
                draft_parameters: int) -> str:
    """The plan as `dflash-hf train --plan` prints it."""
    lines = [
        f"dflash-hf train --plan: {target_name} ({target_parameters / 1e9:.2f}B parameters), a draft of "
        f"{draft_parameters / 1e9:.2f}B trained parameters, on {run.processes} x {run.gpu.name} at "
        f"{UTILISATION:.0%} of the dense bf16 peak (assumed; docs/training.md, 'The cost of a run')",
        f"  sequences: {run.sequences:,} x {run.epochs} epochs, each taken at --max-length {run.tokens:,} tokens "
        "(an upper bound)",
        f"  optimiser steps: {plan.steps:,} ({run.per_process * run.processes:g} sequences each), "
        f"{plan.tokens:.3g} tokens",
        f"  training: {hours(plan.training_seconds)} ({plan.step_seconds:.2f} s a step)",
        f"  checkpoints: every {plan.checkpoint_every:,} steps (--checkpoint-every {run.checkpoint_every}), "
        f"{plan.checkpoints:,} of {gib(plan.checkpoint_bytes)}: {plan.checkpoints * plan.checkpoint_bytes / 1e12:.2f}"
        f" TB written, {hours(plan.checkpoint_seconds)}",
        "  held-out loss: " + (f"{run.held_out_rows:,} rows every {plan.held_out_every:,} steps (--held-out-every "
                                f"{run.held_out_every}), {plan.held_out_measurements:,} times, "
                                f"{hours(plan.held_out_seconds)}" if plan.held_out_measurements else "off"),
        "  decode evaluation: " + (f"{run.num_eval} prompts every {plan.eval_every:,} steps (--eval-every "
                                    f"{run.eval_every}), {plan.evaluations:,} times sharded over the processes, "
                                    "and once after training: " if plan.evaluations else
                                    f"{run.num_eval} prompts after training: ") + hours(plan.evaluation_seconds),
        f"  checkpoints and held-out measurements: {plan.overhead:.1%} of the training time",
    ]
    for layout, parts in plan.memory.items():
        detail = ", ".join(f"{part} {gib(value)}" for part, value in parts.items())
        lines.append(f"  memory per GPU, {layout}: {gib(sum(parts.values()))} of {gib(run.gpu.memory_bytes)} "
                     f"({detail})")
    warning = overhead_warning(plan)
    return "\n".join(lines + ([warning] if warning else []))


def overhead_warning(plan: RunPlan) -> str | None:
    """What a run that spends more than OVERHEAD_LIMIT of its training time on checkpoints and held-out measurements
    is told up front, or None."""
    if plan.overhead <= OVERHEAD_LIMIT:
        return None
    return (f"dflash-hf train: checkpoints and held-out measurements would take {plan.overhead:.0%} of the training "
            f"time (checkpoints {hours(plan.checkpoint_seconds)}, held-out loss {hours(plan.held_out_seconds)}, "
            f"decode evaluation {hours(plan.evaluation_seconds)}, training {hours(plan.training_seconds)}); space "
            "them out (e.g. --checkpoint-every 2%, --held-out-every 2%, --eval-every 10%) to stay under "
            f"{OVERHEAD_LIMIT:.0%}")


SCHEDULE_FLAGS = {"checkpoint_every": "--checkpoint-every", "eval_every": "--eval-every",
                  "held_out_every": "--held-out-every"}


def resolve_schedule(args: Any, total_steps: int, step_seconds: float | None) -> Any:
    """A copy of `train`'s arguments with --checkpoint-every, --eval-every and --held-out-every as optimiser steps of
    a run of `total_steps` steps of `step_seconds` each (`interval_steps`); a ValueError names a value it refuses
    (--checkpoint-every 0 among them: a run always checkpoints)."""
    resolved = copy.copy(args)
    for name, flag in SCHEDULE_FLAGS.items():
        interval = parse_interval(getattr(args, name), flag)
        if name == "checkpoint_every" and interval.value == 0:
            raise ValueError(f"{flag} 0: a run checkpoints (at least after its last step); give steps, a share of "
                             "the run (2%) or a time (30m)")
        setattr(resolved, name, interval_steps(interval, total_steps, step_seconds, flag))
    return resolved


def run_inputs(args: Any, sequences: int, processes: int, gpu: str) -> RunInputs:
    """The plan's inputs of `train`'s arguments: `sequences` training sequences on `processes` GPUs of kind `gpu`."""
    if args.tokens_per_step is not None:
        per_process = args.tokens_per_step / processes / args.max_length
        per_micro_batch = per_process / args.gradient_accumulation_steps
    else:
        per_process = args.train_batch_size * args.gradient_accumulation_steps
        per_micro_batch = args.train_batch_size
    return RunInputs(
        sequences=sequences, tokens=args.max_length, epochs=args.epochs, processes=processes, gpu=GPUS[gpu],
        anchors=args.num_anchors, per_process=per_process, per_micro_batch=per_micro_batch,
        gradient_checkpointing=args.gradient_checkpointing,
        **{name: parse_interval(getattr(args, name), flag) for name, flag in SCHEDULE_FLAGS.items()},
        held_out_rows=args.held_out_rows, num_eval=args.num_eval,
        eval_max_new_tokens=args.eval_max_new_tokens)


def planned(args: Any, sequences: int, processes: int, gpu: str) -> tuple[RunInputs, RunPlan, int, int]:
    """(inputs, plan, target parameters, draft parameters) of `train`'s arguments (the models' shapes on the meta
    device: nothing is loaded)."""
    config, target_parameters, draft, draft_parameters = model_shapes(
        args.target, args.draft_layers or DEFAULT_DRAFT_LAYERS, args.draft_block_size or DEFAULT_DRAFT_BLOCK_SIZE,
        args.target_layer_ids, args.draft_vocab_size, args.init_from)
    run = run_inputs(args, sequences, processes, gpu)
    return run, plan_run(run, config, target_parameters, draft, draft_parameters), target_parameters, draft_parameters


def plan_text(args: Any, sequences: int) -> str:
    """What `dflash-hf train --plan [HARDWARE]` prints for `sequences` training sequences (nothing is loaded)."""
    processes, gpu = parse_hardware(args.plan)
    run, plan, target_parameters, draft_parameters = planned(args, sequences, processes, gpu)
    return format_plan(run, plan, args.target, target_parameters, draft_parameters)


def run_steps(rows: Any, num_processes: int, settings: Any) -> int:
    """Optimiser steps of a run on `rows` (a SequenceStore, or row dicts) over `num_processes` processes with these
    TrainingSettings: what the trainer's plan of steps counts (`trainer.training_plan`)."""
    return training_plan(training_sequences(rows, settings.max_length), num_processes,
                         settings).total_steps(settings.epochs)
