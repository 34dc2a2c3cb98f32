"""Control selectors: seeded random and spatially uniform subsampling."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from prune_audit.pruners.base import InputSelector, Reference, Selection
from prune_audit.pruners.fidelity import Fidelity
from prune_audit.pruners.layout import GRID_SPLIT
from prune_audit.pruners.registry import register
from prune_audit.pruners.signals import InputSignals


@register
@dataclass
class RandomSelector(InputSelector):
    """Keep a uniformly random subset of ``budget`` tokens (seeded by the generator)."""

    name: ClassVar[str] = "random"
    summary: ClassVar[str] = "uniformly random subset (control)"
    reference: ClassVar[Reference] = Reference("control baseline", "-")
    fidelity: ClassVar[Fidelity] = Fidelity(
        "-", "seeded uniform subset (control)", (), ("control, no reference",), "not applicable"
    )

    flops_exact: ClassVar[bool] = True  # no products of its own: a random draw
    per_frame: ClassVar[bool] = True  # a random subset of each temporal step of a clip (``pruners.frame_scope``)

    def score(self, signals: InputSignals, generator: torch.Generator | None) -> Tensor:
        return torch.rand(signals.num_tokens, generator=generator)


@register
@dataclass
class UniformSelector(InputSelector):
    """Spatially even subsample: the grid cells nearest a regular lattice of ``budget`` points.

    The lattice has ``r x c`` points with ``r / c`` close to the grid's aspect ratio and
    ``r * c >= budget``; points are visited in an order that spreads them (a strided
    permutation), each takes its nearest free cell, so exactly ``budget`` distinct cells
    are kept and they cover the grid evenly. Deterministic (no generator needed).
    """

    name: ClassVar[str] = "uniform"
    summary: ClassVar[str] = "spatially even subsample of the grid (control)"
    per_grid: ClassVar[str] = GRID_SPLIT
    reference: ClassVar[Reference] = Reference("control baseline", "-")
    fidelity: ClassVar[Fidelity] = Fidelity(
        "-", "spatially even lattice subsample (control)", (), ("control, no reference",), "not applicable"
    )

    flops_exact: ClassVar[bool] = True  # no products of its own: evenly spaced cells
    per_frame: ClassVar[bool] = True  # a lattice on each temporal step's h x w grid of a clip (``pruners.frame_scope``)

    def _select(self, signals: InputSignals, budget: int, generator: torch.Generator | None) -> Selection:
        rows, cols = signals.grid
        lattice_rows = max(1, min(rows, round(math.sqrt(budget * rows / cols))))
        lattice_cols = max(1, math.ceil(budget / lattice_rows))
        while lattice_rows * lattice_cols < budget:
            lattice_rows += 1
        ys = (torch.arange(lattice_rows, dtype=torch.float64) + 0.5) * rows / lattice_rows
        xs = (torch.arange(lattice_cols, dtype=torch.float64) + 0.5) * cols / lattice_cols
        points = torch.cartesian_prod(ys, xs)
        # drop surplus lattice points evenly so the remaining ones still span the grid
        chosen = torch.linspace(0, points.shape[0] - 1, budget, dtype=torch.float64).round().long()
        points = points[chosen]
        cell_y = torch.arange(rows, dtype=torch.float64).repeat_interleave(cols) + 0.5
        cell_x = torch.arange(cols, dtype=torch.float64).repeat(rows) + 0.5
        taken = torch.zeros(rows * cols, dtype=torch.bool)
        # one (N,) distance row per lattice point keeps memory O(N) even at N = 16384
        for y, x in points.tolist():
            distance = ((cell_y - y) ** 2 + (cell_x - x) ** 2).masked_fill(taken, float("inf"))
            taken[int(torch.argmin(distance))] = True
        return Selection(kept=torch.nonzero(taken).flatten())
