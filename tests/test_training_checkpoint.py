"""The resumable training checkpoint: a folder of safetensors and JSON, never a pickle or any torch file."""

from __future__ import annotations

import inspect
import json
import re
from dataclasses import asdict, replace
from pathlib import Path

import pytest
import torch
from helpers import VOCAB_SIZE, make_draft, make_target
from safetensors.torch import load_file
from transformers import get_cosine_schedule_with_warmup

import dflash_hf
import dflash_hf.versions_dflash as versions_dflash
from dflash_hf.training.processes import check_fsdp_applies
from dflash_hf.training.trainer import (
    CHECKPOINT_DIR,
    DRAFT_WEIGHTS_FILE,
    LEGACY_CHECKPOINT_FILE,
    OPTIMIZER_SCHEDULER_FILE,
    OPTIMIZER_TENSORS_FILE,
    STATE_FILE,
    TrainingLog,
    TrainingSettings,
    join_optimizer_state,
    load_checkpoint,
    save_checkpoint,
    split_optimizer_state,
    train_draft,
)

SETTINGS = TrainingSettings(epochs=2, learning_rate=2e-3, num_anchors=8, checkpoint_every=2)  # 4 rows: 8 steps


@pytest.fixture(scope="module")
def target() -> torch.nn.Module:
    return make_target("qwen3", seed=4)


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    generator = torch.Generator().manual_seed(3)
    return [{"prompt_ids": torch.randint(0, VOCAB_SIZE - 1, (5,), generator=generator).tolist(),
             "response_ids": torch.randint(0, VOCAB_SIZE - 1, (16,), generator=generator).tolist()}
            for _ in range(4)]


def test_checkpoint_is_a_folder_of_safetensors_and_json(tmp_path, target, rows):
    draft = make_draft(5, block_size=4)
    log = train_draft(draft, target, rows, SETTINGS, tmp_path, progress=False, max_steps=3)
    folder = tmp_path / CHECKPOINT_DIR
    assert {p.name for p in folder.iterdir()} == {DRAFT_WEIGHTS_FILE, OPTIMIZER_TENSORS_FILE, OPTIMIZER_SCHEDULER_FILE,
                                                  STATE_FILE}
    assert not (tmp_path / LEGACY_CHECKPOINT_FILE).exists()
    assert not list(tmp_path.glob(f"{CHECKPOINT_DIR}.*"))  # no staging or moved-aside folder left behind

    weights = load_file(folder / DRAFT_WEIGHTS_FILE)
    assert weights.keys() == draft.state_dict().keys()
    for name, value in draft.state_dict().items():
        assert torch.equal(weights[name], value.cpu()), name  # .cpu(): the draft trains on a GPU if there is one
    optimizer_scheduler = json.loads((folder / OPTIMIZER_SCHEDULER_FILE).read_text())
    assert optimizer_scheduler.keys() == {"optimizer", "scheduler"}  # no draft, no log: not the whole state
    assert optimizer_scheduler["scheduler"]["last_epoch"] == 3
    num_params = len(list(draft.parameters()))
    assert load_file(folder / OPTIMIZER_TENSORS_FILE).keys() == {  # AdamW: three tensors per parameter
        f"{param}.{name}" for param in range(num_params) for name in ("step", "exp_avg", "exp_avg_sq")}
    state = json.loads((folder / STATE_FILE).read_text())
    assert state["format"] == 2 and state["steps"] == 3 and state["losses"] == log.losses

    # no torch (zip/pickle) file: both tensor files are safetensors (a length-prefixed JSON header)
    for name in (DRAFT_WEIGHTS_FILE, OPTIMIZER_TENSORS_FILE):
        raw = (folder / name).read_bytes()
        assert raw[:2] != b"PK" and raw[8:9] == b"{" and int.from_bytes(raw[:8], "little") < len(raw), name


