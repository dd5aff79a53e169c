"""README's set-up commands are the ones CI runs, and every `dflash-hf` command it shows exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dflash_hf.cli import main

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CI = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
# `dflash-hf <command>` where the README shows a command: at a line start (code blocks), after a backtick or `&&`
SHOWN_COMMANDS = sorted(set(re.findall(r"(?:^|`|&& )dflash-hf ([a-z]+)", README, flags=re.M)))


def setup_commands() -> tuple[str, str]:
    section = README.split("## Install and run the demo", 1)[1]
    blocks = re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)
    return blocks[0].strip(), blocks[1].strip()


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
