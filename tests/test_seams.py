"""The target backend seam's shape: the backends know nothing of recurrence or of trees, a hybrid target's rollback
wraps a backend (eager and compiled alike), the protocols promise only what every implementation honours, and the
chain and tree strategies verify on their own."""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_hf"
# The modules of the target's side: the seam, the backends and the rollbacks that wrap them.
BACKEND_MODULES = ("backends_dflash", "static_dflash", "recurrent_dflash", "static_recurrent_dflash")


def backend_classes() -> list[type]:
    """Every class defined in the backend modules (those that exist), protocols included."""
    classes = []
    for name in BACKEND_MODULES:
        if not (PACKAGE / f"{name}.py").is_file():
            continue
        module = importlib.import_module(f"dflash_hf.{name}")
        classes += [value for value in vars(module).values()
                    if inspect.isclass(value) and value.__module__ == module.__name__]
    return classes


def test_the_static_backend_never_asks_about_recurrence():
    """static_dflash holds no branch on a hybrid target: the compiled rollback wraps the backend
    (static_recurrent_dflash) and hands it hooks."""
    source = (PACKAGE / "static_dflash.py").read_text()
    assert not re.findall(r"\bself\.recurrent\b|\.recurrent is\b|from \.recurrent_dflash|\bMixer\b", source)


def test_no_backend_method_takes_or_returns_a_draft_tree():
    """The backends receive a strategy-neutral `VerifyLayout`, never a `DraftTree`: no annotation of any method of
    any class of the backend modules names one, and none of those modules imports it."""
    leaks = []
    for cls in backend_classes():
        for name, method in inspect.getmembers(cls, inspect.isfunction):
            annotations = inspect.get_annotations(method)
            leaks += [f"{cls.__name__}.{name}({parameter})" for parameter, annotation in annotations.items()
                      if "DraftTree" in str(annotation)]
    for name in BACKEND_MODULES:
        path = PACKAGE / f"{name}.py"
        tree = ast.parse(path.read_text()) if path.is_file() else ast.Module(body=[], type_ignores=[])
        leaks += [f"{name} imports {alias.name}" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                  for alias in node.names if alias.name in ("DraftTree", "tree_sees")]
    assert not leaks


def test_the_tree_strategy_verifies_without_the_chains_verify():
    """TreeStep.verify calls the backend's verify, never ChainStep's (a one-column step is a tree of the root)."""
    tree = ast.parse((PACKAGE / "steps_dflash.py").read_text())
    step = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "TreeStep")
    verify = next(node for node in step.body if isinstance(node, ast.FunctionDef) and node.name == "verify")
    callers = [ast.unparse(node.func.value) for node in ast.walk(verify)
               if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "verify"]
    assert callers == ["state.backend"]
    names = {node.id for node in ast.walk(verify) if isinstance(node, ast.Name)}
    assert not names & {"CHAIN", "ChainStep"}


def protocol_members(protocol: type) -> set[str]:
    return {name for name, value in vars(protocol).items() if inspect.isfunction(value)}


def test_every_backend_offers_the_whole_protocol_and_the_protocol_no_more():
    """`TargetBackend` holds what every backend honours (decode_token, which the compiled backend cannot run, is the
    eager backends' `TimedBackend` only), and each backend, a wrapper or not, implements all of it. The compiled
    backends keep every row (`FixedRowBackend`: all but drop_rows); `FixedRowBatch` around one is a TargetBackend."""
    from dflash_hf.backends_dflash import EagerBackend, RecurrentRollback, TargetBackend
    from dflash_hf.static_dflash import FixedRowBackend, FixedRowBatch, StaticBackend
    from dflash_hf.static_recurrent_dflash import StaticRecurrentRollback

    members = protocol_members(TargetBackend)
    assert "decode_token" not in members
    assert {"prefill", "step_width", "verify", "keep", "discard", "compact", "drop_rows"} <= members
    assert protocol_members(FixedRowBackend) == members - {"drop_rows"}
    for implementation, protocol in [(EagerBackend, TargetBackend), (RecurrentRollback, TargetBackend),
                                     (FixedRowBatch, TargetBackend), (StaticBackend, FixedRowBackend),
                                     (StaticRecurrentRollback, FixedRowBackend)]:
        missing = protocol_members(protocol) - {name for name, _ in inspect.getmembers(implementation)}
        assert not missing, (implementation.__name__, missing)
        parameters = list(inspect.signature(implementation.verify).parameters)
        assert parameters[:3] == ["self", "input_ids", "layout"], implementation.__name__


def test_both_rollbacks_wrap_a_backend_with_the_same_interface():
    """The eager rollback wraps the eager backend and the compiled one the compiled backend: both hold an `inner`
    backend and offer the same methods; the backends they wrap take a hook around each verify."""
    from dflash_hf.backends_dflash import EagerBackend, RecurrentRollback
    from dflash_hf.static_dflash import StaticBackend
    from dflash_hf.static_recurrent_dflash import StaticRecurrentRollback

    def public(cls: type) -> set[str]:
        return {name for name in dir(cls) if not name.startswith("_")}

    assert public(StaticRecurrentRollback) == public(RecurrentRollback) - {"decode_token", "drop_rows"}
    assert inspect.get_annotations(RecurrentRollback.__init__)["inner"] == "EagerBackend"
    assert inspect.get_annotations(StaticRecurrentRollback.__init__)["inner"] == "StaticBackend"
    for backend in (EagerBackend, StaticBackend):
        assert "around" in inspect.signature(backend.verify).parameters, backend.__name__


@pytest.mark.parametrize("dead", [("draft_backends_dflash", "StaticDraftContextCache", "select_rows"),
                                  ("recurrent_dflash", None, "recurrent_states")])
def test_dead_code_stays_gone(dead):
    module_name, class_name, name = dead
    module = importlib.import_module(f"dflash_hf.{module_name}")
    owner = module if class_name is None else getattr(module, class_name)
    assert not hasattr(owner, name)
