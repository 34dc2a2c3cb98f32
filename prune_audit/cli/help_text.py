"""What ``--help`` shows beyond the commands' own text: paragraphs rewrapped to the terminal, the registered tasks."""

from __future__ import annotations

import inspect
from typing import Any

import typer
from typer.core import TyperCommand


def unwrapped(text: str) -> str:
    """``text`` with the line breaks inside each paragraph joined (paragraphs stay apart), so that --help wraps it
    to the terminal's width instead of keeping the source's ~100-column lines (one-word lines at 80 columns)."""
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(" ".join(line.strip() for line in paragraph.splitlines()) for paragraph in paragraphs)


def unwrap_help(app: typer.Typer) -> None:
    """Unwrap the help text of every command of ``app`` and of its command groups, in place."""
    for info in app.registered_commands:
        info.help = unwrapped(info.help or inspect.getdoc(info.callback) or "")
    for group in app.registered_groups:
        unwrap_help(group.typer_instance)


class TaskListingCommand(TyperCommand):
    """A command with ``--task`` whose --help ends with the registered tasks (plug-ins included). They are read
    only when help is shown: importing the tasks costs every other command's start-up time."""

    def format_help(self, ctx: Any, formatter: Any) -> None:
        from prune_audit.tasks import list_tasks

        self.epilog = f"Registered tasks (--task): {', '.join(list_tasks())}; docs/tasks.md describes each."
        super().format_help(ctx, formatter)


__all__ = ["TaskListingCommand", "unwrap_help", "unwrapped"]
