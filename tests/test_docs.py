"""README.md and docs/*.md agree with the code: links and anchors resolve, every `dflash-hf` subcommand and flag they
name exists, every `spec_generate` keyword they name is accepted, every repository path they name exists, every Python
snippet compiles, README's sections that the code's errors point to exist, and README's result numbers are the ones
MEASUREMENTS.md records."""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import pkgutil
import re
import shlex
from pathlib import Path

import pytest

import dflash_hf
from dflash_hf.cli import build_parser
from dflash_hf.configuration_dflash import REMOTE_CODE_FILES
from dflash_hf.generation_dflash import spec_generate

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dflash_hf"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README = (ROOT / "README.md").read_text(encoding="utf-8")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", flags=re.M | re.S)
INLINE_CODE = re.compile(r"`([^`\n]+)`")


def prose(text: str) -> str:
    """`text` without its fenced code blocks."""
    return FENCE.sub("", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: links reduced to their text, lowercased, punctuation other than `-` and `_`
    dropped, each space a hyphen."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def headings(path: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in prose(path.read_text(encoding="utf-8")).splitlines()
            if re.match(r"#{1,6} ", line)]


def anchors(path: Path) -> set[str]:
    """Every anchor GitHub gives the headings of `path` (a repeated heading gets -1, -2, ...)."""
    found: set[str] = set()
    for heading in headings(path):
        anchor, number = slug(heading), 1
        while anchor in found:
            anchor, number = f"{slug(heading)}-{number}", number + 1
        found.add(anchor)
    return found


def test_the_slug_follows_githubs_rules():
    assert slug("What generate's arguments do") == "what-generates-arguments-do"
    assert slug("`spec_generate` arguments") == "spec_generate-arguments"
    assert slug("Hybrid targets (Qwen3.5, Qwen3-Next)") == "hybrid-targets-qwen35-qwen3-next"


# --- Links and anchors --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [*DOCS, ROOT / "MEASUREMENTS.md"], ids=lambda path: path.name)
def test_every_relative_link_and_anchor_resolves(path):
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", prose(path.read_text(encoding="utf-8"))):
        if "://" in target or target.startswith("mailto:"):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        if not linked.exists():
            broken.append(f"{target}: no file {linked.relative_to(ROOT) if ROOT in linked.parents else linked}")
        elif anchor and (linked.suffix != ".md" or anchor not in anchors(linked)):
            broken.append(f"{target}: no heading with anchor #{anchor}")
    assert not broken, broken


@pytest.mark.parametrize("path", DOCS, ids=lambda path: path.name)
def test_every_section_named_above_or_below_is_a_heading_of_the_page(path):
    """`"Section" below`, `("Section", above)` and `[file.md](file.md), "Section"` name headings that exist."""
    text = prose(path.read_text(encoding="utf-8"))
    named = [(path, name) for name in re.findall(r"\"([^\"\n]+)\",?\s+(?:below|above)\b", text)]
    named += [((path.parent / link).resolve(), name) for link, name in
              re.findall(r"\]\(([\w./-]+\.md)\),\s*\"([^\"]+)\"", text)]
    missing = [f"{page.name}: {name}" for page, name in named
               if " ".join(name.split()) not in headings(page) and f"`{name}`" not in headings(page)]
    assert not missing, missing


def readme_section_references(text: str) -> list[str]:
    """Sections named as `README, "X"`, `README "X"`, `README ("X")`, `README.md ("X")` or `README, 'X'` (in Python
    source, string literals split over lines are joined first)."""
    text = re.sub(r"[\"']\s*\n\s*[rf]*[\"']", "", text)
    pattern = re.compile(r"README(?:\.md)?(?:,\s*|\s+|\s*\(\s*)(?:\\?\"([^\"\\\n]+)\\?\"|'([^'\n]+)')")
    return [" ".join((match.group(1) or match.group(2)).split()) for match in pattern.finditer(text)
            if not text[:match.start()].endswith("` ")]  # `other/repo` README, "X": another repository's


def test_every_readme_section_named_in_code_docs_and_errors_exists():
    """Errors and docstrings point users to README sections by name: each must be a heading of README (`X: Y` names
    a section Y under a heading X)."""
    names = {heading.strip("`") for heading in headings(ROOT / "README.md")} | set(headings(ROOT / "README.md"))
    sources = [*PACKAGE.rglob("*.py"), *PACKAGE.glob("*/README.md"), *DOCS, ROOT / "MEASUREMENTS.md"]
    missing = set()
    for path in sources:
        for name in readme_section_references(path.read_text(encoding="utf-8")):
            parts = [part.strip().strip("`") for part in name.split(":")] if name not in names else [name]
            missing |= {f"{path.name}: {name!r}" for part in parts if part not in names and f"`{part}`" not in names}
    assert not missing, sorted(missing)


