"""`dflash-hf push`: check a draft folder is Hub-ready (remote code, weights, card metadata) and upload it."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from .checkpoint_dflash import check_draft_source, without_export_header
from .configuration_dflash import CUSTOM_GENERATE_FILE, REMOTE_CODE_FILES
from .modeling_dflash import DFlashDraftModel

REQUIRED_METADATA = ("base_model", "library_name", "pipeline_tag", "license", "tags")
PACKAGE_DIR = Path(__file__).resolve().parent


def hub_ready_folder(folder: str | Path, staging: str | Path) -> Path:
    """`folder` if it already holds the remote code; else a copy in `staging` written by `save_pretrained`."""
    check_draft_source(folder)
    folder = Path(folder)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if all((folder / name).exists() for name in remote_code_sources()) and "auto_map" in config:
        return folder
    staging = Path(staging)
    DFlashDraftModel.from_pretrained(folder, dtype="auto").save_pretrained(staging)  # keep the stored dtype
    for extra in ("README.md", "dflash_card.json"):
        if (folder / extra).exists():
            shutil.copy(folder / extra, staging / extra)
    return staging


def remote_code_sources() -> dict[str, Path]:
    """Each remote-code file of an exported folder, and the package module it is a copy of."""
    return {**{name: PACKAGE_DIR / name for name in REMOTE_CODE_FILES},
            CUSTOM_GENERATE_FILE: PACKAGE_DIR / "custom_generate_dflash.py"}


def differing_remote_code(folder: str | Path) -> list[str]:
    """The remote-code files of `folder` that differ from the installed package's modules."""
    folder = Path(folder)
    return [name for name, source in remote_code_sources().items()
            if (folder / name).exists() and without_export_header((folder / name).read_text(encoding="utf-8"))
            != source.read_text(encoding="utf-8")]


def check_hub_folder(folder: str | Path, keep_remote_code: bool = False,
                     shown_as: str | Path | None = None) -> list[str]:
    """Raise a ValueError naming what a Hub upload would miss (or remote code not the installed package's).

    `shown_as`: the folder the user named, when `folder` is a staged copy of it (messages name the user's)."""
    from huggingface_hub import ModelCard

    folder = Path(folder)
    shown = Path(shown_as) if shown_as is not None else folder
    missing = [name for name in ("config.json", "model.safetensors", "README.md", *remote_code_sources())
               if not (folder / name).exists()]
    if missing:
        raise ValueError(f"{shown} is not Hub-ready: missing {', '.join(missing)}.")
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    if config.get("auto_map", {}).get("AutoModel") != "modeling_dflash.DFlashDraftModel":
        raise ValueError(f"{shown}/config.json has no auto_map to modeling_dflash.DFlashDraftModel "
                         "for trust_remote_code.")
    differing = differing_remote_code(folder)
    if differing and not keep_remote_code:
        raise ValueError(
            f"{shown}: the remote code {', '.join(differing)} differs from the installed dflash-hf's "
            f"(the folder says {config.get('dflash_hf_version', 'no version')}): re-export the draft with "
            "save_pretrained, or pass --keep-remote-code to upload the folder's own code."
        )
    metadata = ModelCard.load(folder / "README.md").data.to_dict()
    absent = [key for key in REQUIRED_METADATA if not metadata.get(key)]
    if absent:
        raise ValueError(f"{shown}/README.md metadata lacks {', '.join(absent)}.")
    return sorted(str(path.relative_to(folder)) for path in folder.rglob("*") if path.is_file())


def push_to_hub(folder: str | Path, repo_id: str, private: bool = False, dry_run: bool = False,
                staging: str | Path | None = None, keep_remote_code: bool = False) -> list[str]:
    """Upload a draft folder to the Hub model repo `repo_id` (created if needed); returns the uploaded files."""
    token = None
    if not dry_run:
        from huggingface_hub import get_token

        token = get_token()
        if token is None:
            raise ValueError("No Hugging Face token: run `huggingface-cli login` (or `hf auth login`) or set "
                             "HF_TOKEN, then push again; `dflash-hf push --dry-run` checks the folder without one.")
    with tempfile.TemporaryDirectory() as temporary:
        ready = hub_ready_folder(folder, staging or Path(temporary) / "draft")
        files = check_hub_folder(ready, keep_remote_code, shown_as=folder)
        if dry_run:
            return files
        from huggingface_hub import HfApi

        api = HfApi(token=token)
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        api.upload_folder(folder_path=str(ready), repo_id=repo_id, repo_type="model",
                          commit_message="Upload DFlash draft with dflash-hf")
        return files
