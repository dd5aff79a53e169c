"""Training DFlash drafts (docs/training.md)."""

from .objective import BlockBatch, StepResult, build_blocks, dflash_loss, position_weights, sample_anchors

__all__ = ["BlockBatch", "StepResult", "build_blocks", "dflash_loss", "position_weights", "sample_anchors"]
