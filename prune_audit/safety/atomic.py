"""Atomic writes: a file is absent, old, or complete; never half-written under its final name.

Every write goes to a hidden temporary sibling (``.NAME.<32 hex>.tmp``), is flushed and
fsynced, then renamed over the final name; a set of files is staged in a hidden folder
(``.staging-<32 hex>``) and moved into place when complete. An interrupted write removes
its temporary file; one left by a killed process is removed on the next start of the
command that owns the folder (``remove_partial_files``, ``remove_staging_folders``), and
is never read as a record because its name does not match any output. Clean-up matches
these exact names only, so a user's own ``*.tmp`` files are never touched.
"""

from __future__ import annotations

import fnmatch
import os
import re
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import BinaryIO

TEMPORARY_SUFFIX = ".tmp"
STAGING_PREFIX = ".staging-"
_TEMPORARY_NAME = re.compile(r"\.(?P<name>.+)\.[0-9a-f]{32}" + re.escape(TEMPORARY_SUFFIX))
_STAGING_NAME = re.compile(re.escape(STAGING_PREFIX) + r"[0-9a-f]{32}")


def temporary_sibling(path: Path) -> Path:
    """A fresh hidden name beside ``path`` for staging its new content."""
    return path.with_name(f".{path.name}.{uuid.uuid4().hex}{TEMPORARY_SUFFIX}")


def temporary_target(name: str) -> str | None:
    """The file name whose ``write_atomic`` temporary ``name`` is (exact names only); None for any other name."""
    match = _TEMPORARY_NAME.fullmatch(name)
    return match["name"] if match else None


def staging_folder(directory: Path) -> Path:
    """A new hidden folder in ``directory`` where files are prepared before they are moved into place."""
    folder = Path(directory) / f"{STAGING_PREFIX}{uuid.uuid4().hex}"
    folder.mkdir()
    return folder


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


def remove_partial_files(directory: str | Path, names: Sequence[str]) -> list[Path]:
    """Delete the temporary files that interrupted ``write_atomic`` calls left for files named like
    ``names`` (shell patterns such as ``part-0-*.parquet``) directly in ``directory``.

    Only this project's exact temporary names match, and subfolders are not searched. Call it
    only while holding the directory's write lock: a live writer's temporary file looks the same.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = []
    for path in sorted(directory.iterdir()):
        target = temporary_target(path.name)
        if target and path.is_file() and any(fnmatch.fnmatchcase(target, name) for name in names):
            path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def remove_staging_folders(directory: str | Path) -> list[Path]:
    """Delete the staging folders (``staging_folder``) that killed writers left directly in ``directory``.

    Call it only while holding the directory's exclusive write lock.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    removed = [
        path
        for path in sorted(directory.iterdir())
        if _STAGING_NAME.fullmatch(path.name) and path.is_dir() and not path.is_symlink()
    ]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


def write_files(directory: Path, files: Mapping[str, str | bytes]) -> list[Path]:
    """Write every file into ``directory`` or none of them.

    Files are first written into a hidden staging folder beside them, then each is moved
    into place with an atomic rename; a failure before the moves leaves ``directory``
    untouched. A staging folder left by a killed process is removed by the next
    ``hold_output_dir`` of ``directory``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(directory)
    try:
        for name, content in files.items():
            data = content.encode("utf-8") if isinstance(content, str) else content
            try:
                (staging / name).write_bytes(data)
            except OSError as error:  # name the file being written, not the hidden staging copy
                raise OSError(error.errno, error.strerror, str(directory / name)) from error
        written = []
        for name in files:
            os.replace(staging / name, directory / name)
            written.append(directory / name)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)
