"""The whole recipe around the loop: a draft config for any target, evaluation of tau, the model card."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..configuration_dflash import DFlashConfig, default_target_layer_ids, read_rope_parameters
from ..decoding import SpecGenerateOutput, target_text_config
from ..modeling_dflash import DFlashDraftModel


def draft_config_for(
    target: torch.nn.Module,
    num_layers: int,
    block_size: int,
    mask_token_id: int,
    target_layer_ids: list[int] | None = None,
) -> DFlashConfig:
    """A draft config shaped like the target's layers (hidden size, heads, MLP, rope), in the published layout."""
    config = target_text_config(target)
    num_target_layers = config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = read_rope_parameters(config)
    rope_theta = rope.pop("rope_theta")
    return DFlashConfig(
        architectures=["DFlashDraftModel"],
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
        head_dim=head_dim,
        hidden_act=getattr(config, "hidden_act", "silu"),
        rms_norm_eps=getattr(config, "rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=None if rope["rope_type"] == "default" else rope,
        max_position_embeddings=config.max_position_embeddings,
        vocab_size=target.get_output_embeddings().weight.shape[0],
        block_size=block_size,
        num_target_layers=num_target_layers,
        dflash_config={
            "mask_token_id": mask_token_id,
            "target_layer_ids": target_layer_ids or default_target_layer_ids(num_target_layers, num_layers),
        },
        tie_word_embeddings=False,
    )


@torch.no_grad()
def evaluate_draft(
    draft: DFlashDraftModel,
    target: torch.nn.Module,
    prompts: list[list[int]],
    max_new_tokens: int = 256,
    block_size: int | None = None,
    stop_token_ids: list[int] | None = None,
    on_result: Callable[[int, SpecGenerateOutput], None] | None = None,
) -> dict[str, Any]:
    """tau, tokens/s against plain `target.generate`, and whether every output equalled it (greedy).

    `on_result(prompt_index, result)` sees each speculative result as soon as it is measured.
    """
    acceptance_lengths: list[int] = []
    plain_seconds = dflash_seconds = 0.0
    plain_tokens = dflash_tokens = 0
    lossless = True
    device = target.get_input_embeddings().weight.device
    warm_up = torch.tensor([prompts[0]], device=device)
    target.generate(warm_up, attention_mask=torch.ones_like(warm_up), max_new_tokens=8, do_sample=False, pad_token_id=0)
    draft.spec_generate(target=target, input_ids=warm_up, max_new_tokens=8, block_size=block_size)
    for index, prompt in enumerate(prompts):
        input_ids = torch.tensor([prompt], device=device)
        started = time.perf_counter()
        plain = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=stop_token_ids, pad_token_id=(stop_token_ids or [0])[0])
        plain_seconds += time.perf_counter() - started
        plain_tokens += plain.shape[1] - input_ids.shape[1]
        started = time.perf_counter()
        result = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=max_new_tokens,
                                     block_size=block_size, stop_token_ids=stop_token_ids, return_stats=True)
        dflash_seconds += time.perf_counter() - started
        dflash_tokens += result.num_output_tokens
        acceptance_lengths += result.acceptance_lengths
        lossless = lossless and torch.equal(result.output_ids, plain)
        if on_result is not None:
            on_result(index, result)
    plain_rate, dflash_rate = plain_tokens / plain_seconds, dflash_tokens / dflash_seconds
    return {
        "num_prompts": len(prompts),
        "block_size": block_size or draft.block_size,
        "tau": sum(acceptance_lengths) / max(len(acceptance_lengths), 1),
        "tokens_per_s": {"plain": plain_rate, "dflash": dflash_rate},
        "speedup": dflash_rate / plain_rate,
        "lossless": lossless,
    }


def write_model_card(folder: str | Path, base_model: str, details: dict[str, Any]) -> None:
    """A README.md model card stub: what the draft is for, how it was trained, what it measured."""
    lines = [
        "---",
        "library_name: transformers",
        "pipeline_tag: text-generation",
        f"base_model: {base_model}",
        "tags: [dflash, speculative-decoding, block-diffusion]",
        "---",
        "",
        f"# DFlash draft for {base_model}",
        "",
        "A block-diffusion draft for lossless speculative decoding with [dflash-hf](https://pypi.org/project/dflash-hf/).",
        "",
        "```python",
        "from transformers import AutoModel",
        "draft = AutoModel.from_pretrained('<this folder>', trust_remote_code=True).eval()",
        "out = draft.spec_generate(target=target, input_ids=input_ids, max_new_tokens=256)",
        "```",
        "",
        "## Training and evaluation",
        "",
    ]
    lines += [f"- **{key}**: {value}" for key, value in details.items()]
    Path(folder, "README.md").write_text("\n".join(lines) + "\n", encoding="utf-8")
