"""Shared CLI plumbing: one-line errors and the console."""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import typer

F = TypeVar("F", bound=Callable[..., Any])

USER_ERRORS = (ValueError, FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError, KeyError)


def fail(message: str, code: int = 2) -> typer.Exit:
    """Print ``error: message`` on stderr and return the Exit to raise."""
    print(f"error: {message}", file=sys.stderr)
    return typer.Exit(code)


INTERRUPTED = 130  # the shell's code for a command ended by SIGINT


def handle_errors(command: F) -> F:
    """Turn user errors raised by a command into one line on stderr and exit code 2.

    Ctrl-C ends with exit code 130 and a disk full with exit code 1, each with one line
    saying how many questions are saved and that the same command resumes. Set
    ``PRUNE_AUDIT_DEBUG=1`` to see the traceback instead.
    """

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        from prune_audit.safety import progress

        progress.forget_saved()
        try:
            return command(*args, **kwargs)
        except KeyboardInterrupt:
            if os.environ.get("PRUNE_AUDIT_DEBUG"):
                raise
            raise fail(progress.interrupted_message(), INTERRUPTED) from None
        except OSError as error:
            if os.environ.get("PRUNE_AUDIT_DEBUG"):
                raise
            if progress.is_disk_full(error):
                raise fail(progress.disk_full_message(error), 1) from None
            raise fail(_one_line(error)) from None
        except USER_ERRORS as error:
            if os.environ.get("PRUNE_AUDIT_DEBUG"):
                raise
            raise fail(_one_line(error)) from None

    return wrapper  # type: ignore[return-value]


def _one_line(error: BaseException) -> str:
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if isinstance(error, OSError) and error.filename:
        message = f"{error.strerror or message}: {error.filename}"
    return message
