"""File names a command writes: parts given on the command line (prefixes, names) stay inside their folder,
and names taken from input files can be written at all."""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import PurePosixPath

from prune_audit.errors import PruneAuditError


def check_plain_name(value: str, option: str) -> str:
    """``value`` unchanged when it is a plain name part: no path separator, no ``..``, not empty."""
    separators = {"/", "\\", os.sep, *([os.altsep] if os.altsep else [])}
    if not value or "\0" in value or ".." in value or any(sep in value for sep in separators):
        raise PruneAuditError(
            f"{option} {value!r} must be a plain name (no path separators, no '..'); "
            f"choose the folder with --out instead"
        )
    return value


NAME_MAX_BYTES = 255
"""The longest name of one file or folder that common file systems (ext4, APFS, NTFS) accept, in UTF-8 bytes."""


def check_file_names(names: Iterable[str], where: str) -> None:
    """Names of files a command is about to write (``/``-separated, relative to its folder) can all be written:
    each names a file inside the folder, in UTF-8, without a NUL byte or a part longer than ``NAME_MAX_BYTES``;
    no two name one file (``a.png``, ``./a.png``) and none is also the folder of another (``a.png`` beside
    ``a.png/b.png``). Checked before the first byte, so no write fails half-way."""
    files: dict[PurePosixPath, str] = {}
    for name in names:
        path = PurePosixPath(name)
        _check_parts(name, path, where)
        if path in files:
            raise PruneAuditError(f"{where}: {files[path]!r} and {name!r} name the same file; rename one of them")
        files[path] = name
    for path, name in files.items():
        folder = next((parent for parent in path.parents if parent in files), None)
        if folder is not None:
            raise PruneAuditError(
                f"{where}: {files[folder]!r} names both a file and the folder of {name!r}; rename one of them"
            )


def _check_parts(name: str, path: PurePosixPath, where: str) -> None:
    if "\0" in name:
        raise PruneAuditError(f"{where}: file name {name!r} holds a NUL byte, which no file name may; rename it")
    if path.is_absolute() or ".." in path.parts:
        raise PruneAuditError(f"{where}: file name {name!r} leads outside its folder; name it relative to the folder")
    if not path.parts or path.name == ".":
        raise PruneAuditError(f"{where}: {name!r} names a folder, not a file; give the file's name")
    try:
        longest = max(len(part.encode("utf-8")) for part in path.parts)
    except UnicodeEncodeError:
        raise PruneAuditError(f"{where}: file name {name!r} is not valid UTF-8 text; rename it") from None
    if longest > NAME_MAX_BYTES:
        raise PruneAuditError(
            f"{where}: file name {name[:40]!r}... has a part of {longest} bytes, over the "
            f"{NAME_MAX_BYTES} a file system allows; shorten it"
        )
