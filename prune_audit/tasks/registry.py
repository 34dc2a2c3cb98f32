"""The task registry shared by the CLI, the runner, the analyses and third-party plugins.

Built-in tasks register themselves on import of :mod:`prune_audit.tasks`. Plugins expose a
:class:`~prune_audit.tasks.base.Task` subclass under the entry-point group
``prune_audit.tasks``; it is registered under the entry point's name (as selectors are, in
``pruners.registry``).
"""

from __future__ import annotations

from typing import TypeVar

from prune_audit.errors import PruneAuditError
from prune_audit.plugins import PluginRegistry
from prune_audit.tasks.base import Task

T = TypeVar("T", bound=type[Task])

DEFAULT_TASK = "pope"
"""The task of ``run`` without ``--task``, and of a manifest that names none (written before tasks existed
within this records schema)."""

TASKS: PluginRegistry[type[Task]] = PluginRegistry("task", "prune_audit.tasks")


def register_task(cls: T) -> T:
    """Class decorator: add a task class under ``cls.name``."""
    TASKS.register(cls)
    return cls


def list_tasks() -> list[str]:
    """Names of every registered task, sorted."""
    return sorted(TASKS.loaded())


def task_classes() -> list[type[Task]]:
    """Every registered task class in registration order (the built-ins first, then plug-ins), which is the order
    of their record columns (``records.schema.run_columns``)."""
    return list(TASKS.loaded().values())


def get_task(name: str, max_new_tokens: int | None = None, confidence: str | None = None) -> Task:
    """The registered task ``name``; a task that generates takes its generation limit and confidence definition
    (``Task.confidences``). An unknown name or a misplaced option is a one-line PruneAuditError."""
    classes = TASKS.loaded()
    if name not in classes:
        raise PruneAuditError(f"unknown task {name!r}; choose one of {', '.join(list_tasks())} (--task)")
    return classes[name](max_new_tokens, confidence)


def manifest_task(manifest: dict) -> Task:
    """The task a run manifest records (``task``, ``max_new_tokens``, ``confidence``)."""
    return get_task(manifest.get("task", DEFAULT_TASK), manifest.get("max_new_tokens"), manifest.get("confidence"))


__all__ = ["DEFAULT_TASK", "get_task", "list_tasks", "manifest_task", "register_task", "task_classes"]
