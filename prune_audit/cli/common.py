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


def handle_errors(command: F) -> F:
    """Turn user errors raised by a command into one line on stderr and exit code 2.

    Set ``PRUNE_AUDIT_DEBUG=1`` to see the traceback instead.
    """

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except USER_ERRORS as error:
            if os.environ.get("PRUNE_AUDIT_DEBUG"):
                raise
            message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            if isinstance(error, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)) and error.filename:
                message = f"{error.strerror or message}: {error.filename}"
            raise fail(message) from None

    return wrapper  # type: ignore[return-value]
