"""A draft's checkpoints on disk: which sources hold a draft, strict loading (also of Transformers' native DFlash
folders), and the versioned export with the remote code.

`DFlashCheckpointMixin` gives the draft models (`modeling_dflash`) their `from_pretrained` and `save_pretrained`, as
`DFlashGenerationMixin` gives them `spec_generate`. Hub remote code: imports only torch, transformers and its sibling
files.
"""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from .configuration_dflash import (
    CUSTOM_GENERATE_FILE,
    DEEPSPEC_BORROWED_WEIGHTS,
    DEEPSPEC_GEMMA4_ARCHITECTURE,
    DFLASH_HF_VERSION,
    NATIVE_MODEL_TYPE,
    REMOTE_CODE_FILES,
    SPECULATORS_TYPE_KEY,
    DFlashConfig,
    config_from_native,
    config_from_speculators,
    speculators_verifier_copies,
)
from .custom_generate_dflash import generate as custom_generate

# Weight name prefixes of Transformers' native DFlash draft (`MuseGlimmerAssistantModel`) -> ours; the rest is shared.
NATIVE_PREFIXES = {"encoder.fc.": "fc.", "encoder.output_norm_enc.": "hidden_norm."}
# from_pretrained's form
NATIVE_KEY_MAPPING = {"^" + re.escape(native): ours for native, ours in NATIVE_PREFIXES.items()}

# The first line of every remote-code file that `save_pretrained` writes.
REMOTE_CODE_HEADER = ("# Exported by dflash-hf {version}: a copy of the package's module; "
                      "change the package, not this file.\n")
# What from_pretrained reads a config with, of its own keyword arguments.
CONFIG_ARGUMENTS = ("revision", "cache_dir", "local_files_only", "token", "subfolder", "force_download", "proxies")


def without_export_header(text: str) -> str:
    """A remote-code file's text without the header line `save_pretrained` puts first (as the package has it)."""
    return text.split("\n", 1)[1] if text.startswith(REMOTE_CODE_HEADER.split("{", 1)[0]) else text


def check_draft_source(source: Any, subfolder: str = "") -> None:
    """Raise a FileNotFoundError / ValueError when `source` (and `subfolder` in it) names a local path that holds no
    draft (a missing folder, a file, a folder without config.json); a Hub repo id ("namespace/name") passes."""
    if source is None or not isinstance(source, (str, Path)):
        return
    path = Path(source).expanduser() / subfolder
    if path.is_file():
        raise ValueError(f"{source} is a file; pass the draft's folder (with config.json and model.safetensors).")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ValueError(f"{source} holds no config.json: it is not a draft folder (export one with "
                             "draft.save_pretrained(folder) or `dflash-hf convert`).")
        return
    text = str(source)
    looks_local = (isinstance(source, Path) or path.is_absolute() or text.startswith((".", "~")) or "\\" in text
                   or text.count("/") != 1)
    if looks_local:
        raise FileNotFoundError(f"No draft folder at {source}; pass an existing folder or a Hub repo id "
                                "('namespace/name').")


def loading_problems(loading_info: dict[str, Any]) -> str | None:
    """The weights a load left missing, unexpected or mismatched, in words (at most six names of each), or None."""
    problems = {key: sorted(map(str, value)) for key, value in loading_info.items()
                if key in ("missing_keys", "unexpected_keys", "mismatched_keys") and value}
    if not problems:
        return None
    return "; ".join(f"{key}: {', '.join(names[:6])}{' ...' if len(names) > 6 else ''}"
                     for key, names in problems.items())


