"""Shared fixtures: the tiny seeded target and draft most tests decode with, built once per session.

The builders, seeded prompts (`random_prompt`) and test doubles (`RecordingProposer`, `ReferenceProposer`) live in
helpers.py; a test that edits a model, adds a hook or changes a config builds its own instead of using these.
"""

from __future__ import annotations

import pytest
import torch
from helpers import make_draft, make_target
from sampling_checks import sampling_target

from dflash_hf import DFlashDraftModel


@pytest.fixture(scope="session")
def target() -> torch.nn.Module:
    """The tiny Qwen3 target of seed 0 (4 layers, vocabulary 128), shared read-only; a module may override it."""
    return make_target("qwen3", seed=0)


@pytest.fixture(scope="session")
def draft() -> DFlashDraftModel:
    """The tiny draft of seed 0 for `target` (2 layers, block size 8), shared read-only; a module may override it."""
    return make_draft(0, block_size=8)


@pytest.fixture(scope="session")
def sampling_setup() -> tuple[torch.nn.Module, torch.Tensor]:
    """The 6-token target the chi-square tests sample, and its prompt [1, 4] (sampling_checks.py)."""
    return sampling_target()
