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
    no NUL byte, no part longer than ``NAME_MAX_BYTES``, and no name that is also the folder of another
    (``a.png`` beside ``a.png/b.png``). Checked before the first byte, so no write fails half-way."""
    names = list(names)
    for name in names:
        if "\0" in name:
            raise PruneAuditError(f"{where}: file name {name!r} holds a NUL byte, which no file name may; rename it")
        longest = max((part for part in PurePosixPath(name).parts), key=lambda part: len(part.encode()), default="")
        if len(longest.encode()) > NAME_MAX_BYTES:
            raise PruneAuditError(f"{where}: file name {name[:40]!r}... has a part of {len(longest.encode())} bytes, "
                                  f"over the {NAME_MAX_BYTES} a file system allows; shorten it")
    files = {PurePosixPath(name) for name in names}
    for name in sorted(files):
        folder = next((parent for parent in name.parents if parent in files), None)
        if folder is not None:
            raise PruneAuditError(f"{where}: {str(folder)!r} names both a file and the folder of {str(name)!r}; "
                                  f"rename one of them")
