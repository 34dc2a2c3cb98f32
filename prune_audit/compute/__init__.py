"""Compute accounting: analytic FLOPs, KV-cache bytes and equivalent tokens of a pruned prefill.

Pure arithmetic on a :class:`~prune_audit.compute.shape.ModelShape` (read from a loaded model by
``prune_audit.models.shape``) and the realised token counts of one question; no torch, no
transformers. The formulas and what they leave out are in docs/compute.md.
"""

from prune_audit.compute.cost import PrefillCost, QuestionTokens, StageProbe, prefill_cost
from prune_audit.compute.shape import ClipTextShape, LanguageShape, ModelShape, VisionShape

__all__ = [
    "ClipTextShape",
    "LanguageShape",
    "ModelShape",
    "VisionShape",
    "QuestionTokens",
    "StageProbe",
    "PrefillCost",
    "prefill_cost",
]
