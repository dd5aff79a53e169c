"""The prompt sets ship with the package: bench and train find them in any clone or install, each with its license."""

import hashlib
import re
import sys

import pytest

from dflash_hf.benchmark import DATASETS
from dflash_hf.prompts import SHIPPED_DATA_DIR, default_data_dir, read_conversations

TRAINING_FILES = ("gsm8k_train.jsonl", "mbpp_train.jsonl")  # train's default prompts and the shipped draft's data


def data_readme_rows() -> dict[str, tuple[int, str, str]]:
    """file -> (rows, sha256, license), from the table in the data folder's README."""
    table = re.findall(r"^\| (\S+\.jsonl) \| (\d+) \| \d+ \| `([0-9a-f]{64})` \| (\S+) \|$",
                       (SHIPPED_DATA_DIR / "README.md").read_text(), re.MULTILINE)
    return {name: (int(rows), sha, license) for name, rows, sha, license in table}


def test_every_shipped_prompt_file_is_listed_with_its_rows_checksum_and_license():
    listed = data_readme_rows()
    shipped = sorted(path.name for path in SHIPPED_DATA_DIR.glob("*.jsonl"))
    assert shipped == sorted(listed), "each file in dflash_hf/data needs a row (rows, sha256, license) in its README"
    assert {source.file_name for source in DATASETS.values()} | set(TRAINING_FILES) <= set(shipped)
    for name, (rows, sha, license) in listed.items():
        content = (SHIPPED_DATA_DIR / name).read_bytes()
        assert hashlib.sha256(content).hexdigest() == sha, name
        assert content.count(b"\n") == rows and license in {"MIT", "CC-BY-4.0", "Apache-2.0"}, name


def test_the_default_data_folder_is_the_shipped_one_unless_the_environment_names_another(monkeypatch, tmp_path):
    monkeypatch.delenv("DFLASH_HF_DATA_DIR", raising=False)
    assert default_data_dir() == SHIPPED_DATA_DIR
    assert len(read_conversations(default_data_dir() / "gsm8k_test.jsonl")) == 1319
    monkeypatch.setenv("DFLASH_HF_DATA_DIR", str(tmp_path))
    assert default_data_dir() == tmp_path


@pytest.mark.parametrize("dataset", sorted(DATASETS))
def test_each_benchmark_reads_from_the_shipped_data_without_a_network(dataset, monkeypatch):
    from dflash_hf.benchmark import load_conversations

    monkeypatch.setitem(sys.modules, "datasets", None)  # the Hub fallback would fail
    conversations = load_conversations(dataset, SHIPPED_DATA_DIR, limit=3)
    assert len(conversations) == 3 and all(turn for conversation in conversations for turn in conversation)
