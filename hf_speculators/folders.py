"""Writing a folder of files all at once: a preset, an exported head checkpoint. Nothing is left half-written."""

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def write_folder(folder: str | Path, write: Callable[[Path], None]) -> Path:
    """Runs `write(temporary)` to fill a temporary folder beside `folder`, then moves its files into `folder`.

    A new `folder` appears at once, complete (one rename); into an existing folder each file is moved with
    `os.replace`, so each is either the old file or the new one, never half of one. If `write` raises (or the
    process is interrupted), the temporary folder is removed and `folder` is as it was.

    Args:
        folder (`str` or `Path`): the destination; its parent folders are created.
        write (`Callable[[Path], None]`): writes the files into the folder it is given.

    Returns:
        `Path`: `folder`.

    Raises:
        `NotADirectoryError`: `folder` exists and is a file.
    """
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise NotADirectoryError(f"{folder} is a file: pass a folder to write into.")
    folder.parent.mkdir(parents=True, exist_ok=True)
    temporary = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".partial", dir=folder.parent))
    try:
        write(temporary)
        if not folder.exists():
            os.rename(temporary, folder)
            return folder
        for path in temporary.iterdir():
            os.replace(path, folder / path.name)
    finally:
        shutil.rmtree(temporary, ignore_errors=True)
    return folder
