"""The cost of one draft training step at Qwen3-8B's draft shape, measured on this machine, and a whole run from it.

A draft of the published Qwen3-8B shape (hidden 4096, MLP 12288, 32 query / 8 key-value heads, vocabulary 151,936;
`--layers` of its 5 layers, random float32 weights) takes real training steps (`dflash_loss`, backward, AdamW) on
random target features with a top-32 teacher, at small sizes that fit a CPU. torch's FlopCounterMode counts each
step's floating-point operations and the clock times it. The cost model's `step_flops` (`training/plan.py`) is
checked against every count; it then gives the FLOPs of a step at the paper's settings (5 layers, 512 anchors, blocks
of 16, 3,072 tokens) and of the target's forward that computes the features online (2 x 8.2e9 x tokens).
`dflash-hf train --plan` turns them into GPU hours at a stated utilisation (docs/training.md, "The cost of a
run").

    python scripts/training_step_cost.py                 # 1 layer, anchors 8 and 16, 512 tokens
    python scripts/training_step_cost.py --layers 2 --anchors 8 --tokens 256
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.utils.flop_counter import FlopCounterMode

from dflash_hf.configuration_dflash import DFlashConfig
from dflash_hf.loading import PUBLISHED_CONFIGS
from dflash_hf.modeling_dflash import DFlashDraftModel
from dflash_hf.training.objective import TargetSignals, dflash_loss
from dflash_hf.training.plan import step_flops

TARGET_PARAMETERS = 8.2e9  # Qwen3-8B
TOP_K = 32


class FrozenHead(torch.nn.Module):
    """The target's embedding and LM head the draft borrows (one tied tensor here, to halve the host memory)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab_size, hidden_size)
        self.lm_head = torch.nn.Linear(hidden_size, vocab_size, bias=False)
        self.lm_head.weight = self.embed.weight
        self.requires_grad_(False)

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.embed

    def get_output_embeddings(self) -> torch.nn.Module:
        return self.lm_head


def measure(config: DFlashConfig, head: FrozenHead, layers: int, anchors: int, tokens: int) -> dict[str, float]:
    """FLOPs (counted), seconds (the faster of two steps) and the bytes autograd saves for the backward (the
    activations; each step's own, float32 here) of training steps at these sizes."""
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    draft = DFlashDraftModel(config)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-4)
    features = len(config.dflash_config["target_layer_ids"]) * config.hidden_size
    input_ids = torch.randint(0, config.vocab_size, (tokens,))
    loss_mask = torch.ones(tokens, dtype=torch.long)
    teacher_ids = torch.randint(0, config.vocab_size, (tokens, TOP_K))
    signals = TargetSignals(torch.randn(tokens, features), torch.rand(tokens, TOP_K).softmax(-1), teacher_ids)
    seconds, counted, saved = [], 0.0, {}

    weights = {p.untyped_storage().data_ptr() for p in [*draft.parameters(), *head.parameters()]}

    def keep(tensor: torch.Tensor) -> torch.Tensor:  # what autograd saves for the backward (not the weights), once
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    for repeat in range(2):
        saved.clear()
        counter = FlopCounterMode(display=False)
        started = time.perf_counter()
        with counter:
            with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
                result = dflash_loss(draft, head, input_ids, loss_mask, anchors,  # the dense mask `step_flops` counts
                                     torch.Generator().manual_seed(repeat), signals, tile_rows=None)
            result.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        seconds.append(time.perf_counter() - started)
        counted = counter.get_total_flops()
    return {"layers": layers, "anchors": anchors, "tokens": tokens, "counted_flops": counted,
            "formula_flops": step_flops(config, layers, anchors, tokens), "seconds": min(seconds),
            "saved_for_backward_bytes": sum(saved.values())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--anchors", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--tokens", type=int, default=512)
    args = parser.parse_args()
    config = DFlashConfig.from_json_file(str(PUBLISHED_CONFIGS / "Qwen3-8B-DFlash-b16.json"))
    config._attn_implementation = "sdpa"
    head = FrozenHead(config.vocab_size, config.hidden_size)
    rows = [measure(config, head, args.layers, anchors, args.tokens) for anchors in args.anchors]
    for row in rows:
        row["cpu_tflops_per_s"] = row["counted_flops"] / row["seconds"] / 1e12
        print(json.dumps(row))
    config.num_hidden_layers = 5
    with torch.device("meta"):  # shapes only: the parameter count of the whole draft
        parameters = sum(p.numel() for p in DFlashDraftModel(config).parameters())
    print(json.dumps({"paper_step_flops": step_flops(config, 5, 512, 3072),
                      "target_forward_flops": 2 * TARGET_PARAMETERS * 3072, "draft_parameters": parameters}))


if __name__ == "__main__":
    main()