def test_a_resumed_run_continues_from_the_checkpoint(tmp_path, target, rows):
    first = make_draft(5, block_size=4)
    first_log = train_draft(first, target, rows, SETTINGS, tmp_path, progress=False, max_steps=3)
    saved = load_file(tmp_path / CHECKPOINT_DIR / DRAFT_WEIGHTS_FILE)

    idle = make_draft(6, block_size=4)  # nothing left to train: ends with exactly the checkpoint's weights
    idle_log = train_draft(idle, target, rows, SETTINGS, tmp_path, progress=False, max_steps=3)
    assert idle_log.steps == 3 and idle_log.losses == first_log.losses
    for name, value in idle.state_dict().items():
        assert torch.equal(value.cpu(), saved[name]), name

    resumed = make_draft(7, block_size=4)
    resumed_log = train_draft(resumed, target, rows, SETTINGS, tmp_path, progress=False, max_steps=5)
    assert resumed_log.steps == 5 and len(resumed_log.losses) == 5
    assert resumed_log.losses[:3] == first_log.losses  # the log continues: steps 1..3 came from the checkpoint
    scheduler_state = json.loads((tmp_path / CHECKPOINT_DIR / OPTIMIZER_SCHEDULER_FILE).read_text())["scheduler"]
    assert scheduler_state["last_epoch"] == 5


def test_a_resume_with_other_settings_or_data_is_refused_and_the_checkpoint_kept(tmp_path, target, rows):
    train_draft(make_draft(5, block_size=4), target, rows, SETTINGS, tmp_path, progress=False, max_steps=1)
    weights = (tmp_path / CHECKPOINT_DIR / DRAFT_WEIGHTS_FILE).read_bytes()
    for settings, kept_rows, message in [
        (replace(SETTINGS, learning_rate=1e-3), rows, "learning_rate 0.002 there, 0.001 here"),
        (replace(SETTINGS, num_anchors=4, distill=False), rows, "num_anchors 8 there, 4 here; distill True there"),
        (SETTINGS, rows[:3], "sequences 4 there, 3 here"),  # another schedule length
    ]:
        with pytest.raises(ValueError, match=re.escape(message)) as error:
            train_draft(make_draft(5, block_size=4), target, kept_rows, settings, tmp_path, progress=False)
        assert "start a new --output" in str(error.value)
    assert (tmp_path / CHECKPOINT_DIR / DRAFT_WEIGHTS_FILE).read_bytes() == weights
    # how often it is saved changes nothing that is trained: resumed
    log = train_draft(make_draft(5, block_size=4), target, rows, replace(SETTINGS, checkpoint_every=5), tmp_path,
                      progress=False, max_steps=2)
    assert log.steps == 2


def test_save_replaces_the_folder_and_load_restores_optimizer_and_schedule(tmp_path):
    def components(seed: int):
        draft = make_draft(seed, block_size=4)
        optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-3)
        return draft, optimizer, get_cosine_schedule_with_warmup(optimizer, 2, 10)

    draft, optimizer, scheduler = components(0)
    for _ in range(3):
        sum(p.square().sum() for p in draft.parameters()).backward()
        optimizer.step()
        scheduler.step()
    folder = tmp_path / CHECKPOINT_DIR
    (tmp_path / f"{CHECKPOINT_DIR}.tmp").mkdir()  # a stale staging folder from an interrupted save
    (tmp_path / f"{CHECKPOINT_DIR}.tmp" / "junk").write_text("x")
    save_checkpoint(folder, draft, optimizer, scheduler, TrainingLog(steps=2))
    save_checkpoint(folder, draft, optimizer, scheduler, TrainingLog(steps=3, losses=[1.0, 0.5, 0.25]))
    assert sorted(p.name for p in tmp_path.iterdir()) == [CHECKPOINT_DIR]

    fresh_draft, fresh_optimizer, fresh_scheduler = components(1)
    log = load_checkpoint(folder, fresh_draft, fresh_optimizer, fresh_scheduler)
    assert log == TrainingLog(steps=3, losses=[1.0, 0.5, 0.25])
    assert fresh_scheduler.state_dict() == scheduler.state_dict()
    for name, value in draft.state_dict().items():
        assert torch.equal(fresh_draft.state_dict()[name], value), name
    for fresh_state, state in zip(fresh_optimizer.state.values(), optimizer.state.values(), strict=True):
        assert all(torch.equal(fresh_state[key], state[key]) for key in ("step", "exp_avg", "exp_avg_sq"))

    folder.rename(tmp_path / f"{CHECKPOINT_DIR}.old")  # a save interrupted between its two renames
    assert load_checkpoint(folder, *components(2)) == log
    assert load_checkpoint(tmp_path / "elsewhere" / CHECKPOINT_DIR, *components(2)) is None