# --- The command line ---------------------------------------------------------------------------------------------


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(action for action in parser._actions if isinstance(action, argparse._SubParsersAction))
    return dict(action.choices)


def flags(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


SUBCOMMANDS = subparsers()
ALL_FLAGS = set().union(*map(flags, SUBCOMMANDS.values())) | flags(build_parser())
# Flags of other programs that the docs name in backticks: pip, venv, accelerate, torchrun, pytest.
OTHER_PROGRAMS_FLAGS = {"--no-deps", "--index-url", "--system-site-packages", "--multi_gpu", "--multi_cpu",
                        "--num_processes", "--config_file", "--nproc_per_node", "--standalone", "--deselect",
                        "--durations"}


def script_flags(path: Path) -> set[str]:
    """The flags a script of scripts/ or examples/ defines (`add_argument("--flag"`)."""
    return set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", path.read_text(encoding="utf-8")))


SCRIPTS = {path.relative_to(ROOT).as_posix(): script_flags(path)
           for path in [*(ROOT / "scripts").glob("*.py"), *(ROOT / "examples").glob("*.py")]}
SCRIPT_FLAGS = set().union(*SCRIPTS.values())


def command_lines(text: str) -> list[str]:
    """Every `dflash-hf ...` command the text shows: lines of its code blocks (continuations joined) and inline code,
    from `dflash-hf` (or `-m dflash_hf.cli`) on, without a trailing comment."""
    found = []
    blocks = [body.replace("\\\n", " ") for _, body in FENCE.findall(text)]
    for line in [*"\n".join(blocks).splitlines(), *INLINE_CODE.findall(prose(text))]:
        match = re.search(r"(?:^|&& |\s)(?:dflash-hf|-m dflash_hf\.cli)( .*|$)", line)
        if match:
            found.append(("dflash-hf" + match.group(1)).split(" #", 1)[0].strip())
    return found


@pytest.mark.parametrize("path", DOCS, ids=lambda path: path.name)
def test_every_command_and_flag_named_exists_in_the_parser(path):
    text = path.read_text(encoding="utf-8")
    wrong = []
    for command in command_lines(text):
        words = shlex.split(command.replace("...", ""), posix=True)
        if len(words) < 2 or not re.fullmatch(r"[a-z]+(/[a-z]+)*", words[1]):
            wrong += [f"{command}: {word}" for word in words[1:] if word.startswith("--") and word not in ALL_FLAGS]
            continue
        for name in words[1].split("/"):  # `dflash-hf bench/demo --flag`: both
            if name not in SUBCOMMANDS:
                wrong.append(f"{command}: no subcommand {name}")
                continue
            known = flags(SUBCOMMANDS[name])
            wrong += [f"{command}: {name} has no {word}" for word in words[2:]
                      if word.startswith("--") and word.split("=")[0] not in known]
    for code in INLINE_CODE.findall(prose(text)):  # a flag named on its own: `--flag` or `--flag VALUE`
        flag = code.split()[0]
        if re.fullmatch(r"--[a-z][\w-]*", flag) and flag not in ALL_FLAGS | OTHER_PROGRAMS_FLAGS | SCRIPT_FLAGS:
            wrong.append(f"`{code}`: no subcommand or script has {flag}")
    for script, flag in re.findall(r"python (\S+\.py)\b([^`\n]*)", text):  # `python scripts/x.py --flag ...`
        if script.startswith(("scripts/", "examples/")) and script not in SCRIPTS:
            wrong.append(f"{script}: no such script")
            continue
        wrong += [f"{script}: no {word}" for word in re.findall(r"(?<!\S)--[\w-]+", flag)
                  if script in SCRIPTS and word not in SCRIPTS[script]]
    assert not wrong, wrong


def test_the_shared_flags_listed_are_the_parsers():
    """docs/api.md lists the flags several subcommands share: exactly `cli.SHARED_OPTIONS`."""
    from dflash_hf.cli import SHARED_OPTIONS

    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    listed = re.search(r"A flag that several\s+subcommands take means the same in each \(([^)]*)\)", text).group(1)
    assert set(re.findall(r"`(--[\w-]+)`", listed)) == set(SHARED_OPTIONS)


# --- spec_generate's keywords -------------------------------------------------------------------------------------


def accepted_keywords() -> set[str]:
    """What `spec_generate` takes: its named parameters, and through **kwargs exactly the call settings and generate's
    settings it honours or refuses by name (`CALL_SETTINGS`, `NEUTRAL_GENERATION_SETTINGS`, wherever they live)."""
    named = {name for name, parameter in inspect.signature(spec_generate).parameters.items()
             if parameter.kind is not inspect.Parameter.VAR_KEYWORD and name != "draft"}
    extra: set[str] = set()
    for module in pkgutil.iter_modules(dflash_hf.__path__, "dflash_hf."):
        if module.name.endswith("_dflash"):
            loaded = importlib.import_module(module.name)
            for table in ("CALL_SETTINGS", "NEUTRAL_GENERATION_SETTINGS"):
                extra |= set(getattr(loaded, table, ()))
    assert {"max_length", "repetition_penalty", "stop_strings"} <= extra  # the tables were found
    return named | extra


ACCEPTED = accepted_keywords()


def call_keywords(text: str, function: str) -> list[str]:
    """The keyword names in every `function(...)` call of `text` (nested calls' keywords left out)."""
    names = []
    for match in re.finditer(rf"\b{function}\(", text):
        depth, start, position = 1, match.end(), match.end()
        while depth and position < len(text):
            depth += {"(": 1, ")": -1}.get(text[position], 0)
            position += 1
        arguments, level, flat = text[start:position - 1], 0, []
        for character in arguments:
            level += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(character, 0)
            flat.append(character if level == 0 or character in "([{" else " ")
        names += re.findall(r"(?:^|[,(\s])(\w+)=(?!=)", "".join(flat))
    return names


def table_rows(text: str, header: str) -> list[str]:
    """First cells of the Markdown tables whose header row starts with `| header |`."""
    cells, inside = [], False
    for line in text.splitlines():
        if line.startswith(f"| {header} |"):
            inside = True
        elif inside and line.startswith("|"):
            if not line.startswith("|---"):
                cells.append(line.strip("|").split("|")[0])
        else:
            inside = False
    return cells


@pytest.mark.parametrize("path", DOCS, ids=lambda path: path.name)
def test_every_spec_generate_keyword_named_is_accepted(path):
    text = path.read_text(encoding="utf-8")
    named = set(call_keywords(text, "spec_generate"))
    for cell in table_rows(text, "argument"):  # the reference table of spec_generate's arguments
        named |= set(re.findall(r"`(\w+)`", cell))
    for cell in table_rows(text, "setting"):  # generate's arguments, as spec_generate takes them
        if "custom_generate" not in cell:
            named |= {name for name in re.findall(r"`(\w+)(?:=[^`]*)?`", cell)}
    assert named - {"target", "input_ids"} <= ACCEPTED | {"target", "input_ids"}, sorted(named - ACCEPTED)


def test_the_keyword_check_bites():
    assert call_keywords("draft.spec_generate(target=t, input_ids=x, tree_size=8, f(a=1))", "spec_generate") == [
        "target", "input_ids", "tree_size"]
    assert "tree_sizes" not in ACCEPTED and "tree_size" in ACCEPTED and "repetition_penalty" in ACCEPTED


# --- Paths ----------------------------------------------------------------------------------------------------------

TOP_LEVEL = {path.name for path in ROOT.iterdir() if not path.name.startswith(".git")} - {".venv"}
PACKAGE_DIRS = {path.name for path in PACKAGE.iterdir() if path.is_dir()}


def repository_paths(text: str) -> list[str]:
    """Paths that name this repository's files, in inline code and code blocks, word by word: starting at a top-level
    entry (`tests/...`, `.ci/run`) or at a folder of the package (`published_configs/...`), or a bare `*.py` /
    `*.ipynb` file name of inline code."""
    found = []
    words = [(word, True) for code in INLINE_CODE.findall(prose(text)) for word in code.split()]
    words += [(word, False) for _, body in FENCE.findall(text) for word in body.split()]
    for word, inline in words:
        word = word.strip("\"'`,;:()[]")
        if "://" in word or "*" in word or "<" in word or "{" in word or word.startswith(("~", "$", "-", ".venv")):
            continue
        first = word.split("/")[0]
        if ("/" in word and (first in TOP_LEVEL or first in PACKAGE_DIRS)) or word in {"README.md", "MEASUREMENTS.md"}:
            found.append(word.split("::")[0])
        elif inline and re.fullmatch(r"[\w.-]+\.(py|ipynb)", word):
            found.append(word)
    return found


def exists(path: str) -> bool:
    if "/" not in path and path.endswith((".py", ".ipynb")):
        return any(ROOT.glob(f"*/**/{path}")) or (ROOT / path).exists()
    return (ROOT / path).exists() or (PACKAGE / path).exists()


@pytest.mark.parametrize("path", DOCS, ids=lambda path: path.name)
def test_every_repository_path_named_exists(path):
    missing = [name for name in repository_paths(path.read_text(encoding="utf-8")) if not exists(name)]
    assert not missing, missing


def test_remote_code_is_every_dflash_module():
    """docs/hub.md says the remote code is every `*_dflash.py` module of the package."""
    assert "every `dflash_hf/*_dflash.py` module" in (ROOT / "docs" / "hub.md").read_text(encoding="utf-8")
    assert set(REMOTE_CODE_FILES) == {path.name for path in PACKAGE.glob("*_dflash.py")}


# --- Snippets -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", DOCS, ids=lambda path: path.name)
def test_every_python_snippet_compiles(path):
    for language, body in FENCE.findall(path.read_text(encoding="utf-8")):
        if language == "python":
            compile(body, f"{path.name} snippet", "exec")


# --- README's facts -------------------------------------------------------------------------------------------------


def test_readmes_published_drafts_are_the_configs():
    """README's table of published drafts gives each draft's layers and block as its shipped config says."""
    configs = {}
    for path in (PACKAGE / "published_configs").glob("*.json"):
        config = json.loads(path.read_text())
        block = config.get("block_size") or config.get("dflash_config", {}).get("block_size")
        configs[path.stem] = (config["num_hidden_layers"], block)
    listed = re.findall(r"`(?:z-lab/)?([\w.-]+)` \((\d+), (\d+)\)", README.split("## Supported targets", 1)[1])
    assert len(listed) >= 10
    for name, layers, block in listed:
        assert configs[name] == (int(layers), int(block)), name
    low, high = map(int, re.search(r"draft \((\d+) to (\d+) layers", README).groups())
    assert (low, high) == (min(v[0] for v in configs.values()), max(v[0] for v in configs.values()))


def numbers(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w.])\d+(?:,\d{3})*(?:\.\d+)?", text))


