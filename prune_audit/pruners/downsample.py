"""Image-downsampling baseline (VTC-Bench): the token grid resized as the image would be, to fit the budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from prune_audit.pruners.arithmetic import SelectorWork
from prune_audit.pruners.base import InputSelector, Reference, Selection, as_float32
from prune_audit.pruners.fidelity import Fidelity
from prune_audit.pruners.layout import GRID_MERGE, PRE_PROJECTOR_FEATURES
from prune_audit.pruners.options import Choice, option
from prune_audit.pruners.pool import pooled_grid
from prune_audit.pruners.registry import register
from prune_audit.pruners.signals import InputSignals

#: ``factor`` values: the largest grid of the image's aspect ratio within the budget, or VTC-Bench's integer ratio
FACTORS = ("fit", "integer")


@register
@dataclass
class DownsampleSelector(InputSelector):
    """Resize the (rows, cols) grid of vision features to a smaller grid within the budget, with the filter
    VTC-Bench resizes its images with (PIL's antialiased bicubic).

    VTC-Bench's baseline (Chenfei-Liao/VTC-Bench, commit 983e443e,
    ``external/DART/lmms-eval/lmms_eval/models/qwen2_vl.py`` with ``VTC_IMAGE_RATIO=r`` from ``scripts/dart.sh``)
    resizes the image to ``(W // r, H // r)`` with ``PIL.Image.resize(..., BICUBIC)`` for an integer ratio ``r``
    and runs Qwen2-VL on it, whose processor then gives about ``N / r**2`` tokens; it has no budget of its own
    (its ratios 2, 3, 4, 5, 10 stand against keep ratios 0.25, 0.1111, 0.0625, 0.04, 0.01), and no code for a
    fixed-resolution tower. Here the vision tower is not rerun: the pre-projector ``vision_features`` ((N, Dv),
    N = rows x cols) are resampled from (rows, cols) to the downsampled grid (r', c') with PIL's filter
    (``torch.nn.functional.interpolate(mode="bicubic", antialias=True, align_corners=False)``, which matches
    ``PIL.Image.resize(BICUBIC)`` of each channel to float rounding), in float32, then projected as merged tokens.

    The downsampled grid: ``factor="fit"`` (default) the largest grid of the image's aspect ratio within the budget,
    ``(floor(rows * s), floor(cols * s))`` with ``s = sqrt(budget / N)`` (24 x 24 at 64 -> 8 x 8, at 144 -> 12 x 12,
    at 192 -> 13 x 13 = 169); ``factor="integer"`` VTC-Bench's integer ratio, the smallest ``r`` with
    ``(rows // r) * (cols // r) <= budget``: on LLaVA-1.5 the patch grid of the 336 // r image CLIP would see
    (24 x 24 at 64 -> r = 3, 8 x 8; at 144 and at 192 -> r = 2, 12 x 12; at 128 -> r = 3, 64 tokens).

    Retention goes through the downsampled geometry: output token (i, j) covers the original image region of
    the downsampled grid's cell (i, j), and carries as its sources the original cells whose centres fall in that
    footprint (row ``a`` -> ``floor((a + 0.5) * r' / rows)``, likewise for columns; the sources partition the
    grid, as ``data.geometry`` assigns each pixel to the token holding its centre). ``kept`` is empty: every
    output token is a merged token (an object is diluted, never lost). Output order: the downsampled grid in
    raster order.

    Options:
        factor: ``"fit"`` (largest grid within the budget) or ``"integer"`` (VTC-Bench's integer ratio).
    """

    name: ClassVar[str] = "downsample"
    summary: ClassVar[str] = "resize the token grid as the image (bicubic) to the budget (VTC-Bench downsampling)"
    layout_need: ClassVar[str] = PRE_PROJECTOR_FEATURES  # it resamples the tower's output before the projector
    per_grid: ClassVar[str] = GRID_MERGE
    requires: ClassVar[frozenset[str]] = frozenset({"vision_features"})
    fills_budget: ClassVar[bool] = False  # the largest downsampled grid within the budget: 192 on 24 x 24 feeds 169
    merges: ClassVar[bool] = True
    reference: ClassVar[Reference] = Reference(
        "Are We Using the Right Benchmark: An Evaluation Framework for Visual Token Compression Methods "
        "(VTC-Bench, arXiv 2510.07143)",
        "Chenfei-Liao/VTC-Bench",
        "image downsampling baseline (PIL bicubic resize by an integer ratio), here on the vision-feature grid",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "983e443e",
        "the pre-projector feature grid resized with PIL's antialiased bicubic filter to the largest grid of the "
        "image's aspect ratio within the budget",
        ("factor=integer",),
        (
            "VTC-Bench resizes the image's pixels and reruns the vision tower (Qwen2-VL only); here the tower's "
            "full-resolution feature grid is resized with the same filter (one vision pass, no second encoding), "
            "so the tokens approximate those of the smaller image; families without pre-projector features or "
            "with fixed positions (Qwen2.5-VL) refuse it",
            "the reference takes an integer ratio, not a budget: factor=integer picks the smallest ratio whose grid "
            "(rows // r, cols // r) fits the budget (CLIP's patch grid of the 336 // r image; Qwen's smart_resize "
            "rounds to the nearest 28 pixels instead, at most one row or column more); factor=fit (default) "
            "takes the largest grid within the budget, so a budget that is no integer ratio's count is nearly met",
            "retention counts each output token's footprint in the original image as the original cells whose "
            "centres it holds (merged_stages), so an object is diluted, not lost",
        ),
        "tokens equal PIL.Image.resize(BICUBIC) of each feature channel and a float64 re-derivation of PIL's "
        "antialiased bicubic filter (test_downsample.py::test_downsample_equals_pil_bicubic_resize_of_each_channel)",
    )
    flops_exact: ClassVar[bool] = True  # resampling counts zero under the FLOP convention, as pooling does

    factor: str = option(
        "fit", Choice(FACTORS), "largest downsampled grid within the budget, or VTC-Bench's integer ratio"
    )

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """Zero: the resize is an interpolation kernel, which ``FlopCounterMode`` (the FLOP convention) does not
        count, as it does not count pooling's means."""
        return 0

    def _select(self, signals: InputSignals, budget: int, generator: torch.Generator | None) -> Selection:
        rows, cols = signals.grid
        out_rows, out_cols = self.downsampled_grid(rows, cols, budget)
        features = as_float32(signals.vision_features).T.reshape(1, -1, rows, cols)
        resized = F.interpolate(
            features, size=(out_rows, out_cols), mode="bicubic", antialias=True, align_corners=False
        )
        tokens = resized.flatten(2)[0].T.contiguous()
        sources = footprint_cells(rows, cols, out_rows, out_cols)
        return Selection(kept=torch.zeros(0, dtype=torch.long), sources=sources, vision_tokens=tokens)

    def downsampled_grid(self, rows: int, cols: int, budget: int) -> tuple[int, int]:
        """``(r', c')`` of the downsampled grid for ``budget < rows * cols`` under ``factor``."""
        if self.factor == "fit":
            return pooled_grid(rows, cols, budget)
        return integer_ratio_grid(rows, cols, budget)


def integer_ratio_grid(rows: int, cols: int, budget: int) -> tuple[int, int]:
    """``(rows // r, cols // r)`` (each at least 1) for the smallest integer ``r`` whose grid fits ``budget``."""
    return next(
        grid
        for r in range(1, max(rows, cols) + 1)
        if (grid := (max(1, rows // r), max(1, cols // r)))[0] * grid[1] <= budget
    )


def footprint_cells(rows: int, cols: int, out_rows: int, out_cols: int) -> list[Tensor]:
    """Ascending grid indices of the original cells whose centres lie in each downsampled token's footprint,
    raster order: cell row ``a`` to row ``floor((2a + 1) r' / 2 rows)`` (integer arithmetic; a centre on a border
    goes to the lower token), likewise for columns. A partition of the ``rows x cols`` cells, none empty while
    ``r' <= rows`` and ``c' <= cols``."""
    row_of = (2 * torch.arange(rows) + 1) * out_rows // (2 * rows)
    col_of = (2 * torch.arange(cols) + 1) * out_cols // (2 * cols)
    token_of = (row_of[:, None] * out_cols + col_of[None, :]).flatten()
    order = torch.argsort(token_of, stable=True)
    counts = torch.bincount(token_of, minlength=out_rows * out_cols)
    return list(torch.split(order, counts.tolist()))
