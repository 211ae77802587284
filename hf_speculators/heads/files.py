"""Reading a draft head's checkpoint files, local or from the Hub, as data only (never code)."""

import json
from collections.abc import Sequence
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from safetensors import SafetensorError
from safetensors.torch import load_file

from ..loading import looks_local, reading, resolve_model_id

# what a head reader may need from a repository: its config and weights, never code
HEAD_FILE_PATTERNS = ("*.json", "*.safetensors", "*.bin", "*.pt")


def head_folder(repo_id_or_path: str, revision: str | None = None, token: str | None = None) -> Path:
    """The local folder of a draft head checkpoint: a local folder or demo id as is, a Hub repo downloaded (its
    JSON and weight files only; needs a network).

    Raises:
        `FileNotFoundError`: a local path that does not exist or is not a folder.
        `OSError`: a Hub repo that cannot be fetched (offline, no such repo, no access).
    """
    name = resolve_model_id(repo_id_or_path)
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if looks_local(name) or path.exists():
        raise FileNotFoundError(
            f"Draft head checkpoint {repo_id_or_path!r} is not a folder: pass the folder holding its config.json and "
            "weights, or a Hub id such as 'RedHatAI/Llama-3.1-8B-Instruct-speculator.eagle3'."
        )
    with reading(name, "Draft head checkpoint"):
        return Path(snapshot_download(name, revision=revision, token=token, allow_patterns=list(HEAD_FILE_PATTERNS)))


def read_json(path: Path) -> dict:
    """A JSON object from `path`. Raises `ValueError` naming the file when it is malformed or not an object."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: malformed JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}.")
    return value


def read_weights(folder: Path, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """The tensors of the first file of `names` present in `folder`: safetensors with `safetensors`, a `.bin` or
    `.pt` pickle only through `torch.load(weights_only=True)` (tensors and plain containers, no code).

    Raises:
        `FileNotFoundError`: none of `names` is in `folder` (the message lists them).
        `ValueError`: a safetensors file that cannot be read (corrupted or truncated), a pickle holding anything but
            tensors (refused by `weights_only`), or not a mapping.
    """
    for name in names:
        path = folder / name
        if not path.is_file():
            continue
        if path.suffix == ".safetensors":
            try:
                return load_file(str(path))
            except (SafetensorError, OSError) as error:
                raise ValueError(f"{path}: not a readable safetensors file ({error}); save or download it again.") from None
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as error:  # pickle.UnpicklingError for anything but tensors and containers
            raise ValueError(f"{path}: not a plain tensor checkpoint, refused without running its code: {error}") from None
        if not isinstance(state, dict):
            raise ValueError(f"{path}: expected a mapping of tensor names to tensors, got {type(state).__name__}.")
        return state
    raise FileNotFoundError(f"{folder} holds none of the weight files {list(names)}.")
