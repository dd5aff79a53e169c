"""Re-execute the notebooks with their full settings and write the outputs a reader sees into them.

    python scripts/refresh_notebooks.py                 # all of notebooks/
    python scripts/refresh_notebooks.py quickstart      # one, by name

Run it on a quiet machine and commit the result (CI executes the notebooks with small settings, which it does not
commit). Needs the `notebooks` extra and the SmolLM2 wheel; say in the commit which machine ran it.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def refresh(path: Path) -> float:
    """Execute `path` top to bottom in a fresh kernel with full settings and save it with its outputs; seconds."""
    notebook = nbformat.read(path, as_version=4)
    start = time.perf_counter()
    NotebookClient(notebook, timeout=3600, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    nbformat.write(notebook, path)
    return time.perf_counter() - start


def main(names: list[str]) -> None:
    os.environ.pop("DFLASH_NB_QUICK", None)  # full settings
    paths = [NOTEBOOKS / f"{name}.ipynb" for name in names] or sorted(NOTEBOOKS.glob("*.ipynb"))
    for path in paths:
        print(f"{path.name}: {refresh(path):.0f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
