"""The selector registry shared by the CLI, the tests and third-party plugins.

Built-in selectors register themselves on import of :mod:`prune_audit.pruners`.
Plugins expose a selector class under the entry-point group
``prune_audit.selectors``; it is registered under the entry point's name.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

from prune_audit.plugins import PluginRegistry
from prune_audit.pruners.base import Selector, option_defaults
from prune_audit.pruners.options import describe_options, option_domains, parse_options

S = TypeVar("S", bound=type[Selector])


def _check_selector(cls: type[Selector]) -> None:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"selector {cls.name!r} must be a dataclass whose fields are its options")
    option_domains(cls)  # every option declares its domain


SELECTORS: PluginRegistry[type[Selector]] = PluginRegistry("selector", "prune_audit.selectors", _check_selector)


def register(cls: S) -> S:
    """Class decorator: add a selector class under ``cls.name``."""
    SELECTORS.register(cls)
    return cls


def list_selectors() -> list[str]:
    """Names of every registered selector, sorted."""
    return sorted(SELECTORS.loaded())


def registered_classes() -> list[type[Selector]]:
    """The selector classes registered so far (the built-ins, on import of :mod:`prune_audit.pruners`), in name
    order, without loading plugins: what a model family's class-level support tables are computed from."""
    return [SELECTORS.classes[name] for name in sorted(SELECTORS.classes)]


def selector_class(name: str) -> type[Selector]:
    classes = SELECTORS.loaded()
    try:
        return classes[name]
    except KeyError:
        raise ValueError(f"unknown selector {name!r}; valid selectors: {', '.join(sorted(classes))}") from None


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


def selector_from_strings(name: str, pairs: Sequence[str], depth: int | None = None) -> Selector:
    """A selector from ``KEY=VALUE`` strings (the CLI's ``--option``), every value checked against its domain
    (``depth``: the model's decoder layers, when known: a refused layer option names the model's own layers).

    Raises:
        ValueError: one line naming the selector, option, value and allowed domain; nothing is built.
    """
    return get_selector(name, **parse_options(selector_class(name), pairs, depth))
