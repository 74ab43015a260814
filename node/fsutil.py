"""Durable file-system steps shared by checkpoints, datasets and exports: fsync a file or a directory."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def fsync_file(path: Path) -> None:
    """Flush a written file's data to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory entry (a rename or a new file in it) to disk.

    Some file systems (certain network mounts) refuse fsync on directories; the rename is still atomic there,
    only its durability across a power cut is weaker, so that refusal is ignored."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes | str, *, durable: bool = False) -> None:
    """Write `data` to `path` so that a reader sees the old file or the new one, never a part: into a temporary
    file beside it, then renamed over it. `durable`: the file and the rename are also flushed to disk."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as file:
            file.write(data.encode() if isinstance(data, str) else data)
            if durable:
                file.flush()
                os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    if durable:
        fsync_dir(path.parent)
