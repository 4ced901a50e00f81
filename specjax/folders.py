"""Checkpoint folders found and their small files read without trusting them: a local
folder or a Hugging Face hub id (`resolve`), files that are regular files and not FIFOs or
devices (`check_regular`), JSON that is an object (`_read_json`), and the errors that say
what is wrong with a folder.

It knows nothing of what the files hold: hf.py reads weights and configs, text.py
tokenizers, drafters/ their own records.
"""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint folder is missing files, or its files are corrupt or do not match the config."""


class UnsafeCheckpointError(CheckpointError):
    """The checkpoint's weights are a pickle (pytorch_model.bin and the like), which specjax
    refuses to load: unpickling a file can run any code its author chose."""


def check_regular(file: Path) -> Path:
    """file, unless it exists and is not a regular file (a FIFO, a device, a socket: reading
    one can block forever or never end) or is a symbolic link to nothing: those raise
    CheckpointError."""
    try:
        mode = file.stat().st_mode
    except FileNotFoundError:
        if file.is_symlink():
            raise CheckpointError(f"{file} is a symbolic link to nothing ({os.readlink(file)})") from None
        return file
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{file} is not a regular file (a folder, FIFO, device or socket); refusing to read it")
    return file


HUB_PATTERNS = ("*.json", "*.safetensors", "*.txt", "*.model")


def resolve(path: str | os.PathLike, patterns: tuple[str, ...] = HUB_PATTERNS) -> Path:
    """A local folder, or else a hub id ("gpt2", "org/name") resolved (downloaded: the files
    matching patterns) with huggingface_hub: any name that is no local path and is a valid
    repo id is tried as one."""
    folder = Path(path)
    if folder.is_dir():
        return folder
    if folder.exists():
        raise CheckpointError(f"{folder} is a file; expected a folder with config.json and *.safetensors")
    name = str(path)
    if not _is_hub_id(name):
        raise CheckpointError(f"checkpoint folder {name} does not exist")
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.utils import LocalEntryNotFoundError

    if not constants.HF_HUB_OFFLINE:  # offline, the refusal below says it all
        print(f"note: {name} is not a folder here; trying it as a Hugging Face hub id", file=sys.stderr)
    try:
        return Path(snapshot_download(name, allow_patterns=list(patterns)))
    except Exception as e:  # offline and not cached, unknown repo, no access: say which and why
        offline = constants.HF_HUB_OFFLINE and isinstance(e, LocalEntryNotFoundError)
        why = "it is not in the local cache, and HF_HUB_OFFLINE is set" if offline else f"{type(e).__name__}: {e}"
        raise CheckpointError(f"{name} is not a local folder, and tried as a Hugging Face hub id it could not be "
                              f"fetched: {why}") from e


def _is_hub_id(name: str) -> bool:
    """True for a name the hub could hold ("gpt2", "org/name"); not for paths such as
    "./x", "/abs" or "a/b/c"."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def _read_json(file: Path) -> dict:
    check_regular(file)
    try:
        value = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{file} is not valid JSON: {e}") from e
    except RecursionError:
        raise CheckpointError(f"{file} nests its JSON too deeply to be a config") from None
    if not isinstance(value, dict):
        raise CheckpointError(f"{file} holds a JSON {type(value).__name__}, not an object")
    return value
