"""What an interrupted or failed command has saved, for its last line.

Writers report each durable step (``report_saved``); the CLI's error handler turns a
Ctrl-C (exit 130) or a full disk into one line saying how many questions are safe and
that the same command resumes.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from pathlib import Path

DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


@dataclass
class Saved:
    directory: Path
    done: int
    total: int
    resumable: bool


_saved: Saved | None = None


def report_saved(directory: str | Path, done: int, total: int, resumable: bool = True) -> None:
    """Record that ``done`` of ``total`` questions are durably saved in ``directory``."""
    global _saved
    _saved = Saved(Path(directory), done, total, resumable)


def forget_saved() -> None:
    global _saved
    _saved = None


def _saved_clause() -> str:
    if _saved is None:
        return "nothing was written"
    if not _saved.resumable:
        return f"nothing was written to {_saved.directory} (its outputs are written only when complete)"
    return (f"{_saved.done} of {_saved.total} questions are saved in {_saved.directory}; "
            f"run the same command again to resume")


def interrupted_message() -> str:
    return f"interrupted: {_saved_clause()}"


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in DISK_FULL


def disk_full_message(error: OSError) -> str:
    where = f" writing {error.filename}" if error.filename else ""
    return f"no space left on the device{where}: {_saved_clause()} after freeing space"
