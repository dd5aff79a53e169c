"""Peak resident memory of each process of `dflash-hf train` on two CPU processes, by the size of the corpus.

Writes a tiny Llama target (word-level tokenizer with a chat template) and `--rows` synthetic conversations (a
20-word user turn, a 40-word assistant turn) into `--folder`, then runs `dflash-hf train --conversations` on two
gloo processes (torchrun) for `--max-steps` optimiser steps, nothing generated and nothing evaluated. Each process
records its peak RSS (`resource.getrusage(RUSAGE_SELF).ru_maxrss`) once `train` returns; one JSON line is printed.
Run it from the checkout whose code is measured (`PYTHONPATH=. python scripts/training_memory.py --rows 20000`):
only `dflash_hf.cli` is used, so the same script measures an earlier checkout too (docs/training.md, "Data that
streams").
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VOCAB_SIZE = 128


def write_target(folder: Path) -> None:
    """A tiny random Llama target and a word-level tokenizer ('w0' .. 'w127', a chat template) in `folder`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(folder)
    backend = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB_SIZE)}, unk_token="w2"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="w0", eos_token="w1", unk_token="w2")
    tokenizer.chat_template = "{% for m in messages %}w3 {{ m['content'] }} w1 {% endfor %}"
    tokenizer.save_pretrained(folder)


def write_conversations(path: Path, rows: int) -> None:
    """`rows` seeded conversations of a 20-word user turn and a 40-word assistant turn."""
    generator = random.Random(0)

    def words(count: int) -> str:
        return " ".join(f"w{generator.randrange(10, VOCAB_SIZE)}" for _ in range(count))

    with open(path, "w", encoding="utf-8") as handle:
        for _ in range(rows):
            handle.write(json.dumps({"messages": [{"role": "user", "content": words(20)},
                                                  {"role": "assistant", "content": words(40)}]}) + "\n")


def worker(folder: Path, max_steps: int) -> None:
    """One process: `dflash-hf train` on the conversations, then its peak RSS into folder/rss-<rank>.json."""
    from dflash_hf.cli import main

    main(["train", "--target", str(folder / "target"), "--conversations", str(folder / "conversations.jsonl"),
          "--output", str(folder / "run"), "--max-steps", str(max_steps), "--num-eval", "0", "--epochs", "1",
          "--draft-layers", "1", "--draft-block-size", "4", "--num-anchors", "4", "--mask-token", "w127"])
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    (folder / f"rss-{os.environ['RANK']}.json").write_text(json.dumps(peak_mib))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=20000, help="synthetic conversations in the corpus")
    parser.add_argument("--max-steps", type=int, default=2, help="optimiser steps trained")
    parser.add_argument("--folder", default=None, help="where the target, corpus and run go (default: a new "
                        "temporary folder)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one torchrun process
    args = parser.parse_args()
    folder = Path(args.folder or tempfile.mkdtemp(prefix="dflash-memory-"))
    if args.worker:
        worker(folder, args.max_steps)
        return
    folder.mkdir(parents=True, exist_ok=True)
    write_target(folder / "target")
    write_conversations(folder / "conversations.jsonl", args.rows)
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", "2",
                    "--master_addr", "127.0.0.1", "--master_port", "29517", __file__, "--worker", "--folder",
                    str(folder), "--max-steps", str(args.max_steps)],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    peaks = [json.loads((folder / f"rss-{rank}.json").read_text()) for rank in range(2)]
    print(json.dumps({"rows": args.rows, "peak_rss_mib": [round(peak) for peak in peaks],
                      "seconds": round(time.perf_counter() - started)}))


if __name__ == "__main__":
    main()
