"""DivPrune: diversity-maximising selection by greedy max-min cosine distance."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from prune_audit.pruners.arithmetic import SelectorWork, matmul
from prune_audit.pruners.base import InputSelector, Reference, Selection
from prune_audit.pruners.signals import InputSignals
from prune_audit.pruners.registry import register
from prune_audit.pruners.options import Choice, option
from prune_audit.pruners.similarity import (
    TIES, farthest_point_order, half_dtype, rows_per_block, tie_tolerance, unit_rows,
)


@register
@dataclass
class DivPruneSelector(InputSelector):
    """Greedy max-min diversity on projector outputs (DivPrune).

    With cosine distance ``1 - cos(v_i, v_j)`` between the (N, D) ``features``, the
    first pick is the most isolated token (largest distance to its nearest other
    token), each further pick the token farthest from its nearest picked token
    (farthest-point traversal); the picks are returned in raster order. Follows
    vbdi/divprune ``llava_arch.py::DivPrune`` with the integer budget in place of
    ``round(SUBSET_RATIO * N)``.

    Picks take the plain float32 argmax (``ties="argmax"``, reference); ``ties="tolerance"``
    treats distances within a relative 1e-5 of the best as tied, the lower index winning.
    ``score_dtype="model"``: unit rows and distances in the model's dtype (``signals.model_dtype``;
    hand-built half-precision features keep their own), as the reference computes them (fp16 in
    practice, whose rounding creates ties).

    Deviations: a running minimum instead of re-gathering picked rows, no N x N matrix
    (see ``similarity``), and picked tokens are never picked again (the reference can
    re-pick once all distances are 0).
    """

    name: ClassVar[str] = "divprune"
    summary: ClassVar[str] = "greedy max-min cosine diversity of projector outputs (DivPrune)"
    requires: ClassVar[frozenset[str]] = frozenset({"features"})
    reference: ClassVar[Reference] = Reference(
        "DivPrune: Diversity-based Visual Token Pruning for Large Multimodal Models (CVPR 2025, arXiv 2503.02175)",
        "vbdi/divprune",
        "LLM input embeddings of the image span, cosine distance, most isolated token first",
    )

    #: nominal above one similarity block, where the speculative rows vary with the data (``pruners.arithmetic``)
    flops_exact: ClassVar[bool] = False

    ties: str = option("argmax", Choice(TIES), "argmax (official) or tolerance (relative 1e-5, lower index)")
    score_dtype: str = option("float32", Choice(("float32", "model")), "float32, or the model dtype as the reference")

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """The N x N cosine, held and read while it fits one block (``pruners.similarity.farthest_point_order``:
        exact there); above, one row per pick after the first (the speculative rows vary with the data)."""
        gram = matmul(work.tokens, work.feature_width, work.tokens)
        if rows_per_block(work.tokens) >= work.tokens:
            return gram
        return gram + max(work.kept - 1, 0) * matmul(1, work.feature_width, work.tokens)

    def _select(self, signals: InputSignals, budget: int, generator: torch.Generator | None) -> Selection:
        features = signals.features.detach()
        dtype = half_dtype(signals.model_dtype, features) if self.score_dtype == "model" else None
        if dtype is not None:  # normalised and compared in the model's dtype, as the reference
            features = features.to(dtype)
            unit = features / features.norm(dim=1, keepdim=True)
        else:
            unit = unit_rows(features)
        order = farthest_point_order(unit, budget, tie_tolerance(self.ties))
        return Selection(kept=torch.sort(order).values)
