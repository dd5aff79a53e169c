"""Peak resident memory and wall time of each process of `dflash-hf train` on CPU processes, by the corpus's size.

Writes a tiny Llama target (word-level tokenizer with a chat template) and `--rows` synthetic rows into `--folder`,
then runs `dflash-hf train` on `--processes` gloo processes (torchrun; 2 by default) for `--max-steps` optimiser
steps, nothing generated and nothing evaluated. `--source conversations`: `--conversations` rows of a 20-word user
turn and a 40-word assistant turn. `--source responses`: `--prompts` of 20 words whose answers (40 tokens each) are
already in the run's `responses.jsonl`, as when a finished generation is resumed. `--source seeded`: the same
answers in a `--responses` file (rows generated elsewhere), copied into the run's `responses.jsonl`. Each process
records its peak RSS (`resource.getrusage(RUSAGE_SELF).ru_maxrss`) and the seconds `train` took once it returns; one
JSON line is printed.
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
import socket
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


def write_prompts_and_responses(folder: Path, rows: int, seeded: bool = False) -> None:
    """`rows` seeded 20-word prompts in folder/prompts.jsonl, and their answers (40 tokens each) in the run's
    responses.jsonl (`seeded`: in folder/seed.jsonl, for --responses), each row's prompt ids rendered with the
    target's chat template as `train` renders them."""
    from transformers import AutoTokenizer

    from dflash_hf.prompts import user_prompt_ids

    tokenizer, generator = AutoTokenizer.from_pretrained(folder / "target"), random.Random(0)
    (folder / "run").mkdir()
    with open(folder / "prompts.jsonl", "w", encoding="utf-8") as prompts, \
            open(folder / ("seed.jsonl" if seeded else "run/responses.jsonl"), "w", encoding="utf-8") as responses:
        for index in range(rows):
            prompt = " ".join(f"w{generator.randrange(10, VOCAB_SIZE)}" for _ in range(20))
            prompts.write(json.dumps({"question": prompt}) + "\n")
            answer = [generator.randrange(10, VOCAB_SIZE) for _ in range(40)]
            responses.write(json.dumps({"index": index, "prompt_ids": user_prompt_ids(tokenizer, prompt),
                                        "response_ids": answer}) + "\n")


def worker(folder: Path, source: str, max_steps: int) -> None:
    """One process: `dflash-hf train` on the rows, then its peak RSS into folder/rss-<rank>.json."""
    from dflash_hf.cli import main

    rows = (["--conversations", str(folder / "conversations.jsonl")] if source == "conversations" else
            ["--prompts", str(folder / "prompts.jsonl")])
    if source == "seeded":
        rows += ["--responses", str(folder / "seed.jsonl")]
    started = time.perf_counter()
    main(["train", "--target", str(folder / "target"), *rows, "--output", str(folder / "run"),
          "--max-steps", str(max_steps), "--num-eval", "0", "--epochs", "1", "--draft-layers", "1",
          "--draft-block-size", "4", "--num-anchors", "4", "--mask-token", "w127"])
    peak_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    seconds = time.perf_counter() - started
    (folder / f"rss-{os.environ['RANK']}.json").write_text(json.dumps([peak_mib, seconds]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=20000, help="synthetic conversations in the corpus")
    parser.add_argument("--source", choices=["conversations", "responses", "seeded"], default="conversations",
                        help="the corpus: conversations, or prompts with their responses already generated (in the "
                             "run's responses.jsonl, or seeded: in a --responses file)")
    parser.add_argument("--processes", type=int, default=2, help="processes torchrun starts")
    parser.add_argument("--max-steps", type=int, default=2, help="optimiser steps trained")
    parser.add_argument("--folder", default=None, help="where the target, corpus and run go (default: a new "
                        "temporary folder)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one torchrun process
    args = parser.parse_args()
    folder = Path(args.folder or tempfile.mkdtemp(prefix="dflash-memory-"))
    if args.worker:
        worker(folder, args.source, args.max_steps)
        return
    folder.mkdir(parents=True, exist_ok=True)
    write_target(folder / "target")
    if args.source == "conversations":
        write_conversations(folder / "conversations.jsonl", args.rows)
    else:
        write_prompts_and_responses(folder, args.rows, seeded=args.source == "seeded")
    with socket.socket() as probe:  # a port no other process listens on now
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node",
                    str(args.processes), "--master_addr", "127.0.0.1", "--master_port", str(port), __file__,
                    "--worker", "--folder", str(folder), "--source", args.source, "--max-steps", str(args.max_steps)],
                   check=True, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})
    measured = [json.loads((folder / f"rss-{rank}.json").read_text()) for rank in range(args.processes)]
    print(json.dumps({"rows": args.rows, "source": args.source, "processes": args.processes,
                      "peak_rss_mib": [round(peak) for peak, _ in measured],
                      "train_seconds": [round(seconds) for _, seconds in measured],
                      "seconds": round(time.perf_counter() - started)}))


if __name__ == "__main__":
    main()
