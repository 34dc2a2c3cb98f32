"""The selector registry shared by the CLI, the tests and third-party plugins.

Built-in selectors register themselves on import of :mod:`prune_audit.pruners`.
Plugins expose a selector class under the entry-point group
``prune_audit.selectors``; it is registered under the entry point's name.
"""

from __future__ import annotations

import dataclasses
from importlib.metadata import entry_points
from collections.abc import Sequence
from typing import Any, TypeVar

from prune_audit.pruners.base import Selector, option_defaults
from prune_audit.pruners.options import describe_options, option_domains, parse_options

S = TypeVar("S", bound=type[Selector])

_REGISTRY: dict[str, type[Selector]] = {}
_PLUGINS_LOADED = False


def register(cls: S) -> S:
    """Class decorator: add a selector class under ``cls.name``."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"selector {cls.name!r} must be a dataclass whose fields are its options")
    option_domains(cls)  # every option declares its domain
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"a selector named {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def _load_plugins() -> None:
    global _PLUGINS_LOADED
    if _PLUGINS_LOADED:
        return
    _PLUGINS_LOADED = True
    for entry in entry_points(group="prune_audit.selectors"):
        cls = entry.load()
        if getattr(cls, "name", "") != entry.name:
            cls.name = entry.name
        register(cls)


def list_selectors() -> list[str]:
    """Names of every registered selector, sorted."""
    _load_plugins()
    return sorted(_REGISTRY)


def selector_class(name: str) -> type[Selector]:
    _load_plugins()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown selector {name!r}; valid selectors: {', '.join(sorted(_REGISTRY))}"
        ) from None


def get_selector(name: str, **options: Any) -> Selector:
    """Instantiate a registered selector; unknown names or options raise ValueError."""
    cls = selector_class(name)
    valid = option_defaults(cls)
    unknown = sorted(set(options) - set(valid))
    if unknown:
        raise ValueError(
            f"unknown option(s) {', '.join(unknown)} of selector {name!r}; valid options: {describe_options(cls)}"
        )
    return cls(**options)


def selector_from_strings(name: str, pairs: Sequence[str]) -> Selector:
    """A selector from ``KEY=VALUE`` strings (the CLI's ``--option``), every value checked against its domain.

    Raises:
        ValueError: one line naming the selector, option, value and allowed domain; nothing is built.
    """
    return get_selector(name, **parse_options(selector_class(name), pairs))
