"""The task registry shared by the CLI, the runner, the analyses and third-party plugins.

Built-in tasks register themselves on import of :mod:`prune_audit.tasks`. Plugins expose a
:class:`~prune_audit.tasks.base.Task` subclass under the entry-point group
``prune_audit.tasks``; it is registered under the entry point's name (as selectors are, in
``pruners.registry``).
"""

from __future__ import annotations

from importlib.metadata import entry_points
from typing import TypeVar

from prune_audit.errors import PruneAuditError
from prune_audit.tasks.base import Task

T = TypeVar("T", bound=type[Task])

DEFAULT_TASK = "pope"
"""The task of ``run`` without ``--task``, and of a manifest that names none (written before tasks existed
within this records schema)."""

_REGISTRY: dict[str, type[Task]] = {}
_PLUGINS_LOADED = False


def register_task(cls: T) -> T:
    """Class decorator: add a task class under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"a task named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def _load_plugins() -> None:
    global _PLUGINS_LOADED
    if _PLUGINS_LOADED:
        return
    _PLUGINS_LOADED = True
    for entry in entry_points(group="prune_audit.tasks"):
        cls = entry.load()
        if getattr(cls, "name", "") != entry.name:
            cls.name = entry.name
        register_task(cls)


def list_tasks() -> list[str]:
    """Names of every registered task, sorted."""
    _load_plugins()
    return sorted(_REGISTRY)


def get_task(name: str, max_new_tokens: int | None = None, confidence: str | None = None) -> Task:
    """The registered task ``name``; a task that generates takes its generation limit and confidence definition
    (``Task.confidences``). An unknown name or a misplaced option is a one-line PruneAuditError."""
    _load_plugins()
    if name not in _REGISTRY:
        raise PruneAuditError(f"unknown task {name!r}; choose one of {', '.join(list_tasks())} (--task)")
    return _REGISTRY[name](max_new_tokens, confidence)


def manifest_task(manifest: dict) -> Task:
    """The task a run manifest records (``task``, ``max_new_tokens``, ``confidence``)."""
    return get_task(manifest.get("task", DEFAULT_TASK), manifest.get("max_new_tokens"), manifest.get("confidence"))


__all__ = ["DEFAULT_TASK", "get_task", "list_tasks", "manifest_task", "register_task"]
