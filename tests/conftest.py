"""Shared fixtures: the tiny seeded target and draft most tests decode with, built once per session.

The builders, seeded prompts (`random_prompt`) and test doubles (`RecordingProposer`, `ReferenceProposer`) live in
helpers.py; a test that edits a model, adds a hook or changes a config builds its own instead of using these.
"""

from __future__ import annotations

import os
import tempfile

# Under pytest-xdist (`-n auto`, README's test command): each worker gets its own Transformers remote-code module
# cache (two workers loading exported folders of one name would write the same files) and its share of the cores,
# and so do the processes it starts (Jupyter kernels, `accelerate launch`, remote-code checks): they read
# OMP_NUM_THREADS. Without it, a notebook's kernel ran 2 threads beside the other worker on a 2-core machine and took
# 2.1x as long as with 1 (the suite 24:29 -> 14:55 on a 2-core AVX2 machine; commit 868de2b). Set before torch and
# Transformers are imported (Transformers reads HF_MODULES_CACHE once).
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["HF_MODULES_CACHE"] = tempfile.mkdtemp(prefix="dflash-hf-modules-")
    CORES_PER_WORKER = max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
    os.environ["OMP_NUM_THREADS"] = str(CORES_PER_WORKER)

import pytest  # noqa: E402
import torch  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    torch.set_num_threads(CORES_PER_WORKER)

from helpers import make_draft, make_target
from sampling_checks import sampling_target

from dflash_hf import DFlashDraftModel

# The slowest tests (`pytest --durations`: the notebooks, the chi-square and multi-process tests) start first, so
# that under `-n auto` none of them is left running alone at the end while the other workers idle.
SLOWEST_FIRST = ("test_notebooks.py::test_notebook_executes", "test_sampling.py::test_shortened_steps",
                 "test_hybrid_targets.py::test_sampling_keeps", "test_bench.py::test_data_parallel",
                 "test_compiled.py::test_the_default_compiled_path",
                 "test_compiled_hybrid.py::test_the_default_compiled_path", "test_training_distributed.py::",
                 "test_compiled_hybrid.py::test_compiled_hybrid_sampling")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run `SLOWEST_FIRST` before the rest (a stable sort: each group keeps its order)."""
    items.sort(key=lambda item: not any(name in item.nodeid for name in SLOWEST_FIRST))


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
