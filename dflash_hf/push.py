"""`dflash-hf push`: check a draft folder is Hub-ready (remote code, weights, card metadata) and upload it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

REMOTE_CODE_FILES = ("configuration_dflash.py", "modeling_dflash.py", "decoding.py")
REQUIRED_METADATA = ("base_model", "library_name", "pipeline_tag", "license", "tags")


def hub_ready_folder(folder: str | Path, staging: str | Path) -> Path:
    """`folder` if it already holds the remote code; else a copy in `staging` written by `save_pretrained`."""
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if all((folder / name).exists() for name in REMOTE_CODE_FILES) and "auto_map" in config:
        return folder
    from .modeling_dflash import DFlashDraftModel

    staging = Path(staging)
    DFlashDraftModel.from_pretrained(folder, dtype="auto").save_pretrained(staging)  # keep the stored dtype
    for extra in ("README.md", "dflash_card.json"):
        if (folder / extra).exists():
            shutil.copy(folder / extra, staging / extra)
    return staging


def check_hub_folder(folder: str | Path) -> list[str]:
    """Raise a ValueError naming what a Hub upload would miss; return the files to upload."""
    from huggingface_hub import ModelCard

    folder = Path(folder)
    missing = [name for name in ("config.json", "model.safetensors", "README.md", *REMOTE_CODE_FILES)
               if not (folder / name).exists()]
    if missing:
        raise ValueError(f"{folder} is not Hub-ready: missing {', '.join(missing)}.")
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if config.get("auto_map", {}).get("AutoModel") != "modeling_dflash.DFlashDraftModel":
        raise ValueError(f"{folder}/config.json has no auto_map to modeling_dflash.DFlashDraftModel for trust_remote_code.")
    metadata = ModelCard.load(folder / "README.md").data.to_dict()
    absent = [key for key in REQUIRED_METADATA if not metadata.get(key)]
    if absent:
        raise ValueError(f"{folder}/README.md metadata lacks {', '.join(absent)}.")
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file())


def push_to_hub(folder: str | Path, repo_id: str, private: bool = False, dry_run: bool = False,
                staging: str | Path | None = None) -> list[str]:
    """Upload a draft folder to the Hub model repo `repo_id` (created if needed); returns the uploaded files."""
    import tempfile

    with tempfile.TemporaryDirectory() as temporary:
        ready = hub_ready_folder(folder, staging or Path(temporary) / "draft")
        files = check_hub_folder(ready)
        if dry_run:
            return files
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(folder_path=str(ready), repo_id=repo_id, repo_type="model",
                          commit_message="Upload DFlash draft with dflash-hf")
        return files
