"""Equal-budget training ablations for the SmolLM2 draft (docs/training.md, "Ablations on this CPU").

Each variant is one `dflash-hf train` run of the same base command with a few flags changed, the same steps and the
same held-out rows; the script runs the variants not yet finished (a killed run resumes from its checkpoint) and
prints a Markdown table of each variant's held-out loss, block tau (greedy) and sampled block tau (temperature 1,
from 1 - L1/2 per position) before and after training, from OUTPUT/training_log.json.

    python scripts/ablations.py --grid loss --output runs/ablations       # run what is missing, then the table
    python scripts/ablations.py --grid loss --output runs/ablations --table-only
    python scripts/ablations.py --grid markov --steps 120 --output runs/ablations-markov
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

SHIPPED = "dflash_hf/drafts/smollm2-135m-instruct-v7"  # v7, the draft every grid continues
RESPONSES = "training_data/smollm2_gsm8k_train_greedy.jsonl.gz"
# the base: 512 gsm8k rows trained, the 64 after them held out, as many steps for every variant
BASE = ["--responses", RESPONSES, "--num-prompts", "576", "--held-out-rows", "64", "--epochs", "1",
        "--num-anchors", "64", "--distill", "--num-eval", "0", "--checkpoint-every", "50"]
GRIDS = {
    # the loss terms, each continuing the v7 draft for the same steps
    "loss": {
        "v7 + cross-entropy": ["--init-from", SHIPPED, "--learning-rate", "3e-4"],
        "v7 + L1 0.9": ["--init-from", SHIPPED, "--learning-rate", "3e-4", "--l1-weight", "0.9"],
        "v7 + logits 0.01": ["--init-from", SHIPPED, "--learning-rate", "3e-4", "--logit-weight", "0.01"],
    },
    # DSpark's parts (DeepSpec), each continuing v7 with DeepSpec's loss weights (L1 0.9) for the same steps: the
    # shifted block (every row a proposal: v7's rows relearn their meaning), then a Markov head of rank 64 on it
    "markov": {
        "v7 + L1 0.9 (DFlash block)": ["--init-from", SHIPPED, "--learning-rate", "3e-4", "--l1-weight", "0.9"],
        "v7 + L1 0.9, shifted labels": ["--init-from", SHIPPED, "--learning-rate", "3e-4", "--l1-weight", "0.9",
                                        "--shifted-labels"],
        "v7 + L1 0.9, shifted, Markov vanilla 64": ["--init-from", SHIPPED, "--learning-rate", "3e-4",
                                                    "--l1-weight", "0.9", "--markov-rank", "64"],
        "v7 + L1 0.9, shifted, Markov gated 64": ["--init-from", SHIPPED, "--learning-rate", "3e-4",
                                                  "--l1-weight", "0.9", "--markov-rank", "64", "--markov-head",
                                                  "gated"],
    },
    # the draft's shape, each from scratch
    "shape": {
        "3 layers, block 8": ["--draft-layers", "3", "--draft-block-size", "8"],
        "1 layer, block 8": ["--draft-layers", "1", "--draft-block-size", "8"],
        "5 layers, block 8": ["--draft-layers", "5", "--draft-block-size", "8"],
        "3 layers, block 16": ["--draft-layers", "3", "--draft-block-size", "16"],
        "3 layers, 256 anchors": ["--draft-layers", "3", "--draft-block-size", "8", "--num-anchors", "256"],
        "3 layers, own vocabulary 8192": ["--draft-layers", "3", "--draft-block-size", "8",
                                          "--draft-vocab-size", "8192"],
        "3 layers, hard labels": ["--draft-layers", "3", "--draft-block-size", "8", "--no-distill"],
    },
}


def folder_name(variant: str) -> str:
    """A run folder's name for a variant."""
    return "".join(c if c.isalnum() else "-" for c in variant.lower()).strip("-")


def run_variant(output: Path, flags: list[str], steps: int) -> float:
    """Train one variant to `steps` (resuming a killed run); the seconds it took now (0 when it was done)."""
    log = output / "training_log.json"
    if log.exists() and json.loads(log.read_text()).get("steps", 0) >= steps:
        return 0.0
    started = time.perf_counter()
    command = [sys.executable, "-m", "dflash_hf.cli", "train", "--output", str(output), *BASE, *flags,
               "--max-steps", str(steps), "--held-out-every", str(steps)]
    print(" ".join(command), flush=True)
    subprocess.run(command, check=True)
    return time.perf_counter() - started


def table(root: Path, grid: dict[str, list[str]]) -> str:
    """The Markdown table of the variants' held-out measurements (first and last)."""
    lines = ["| variant | steps | held-out loss | block tau (greedy) | sampled block tau (T = 1) | minutes |",
             "|---|---:|---:|---:|---:|---:|"]
    for variant in grid:
        log_path = root / folder_name(variant) / "training_log.json"
        if not log_path.exists():
            lines.append(f"| {variant} | not run | | | | |")
            continue
        log = json.loads(log_path.read_text())
        held = log.get("held_out_losses", [])
        if not held:
            lines.append(f"| {variant} | {log.get('steps', 0)} | | | | |")
            continue
        pairs = [f"{held[0].get(key, float('nan')):.3f} -> {held[-1].get(key, float('nan')):.3f}"
                 for key in ("loss", "block_tau", "sampled_block_tau")]
        lines.append(f"| {variant} | {log.get('steps', 0)} | {' | '.join(pairs)} | {log.get('seconds', 0) / 60:.0f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--grid", choices=sorted(GRIDS), required=True)
    parser.add_argument("--output", default="runs/ablations", help="a folder of run folders, one per variant")
    parser.add_argument("--steps", type=int, default=200, help="optimiser steps of every variant")
    parser.add_argument("--variants", nargs="*", default=None, help="only these variants (default: the grid's)")
    parser.add_argument("--table-only", action="store_true", help="print the table of what has run")
    args = parser.parse_args()
    grid = {name: flags for name, flags in GRIDS[args.grid].items() if not args.variants or name in args.variants}
    root = Path(args.output)
    if not args.table_only:
        for variant, flags in grid.items():
            run_variant(root / folder_name(variant), flags, args.steps)
    print(table(root, grid))


if __name__ == "__main__":
    main()