def test_an_old_pickle_checkpoint_is_refused_by_name(tmp_path, target, rows):
    legacy = tmp_path / LEGACY_CHECKPOINT_FILE
    legacy.write_bytes(b"never unpickled")
    with pytest.raises(ValueError, match=re.escape(str(legacy))) as error:
        train_draft(make_draft(5, block_size=4), target, rows, SETTINGS, tmp_path, progress=False, max_steps=1)
    assert "old pickle checkpoint" in str(error.value) and "--output" in str(error.value)
    assert not (tmp_path / CHECKPOINT_DIR).exists()


def test_a_checkpoint_of_the_torch_file_format_is_refused_with_the_way_out(tmp_path, target, rows):
    folder = tmp_path / CHECKPOINT_DIR
    folder.mkdir()
    (folder / STATE_FILE).write_text(json.dumps({"format": 1, **asdict(TrainingLog(steps=2))}))
    (folder / "optimizer_scheduler.pt").write_bytes(b"never unpickled")
    with pytest.raises(ValueError, match=re.escape(str(folder))) as error:
        train_draft(make_draft(5, block_size=4), target, rows, SETTINGS, tmp_path, progress=False, max_steps=1)
    assert "torch pickle" in str(error.value) and "--init-from" in str(error.value)
    (folder / STATE_FILE).write_text(json.dumps({"format": 7}))
    with pytest.raises(ValueError, match="unknown checkpoint format 7, expected 2"):
        load_checkpoint(folder, *[None] * 3)


def test_fsdp_is_refused_exactly_where_torch_lacks_the_safetensors_storage_of_its_sharded_checkpoints():
    """FSDP checkpoints are sharded safetensors through torch.distributed.checkpoint's HuggingFaceStorageWriter
    (`save_distributed`) and HuggingFaceStorageReader: the installed torch is refused exactly when it lacks them (on
    CI's oldest end, torch 2.6, it is refused)."""
    import torch.distributed.checkpoint as dcp

    writer = getattr(dcp, "HuggingFaceStorageWriter", None)
    storage = (writer is not None and "save_distributed" in inspect.signature(writer).parameters
               and hasattr(dcp, "HuggingFaceStorageReader"))
    assert (versions_dflash.torch_refusal("FSDP training") is None) == storage