def measured_text(text: str) -> str:
    """What a README section states as measured: its prose and tables, and its `text` blocks (a command's output),
    without inline code (settings such as `temperature=0.0`) and other code blocks."""
    kept = FENCE.sub(lambda block: block.group(2) if block.group(1) == "text" else "", text)
    return INLINE_CODE.sub("", kept)


def test_readmes_measured_numbers_are_in_the_measurements_current_results():
    """Every number README states as measured (its results, the demo's output, the quickstart's compiled step) appears
    in MEASUREMENTS.md's current results."""
    sections = [README.split(f"\n{heading}", 1)[1].split("\n## ", 1)[0]
                for heading in ("## Results", "## The CPU demo", "## GPU quickstart")]
    stated = numbers("\n".join(map(measured_text, sections)))
    measurements = (ROOT / "MEASUREMENTS.md").read_text(encoding="utf-8")
    current = measurements.split("## Current results", 1)[1].split("\n## ", 1)[0]
    assert {"1.45", "1.88", "1.24", "1.62", "9.8", "72"} <= stated  # the headline numbers are among those checked
    assert stated <= numbers(current), sorted(stated - numbers(current))


# --- Names of the code ----------------------------------------------------------------------------------------------

MODULES = {module.name.removeprefix("dflash_hf.")
           for module in pkgutil.walk_packages(dflash_hf.__path__, "dflash_hf.")}
