"""File-system steps shared by checkpoints, datasets, exports and tools: fsync a file or a directory, and write a
file atomically (a temporary file beside it, renamed over it)."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
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


@contextlib.contextmanager
def atomic_path(path: Path, *, durable: bool = False) -> Iterator[Path]:
    """A temporary path beside `path` for the caller to write (for writers that take a file name, such as
    safetensors' `save_file`). When the block ends without an error the file is renamed over `path`, so a reader
    sees the old file or the new one, never a part; on an error it is removed. `durable`: the file and the
    rename are also flushed to disk."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    try:
        yield temporary
        if durable:
            fsync_file(temporary)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise
    if durable:
        fsync_dir(path.parent)


def write_atomic(path: Path, data: bytes | str, *, durable: bool = False, mode: int | None = None) -> None:
    """Write `data` (str: as UTF-8) to `path` through `atomic_path`: a reader sees the old file or the new one,
    never a part. `durable`: the file and the rename are also flushed to disk. `mode`: the file's permission
    bits; the file has them from its creation on (a secret is never readable by others, not even briefly)."""
    with atomic_path(path, durable=durable) as temporary:
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666 if mode is None else mode)
        with open(fd, "wb") as file:
            if mode is not None:
                os.fchmod(fd, mode)  # exactly `mode`, whatever the umask
            file.write(data.encode() if isinstance(data, str) else data)
