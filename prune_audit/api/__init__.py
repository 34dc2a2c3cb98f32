"""The Python API (``pruning``: ``load``, ``pruned`` and their typed results) and the lmms-eval model plugin
(``lmms_eval``, imported only by lmms-eval's entry point). Importing this package loads no torch."""

from prune_audit.api.pruning import (
    ChoiceResult,
    GenerationResult,
    ImageInput,
    PrunedModel,
    PrunedResult,
    ScoreResult,
    YesNoResult,
    load,
    pruned,
)

__all__ = [
    "ChoiceResult",
    "GenerationResult",
    "ImageInput",
    "PrunedModel",
    "PrunedResult",
    "ScoreResult",
    "YesNoResult",
    "load",
    "pruned",
]
