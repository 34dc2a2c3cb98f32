"""DivPrune: diversity-maximising selection by greedy max-min cosine distance."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from prune_audit.pruners.arithmetic import SelectorWork, matmul
from prune_audit.pruners.base import InputSelector, Reference, Selection
from prune_audit.pruners.fidelity import Fidelity, random_agreement
from prune_audit.pruners.options import Choice, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.signals import InputSignals
from prune_audit.pruners.similarity import (
    TIES,
    farthest_point_order,
    half_dtype,
    rows_per_block,
    tie_tolerance,
    unit_rows,
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
    fidelity: ClassVar[Fidelity] = Fidelity(
        "799e2d95",
        "greedy max-min cosine distance, plain float32 argmax",
        (),
        (
            "float32 by default (the official code computes in the model dtype, fp16 in practice, whose ties make "
            "the picks depend on rounding; score_dtype=model does the same)",
            "running minimum, no N x N matrix; picked tokens are never re-picked (only differs once all distances are 0)",
        ),
        random_agreement(
            30,
            "test_fidelity.py::test_plain_argmax_reproduces_the_official_greedy",
            "ties=tolerance: 25 of 30; fp16 features: score_dtype=model 30 of 30, float32 2 of 30 "
            "(measured once; the test runs 6 of those cases)",
        ),  # fmt: skip
        30,
        "fp16 6 of 6 (1024-dim cases: fp16 matrix products are slow on CPU; all 30 measured once: 30 of 30), bf16 30 "
        "of 30 with score_dtype=model against the official greedy run in that dtype on CPU "
        "(test_divprune.py::test_divprune_model_dtype_reproduces_the_official_half_precision_picks, "
        "test_divprune.py::test_divprune_model_dtype_reproduces_the_official_bf16_picks); float32 2 and 0 of 30",
        {"bf16": 30},
    )

    #: nominal above one similarity block, where the speculative rows vary with the data (``pruners.arithmetic``)
    flops_exact: ClassVar[bool] = False
    #: its diversity greedy needs only a set of features: on a clip, each temporal step alone (``pruners.frame_scope``)
    per_frame: ClassVar[bool] = True

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
