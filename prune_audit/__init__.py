"""prune-audit: audit visual-token pruning in vision-language models.

``from prune_audit import load, pruned`` is the Python pruning API (``prune_audit.api``); the names are
imported on first use, so ``import prune_audit`` (and ``prune-audit --help``) stays free of torch.
"""

from prune_audit.lazy import lazy_exports

__version__ = "0.1.0"

__getattr__, __dir__ = lazy_exports(__name__, {"load": "api", "pruned": "api"})
