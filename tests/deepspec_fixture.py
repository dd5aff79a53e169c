"""What tests/test_deepspec_drafts.py and the golden recording share: the tiny target, the seeded weights of a
DeepSpec checkpoint (by name and shape, as DeepSpec's `Qwen3DSparkModel` saves them) and the prompts.

The golden fixture (tests/data/deepspec_golden.json) was recorded by running DeepSeek DeepSpec's own inference code
(`build_dspark_proposal`, `verify_draft_tokens`, `generate_decoding_sample`, at the commit named in the fixture) on
these models; the recording script is not part of the repository (docs/formats.md, "DeepSeek DeepSpec drafts").
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from helpers import COMMON_DECODER, FAMILIES, make_target, random_prompt, transformers_class
from safetensors.torch import save_file

GOLDEN = Path(__file__).resolve().parent / "data" / "deepspec_golden.json"
GEMMA4_GOLDEN = GOLDEN.with_name("deepspec_gemma4_golden.json")  # DeepSpec's Gemma-4 draft (`Gemma4DSparkModel`)
VOCAB = 16  # a small vocabulary: random drafts then agree with the target often enough to accept some proposals
BORROWED = ("embed_tokens.weight", "lm_head.weight")  # DeepSpec's frozen copies of the target's


BIGRAM = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))  # [V]: the golden target's favourite next


@torch.no_grad()
def golden_target() -> torch.nn.Module:
    """The tiny float32 Qwen3 target of the golden runs, leaning to a bigram: its embedding scaled up and half its LM
    head planted so that token v's row points to BIGRAM[v] (it follows the bigram about half the time)."""
    return planted(make_target("qwen3", seed=0, vocab_size=VOCAB, init_std=0.2))


@torch.no_grad()
def gemma4_golden_target() -> torch.nn.Module:
    """The tiny float32 Gemma-4 target of the Gemma-4 golden runs (tests/helpers.py's `gemma4_unified`, Gemma-4 12B's
    kind, with the 12B's soft cap of 30), planted with the bigram as `golden_target`. Its config also names the two
    fields DeepSpec's Gemma-4 draft config asks of a target (no MoE block, no per-layer inputs)."""
    model_class, config_class, settings = FAMILIES["gemma4_unified"]
    torch.manual_seed(0)
    config = transformers_class(config_class)(**{**COMMON_DECODER, **settings, "vocab_size": VOCAB,
                                                 "final_logit_softcapping": 30.0}, enable_moe_block=False,
                                              hidden_size_per_layer_input=0)
    target = transformers_class(model_class)(config).eval()
    target.generation_config.eos_token_id = None
    return planted(target)


def planted(target: torch.nn.Module) -> torch.nn.Module:
    """`target` leaning to the bigram, in place (see `golden_target`)."""
    embedding, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    embedding.mul_(10.0)
    rows = torch.zeros_like(head)
    rows[BIGRAM] = 8.0 * embedding / embedding.norm(dim=-1, keepdim=True).clamp_min(1e-6)  # Gemma's pad row: 0
    head.mul_(0.5).add_(0.5 * rows)
    return target


def golden_prompts() -> list[torch.Tensor]:
    """The golden runs' prompts [1, T]."""
    return [random_prompt(900 + seed, length, VOCAB) for seed, length in ((0, 5), (1, 9), (2, 3))]


def deepspec_weights(shapes: dict[str, list[int]], target: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
    """A DeepSpec checkpoint's tensors: each named tensor seeded from its name's rank (norm weights and Gemma-4's layer
    scalars near 1; the final norm's near 0.05), the
    target's embedding and LM head under DeepSpec's names (its trainer copies them from the target), and a Markov
    head of rank V planted with the golden target's bigram (`BIGRAM`), so that its drafts get accepted."""
    weights = {}
    for index, (name, shape) in enumerate(sorted(shapes.items())):
        generator = torch.Generator().manual_seed(seed * 1000 + index)
        noise = torch.randn(shape, generator=generator)
        weights[name] = 1.0 + 0.1 * noise if name.endswith(("norm.weight", "layer_scalar")) else 0.15 * noise
    weights["norm.weight"] = 0.05 * weights["norm.weight"]  # moderate logits: the Markov bias then counts
    weights["embed_tokens.weight"] = target.get_input_embeddings().weight.detach().clone()
    weights["lm_head.weight"] = target.get_output_embeddings().weight.detach().clone()
    if shapes.get("markov_head.markov_w1.weight") == [VOCAB, VOCAB]:
        identity = torch.eye(VOCAB)
        weights["markov_head.markov_w1.weight"] += identity
        weights["markov_head.markov_w2.weight"] += 4.0 * identity[BIGRAM].T  # column v: the bigram of v
        if "markov_head.joint_proj.weight" in weights:  # rnn: its output gate opens on the token before
            weights["markov_head.joint_proj.weight"][2 * VOCAB :, VOCAB : 2 * VOCAB] += 3.0 * identity
    return weights


def write_deepspec_folder(folder: Path, config: dict, shapes: dict[str, list[int]], target: torch.nn.Module,
                          seed: int) -> Path:
    """A DeepSpec checkpoint folder (config.json as DeepSpec writes it, model.safetensors) with seeded weights."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    tensors = {name: tensor.contiguous() for name, tensor in deepspec_weights(shapes, target, seed).items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder
