"""dflash-hf: DFlash block-diffusion speculative decoding for Hugging Face Transformers."""

from .configuration_dflash import DFlashConfig
from .decoding import DraftStep, SpecGenerateOutput, left_pad, speculative_decode
from .demo import load_demo
from .modeling_dflash import DFlashDraftModel

__version__ = "0.1.0"

__all__ = ["DFlashConfig", "DFlashDraftModel", "DraftStep", "SpecGenerateOutput", "left_pad", "load_demo",
           "speculative_decode"]
