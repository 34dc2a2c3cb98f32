"""What an interrupted or failed command has saved, for its last line.

Writers report each durable step (``report_saved``); the CLI's error handler turns a
Ctrl-C (exit 130), a SIGTERM (143) or SIGHUP (129) from ``stops_like_ctrl_c``, or a full
disk into one line saying how many questions are safe and that the same command resumes.
"""

from __future__ import annotations

import errno
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType

STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # ended like Ctrl-C (SIGINT already is)

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
    return (
        f"{_saved.done} of {_saved.total} questions are saved in {_saved.directory}; "
        f"run the same command again to resume"
    )


class Stopped(KeyboardInterrupt):
    """A stop signal turned into Ctrl-C's exception, so every clean-up path runs the same way."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_held: list[int] | None = None  # signals that arrived while ``saving`` held them, else None


def _stop(signum: int) -> None:
    """End the command as the signal asks: Ctrl-C's KeyboardInterrupt, or ``Stopped`` for SIGTERM / SIGHUP."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    signal.signal(signum, signal.SIG_DFL)  # a second signal ends the process at once, as the user asked
    raise Stopped(signum)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    if _held is not None:
        _held.append(signum)
        return
    _stop(signum)


@contextmanager
def stops_like_ctrl_c() -> Iterator[None]:
    """While the block runs, SIGTERM and SIGHUP raise ``Stopped`` (a KeyboardInterrupt) in the main thread,
    and Ctrl-C its KeyboardInterrupt, each held while ``saving`` runs.

    A signal the process was started ignoring (``nohup``) stays ignored; the previous handlers
    are restored afterwards.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, *STOP_SIGNALS)}
    for signum, handler in previous.items():
        if handler is signal.SIG_DFL or (signum == signal.SIGINT and handler is signal.default_int_handler):
            signal.signal(signum, _on_signal)
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def saving() -> Iterator[None]:
    """Hold Ctrl-C, SIGTERM and SIGHUP while the block makes a write durable and reports it
    (``report_saved``), so the saved-count line never misses a batch that was saved; a signal
    that arrived meanwhile ends the command right after the block."""
    global _held
    outer, _held = _held, [] if _held is None else _held
    try:
        yield
    finally:
        pending, _held = _held, outer
    if outer is None and pending:
        _stop(pending[0])


def interrupt_exit_code(interrupt: KeyboardInterrupt) -> int:
    """The shell's code for a command ended by the signal: 128 + its number (Ctrl-C: 130)."""
    return 128 + (interrupt.signum if isinstance(interrupt, Stopped) else signal.SIGINT)


def interrupted_message(interrupt: KeyboardInterrupt | None = None) -> str:
    how = f" by {signal.Signals(interrupt.signum).name}" if isinstance(interrupt, Stopped) else ""
    return f"interrupted{how}: {_saved_clause()}"


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in DISK_FULL


def disk_full_message(error: OSError) -> str:
    where = f" writing {error.filename}" if error.filename else ""
    return f"no space left on the device{where}: {_saved_clause()} after freeing space"
