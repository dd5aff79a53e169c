"""The tokenized training sequences on disk: Arrow files that every process memory-maps (Hugging Face `datasets`).

`dflash-hf train` writes them once into OUTPUT/data/ (`write_sequences`: each process its own range of rows, one
file per process and part), and every process opens them all as one `SequenceStore`, reading only the rows a step
trains on. So no process holds the whole corpus in memory, whatever its size (docs/training.md, "Data that streams").
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

STORE_DIR = "data"  # OUTPUT/data/: the sequences' Arrow files and what they were built from
STORE_FACTS_FILE = "store.json"  # the sources and settings the files were built from; written last
WRITE_BATCH_ROWS = 1024  # rows per Arrow record batch written (the writer holds one batch at a time)
PARTS = ("train", "held_out")  # the trained sequences, and those held out of training (--held-out-rows)


def check_datasets_installed() -> None:
    """Refuse training without Hugging Face `datasets` (the `train` extra), naming the install."""
    try:
        import datasets  # noqa: F401
    except ImportError as error:
        raise ImportError("training reads its sequences through Hugging Face datasets, which is not installed: "
                          "pip install 'dflash-hf[train]' (README, \"Train your own draft\")") from error


def part_file(folder: Path, part: str, shard: int) -> Path:
    """The Arrow file of `part` ("train" or "held_out") that process `shard` wrote."""
    return folder / f"{part}-{shard:05d}.arrow"


def write_sequences(path: Path, sequences: Iterable[tuple[list[int], list[int]]], max_length: int) -> int:
    """Write (token ids, loss mask) pairs to the Arrow file `path` (a stream of record batches, which `datasets`
    memory-maps), each cut to `max_length`; a sequence with no label after the cut is left out, as
    `trainer.training_sequences` does. Returns the number written. Memory: one record batch."""
    import pyarrow as pa

    schema = pa.schema([("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.int8()))])
    staging, written = path.with_name(path.name + ".tmp"), 0
    with pa.OSFile(str(staging), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        batch: dict[str, list[list[int]]] = {"input_ids": [], "loss_mask": []}
        for ids, mask in sequences:
            ids, mask = ids[:max_length], mask[:max_length]
            if sum(mask[1:]) == 0:
                continue
            batch["input_ids"].append(ids)
            batch["loss_mask"].append(mask)
            if len(batch["input_ids"]) == WRITE_BATCH_ROWS:
                written += _write_batch(writer, batch, schema)
        written += _write_batch(writer, batch, schema)
    staging.replace(path)
    return written


def _write_batch(writer: Any, batch: dict[str, list[list[int]]], schema: Any) -> int:
    """Write `batch`'s rows as one record batch (none when empty), empty it and return how many were written."""
    import pyarrow as pa

    count = len(batch["input_ids"])
    if count:
        writer.write_batch(pa.record_batch([batch["input_ids"], batch["loss_mask"]], schema=schema))
    for values in batch.values():
        values.clear()
    return count


def read_store_facts(folder: Path) -> dict[str, Any] | None:
    """What the store in `folder` was built from (`store_facts`), or None where no complete store is there."""
    path = folder / STORE_FACTS_FILE
    return json.loads(path.read_text()) if path.exists() else None


def write_store_facts(folder: Path, facts: dict[str, Any]) -> None:
    """Record what the store was built from; written after every part file, so a store with it is complete."""
    (folder / STORE_FACTS_FILE).write_text(json.dumps(facts))


def row_tokens(row: dict) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of a training row: a generated row {"prompt_ids", "response_ids"} (the response
    counts), or a conversation row {"input_ids", "loss_mask"} (`data.conversation_row`: the assistant turns count)."""
    if "input_ids" in row:
        return row["input_ids"], row["loss_mask"]
    return row["prompt_ids"] + row["response_ids"], [0] * len(row["prompt_ids"]) + [1] * len(row["response_ids"])


class SequenceStore(Sequence[tuple[torch.Tensor, torch.Tensor]]):
    """Training sequences memory-mapped from the Arrow files of one part (`datasets.Dataset.from_file` of each,
    concatenated in shard order): `store[i]` reads sequence i alone as (input_ids [T], loss_mask [T]) int64
    tensors, as `trainer.training_sequences` gives them."""

    def __init__(self, folder: Path, part: str, shards: int) -> None:
        from datasets import Dataset, concatenate_datasets

        parts = [Dataset.from_file(str(part_file(folder, part, shard))) for shard in range(shards)]
        self.dataset = concatenate_datasets(parts).with_format("numpy")

    def __len__(self) -> int:
        return len(self.dataset)

    def lengths(self) -> list[int]:
        """Tokens of every sequence, from the Arrow column's list offsets (no sequence is read)."""
        import pyarrow.compute as pc

        return pc.list_value_length(self.dataset.data.column("input_ids")).to_numpy().tolist()

    def label_counts(self, rows: range, vocab_size: int) -> torch.Tensor:
        """How often each token id is a label (loss mask 1) in the sequences `rows` [V], read WRITE_BATCH_ROWS
        sequences at a time."""
        import numpy as np

        counts = np.zeros(vocab_size, dtype=np.int64)
        for start in range(rows.start, rows.stop, WRITE_BATCH_ROWS):
            batch = self.dataset[start:min(start + WRITE_BATCH_ROWS, rows.stop)]
            labels = [ids[mask.astype(bool)] for ids, mask in zip(batch["input_ids"], batch["loss_mask"])]
            if labels:
                counts += np.bincount(np.concatenate(labels), minlength=vocab_size)[:vocab_size]
        return torch.from_numpy(counts)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.dataset[index]
        return (torch.from_numpy(row["input_ids"]).long(), torch.from_numpy(row["loss_mask"]).long())
