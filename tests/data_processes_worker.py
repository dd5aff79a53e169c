"""One process of tests/test_training_data_processes.py: `dflash-hf train ARGS` (`python data_processes_worker.py
FOLDER ARGS...` under torchrun), recording in FOLDER/record-<rank>.json the prompt texts this process rendered with the
chat template and how many response rows ({"prompt_ids", "response_ids", ...}) it decoded from JSON."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import dflash_hf.training.data as data
from dflash_hf.cli import main

RANK = int(os.environ.get("RANK", 0))  # set by torchrun


def run(folder: Path, arguments: list[str]) -> None:
    """Train with `arguments`, counting this process's renders and row decodes."""
    rendered: list[str] = []
    decoded = [0]
    render, loads = data.user_prompt_ids, json.loads

    def counted_render(tokenizer, text, *args, **kwargs):
        rendered.append(text)
        return render(tokenizer, text, *args, **kwargs)

    def counted_loads(text, *args, **kwargs):
        value = loads(text, *args, **kwargs)
        if isinstance(value, dict) and "response_ids" in value:
            decoded[0] += 1
        return value

    data.user_prompt_ids, json.loads = counted_render, counted_loads
    try:
        main(arguments)
    finally:
        data.user_prompt_ids, json.loads = render, loads
    (folder / f"record-{RANK}.json").write_text(json.dumps({"rendered": rendered, "decoded": decoded[0]}))


if __name__ == "__main__":
    run(Path(sys.argv[1]), sys.argv[2:])
