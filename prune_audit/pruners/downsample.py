"""Image-downsampling baseline (VTC-Bench): the image (Qwen) or its token grid (LLaVA) resized to fit the budget."""

from __future__ import annotations

from collections.abc import Callable
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
    """Resize the image (Qwen families) or the (rows, cols) grid of vision features (the others) to the budget,
    with the filter VTC-Bench resizes its images with (PIL's antialiased bicubic).

    VTC-Bench's baseline (Chenfei-Liao/VTC-Bench, commit 983e443e,
    ``external/DART/lmms-eval/lmms_eval/models/qwen2_vl.py`` with ``VTC_IMAGE_RATIO=r`` from ``scripts/dart.sh``)
    resizes the image to ``(W // r, H // r)`` with ``PIL.Image.resize(..., BICUBIC)`` for an integer ratio ``r``
    and runs Qwen2-VL on it, whose processor then gives about ``N / r**2`` tokens; it has no budget of its own
    (its ratios 2, 3, 4, 5, 10 stand against keep ratios 0.25, 0.1111, 0.0625, 0.04, 0.01), and no code for a
    fixed-resolution tower.

    On the Qwen families (Qwen2-VL, Qwen2.5-VL, Qwen3-VL), whose processor sets the token grid from the image's
    own size, it does what the reference does: ``resizes_image`` is declared here and honoured by the adapter's
    ``prepare_for``, which resizes the PIL image with ``BICUBIC`` to :meth:`resized_image_size` before the
    processor, so the tower reruns on the smaller image and every one of its tokens is fed (no selection runs;
    the record's geometry is the resized image's mapped back to the original pixels, so retention, lost and
    diluted go through it). The trait sits on the selector and the resize in the adapter's prepare step because
    the resized prompt is another prompt (its own grid, M-RoPE ids, pixel patches and tower and LLM cost): no
    selection over the N tokens of the original gives it, and pruners/ never touches images or processors.

    On the other families (LLaVA, LLaVA-NeXT, InternVL: fixed-resolution towers) the vision tower is not rerun:
    the pre-projector ``vision_features`` ((N, Dv), N = rows x cols) are resampled from (rows, cols) to the downsampled grid (r', c') with PIL's filter
    (``torch.nn.functional.interpolate(mode="bicubic", antialias=True, align_corners=False)``, which matches
    ``PIL.Image.resize(BICUBIC)`` of each channel to float rounding), in float32, then projected as merged tokens.

    The downsampled grid: ``factor="fit"`` (default) the largest grid of the image's aspect ratio within the budget,
    ``(floor(rows * s), floor(cols * s))`` with ``s = sqrt(budget / N)`` (24 x 24 at 64 -> 8 x 8, at 144 -> 12 x 12,
    at 192 -> 13 x 13 = 169); ``factor="integer"`` VTC-Bench's integer ratio, the smallest ``r`` with
    ``(rows // r) * (cols // r) <= budget``: on LLaVA-1.5 the patch grid of the 336 // r image CLIP would see
    (24 x 24 at 64 -> r = 3, 8 x 8; at 144 and at 192 -> r = 2, 12 x 12; at 128 -> r = 3, 64 tokens).

    There retention goes through the downsampled geometry: output token (i, j) covers the original image region
    of the downsampled grid's cell (i, j), and carries as its sources the original cells whose centres fall in that
    footprint (row ``a`` -> ``floor((a + 0.5) * r' / rows)``, likewise for columns; the sources partition the
    grid, as ``data.geometry`` assigns each pixel to the token holding its centre). ``kept`` is empty: every
    output token is a merged token (an object is diluted, never lost). Output order: the downsampled grid in
    raster order.

    Options:
        factor: ``"fit"`` (largest grid within the budget) or ``"integer"`` (VTC-Bench's integer ratio).
    """

    name: ClassVar[str] = "downsample"
    summary: ClassVar[str] = (
        "resize the image (Qwen) or its token grid (bicubic) to the budget (VTC-Bench downsampling)"
    )
    layout_need: ClassVar[str] = PRE_PROJECTOR_FEATURES  # it resamples the tower's output before the projector
    per_grid: ClassVar[str] = GRID_MERGE
    requires: ClassVar[frozenset[str]] = frozenset({"vision_features"})
    fills_budget: ClassVar[bool] = False  # the largest downsampled grid within the budget: 192 on 24 x 24 feeds 169
    merges: ClassVar[bool] = True
    resizes_image: ClassVar[bool] = True  # on Qwen the image itself is resized and the tower reruns (docstring)
    reference: ClassVar[Reference] = Reference(
        "Are We Using the Right Benchmark: An Evaluation Framework for Visual Token Compression Methods "
        "(VTC-Bench, arXiv 2510.07143)",
        "Chenfei-Liao/VTC-Bench",
        "image downsampling baseline (PIL bicubic resize by an integer ratio): the image on Qwen, the feature grid on "
        "LLaVA",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "983e443e",
        "the pre-projector feature grid resized with PIL's antialiased bicubic filter to the largest grid of the "
        "image's aspect ratio within the budget",
        ("factor=integer",),
        (
            "VTC-Bench resizes the image's pixels and reruns the vision tower (Qwen2-VL only): so do the Qwen "
            "families here (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: PIL bicubic resize before the processor, whose "
            "smart_resize sets the grid; every token of the smaller image fed, retention through its geometry "
            "mapped back to the original); on the others (LLaVA, LLaVA-NeXT, InternVL) the tower's feature grid is "
            "resized with the same filter instead (one vision pass, no second encoding), so the tokens "
            "approximate those of the smaller image; families without pre-projector features and without image "
            "resizing (LLaVA-OneVision) refuse it",
            "the reference takes an integer ratio, not a budget: factor=integer picks the smallest ratio whose "
            "tokens fit the budget (on LLaVA the grid (rows // r, cols // r), CLIP's patch grid of the 336 // r "
            "image; on Qwen the image (W // r, H // r) through smart_resize); factor=fit (default) takes the "
            "largest grid (LLaVA) or image size of the aspect ratio (Qwen) within the budget, so a budget that is "
            "no integer ratio's count is nearly met",
            "on LLaVA retention counts each output token's footprint in the original image as the original cells "
            "whose centres it holds (merged_stages), so an object is diluted, not lost",
        ),
        "tokens equal PIL.Image.resize(BICUBIC) of each feature channel and a float64 re-derivation of PIL's "
        "antialiased bicubic filter (test_downsample.py::test_downsample_equals_pil_bicubic_resize_of_each_channel); "
        "on Qwen2.5-VL the processed size is VTC-Bench's ratio rule through smart_resize and the prefill the stock "
        "one on the resized image (test_qwen2_5_vl.py::test_downsample_resizes_the_image_as_vtc_bench_and_reruns_"
        "the_tower)",
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

    def resized_image_size(
        self, image_size: tuple[int, int], budget: int, tokens_of: Callable[[tuple[int, int]], int]
    ) -> tuple[int, int]:
        """(width, height) of the image resized for ``budget`` on a family whose processor sets the token grid
        (Qwen's ``smart_resize``; ``tokens_of`` counts the tokens of an image of a given size): under
        ``factor="integer"`` VTC-Bench's ``(W // r, H // r)`` for the smallest integer ``r`` whose count fits;
        under ``factor="fit"`` the largest size of the image's aspect ratio whose count fits, its longer side
        ``L`` scanned down from the original's and the shorter ``max(1, round(L * short / long))`` (half up).
        The original size when it fits already (``r = 1``: a budget of at least N keeps the image as given)."""
        width, height = image_size
        if self.factor == "integer":
            sizes = ((width // r, height // r) for r in range(1, min(width, height) + 1))
        else:
            long, short = max(width, height), min(width, height)
            scaled = ((side, max(1, (2 * side * short + long) // (2 * long))) for side in range(long, 0, -1))
            sizes = ((a, b) if width >= height else (b, a) for a, b in scaled)
        fitting = next((size for size in sizes if tokens_of(size) <= budget), None)
        if fitting is None:
            raise ValueError(
                f"no resized {width}x{height} image has at most {budget} tokens (the processor gives at least "
                f"{tokens_of((1, 1))}); raise the budget"
            )
        return fitting

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
