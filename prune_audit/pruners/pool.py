"""Pooling baseline: average-pool the token grid down to the budget (VTC-Bench's downsampling baseline)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from prune_audit.pruners.base import InputSelector, Reference, Selection, as_float32
from prune_audit.pruners.fidelity import Fidelity
from prune_audit.pruners.layout import GRID_MERGE, PRE_PROJECTOR_FEATURES
from prune_audit.pruners.options import Choice, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.signals import InputSignals


@register
@dataclass
class PoolSelector(InputSelector):
    """Average-pool the (rows, cols) grid of vision features to a coarser grid within the budget.

    Every output token is the mean of the pre-projector ``vision_features`` ((N, Dv)) of
    one window of cells and carries those cells as its sources (a merged token: retention
    counts the cells, and an object only pooled with others is *diluted*). Output order:
    the pooled grid in raster order. No cell keeps its own token (``kept`` is empty).

    ``grid="adaptive"`` (default) pools to the largest grid of the image's aspect ratio
    within the budget, ``(floor(rows * s), floor(cols * s))`` with ``s = sqrt(budget / N)``
    (24 x 24 at 64 -> 8 x 8, at 128 -> 11 x 11, at 144 -> 12 x 12), with the bins of
    ``torch.nn.functional.adaptive_avg_pool2d`` (bin ``i`` spans ``floor(i * rows / r)`` to
    ``ceil((i + 1) * rows / r)``; bins overlap by a cell where ``r`` does not divide ``rows``).
    ``grid="window"`` uses square ``k x k`` windows with the smallest ``k`` whose pooled grid
    ``ceil(rows / k) x ceil(cols / k)`` fits the budget (2 x 2, 3 x 3, ...; the last window of
    a row or column is partial), i.e. downsampling by an integer factor.

    Reference: the downsampling baseline of VTC-Bench (Chenfei-Liao/VTC-Bench, arXiv
    2510.07143), which shrinks the image; pooling the features of the full-resolution image is
    the token-level counterpart (no second vision pass), as spatial pooling in LLaVA-NeXT-Video
    and LLaVA-OneVision pools the vision tower's output grid.

    Options:
        grid: ``"adaptive"`` (largest grid within the budget) or ``"window"`` (integer k x k windows).
    """

    name: ClassVar[str] = "pool"
    summary: ClassVar[str] = "average-pool the token grid to the budget (downsampling baseline)"
    layout_need: ClassVar[str] = PRE_PROJECTOR_FEATURES  # it averages them before the projector
    per_grid: ClassVar[str] = GRID_MERGE
    requires: ClassVar[frozenset[str]] = frozenset({"vision_features"})
    fills_budget: ClassVar[bool] = False  # the largest pooled grid within the budget: 128 on 24 x 24 feeds 121
    merges: ClassVar[bool] = True
    reference: ClassVar[Reference] = Reference(
        "Are We Using the Right Benchmark: An Evaluation Framework for Visual Token Compression Methods "
        "(VTC-Bench, arXiv 2510.07143)",
        "Chenfei-Liao/VTC-Bench",
        "image downsampling baseline, here as average pooling of the feature grid",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "-",
        "adaptive average pooling of the pre-projector feature grid to the largest grid within the budget",
        (),
        (
            "VTC-Bench's baseline downsamples the image and runs the vision tower on it; pooling the full-resolution "
            "features is its token-level counterpart (one vision pass, same grid geometry); grid=window pools k x k "
            "windows, downsampling by an integer factor",
            "every output token is a merged token carrying its window's cells (merged_stages), so retention counts "
            "them and an object only pooled with other cells is diluted, not lost",
        ),
        "pooled tokens equal torch.nn.functional.adaptive_avg_pool2d of the feature grid "
        "(test_pool.py::test_pool_equals_adaptive_average_pooling)",
    )

    flops_exact: ClassVar[bool] = True  # no products of its own: it averages cells

    grid: str = option(
        "adaptive", Choice(("adaptive", "window")), "largest pooled grid within the budget, or k x k windows"
    )

    def _select(self, signals: InputSignals, budget: int, generator: torch.Generator | None) -> Selection:
        rows, cols = signals.grid
        windows = (
            adaptive_windows(rows, cols, budget) if self.grid == "adaptive" else square_windows(rows, cols, budget)
        )
        features = as_float32(signals.vision_features)
        tokens = torch.stack([features[cells].mean(dim=0) for cells in windows])
        return Selection(kept=torch.zeros(0, dtype=torch.long), sources=windows, vision_tokens=tokens)


def pooled_grid(rows: int, cols: int, budget: int) -> tuple[int, int]:
    """The largest ``(r, c)`` of the grid's aspect ratio with ``r * c <= budget`` (each at least 1)."""
    scale = math.sqrt(budget / (rows * cols))
    return max(1, min(rows, math.floor(rows * scale))), max(1, min(cols, math.floor(cols * scale)))


def adaptive_windows(rows: int, cols: int, budget: int) -> list[Tensor]:
    """Ascending grid indices of each adaptive-average-pooling bin of the pooled grid, raster order."""
    out_rows, out_cols = pooled_grid(rows, cols, budget)
    return [
        _cells(_bin(i, rows, out_rows), _bin(j, cols, out_cols), cols) for i in range(out_rows) for j in range(out_cols)
    ]


def square_windows(rows: int, cols: int, budget: int) -> list[Tensor]:
    """Ascending grid indices of each ``k x k`` window (smallest ``k`` fitting the budget), raster order."""
    k = next(k for k in range(1, max(rows, cols) + 1) if math.ceil(rows / k) * math.ceil(cols / k) <= budget)
    return [
        _cells(range(i, min(i + k, rows)), range(j, min(j + k, cols)), cols)
        for i in range(0, rows, k)
        for j in range(0, cols, k)
    ]


def _bin(index: int, size: int, bins: int) -> range:
    """Cells of adaptive pooling bin ``index`` of ``bins`` over ``size`` cells (torch's rule)."""
    return range(index * size // bins, -((-(index + 1) * size) // bins))


def _cells(row_range: range, col_range: range, cols: int) -> Tensor:
    return torch.tensor([r * cols + c for r in row_range for c in col_range], dtype=torch.long)
