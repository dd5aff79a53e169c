"""dflash-hf: DFlash block-diffusion speculative decoding for Hugging Face Transformers."""

from .cache_dflash import left_pad
from .configuration_dflash import DFLASH_HF_VERSION, DFlashConfig
from .generation_dflash import SpecGenerateOutput, speculative_decode
from .modeling_dflash import DFlashDraftModel
from .proposer_dflash import DraftStep
from .settings_dflash import DecodingSettings, resolve_settings
from .tokens_dflash import GenerationTokens, generation_tokens

__version__ = DFLASH_HF_VERSION

__all__ = ["DFlashConfig", "DFlashDraftModel", "DecodingSettings", "DraftStep", "GenerationTokens",
           "SpecGenerateOutput", "generation_tokens", "left_pad", "load_demo", "resolve_settings",
           "speculative_decode"]


def load_demo(*args, **kwargs):  # noqa: ANN002, ANN003 - the demo's own signature
    """(target, tokenizer, draft): SmolLM2-135M-Instruct and the shipped draft (see `dflash_hf.demo.load_demo`)."""
    from .demo import load_demo as load

    return load(*args, **kwargs)
