"""Demand-weighted coverage selection in projector space (CoverPruner-like, unofficial)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from prune_audit.pruners.arithmetic import SelectorWork, matmul
from prune_audit.pruners.base import InputSelector, Reference, Selection, as_float32
from prune_audit.pruners.fidelity import Fidelity
from prune_audit.pruners.options import Real, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.signals import InputSignals
from prune_audit.pruners.similarity import facility_location_greedy, unit_rows


@register
@dataclass
class CoverageSelector(InputSelector):
    """Demand-weighted facility location on projector outputs (CoverPruner-like, UNOFFICIAL).

    Every token j should be represented by a kept one: with ``S`` the mean-centred
    cosine similarity of the (N, D) ``features`` (centring removes the direction all
    tokens share, which would make everything look alike) and coverage
    ``cov_j = max(0, max_{s in picked} S[j, s])`` (similarities clipped at 0), each
    step picks the token maximising ``sum_j w_j * max(0, S[j, i] - cov_j)``. The
    demand weight sits on the covered token j, not on the candidate (the difference
    from SCOPE). ``w = N * softmax(log(demand) / tau)``, i.e. ``w_j`` proportional to
    ``demand_j ** (1 / tau)`` with mean 1: invariant to the scale of the first-layer
    probe's ``demand``, tau = 1 keeps the proportions, tau < 1 sharpens them and
    tau -> infinity gives uniform (unweighted) coverage. Picks are returned in raster
    order.

    No code or full text of CoverPruner (arXiv 2609.03158) is public; this follows its
    abstract and secondary notes (objective ``max sum_i w_i max_{j in S} cos(v_i, v_j)``)
    and is not a reproduction.

    Options:
        tau: demand temperature, > 0.
    """

    name: ClassVar[str] = "coverage"
    summary: ClassVar[str] = (
        "demand-weighted facility location, centred projector cosine (CoverPruner-like, unofficial)"
    )
    requires: ClassVar[frozenset[str]] = frozenset({"features", "demand"})
    reference: ClassVar[Reference] = Reference(
        "Who Speaks for the Pruned? Visual Token Pruning as Coverage Optimization (arXiv 2609.03158)",
        "none public",
        "unofficial re-implementation from the abstract; demand from a first-layer text-to-visual probe",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "-",
        "demand-weighted facility location on centred projector cosine",
        (),
        ("unofficial: written from the CoverPruner abstract; not a reproduction",),
        "no official code to compare with",
    )

    #: nominal: the weighted gains update only the rows a pick changes (``pruners.arithmetic``)
    flops_exact: ClassVar[bool] = False
    #: features and the layer-0 demand exist on a clip and its coverage is defined on any token set: each temporal
    #: step alone (``pruners.frame_scope``), its demand weights normalised within the step
    per_frame: ClassVar[bool] = True

    tau: float = option(1.0, Real(low=0.0, open_low=True), "demand temperature")

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """Centred cosine of the projector outputs, and the demand-weighted first gains (w @ gaps)."""
        return matmul(work.tokens, work.feature_width, work.tokens) + matmul(1, work.tokens, work.tokens)

    def demand_weights(self, demand: Tensor) -> Tensor:
        """(N,) float32 weights with mean 1 from the (N,) non-negative ``demand``."""
        demand = as_float32(demand)
        if bool((demand < 0).any()):
            raise ValueError("coverage demand weights must be non-negative (attention probabilities)")
        # the floor keeps zero demand finite: an all-zero probe gives uniform weights
        logits = torch.log(demand.clamp_min(1e-30)) / self.tau
        return demand.numel() * torch.softmax(logits, dim=0)

    def _select(self, signals: InputSignals, budget: int, generator: torch.Generator | None) -> Selection:
        order, _ = facility_location_greedy(
            unit_rows(signals.features, centre=True),
            budget,
            demand_weights=self.demand_weights(signals.demand),
        )
        return Selection(kept=torch.sort(order).values)
