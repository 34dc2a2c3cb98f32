"""A registry of named classes: built-ins add themselves by decorator, third-party ones come from an entry-point
group, loaded once on the first lookup (selectors in ``pruners.registry``, tasks in ``tasks.registry``)."""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import entry_points
from typing import Generic, TypeVar

C = TypeVar("C", bound=type)


class PluginRegistry(Generic[C]):
    """Classes by their ``name``; ``kind`` names them in errors, ``group`` is the entry-point group of plugins
    (each registered under its entry point's name); ``check`` refuses a malformed class before it is added."""

    def __init__(self, kind: str, group: str, check: Callable[[C], None] | None = None) -> None:
        self.kind, self.group, self.check = kind, group, check
        self.classes: dict[str, C] = {}
        self.plugins_loaded = False

    def register(self, cls: C) -> C:
        """Class decorator: add ``cls`` under ``cls.name``; another class of that name is a ValueError."""
        if not cls.name:
            raise ValueError(f"{cls.__name__} has no name")
        if self.check is not None:
            self.check(cls)
        if cls.name in self.classes and self.classes[cls.name] is not cls:
            raise ValueError(f"a {self.kind} named {cls.name!r} is already registered")
        self.classes[cls.name] = cls
        return cls

    def loaded(self) -> dict[str, C]:
        """Every registered class by name, the entry-point plugins loaded first (once)."""
        if not self.plugins_loaded:
            self.plugins_loaded = True
            for entry in entry_points(group=self.group):
                cls = entry.load()
                if getattr(cls, "name", "") != entry.name:
                    cls.name = entry.name
                self.register(cls)
        return self.classes


__all__ = ["PluginRegistry"]
