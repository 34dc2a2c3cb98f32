"""prune-audit: audit visual-token pruning in vision-language models."""

__version__ = "0.1.0"
