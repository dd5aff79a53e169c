"""`target.generate(..., custom_generate=DRAFT_FOLDER_OR_REPO, trust_remote_code=True)`: DFlash through `generate`.

`save_pretrained` writes this file as `custom_generate/generate.py` next to the draft's weights, so Transformers'
Hub decoding strategies find it. It is loaded on its own (no sibling files): it loads the draft from the same folder
or repo with the draft's remote code (`AutoModel`, once per folder, dtype and device), or takes `assistant_model=`,
and runs `draft.spec_generate` with the arguments `generate` was given (logits processors, stopping criteria, stop
strings with `tokenizer`, ...). It returns what `generate` returns: the ids, or a `GenerateDecoderOnlyOutput` with
`sequences`, and `scores` / `logits` when asked, when `return_dict_in_generate=True`.

Hub remote code: imports only torch and transformers.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from transformers import AutoModel
from transformers.generation import GenerateDecoderOnlyOutput

# Drafts already loaded: (folder or repo, dtype, device) -> draft.
_LOADED_DRAFTS: dict[tuple[str, str, str], torch.nn.Module] = {}
# `generate` arguments the loop cannot apply: refused when set (guidance needs a second forward per step; a verify
# computes no per-token attentions or hidden states in generate's layout; one process runs the loop).
_REFUSED_WHEN_SET = ("negative_prompt_ids", "negative_prompt_attention_mask", "synced_gpus", "output_attentions",
                     "output_hidden_states")
# Arguments `generate` hands every custom function that mean nothing here.
_IGNORED = ("use_model_defaults", "assistant_tokenizer", "kwargs")


def calling_custom_generate() -> str | None:
    """The folder or repo the caller passed as `generate(custom_generate=...)`: where the draft's weights are."""
    frame = inspect.currentframe()
    while frame is not None:
        source = frame.f_locals.get("custom_generate")
        if isinstance(source, str):
            return source
        frame = frame.f_back
    return None


def embedding_device(embeddings: torch.nn.Module) -> torch.device:
    """Where the target's embedding computes: its Accelerate hook's execution device (an int for a GPU index, or
    inside a SequentialHook) when it is dispatched or offloaded, else its weight's device."""
    hook = getattr(embeddings, "_hf_hook", None)
    for item in getattr(hook, "hooks", None) or ([] if hook is None else [hook]):
        if getattr(item, "execution_device", None) is not None:
            return torch.device(item.execution_device)
    return embeddings.weight.device


def load_draft(source: str, target: torch.nn.Module) -> torch.nn.Module:
    """The DFlash draft of `source` (its remote code), in the target's dtype and on its device; loaded once."""
    device = embedding_device(target.get_input_embeddings())
    key = (source, str(target.dtype), str(device))
    if key not in _LOADED_DRAFTS:
        draft = AutoModel.from_pretrained(source, trust_remote_code=True, dtype=target.dtype)
        _LOADED_DRAFTS[key] = draft.to(device).eval()
    return _LOADED_DRAFTS[key]


def generate(model: torch.nn.Module, inputs: torch.Tensor | None = None, **arguments: Any) -> Any:
    """DFlash speculative decoding of `model` (the target) with the arguments `generate` was given."""
    refused = [name for name in _REFUSED_WHEN_SET if arguments.pop(name, None)]  # unset (None, False, []): dropped
    if refused:
        raise ValueError(f"generate(custom_generate=<DFlash draft>) cannot apply {', '.join(refused)} (README, \"What "
                         "generate's arguments do\"); drop them or use plain generate.")
    for name in _IGNORED:
        arguments.pop(name, None)
    input_ids = inputs if inputs is not None else arguments.pop("input_ids", None)
    if input_ids is None:
        raise ValueError("generate(custom_generate=<DFlash draft>) needs the prompt ids (`inputs` or `input_ids`).")
    draft = arguments.pop("assistant_model", None)
    if draft is None:
        source = calling_custom_generate()
        if source is None:
            raise ValueError("Could not tell which folder or repo `custom_generate` named; pass the loaded draft as "
                             "assistant_model=AutoModel.from_pretrained(DRAFT, trust_remote_code=True).")
        draft = load_draft(source, model)
    if not hasattr(draft, "spec_generate"):
        raise ValueError(f"assistant_model is a {type(draft).__name__}; custom_generate needs a DFlash draft "
                         "(AutoModel.from_pretrained(DRAFT, trust_remote_code=True)).")
    generation_config = arguments.pop("generation_config", None)
    result = draft.spec_generate(target=model, input_ids=input_ids, generation_config=generation_config,
                                 return_stats=True, **arguments)
    config = generation_config if generation_config is not None else getattr(model, "generation_config", None)
    as_output = arguments.get("return_dict_in_generate")
    if as_output is None:
        as_output = bool(getattr(config, "return_dict_in_generate", False))
    if not as_output:
        return result.output_ids
    return GenerateDecoderOnlyOutput(sequences=result.output_ids, scores=result.scores, logits=result.logits)