CODE_NAME = re.compile(r"`(?:dflash_hf\.)?((?:training\.)?[a-z_]+)\.([A-Za-z_]\w*)(?:\.(\w+))?(?:\(|`)")


def code_names(text: str) -> list[tuple[str, str, str]]:
    """(module, name, attribute) for each `module.name` (or `dflash_hf.module.name`, `module.Class.attribute`,
    `module.function(...)`) in inline code whose module is one of the package's."""
    extensions = {"py", "md", "json", "jsonl", "yaml", "ipynb", "sh", "gz", "safetensors"}
    return [match for match in CODE_NAME.findall(prose(text)) if match[0] in MODULES and match[1] not in extensions]


@pytest.mark.parametrize("path", DOCS, ids=lambda path: path.name)
def test_every_name_of_the_code_named_exists(path):
    """`versions_dflash.torch_refusal`, `dflash_hf.cache_dflash.CACHE_HOLE_BUDGET`, ...: the module has the name."""
    missing = []
    for module, name, attribute in code_names(path.read_text(encoding="utf-8")):
        loaded = importlib.import_module(f"dflash_hf.{module}")
        found = getattr(loaded, name, None)
        if found is None or (attribute and inspect.isclass(found) and not hasattr(found, attribute)):
            missing.append(f"{module}.{name}" + (f".{attribute}" if attribute else ""))
    assert not missing, missing
