"""What a command may read, and what it refuses before parsing: the one rule for every input file.

A command reads only regular files (after following symlinks): a folder, a FIFO, a device such as
``/dev/zero`` or a socket is refused by kind, before anything reads from it, so a FIFO can never block a
command and a device can never fill memory. A file larger than ``PRUNE_AUDIT_MAX_INPUT_BYTES`` (default
:data:`DEFAULT_MAX_INPUT_BYTES`) is refused before it is read. JSON nested deeper than
:data:`MAX_JSON_DEPTH` is refused before it is parsed (Python's parser would recurse until it fails).
A file name taken from an input file (an image of a question, an instances ``file_name``) is relative
to its folder and cannot leave it (:func:`check_image_name`, :func:`path_under`).

Every refusal is one line naming the file, the cause and the fix.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path, PureWindowsPath
from typing import Any, BinaryIO

from prune_audit.errors import PruneAuditError

MAX_BYTES_VARIABLE = "PRUNE_AUDIT_MAX_INPUT_BYTES"
DEFAULT_MAX_INPUT_BYTES = 4 * 2**30
"""4 GiB: above the largest released file the tasks read (GQA's question JSON, COCO's instances)."""
MAX_JSON_DEPTH = 64
"""Deepest JSON nesting read: the formats need under 10 levels; Python's parser fails near 1,000."""

_KINDS = (
    (stat.S_ISDIR, "a folder"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(set(range(256)) - set(b"[]{}"))
_INNERMOST = re.compile(rb"\[\]|\{\}")


def positive_setting(variable: str, unit: str, example: int, default: str) -> int | None:
    """The environment's ``variable`` as a positive whole number of ``unit``, None when unset; anything else is
    refused in one line suggesting ``example`` (or unsetting it for ``default``)."""
    text = os.environ.get(variable)
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value <= 0:
        raise PruneAuditError(
            f"{variable} must be a positive whole number of {unit}, got {text!r}; "
            f"set it to e.g. {example}, or unset it for {default}"
        )
    return value


def max_input_bytes() -> int:
    """The size limit of one input file: ``PRUNE_AUDIT_MAX_INPUT_BYTES``, else :data:`DEFAULT_MAX_INPUT_BYTES`."""
    return (
        positive_setting(MAX_BYTES_VARIABLE, "bytes", DEFAULT_MAX_INPUT_BYTES, "the default") or DEFAULT_MAX_INPUT_BYTES
    )


def open_input(path: str | Path, role: str, fix: str, limit_size: bool = True) -> BinaryIO:
    """``path`` opened for binary reading if it is a regular file (symlinks followed) within the size limit.

    The file is opened without blocking and checked on its open descriptor, so a FIFO is refused without
    waiting for a writer and a file swapped after a check is still caught.

    Args:
        role: what the file is, for messages ("question file", "image").
        fix: what the user should do instead, ending every message.
        limit_size: False for files never read whole into memory or bounded otherwise (images: PIL's pixel
            limit; pinned files, hashed in chunks).

    Raises:
        PruneAuditError: the file is missing, unreadable, not a regular file or too large.
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise PruneAuditError(f"{role} not found: {path}; {fix}") from None
    except IsADirectoryError:
        raise PruneAuditError(f"{role} {path} is a folder, not a regular file to read; {fix}") from None
    except OSError as error:
        raise PruneAuditError(f"{role} {path} cannot be opened ({error.strerror}); {fix}") from None
    except ValueError:  # os.open's "embedded null byte"
        raise PruneAuditError(f"{role} {path!r} cannot be opened (its name holds a NUL byte); {fix}") from None
    try:
        _check_opened(os.fstat(descriptor), path, role, fix, limit_size)
        os.set_blocking(descriptor, True)
    except BaseException:
        os.close(descriptor)
        raise
    # Outside the try: once fdopen's file object owns the descriptor, a stop signal arriving here would let the
    # object close it and a second os.close fail with EBADF, replacing the interrupt's message.
    return os.fdopen(descriptor, "rb")


def _check_opened(info: os.stat_result, path: str | Path, role: str, fix: str, limit_size: bool) -> None:
    """Refuse an opened file that is not a regular file, or (``limit_size``) is larger than the input limit."""
    kind = next((name for test, name in _KINDS if test(info.st_mode)), None)
    if kind is not None or not stat.S_ISREG(info.st_mode):
        link = f" (a link to {os.path.realpath(path)})" if os.path.islink(path) else ""
        raise PruneAuditError(f"{role} {path}{link} is {kind or 'a special file'}, not a regular file to read; {fix}")
    limit = max_input_bytes()
    if limit_size and info.st_size > limit:
        raise PruneAuditError(
            f"{role} {path} holds {info.st_size} bytes, more than the input limit of {limit}; pass the right file, "
            f"or if you trust it raise the limit: {MAX_BYTES_VARIABLE}=<bytes> prune-audit ..."
        )


def check_input_file(path: str | Path, role: str, fix: str, limit_size: bool = True) -> Path:
    """``path`` as a Path once :func:`open_input` accepts it (for files a library opens by name)."""
    open_input(path, role, fix, limit_size).close()
    return Path(path)


def read_input(path: str | Path, role: str, fix: str) -> bytes:
    """The bytes of ``path`` once :func:`open_input` accepts it."""
    with open_input(path, role, fix) as handle:
        return handle.read()


def json_depth(data: str | bytes) -> int:
    """How deep the arrays and objects of JSON text nest (brackets inside strings not counted), counted
    without recursion and only up to ``MAX_JSON_DEPTH + 1``."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    brackets = _STRING.sub(b"", raw).translate(None, _NOT_BRACKETS)
    for depth in range(MAX_JSON_DEPTH + 1):
        inner = _INNERMOST.sub(b"", brackets)  # one pass: each round removes exactly one level
        if inner == brackets:  # nothing nests any more (or unbalanced text json.loads will name)
            return depth
        brackets = inner
    return MAX_JSON_DEPTH + 1


def loads_json(data: str | bytes, where: str) -> Any:
    """``json.loads(data)`` once its nesting is within :data:`MAX_JSON_DEPTH`; ``where`` names the file and line.

    Raises:
        PruneAuditError: deeper nesting. ``json.JSONDecodeError`` (malformed text) is left to the caller,
            whose message knows the format.
    """
    if json_depth(data) > MAX_JSON_DEPTH:
        raise PruneAuditError(
            f"{where}: JSON nested more than {MAX_JSON_DEPTH} levels deep, which no input format "
            f"needs; fix or regenerate the file"
        )
    return json.loads(data)


def check_image_name(value: Any, where: str) -> str:
    """An image file name taken from an input file: relative to the images folder, which it cannot leave.

    Absolute paths, drive letters and ``..`` parts (``/`` or ``\\`` separated) are refused, so
    ``--images`` / name always lies inside ``--images``.
    """
    if not isinstance(value, str) or not value.strip():
        raise PruneAuditError(f"{where}: image must be a file name, got {value!r}; fix the entry")
    if "\0" in value:
        raise PruneAuditError(f"{where}: image {value!r} holds a NUL byte, which no file name may; rename it")
    name = PureWindowsPath(value)  # parses both separators, drives and roots
    if name.anchor or ".." in name.parts:
        raise PruneAuditError(
            f"{where}: image {value!r} leads outside the images folder (an absolute path or '..'); "
            f"name image files relative to --images"
        )
    return value


def path_under(folder: str | Path, name: str, where: str) -> Path:
    """``folder / name`` for an image ``name`` read from ``where``, refused when it would leave ``folder``."""
    return Path(folder) / check_image_name(name, where)