def test_fsdp_on_an_older_torch_is_refused_before_loading_naming_the_release_and_the_way_out(tmp_path, monkeypatch):
    from accelerate.utils import DistributedType

    monkeypatch.setattr(versions_dflash, "TORCH_RELEASE", (2, 8))
    monkeypatch.setattr(versions_dflash, "TORCH_VERSION", "2.8.0+cu128")
    oldest = versions_dflash.NEWER_TORCH_FEATURES["FSDP training"][0]
    needs = (rf"FSDP training needs torch >= {oldest[0]}\.{oldest[1]} \(.*HuggingFaceStorageWriter.*\); this is "
             r"torch 2\.8\.0\+cu128\. Upgrade torch \(README, \"Which torch\"\), or train data-parallel without the "
             r"FSDP config")
    fsdp_gpu = type("State", (), {"distributed_type": DistributedType.FSDP, "device": torch.device("cuda")})()
    with pytest.raises(ValueError, match=needs):  # what `dflash-hf train` and `train_draft` check first
        check_fsdp_applies(fsdp_gpu)
    folder = tmp_path / CHECKPOINT_DIR  # a sharded checkpoint: refused before torch.distributed.checkpoint reads it
    folder.mkdir()
    (folder / STATE_FILE).write_text(json.dumps({"format": 2, "sharded": True, **asdict(TrainingLog(steps=2))}))
    (folder / OPTIMIZER_SCHEDULER_FILE).write_text(json.dumps({"optimizer": {"param_groups": []}, "scheduler": {}}))
    with pytest.raises(ValueError, match=needs):
        load_checkpoint(folder, make_draft(0, block_size=4), None, None)


def test_optimizer_state_splits_into_tensors_and_json_and_joins_back_exactly():
    draft = make_draft(0, block_size=4)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=1e-3, betas=(0.8, 0.95))
    sum(p.square().sum() for p in draft.parameters()).backward()
    optimizer.step()
    state_dict = optimizer.state_dict()
    tensors, rest = split_optimizer_state(state_dict)
    rest = json.loads(json.dumps(rest))  # as stored
    joined = join_optimizer_state(tensors, rest, optimizer.state_dict())
    assert joined["param_groups"] == state_dict["param_groups"]  # betas back as a tuple
    assert isinstance(joined["param_groups"][0]["betas"], tuple)
    assert list(joined["state"]) == list(state_dict["state"])  # in parameter order, not "0", "1", "10", ...
    for param, values in state_dict["state"].items():
        assert joined["state"][param].keys() == values.keys()
        for name, value in values.items():
            assert (torch.equal(joined["state"][param][name], value)
                    and joined["state"][param][name].dtype == value.dtype)


def test_the_package_never_calls_torch_load_or_pickle():
    package = Path(dflash_hf.__file__).parent
    offenders = [str(path.relative_to(package)) for path in sorted(package.rglob("*.py"))
                 if re.search(r"torch\.load\(|import pickle|weights_only\s*=\s*False",
                              path.read_text(encoding="utf-8"))]
    assert offenders == []


def test_bf16_mixed_precision_trains_under_autocast_and_keeps_float32_weights(tmp_path, target, rows):
    logs = {}
    for precision in ("no", "bf16"):
        settings = TrainingSettings(epochs=2, learning_rate=2e-3, num_anchors=8, mixed_precision=precision)
        draft = make_draft(5, block_size=4)
        logs[precision] = train_draft(draft, target, rows, settings, tmp_path / precision, progress=False)
    bf16 = logs["bf16"].losses
    assert len(bf16) == 8 and all(torch.isfinite(torch.tensor(bf16)))
    assert sum(bf16[-4:]) < sum(bf16[:4])  # it learns
    assert bf16 != logs["no"].losses  # the forward really ran in bfloat16 ...
    assert bf16[0] == pytest.approx(logs["no"].losses[0], rel=2e-2)  # ... computing the same loss
    assert {p.dtype for p in draft.parameters()} == {torch.float32}  # master weights
    saved = load_file(tmp_path / "bf16" / CHECKPOINT_DIR / DRAFT_WEIGHTS_FILE)
    assert {tensor.dtype for tensor in saved.values()} == {torch.float32}
    optimizer_state = load_file(tmp_path / "bf16" / CHECKPOINT_DIR / OPTIMIZER_TENSORS_FILE)
    assert {tensor.dtype for name, tensor in optimizer_state.items() if name.endswith(".exp_avg")} == {torch.float32}
    with pytest.raises(ValueError, match="mixed_precision 'fp8'"):
        TrainingSettings(mixed_precision="fp8")
