"""Atomic writes: a file is absent, old, or complete; never half-written under its final name.

Every write goes to a hidden temporary sibling (``.NAME.<random>.tmp``), is flushed and
fsynced, then renamed over the final name. An interrupted write removes its temporary
file; one left by a killed process is removed by ``remove_partial_files`` on the next
start, and is never read as a record because its name does not match any output.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

TEMPORARY_SUFFIX = ".tmp"


def temporary_sibling(path: Path) -> Path:
    """A fresh hidden name beside ``path`` for staging its new content."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex}{TEMPORARY_SUFFIX}")


def fsync_directory(directory: Path) -> None:
    """Make a rename inside ``directory`` durable."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | Path, write: Callable[[BinaryIO], None]) -> Path:
    """Call ``write(handle)`` on a temporary sibling of ``path``, then rename it into place."""
    path = Path(path)
    temporary = temporary_sibling(path)
    try:
        with open(temporary, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    fsync_directory(path.parent)
    return path


def write_bytes_atomic(data: bytes, path: str | Path) -> Path:
    return write_atomic(path, lambda handle: handle.write(data))


def write_text_atomic(text: str, path: str | Path) -> Path:
    return write_bytes_atomic(text.encode("utf-8"), path)


def remove_partial_files(directory: str | Path, prefix: str = "") -> list[Path]:
    """Delete temporary files left by interrupted writes of ``prefix*`` files in ``directory``
    and its subfolders.

    Call it only while holding the directory's write lock: a live writer's temporary
    file looks the same.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for path in directory.rglob(f".{prefix}*{TEMPORARY_SUFFIX}"):
        if path.is_file():
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed
