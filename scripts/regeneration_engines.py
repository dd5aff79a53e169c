"""Regeneration rows per minute of each engine (`generate_responses`, `dflash-hf train --gen-engine`) on the CPU.

SmolLM2-135M-Instruct (`dflash_hf.load_demo()`, float32, attention "sdpa") answers the first `--prompts`
gsm8k-train prompts greedily, each answer capped at `--caps` new tokens, through: batched `generate` in file order
(the lock-step rounds of `--gen-order file`), batched `generate` with the prompts sorted by length (`--gen-order
length`, the default) and Transformers' continuous batching (`--gen-engine continuous`, all prompts in one
`generate_batch` call). Prints one JSON line per engine and cap: rows per minute by the wall clock, and how many rows
equal the first engine's. Run it from the checkout (`PYTHONPATH=. python scripts/regeneration_engines.py`), so that
its `dflash_hf` is the one imported.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import dflash_hf
from dflash_hf.training.data import generate_responses, read_prompts, rows_by_index

DATA = Path(dflash_hf.__file__).parent / "data" / "gsm8k_train.jsonl"
ENGINES = {"generate, file order": {"engine": "generate", "by_length": False},
           "generate, by length": {"engine": "generate", "by_length": True},
           "continuous": {"engine": "continuous", "by_length": False}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--caps", type=int, nargs="+", default=[96, 512])
    parser.add_argument("--batch-size", type=int, default=16, help="prompts per generate call (--gen-batch-size)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the 2 cores are shared)")
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    target, tokenizer, _ = dflash_hf.load_demo()
    target.set_attn_implementation("sdpa")  # as `dflash-hf train` generates (continuous batching pages sdpa itself)
    prompts = read_prompts([DATA], limit=args.prompts)
    with tempfile.TemporaryDirectory() as folder:
        for cap in args.caps:
            reference = None
            for name in args.engines:
                options = ENGINES[name]
                path = Path(folder) / f"{cap}-{options['engine']}-{options['by_length']}.jsonl"
                batch = len(prompts) if options["engine"] == "continuous" else args.batch_size
                started = time.perf_counter()
                generate_responses(target, tokenizer, prompts, path, batch_size=batch, max_new_tokens=cap,
                                   progress=False, **options)
                seconds = time.perf_counter() - started
                rows = [row["response_ids"] for row in rows_by_index(path, range(len(prompts)))]
                reference = rows if reference is None else reference
                print(json.dumps({"engine": name, "cap": cap, "prompts": len(prompts), "seconds": round(seconds, 1),
                                  "rows_per_minute": round(60 * len(prompts) / seconds, 1),
                                  "new_tokens": sum(map(len, rows)),
                                  "rows_equal_to_first": sum(a == b for a, b in zip(rows, reference))}), flush=True)


if __name__ == "__main__":
    main()
