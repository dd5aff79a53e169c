"""The package's shape: short functions, one-way module dependencies, self-contained remote code."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dflash_hf.configuration_dflash import REMOTE_CODE_FILES

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_hf"
MODULES = {".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts): path
           for path in sorted(PACKAGE.rglob("*.py")) if path.name != "__init__.py"}
ARGUMENT_PARSER_BUILDERS = ("add_train_arguments", "add_bench_arguments", "build_parser")


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported_modules(module: str, module_level_only: bool = False) -> set[str]:
    """The package modules `module` imports at run time (TYPE_CHECKING blocks excluded), lazy imports included."""
    tree = ast.parse(MODULES[module].read_text())
    package = module.rsplit(".", 1)[0]
    found: set[str] = set()
    pending = list(tree.body)
    while pending:
        node = pending.pop()
        if _is_type_checking(node):
            continue
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = package.split(".")[: len(package.split(".")) - node.level + 1]
            prefix = ".".join(base + ([node.module] if node.module else []))
            candidates = [prefix] + [f"{prefix}.{alias.name}" for alias in node.names]
            found.update(name for name in candidates if name in MODULES)
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("dflash_hf"):
            found.update(name for name in [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                         if name in MODULES)
        if not (module_level_only and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))):
            pending.extend(ast.iter_child_nodes(node))
    return found - {module}


def test_no_function_is_longer_than_60_lines():
    too_long = []
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in ARGUMENT_PARSER_BUILDERS:
                length = node.end_lineno - node.lineno + 1
                if length > 60:
                    too_long.append(f"{module}.{node.name}: {length} lines")
    assert not too_long


def test_the_loop_reads_in_one_screen():
    tree = ast.parse(MODULES["dflash_hf.generation_dflash"].read_text())
    loop = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "speculative_decode")
    # after the docstring
    body_start = loop.body[1].lineno if isinstance(loop.body[0], ast.Expr) else loop.body[0].lineno
    assert loop.end_lineno - body_start + 1 <= 40


def test_no_two_modules_import_each_other():
    graph = {module: imported_modules(module) for module in MODULES}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(child == goal or (child not in seen and reaches(child, goal, seen | {child}))
                   for child in graph[start])

    cycles = [module for module in MODULES if reaches(module, module, {module})]
    assert not cycles


@pytest.mark.parametrize("module, forbidden", [
    ("dflash_hf.modeling_dflash", {"dflash_hf.generation_dflash"}),  # no import-time edge from the model to the loop
    ("dflash_hf.evaluation", {"dflash_hf.benchmark", "dflash_hf.demo", "dflash_hf.cli", "dflash_hf.training.command",
                              "dflash_hf.synthetic"}),
    ("dflash_hf.synthetic", {"dflash_hf.benchmark", "dflash_hf.demo", "dflash_hf.cli", "dflash_hf.training.command"}),
    ("dflash_hf.demo", {"dflash_hf.benchmark", "dflash_hf.training.recipe", "dflash_hf.training.command"}),
    ("dflash_hf.benchmark", {"dflash_hf.demo", "dflash_hf.training.command", "dflash_hf.training.recipe"}),
    ("dflash_hf.training.command", {"dflash_hf.benchmark", "dflash_hf.demo", "dflash_hf.cli"}),
    ("dflash_hf.model_card", {"dflash_hf.benchmark"}),
])
def test_dependencies_point_one_way(module, forbidden):
    direct = imported_modules(module, module_level_only=module == "dflash_hf.modeling_dflash")
    assert not direct & forbidden


@pytest.mark.parametrize("name", REMOTE_CODE_FILES)
def test_remote_code_imports_only_torch_transformers_and_its_siblings(name):
    tree = ast.parse((PACKAGE / name).read_text())
    allowed_top = {"torch", "transformers", "__future__", "inspect", "re", "time", "dataclasses", "typing", "weakref",
                   "pathlib", "math", "contextlib", "warnings"}
    module_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert {alias.name.split(".")[0] for alias in node.names} <= allowed_top, ast.unparse(node)
        elif isinstance(node, ast.ImportFrom):
            if node.level > 0:
                assert f"{node.module}.py" in REMOTE_CODE_FILES, ast.unparse(node)
            elif node.module.split(".")[0] == "accelerate":  # inside a function run only for Accelerate-hooked models
                assert id(node) not in module_level, ast.unparse(node)
            else:
                assert node.module.split(".")[0] in allowed_top, ast.unparse(node)


def test_the_remote_code_list_is_what_save_pretrained_copies(tmp_path):
    """REMOTE_CODE_FILES (what push checks and stamps) is exactly what Transformers copies next to the weights."""
    from helpers import make_draft

    make_draft(0).save_pretrained(tmp_path)
    assert sorted(path.name for path in tmp_path.glob("*.py")) == sorted(REMOTE_CODE_FILES)