class DFlashCheckpointMixin:
    """Strict `from_pretrained` and versioned `save_pretrained` of a draft model class; it comes before
    `PreTrainedModel` in the class's bases, whose methods do the loading and saving."""

    @classmethod
    def checkpoint_class(cls, config: DFlashConfig | dict[str, Any]) -> type:
        """The class that loads a checkpoint with `config` (a config or its dict) when `cls.from_pretrained` is
        called: `cls` itself unless the model class says otherwise."""
        return cls

    @classmethod
    def from_pretrained(cls, *args: Any, **kwargs: Any) -> Any:
        """`PreTrainedModel.from_pretrained` of the class the checkpoint's config names (`checkpoint_class`: DFlash or
        DFlash2), refusing a checkpoint whose weights do not match the draft one for one. A folder of Transformers'
        native DFlash draft (`muse_glimmer_assistant`) or of vLLM speculators' (`speculators_model_type: "dflash"`)
        loads as the same draft in our layout, and so does one of DeepSpec's Gemma-4 drafts (its config is the
        target's Gemma-4 text config, model type and all)."""
        wants_loading_info = kwargs.pop("output_loading_info", False)
        source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
        check_draft_source(source, kwargs.get("subfolder") or "")
        config, unread = kwargs.get("config"), ()
        if not isinstance(config, DFlashConfig):
            config, _ = DFlashConfig.get_config_dict(
                source, **{key: kwargs[key] for key in CONFIG_ARGUMENTS if key in kwargs})
            if config.get("model_type") == NATIVE_MODEL_TYPE:
                kwargs["config"] = config = DFlashConfig(**config_from_native(config))
                kwargs.setdefault("key_mapping", NATIVE_KEY_MAPPING)
            elif config.get(SPECULATORS_TYPE_KEY) is not None:
                kwargs["config"] = config = DFlashConfig(**config_from_speculators(config))
                unread = speculators_verifier_copies(config)
            elif DEEPSPEC_GEMMA4_ARCHITECTURE in (config.get("architectures") or []):
                # its model type is the target's (gemma4_text, ...): read here, not as another class's config
                kwargs["config"] = config = DFlashConfig(**config)
        model_class = cls.checkpoint_class(config)
        try:
            model, loading_info = super(DFlashCheckpointMixin, model_class).from_pretrained(
                *args, output_loading_info=True, **kwargs)
        except RuntimeError as error:  # Transformers refuses weights of other shapes with a RuntimeError
            if "size" not in str(error):
                raise
            raise ValueError("The checkpoint's weights do not match a DFlash draft of this config: "
                             f"{error}") from error
        except Exception as error:
            if type(error).__name__ != "SafetensorError":
                raise
            raise ValueError(f"{source}: the weights file is damaged and cannot be read ({error}); download or "
                             "export the draft again.") from error
        if unread:  # a speculators checkpoint's copies of the verifier's weights: the target's own are used
            loading_info = {**loading_info, "unexpected_keys": [
                key for key in loading_info.get("unexpected_keys") or () if key not in unread]}
        if model.config.shifted_labels:  # a DeepSpec checkpoint's frozen copies of the target's: the target's are used
            loading_info = {**loading_info, "unexpected_keys": [
                key for key in loading_info.get("unexpected_keys") or () if key not in DEEPSPEC_BORROWED_WEIGHTS]}
        problems = loading_problems(loading_info)
        if problems is not None:
            raise ValueError(f"The checkpoint's weights do not match a DFlash draft of this config "
                             f"({model_class.__name__}: {problems}). "
                             "Is it a DFlash draft in the published layout (fc, hidden_norm, layers.*, norm)?")
        return (model, loading_info) if wants_loading_info else model

    def save_pretrained(self, save_directory: str | Path, *args: Any, **kwargs: Any) -> None:
        """`PreTrainedModel.save_pretrained` in the published DFlash layout (also for a draft loaded from a native
        folder), recording the dflash-hf version in config.json and the remote-code files."""
        config = self.config
        if config.dflash_config.get("vocab_size_unknown"):
            raise ValueError("This draft came from a native folder that does not record the target's vocabulary size; "
                             "set draft.config.vocab_size = <the target's vocabulary size> and delete "
                             "draft.config.dflash_config['vocab_size_unknown'] before saving (or use "
                             "dflash-hf convert --vocab-size), so that other readers see the right size.")
        config.dflash_hf_version = DFLASH_HF_VERSION
        if "save_original_format" in inspect.signature(PreTrainedModel.save_pretrained).parameters:  # Transformers 5
            kwargs.setdefault("save_original_format", False)  # not the names it was loaded under (key_mapping)
        super().save_pretrained(save_directory, *args, **kwargs)
        # custom_generate/generate.py, where `generate(custom_generate=FOLDER)` looks: this package module, as is
        custom_generate_path = Path(save_directory) / CUSTOM_GENERATE_FILE
        custom_generate_path.parent.mkdir(exist_ok=True)
        custom_generate_path.write_text(Path(inspect.getfile(custom_generate)).read_text(encoding="utf-8"),
                                        encoding="utf-8")
        header = REMOTE_CODE_HEADER.format(version=DFLASH_HF_VERSION)
        for path in [Path(save_directory) / name for name in REMOTE_CODE_FILES] + [custom_generate_path]:
            if path.exists():
                path.write_text(header + without_export_header(path.read_text(encoding="utf-8")), encoding="utf-8")
