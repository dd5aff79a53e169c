"""The package's shape: layered module dependencies, the linter clean, self-contained remote code."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_hf.configuration_dflash import REMOTE_CODE_FILES

PACKAGE = Path(__file__).resolve().parents[1] / "dflash_hf"
MODULES = {".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts): path
           for path in sorted(PACKAGE.rglob("*.py"))
           if path.name != "__init__.py" and "drafts" not in path.relative_to(PACKAGE).parts}  # drafts/: links


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imported_modules(module: str) -> set[str]:
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
        pending.extend(ast.iter_child_nodes(node))
    return found - {module}


def documented_stages() -> list[str]:
    """The first column of docs/architecture.md's stage table ("The loop"), in order."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    table = text[text.index("## The loop"):].split("\n\n")[2]
    return re.findall(r"^\| `(\w+)` \|", table, flags=re.M)


def stage_calls(function: ast.FunctionDef) -> list[str]:
    """The names of the functions and methods a function calls, in source order."""
    calls = [node for node in ast.walk(function) if isinstance(node, ast.Call)]
    calls.sort(key=lambda node: (node.lineno, node.col_offset))
    return [node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            for node in calls]


def test_the_loop_runs_the_documented_stages_in_order():
    """`DecodeSession.step` (which `speculative_decode` runs between `prefill` and `finish`) calls the stages of
    docs/architecture.md's table in the table's order, and nothing else of the loop's: the documented loop is the
    code's. It fits one screen."""
    tree = ast.parse(MODULES["dflash_hf.generation_dflash"].read_text())
    session = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "DecodeSession")
    step = next(node for node in session.body if isinstance(node, ast.FunctionDef) and node.name == "step")
    stages = documented_stages()
    assert stages[0] == "prefill" and stages[-1] == "finish", stages
    assert stage_calls(step) == stages[1:-1]
    body_start = step.body[1].lineno if isinstance(step.body[0], ast.Expr) else step.body[0].lineno  # after the doc
    assert step.end_lineno - body_start + 1 <= 40
    loop = next(node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == "speculative_decode")
    assert [call for call in stage_calls(loop) if call in stages + ["step"]] == ["prefill", "step", "finish"]


def test_the_stages_never_ask_which_backend_runs():
    """The loop's stages (steps_dflash, generation_dflash) reach the target only through the backend's methods: no
    module of a backend is imported there, and no attribute of one (a cache, its columns, recurrent states, a static
    verifier) is read off the decode state or the backend."""
    backend_modules = {"dflash_hf.static_dflash", "dflash_hf.recurrent_dflash", "dflash_hf.static_recurrent_dflash",
                       "dflash_hf.mixers_dflash"}
    backend_internals = {"cache", "columns", "states", "verifier", "static", "recurrent", "inner", "cache_argument"}
    for module in ("dflash_hf.steps_dflash", "dflash_hf.generation_dflash"):
        tree = ast.parse(MODULES[module].read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.level}
        assert not {f"dflash_hf.{name}" for name in imported} & backend_modules, module
        reads = {(ast.unparse(node.value), node.attr) for node in ast.walk(tree) if isinstance(node, ast.Attribute)}
        leaked = sorted(f"{owner}.{name}" for owner, name in reads if name in backend_internals
                        and (owner.endswith("state") or owner.endswith("backend")))
        assert not leaked, f"{module} reads a backend's internals: {leaked}"


def test_no_two_modules_import_each_other():
    graph = {module: imported_modules(module) for module in MODULES}

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(child == goal or (child not in seen and reaches(child, goal, seen | {child}))
                   for child in graph[start])

    cycles = [module for module in MODULES if reaches(module, module, {module})]
    assert not cycles


# The package's layers, lowest first (docs/architecture.md, "Modules and the direction of their imports"): a module
# imports only from layers below its own, so the model inherits `spec_generate` from the loop's mixin as Transformers'
# models inherit GenerationMixin, and nothing in the loop imports the model. A new module must be placed here.
LAYERS = (
    {"versions_dflash"},
    {"families_dflash"},
    {"support_dflash"},
    {"devices_dflash", "sampling_dflash", "processors_dflash", "cache_dflash", "configuration_dflash",
     "custom_generate_dflash", "prompts", "smollm2"},
    {"kernels_dflash", "tree_dflash", "checkpoint_dflash", "masks_dflash"},
    {"draft_backends_dflash"},
    {"proposer_dflash", "target_dflash"},
    {"mixers_dflash"},
    {"recurrent_dflash", "tokens_dflash", "validation_dflash"},
    {"static_dflash"},
    {"settings_dflash", "static_recurrent_dflash"},
    {"backends_dflash"},
    {"steps_dflash"},
    {"generation_dflash"},
    {"modeling_dflash"},
    {"conversion", "push", "cost_model", "loading", "training.objective", "training.recipe", "training.processes",
     "training.store", "training.corpus"},
    {"training.vllm_engine"},
    {"evaluation", "synthetic", "training.trainer", "training.data"},
    {"model_card", "demo", "benchmark", "training.plan"},
    {"training.command", "chat"},
    {"cli"},
)
LAYER_OF = {f"dflash_hf.{name}": depth for depth, names in enumerate(LAYERS) for name in names}


