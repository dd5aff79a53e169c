"""Prompts: JSONL prompt files (one source for bench and train) and chat rendering with a target's template."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterable

PROMPT_FIELDS = ("turns", "question", "prompt", "problem", "instruction")  # tried in this order


SHIPPED_DATA_DIR = Path(__file__).resolve().parent / "data"  # the prompt sets installed with the package


def default_data_dir() -> Path:
    """Where the benchmark and training JSONL files live: $DFLASH_HF_DATA_DIR, else the prompt sets shipped with the
    package (`dflash_hf/data`, sources and licenses in its README)."""
    return Path(os.environ["DFLASH_HF_DATA_DIR"]) if os.environ.get("DFLASH_HF_DATA_DIR") else SHIPPED_DATA_DIR


def record_turns(record: dict[str, Any], field: str | None = None, where: str = "a record") -> list[str]:
    """The user turns of one JSONL record: `field` (a string or a list of strings), else the first of PROMPT_FIELDS."""
    name = field if field is not None else next((key for key in PROMPT_FIELDS if key in record), None)
    if name is None or name not in record:
        wanted = repr(field) if field is not None else "/".join(PROMPT_FIELDS)
        raise ValueError(f"{where}: expected an object with a {wanted} list or string, got keys {sorted(record)}.")
    value = record[name]
    turns = [value] if isinstance(value, str) else list(value) if isinstance(value, list) else []
    if not turns or not all(isinstance(turn, str) and turn for turn in turns):
        raise ValueError(f"{where}: {name!r} must be a non-empty string or list of strings, got {value!r}.")
    return turns


def read_conversations(paths: str | Path | Iterable[str | Path], field: str | None = None,
                       limit: int | None = None) -> list[list[str]]:
    """User turns of every record (one conversation a line) of one or more JSONL files, up to `limit` in all."""
    conversations: list[list[str]] = []
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        check_prompt_file(path)
        with open(path, encoding="utf-8") as handle:
            for number, line in enumerate(handle, 1):
                if limit is not None and len(conversations) >= limit:
                    return conversations
                if line.strip():
                    conversations.append(line_turns(line, field, where=f"{path}:{number}"))
    return conversations


def check_prompt_file(path: str | Path) -> None:
    """Raise a FileNotFoundError naming the fix where there is no prompt file at `path`."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"No prompt file at {path} (JSONL, one object per line); pass --data-dir or the "
                                "file's path (README, 'Benchmark'; docs/benchmark.md).")


def line_turns(line: str | bytes, field: str | None, where: str) -> list[str]:
    """The user turns of one line of a JSONL prompt file (`record_turns`); a ValueError naming `where` otherwise."""
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not a JSON object ({error.msg}).") from None
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}.")
    return record_turns(record, field, where=where)


def chat_prompt_ids(tokenizer: Any, turns: list[dict[str, str]], thinking: bool = False) -> list[int]:
    """Token ids of a chat rendered with the generation prompt, tokenized once (a single BOS). `thinking` is the
    `enable_thinking` switch of templates that have one (Qwen3): off by default, as the paper measures."""
    ids = tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, return_dict=False,
                                        enable_thinking=thinking)
    return list(ids)


def user_prompt_ids(tokenizer: Any, text: str, thinking: bool = False) -> list[int]:
    """Token ids of one user message rendered as a chat with the generation prompt (see `chat_prompt_ids`)."""
    return chat_prompt_ids(tokenizer, [{"role": "user", "content": text}], thinking)
