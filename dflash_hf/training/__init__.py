"""Training DFlash drafts (design doc section 4)."""

from .objective import BlockBatch, StepResult, build_blocks, dflash_loss, position_weights, sample_anchors

__all__ = ["BlockBatch", "StepResult", "build_blocks", "dflash_loss", "position_weights", "sample_anchors"]
