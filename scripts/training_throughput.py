"""Training tokens/s and peak memory of one process at the paper's settings (512 anchors, block 16) on a small config.

A random Qwen3-shaped target and draft (seeded), sequences of `--length` tokens (a 64-token prompt, the rest
response), `train_draft` end to end in one process, FSDP off: on the CPU in float32, on a GPU (where torch sees one)
with the target in `--target-dtype` and the draft's forward under bf16 autocast (`--mixed-precision auto`), as
`dflash-hf train` runs there. Prints one JSON line: tokens/s (sequence tokens trained per second, target features
included; by the wall clock, and by the process's CPU time, which other load on the machine disturbs less), the peak
resident memory of the process and, on a GPU, its peak allocated GPU memory. Run it from the checkout to measure
(`PYTHONPATH=. python scripts/training_throughput.py`), so that its `dflash_hf` is the one imported;
`scripts/gpu_check.sh` runs it on a lent GPU.
"""

from __future__ import annotations

import argparse
import inspect
import json
import resource
import tempfile
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

import dflash_hf
from dflash_hf import DFlashConfig, DFlashDraftModel
from dflash_hf.training.command import training_target_dtype
from dflash_hf.training.trainer import TrainingSettings, train_draft


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--length", type=int, default=1024, help="tokens per sequence")
    parser.add_argument("--sequences", type=int, default=4, help="sequences trained (one epoch)")
    parser.add_argument("--anchors", type=int, default=512)
    parser.add_argument("--block", type=int, default=16)
    parser.add_argument("--draft-layers", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--target-layers", type=int, default=4)
    parser.add_argument("--target-dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                        help="auto: bfloat16 on a GPU, float32 on the CPU (as `dflash-hf train --target-dtype auto`)")
    parser.add_argument("--settings", default="{}", help="extra TrainingSettings fields, as JSON")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = training_target_dtype(args.target_dtype, device)
    torch.manual_seed(0)
    heads, head_dim, vocab, layers = args.hidden // 32, 32, 8192, args.target_layers
    shape = {"vocab_size": vocab, "hidden_size": args.hidden, "intermediate_size": 3 * args.hidden,
             "num_attention_heads": heads, "num_key_value_heads": max(heads // 4, 1), "head_dim": head_dim,
             "max_position_embeddings": 4096}
    target = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=layers, tie_word_embeddings=False, **shape))
    target = target.to(device=device, dtype=dtype).eval()
    draft = DFlashDraftModel(DFlashConfig(
        num_hidden_layers=args.draft_layers, rope_theta=1e6, block_size=args.block, num_target_layers=layers,
        dflash_config={"mask_token_id": vocab - 1, "target_layer_ids": [1, layers - 2]},
        architectures=["DFlashDraftModel"], **shape))
    generator = torch.Generator().manual_seed(1)
    rows = [{"prompt_ids": torch.randint(0, vocab - 1, (64,), generator=generator).tolist(),
             "response_ids": torch.randint(0, vocab - 1, (args.length - 64,), generator=generator).tolist()}
            for _ in range(args.sequences)]
    known = inspect.signature(TrainingSettings).parameters
    extra = {key: value for key, value in json.loads(args.settings).items() if key in known}
    settings = TrainingSettings(epochs=1, num_anchors=args.anchors, max_length=args.length, **extra)
    with tempfile.TemporaryDirectory() as folder:
        started, cpu_started = time.perf_counter(), time.process_time()
        log = train_draft(draft, target, rows, settings, folder, progress=False)
        seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
    tokens = args.sequences * args.length
    on_gpu = device.type == "cuda"
    print(json.dumps({"tokens_per_s": round(tokens / seconds, 1), "seconds": round(seconds, 1),
                      "tokens_per_cpu_s": round(tokens / cpu_seconds, 1), "steps": log.steps,
                      "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
                      "peak_gpu_mib": round(torch.cuda.max_memory_allocated() / 2**20) if on_gpu else None,
                      "device": torch.cuda.get_device_name() if on_gpu else "cpu",
                      "target_dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
                      "settings": extra, "args": vars(args), "package": dflash_hf.__file__}))

if __name__ == "__main__":
    main()
