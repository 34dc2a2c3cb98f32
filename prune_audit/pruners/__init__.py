"""Visual-token selectors as pure tensor code, with a registry.

>>> from prune_audit.pruners import get_selector, list_selectors
"""

import pkgutil
from importlib import import_module

from prune_audit.pruners.base import InputSelector, LayerSelector, Reference, Selection, Selector, Stage
from prune_audit.pruners.registry import get_selector, list_selectors, register, selector_class
from prune_audit.pruners.signals import InputSignals, LayerSignals

# every module of the package is imported; a method's module registers it, so adding a selector adds one file
for _module in pkgutil.iter_modules(__path__):
    import_module(f"{__name__}.{_module.name}")

__all__ = [
    "InputSelector",
    "InputSignals",
    "LayerSelector",
    "LayerSignals",
    "Reference",
    "Selection",
    "Selector",
    "Stage",
    "get_selector",
    "list_selectors",
    "register",
    "selector_class",
]
