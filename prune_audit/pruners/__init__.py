"""Visual-token selectors as pure tensor code, with a registry.

>>> from prune_audit.pruners import get_selector, list_selectors
"""

from importlib import import_module

from prune_audit.pruners.base import InputSelector, LayerSelector, Reference, Selection, Selector, Stage
from prune_audit.pruners.signals import InputSignals, LayerSignals
from prune_audit.pruners.registry import get_selector, list_selectors, register, selector_class

# one module per method; importing it registers the method
_INPUT_METHODS = ["controls", "cls_attn", "visionzip", "vispruner", "divprune", "cdpruner", "scope", "coverage", "pool", "tome", "hiprune"]
_LLM_METHODS = ["fastv", "pdrop", "sparsevlm", "dart", "v2drop", "e2s", "vscan", "sparsevlm2"]
for _module in _INPUT_METHODS + _LLM_METHODS:
    import_module(f"prune_audit.pruners.{_module}")

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