def test_every_module_has_a_layer():
    assert set(MODULES) == set(LAYER_OF), "place new modules in LAYERS (and in docs/architecture.md's table)"


@pytest.mark.parametrize("module", sorted(LAYER_OF))
def test_dependencies_point_down_the_layers(module):
    upward = {name for name in imported_modules(module) if LAYER_OF[name] >= LAYER_OF[module]}
    assert not upward, f"{module} imports {sorted(upward)} from its own layer or above"


def test_the_linter_passes():
    """ruff (pyproject.toml: pyflakes, pycodestyle, import order, bugbear, mccabe complexity <= 12) finds nothing."""
    completed = subprocess.run([sys.executable, "-m", "ruff", "check", str(PACKAGE.parent)], capture_output=True,
                               text=True)
    assert completed.returncode == 0, completed.stdout + completed.stderr


@pytest.mark.parametrize("name", REMOTE_CODE_FILES)
def test_remote_code_imports_only_torch_transformers_and_its_siblings(name):
    tree = ast.parse((PACKAGE / name).read_text())
    allowed_top = {"torch", "transformers", "__future__", "inspect", "re", "time", "dataclasses", "typing", "weakref",
                   "pathlib", "math", "contextlib", "warnings", "numbers",
                   "threading", "contextvars", "heapq", "itertools", "copy"}
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


ROOT = PACKAGE.parent
DOCUMENTED = [*ROOT.glob("*.md"), *ROOT.glob("docs/*.md"), *PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.md"),
              *ROOT.glob("tests/*.py"), *ROOT.glob("examples/*.py"), *ROOT.glob("notebooks/*.ipynb")]
DOCUMENTED = [path for path in DOCUMENTED if path.resolve() != Path(__file__).resolve()]  # this file names examples
DOC_REFERENCE = re.compile(r"(docs/[\w-]+\.md)(?:(?:,|\s*\()\s*\"([^\"]+)\")?")
MARKDOWN_LINK = re.compile(r"\]\(([^)#\s]+\.md)(?:#[^)]*)?\)")


def headings(path: Path) -> set[str]:
    """A document's headings, each as written and without the backticks around a heading that is all code."""
    written = {line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")}
    return written | {heading.strip("`") for heading in written}


def test_every_reference_to_a_document_points_into_this_repository():
    """`docs/X.md` (and `docs/X.md, "Section"`) in code, errors and docs name a file and a heading that exist here;
    markdown links to .md files resolve; nothing points to the design documents outside the repository."""
    broken = []
    for path in DOCUMENTED:
        text = path.read_text()
        if "dflash-formats.md" in text or "dflash-design.md" in text or "design doc" in text:
            broken.append(f"{path.name}: names a document outside this repository")
        for document, section in DOC_REFERENCE.findall(text):
            if not (ROOT / document).is_file():
                broken.append(f"{path.name}: {document} does not exist")
            elif section and " ".join(section.split()) not in headings(ROOT / document):
                broken.append(f"{path.name}: {document} has no section {section!r}")
        if path.suffix == ".md":
            broken += [f"{path.name}: link {link} does not resolve" for link in MARKDOWN_LINK.findall(text)
                       if "://" not in link and not (path.parent / link).is_file()]
    assert not broken


def test_the_model_file_imports_every_remote_code_module_it_needs():
    """Transformers 4.57 copies, for a local folder loaded with trust_remote_code, only the files the loaded module
    imports itself (`from .x import y` lines): modeling_dflash.py must name every module its imports need in turn."""
    def relative_imports(name: str) -> set[str]:
        text = (PACKAGE / f"{name}.py").read_text()
        return set(re.findall(r"^\s*from\s+\.(\S+)\s+import", text, flags=re.M))

    needed, pending = set(), ["modeling_dflash"]
    while pending:
        for name in relative_imports(pending.pop()) - needed:
            needed.add(name)
            pending.append(name)
    assert needed - {"modeling_dflash"} <= relative_imports("modeling_dflash")
    assert {f"{name}.py" for name in needed} <= set(REMOTE_CODE_FILES)
