"""README's set-up commands are the ones CI runs, and every `dflash-hf` command it shows exists."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from dflash_hf.cli import main
from dflash_hf.versions_dflash import OLDEST_TORCH

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CI = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
# `dflash-hf <command>` where the README shows a command: at a line start (code blocks), after a backtick or `&&`
SHOWN_COMMANDS = sorted(set(re.findall(r"(?:^|`|&& )dflash-hf ([a-z]+)", README, flags=re.M)))


def section(heading: str) -> str:
    """README's text under `heading` (a `## ` heading), up to the next `## ` heading."""
    return README.split(f"\n{heading}\n", 1)[1].split("\n## ", 1)[0]


def setup_commands() -> tuple[str, str]:
    """README's two set-up commands: the main job (the install section's line that ends in `dflash-hf demo`, after
    `git clone`) and the test command (the tests section's)."""
    install = re.findall(r"```bash\n(.*?)\n```", section("## Install"), flags=re.S)[0].splitlines()
    assert install[0].startswith("git clone ") and install[0].endswith("&& cd dflash-hf")
    tests = re.findall(r"```bash\n(.*?)\n```", section("## Tests"), flags=re.S)
    return install[1].strip(), tests[0].strip()


def test_readme_test_command_is_what_ci_runs():
    main_command, test_command = setup_commands()
    venv = "python3 -m venv .venv && . .venv/bin/activate && "
    assert test_command.startswith(venv) and main_command.startswith(venv)
    assert test_command[len(venv):] in CI.splitlines()  # CI creates the same venv, then runs this line verbatim
    assert main_command.endswith("dflash-hf demo") and re.search(r"^dflash-hf demo\b", CI, flags=re.M)
    main_extras = re.search(r'-e "\.\[(.*?)\]"', main_command).group(1).split(",")
    test_extras = re.search(r'-e "\.\[(.*?)\]"', test_command).group(1).split(",")
    assert set(main_extras) <= set(test_extras)  # what CI installs covers the main command


@pytest.mark.parametrize("command", SHOWN_COMMANDS)
def test_every_command_in_the_readme_exists(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0 and "usage: dflash-hf" in capsys.readouterr().out


def dependency_bounds(name: str) -> tuple[str, str]:
    """(the oldest release, the cap as written: "<=B" or "<B") of a dependency `name>=A,<=B` or `name>=A,<B`."""
    requirement = next(line for line in PYPROJECT["project"]["dependencies"] if re.match(rf"{name}\b", line))
    oldest = re.search(r">=([\d.]+)", requirement).group(1)
    return oldest, re.search(r"<=?[\d.]+", requirement).group(0)


def ci_installs() -> list[dict[str, str]]:
    """Each `pip install` line of `.ci/run` that pins torch, newest torch first: {package: pinned version}."""
    installs = [dict(re.findall(r"\b([a-z]+)==([\d.]+)", line)) for line in CI.splitlines()
                if "pip install" in line and "torch==" in line]
    return sorted(installs, key=lambda pins: [int(part) for part in pins["torch"].split(".")], reverse=True)


def test_pyprojects_torch_and_transformers_ranges_are_what_ci_installs_at_both_ends():
    """The suite runs on the newest torch with the newest Transformers, the version-dependent tests on the oldest with
    the oldest: pyproject's bounds are exactly those pins, and versions_dflash's floor is pyproject's."""
    newest, oldest = ci_installs()
    torch_floor, torch_cap = dependency_bounds("torch")
    transformers_floor, transformers_cap = dependency_bounds("transformers")
    assert (torch_cap, transformers_cap) == (f"<={newest['torch']}", "<5.26") and newest["transformers"] == "5.25.0"
    assert (oldest["torch"], oldest["transformers"]) == (f"{torch_floor}.0", transformers_floor)
    assert tuple(int(part) for part in torch_floor.split(".")) == OLDEST_TORCH
    assert PYPROJECT["project"]["requires-python"] == ">=3.11"  # CI's Python; Transformers 5.25 needs it
    assert PYPROJECT["tool"]["ruff"]["target-version"] == "py311"


def test_the_install_line_keeps_an_installed_torch():
    """README's main command names no torch and nothing that reinstalls: pip keeps a torch already in pyproject's
    range (a user's CUDA build); README says how to pick a build before it."""
    main_command, _ = setup_commands()
    install = main_command.split("pip install ", 1)[1].split(" && ")[0]
    assert install == '-e ".[demo]"'
    which_torch = README.split("### Which torch", 1)[1].split("\n## ", 1)[0]
    assert "--index-url https://download.pytorch.org/whl/cpu" in which_torch and "whl/cu" in which_torch


def test_the_gpu_quickstart_with_a_published_draft_and_compile_comes_first():
    """A new user finds clone, install, the CPU demo and the GPU quickstart (a published draft, compile=True) in
    README's first 80 lines, and README stays one screen per job."""
    head = "\n".join(README.splitlines()[:80])
    for needed in ("git clone", "dflash-hf demo", "## GPU quickstart", "z-lab/Qwen3-8B-DFlash-b16",
                   "draft.spec_generate(target=target, input_ids=input_ids", "compile=True", "first call"):
        assert needed in head, needed
    assert len(README.splitlines()) <= 270
