"""GlobalCom2: the thumbnail's CLS attention guides how many tokens each anyres crop keeps, and which."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from prune_audit.pruners.arithmetic import SelectorWork
from prune_audit.pruners.base import TOP_K_TIES, InputSelector, Reference, Selection, as_float32, top_k_indices
from prune_audit.pruners.fidelity import Fidelity, random_agreement
from prune_audit.pruners.options import Choice, Real, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.signals import InputSignals

#: ``allocation`` values: the official ratios rescaled so the image keeps exactly the budget, or the official counts
ALLOCATIONS = ("budget", "reference")
#: the official softmax stabiliser: ``exp / (sum(exp) + 1e-8)``
SOFTMAX_EPSILON = 1e-8
#: bisection steps for the common ratio (float64: far past the precision of the targets)
RATIO_STEPS = 100


@dataclass(frozen=True)
class CropLayout:
    """``InputSignals.crop_layout`` read: where an anyres image's tokens lie.

    Attributes:
        base: (rows, cols) of the base view (the thumbnail), tokens ``0..B-1``.
        tiles: (rows, cols) of the unpadded joined tile grid, tokens ``B..N-1`` row-major.
        canvas: (rows, cols) of the canvas in tiles; each tile is a ``base``-sized patch grid.
        cut: patch rows and columns unpadding removed at the top and at the left of the joined tile grid.
    """

    base: tuple[int, int]
    tiles: tuple[int, int]
    canvas: tuple[int, int]
    cut: tuple[int, int]

    @classmethod
    def of(cls, signals: InputSignals) -> CropLayout:
        """The layout of ``signals.crop_layout`` (4, 2), checked to hold ``signals.num_tokens`` tokens."""
        assert signals.crop_layout is not None  # checked by select()
        values = [int(value) for value in signals.crop_layout.round().long().flatten().tolist()]
        layout = cls((values[0], values[1]), (values[2], values[3]), (values[4], values[5]), (values[6], values[7]))
        fits = all(layout.tiles[a] + layout.cut[a] <= layout.canvas[a] * layout.base[a] for a in (0, 1))
        if layout.base_tokens + layout.tiles[0] * layout.tiles[1] != signals.num_tokens or min(values) < 0 or not fits:
            raise ValueError(
                f"crop_layout {values} does not lay out {signals.num_tokens} tokens as a base view and a tile grid"
            )
        return layout

    @property
    def base_tokens(self) -> int:
        return self.base[0] * self.base[1]

    def tile_of(self) -> Tensor:
        """(R x C,) the canvas tile (row-major, 0-based) of each tile-grid token."""
        rows = (torch.arange(self.tiles[0]) + self.cut[0]) // self.base[0]
        cols = (torch.arange(self.tiles[1]) + self.cut[1]) // self.base[1]
        return (rows[:, None] * self.canvas[1] + cols[None, :]).flatten()


def tile_weights(thumbnail: Tensor, canvas: tuple[int, int], temperature: float) -> Tensor:
    """(T,) float64 softmax over the canvas tiles of the thumbnail's scores summed over each tile's region.

    Args:
        thumbnail: (rows, cols) the base view's scores.
        canvas: (rows, cols) of the canvas in tiles, T = rows x cols.
        temperature: the softmax temperature (official 10).

    The base view is cut into ``canvas`` even blocks of ``max(rows // tile rows, 1)`` x ``max(cols // tile cols, 1)``
    patches, the last block row and column taking the remainder, as the official ``generate_scale_for_crop_features``.
    """
    rows, cols = thumbnail.shape
    block_rows, block_cols = max(rows // canvas[0], 1), max(cols // canvas[1], 1)
    tile_row = torch.clamp(torch.arange(rows) // block_rows, max=canvas[0] - 1)
    tile_col = torch.clamp(torch.arange(cols) // block_cols, max=canvas[1] - 1)
    tile = (tile_row[:, None] * canvas[1] + tile_col[None, :]).flatten()
    sums = torch.zeros(canvas[0] * canvas[1], dtype=torch.float64).index_add_(0, tile, thumbnail.flatten().double())
    exponentials = torch.exp((sums - sums.max()) / temperature)
    return exponentials / (exponentials.sum() + SOFTMAX_EPSILON)


def reference_counts(sizes: Sequence[int], factors: Sequence[float], ratio: float) -> list[int]:
    """The official counts: part p keeps ``int(sizes[p] x min(1, ratio x factors[p]))``."""
    return [int(size * min(1.0, ratio * factor)) for size, factor in zip(sizes, factors)]


def budget_counts(sizes: Sequence[int], factors: Sequence[float], budget: int) -> list[int]:
    """Counts summing to ``budget`` (< sum of ``sizes``): the official ``sizes[p] x min(1, r x factors[p])`` at the
    one ratio r whose targets sum to the budget (bisection), rounded by largest remainder (ties to the earlier
    part), none above its size."""
    low, high = 0.0, max(1.0 / factor for factor, size in zip(factors, sizes) if size)

    def targets(ratio: float) -> list[float]:
        return [size * min(1.0, ratio * factor) for size, factor in zip(sizes, factors)]

    for _ in range(RATIO_STEPS):
        middle = (low + high) / 2
        low, high = (middle, high) if sum(targets(middle)) < budget else (low, middle)
    wanted = targets(high)
    counts = [min(size, math.floor(target)) for size, target in zip(sizes, wanted)]
    order = sorted(range(len(sizes)), key=lambda p: (-(wanted[p] - math.floor(wanted[p])), p))
    while sum(counts) < budget:  # one token each to the largest remainders, again if rounding left any over
        for part in order:
            if sum(counts) < budget and counts[part] < sizes[part]:
                counts[part] += 1
    return counts


def crop_scores(logits: Tensor, layout: CropLayout) -> list[tuple[Tensor, Tensor]]:
    """Per canvas tile (row-major): its (M_c,) ascending image tokens and their (M_c,) importance, the unit-norm
    local scores (the tile's own CLS logits) plus the unit-norm global ones (the thumbnail's logits bilinearly
    resized to the unpadded tile grid, ``align_corners=False``, read at each token's cell); tiles unpadding emptied
    give empty tensors.

    Args:
        logits: (N,) float32 ``last_cls_logits``.
    """
    base = layout.base_tokens
    thumbnail = logits[:base].reshape(1, 1, *layout.base)
    resized = F.interpolate(thumbnail, size=layout.tiles, mode="bilinear", align_corners=False).flatten()
    tile_of = layout.tile_of()
    scores = []
    for tile in range(layout.canvas[0] * layout.canvas[1]):
        cells = torch.nonzero(tile_of == tile).flatten()
        local, global_ = logits[base + cells], resized[cells]
        scores.append((base + cells, F.normalize(local, dim=0) + F.normalize(global_, dim=0)))
    return scores


@register
@dataclass
class GlobalCom2Selector(InputSelector):
    """Thumbnail-guided compression of LLaVA-NeXT's anyres crops (GlobalCom2).

    Every score is the head mean of a CLS row's attention logits (before the softmax) at the vision tower's last
    encoder layer (``last_cls_logits``), each crop's tokens scored by that crop's own CLS, as the official customised
    CLIP attention returns them (``attn_maps[-1][:, 0, 1:]``). With ``r`` a retention ratio:

    1. the thumbnail (the base view, B tokens) keeps its ``B r`` tokens of highest score;
    2. the thumbnail's scores summed over the block of it each canvas tile covers (the base view cut evenly into the
       canvas's tile rows x cols), a softmax over the tiles at ``temperature`` gives weights ``w_c``; tile c keeps
       ``M_c min(1, r (1 + w_c - mean w))`` of its ``M_c`` unpadded tokens: tiles the thumbnail attends to more
       keep more;
    3. within a tile, tokens are ranked by the unit-norm local scores (its own CLS) plus the unit-norm global ones
       (the thumbnail's score map bilinearly resized to the unpadded tile grid, read at the token's cell).

    ``allocation="budget"`` (default) picks the one ``r`` whose targets sum to the budget and rounds them by
    largest remainder, so the image keeps exactly the budget; ``allocation="reference"`` takes ``r = budget / N``
    and truncates each count as the official code does (``int``), keeping about the budget: fewer by the
    truncations, and more where the favoured tiles hold more tokens than the others (unpadding leaves the middle
    tile of a 1 x 3 canvas whole: 245 for a budget of 228 in one random case of the tests). Kept tokens are returned
    ascending; ties go to the lower index (``ties="topk"``: ``torch.topk``).

    It needs the anyres crops (``crop_layout``): families that see an image as one crop refuse it for that
    missing signal (the official code leaves a single-crop image uncompressed, a case with nothing to audit).
    It allocates over the crops itself, so ``budget_scope`` is ``image`` only.

    Options:
        temperature: the softmax temperature of the tile weights (official 10).
        allocation: ``"budget"`` (exactly the budget) or ``"reference"`` (the official truncated counts).
        ties: exact ties to the lower index, or ``torch.topk``'s order.
    """

    name: ClassVar[str] = "globalcom2"
    summary: ClassVar[str] = (
        "anyres crops keep tokens in proportion to the thumbnail's CLS attention to them, ranked by local + global "
        "CLS attention (GlobalCom2)"
    )
    requires: ClassVar[frozenset[str]] = frozenset({"last_cls_logits", "crop_layout"})
    reference: ClassVar[Reference] = Reference(
        "Compression with Global Guidance: Towards Training-free High-Resolution MLLMs Acceleration "
        "(GlobalCom2, arXiv 2501.05179)",
        "xuyang-liu16/GlobalCom2",
        "LLaVA-NeXT; last CLIP layer's head-mean CLS logits; thumbnail and tile ratios from retention 0.25, "
        "tile weights by a softmax at temperature 10",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "96b2d00b",
        "thumbnail top-k and per-tile counts from the thumbnail's tile weights (temperature 10), tiles ranked by "
        "unit-norm local + global CLS logits; the official ratios rescaled so the image keeps exactly the budget; "
        "float32 scores",
        ("allocation=reference", "ties=topk"),
        (
            "the official code fixes a retention ratio (0.25) and truncates each count, so an image keeps about a "
            "quarter of its tokens; here the budget is the image's: allocation=budget finds the ratio whose counts "
            "sum to it (largest remainder), allocation=reference takes ratio = budget / N and truncates as the "
            "official code, keeping more or fewer tokens than the budget (the tiles' weighted shares sum to ratio "
            "x their tokens only when unpadding leaves them equal: 245 for a budget of 228 in one random 1 x 3 "
            "canvas case)",
            "the official code feeds the thumbnail's kept tokens in descending score order and one image_newline "
            "after every row of the padded tile grid (rows unpadding removed included); here the kept tokens keep "
            "their raster order and the newlines of the unpadded rows, as every LLaVA-NeXT selection",
            "the tile grid is the processor's unpadding (transformers rounds the unpadded side, the official LLaVA "
            "code truncates it; they differ only when the side lands within 1e-7 of an integer)",
            "ties to the lower index (torch.topk leaves them unspecified)",
            "scores in float32 (a half model's logits widened); the official code forms and ranks them in fp16 and "
            "sums the tile scores in float64 (numpy), as here",
        ),
        random_agreement(
            30,
            "test_globalcom2.py::test_reference_allocation_reproduces_the_official_counts_and_kept_sets",
            "allocation=reference: every crop's count and kept set, at LLaVA-NeXT shapes (576-token base view, "
            "2 x 2, 1 x 3 and 3 x 1 canvases of 576-token tiles, unpadded; budgets N/4, N/8, N/16); "
            "allocation=budget: exactly the budget, "
            "each crop's kept set the official ranking at its count, the counts the official targets at one ratio "
            "(test_budget_allocation_keeps_the_budget_with_the_official_ranking)",
        ),
        30,
    )
    flops_exact: ClassVar[bool] = True  # no products: sums, a softmax, a bilinear resize, norms and top-k count zero

    temperature: float = option(10.0, Real(low=0.0, open_low=True), "softmax temperature of the tile weights")
    allocation: str = option("budget", Choice(ALLOCATIONS), "exactly the budget, or the official truncated counts")
    ties: str = option("lower", Choice(TOP_K_TIES), "exact ties to the lower index, or torch.topk's order (official)")
    budget_scope: str = option("image", Choice(("image",)), "image only: it allocates the budget over the crops itself")

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """No products of its own: it ranks the CLS logits the model gives it."""
        return 0

    def allocate(self, signals: InputSignals, budget: int) -> list[tuple[Tensor, Tensor, int]]:
        """Per part, the thumbnail then each canvas tile (row-major): its (M,) ascending image tokens, their (M,)
        importance (the thumbnail's own logits; a tile's :func:`crop_scores`) and how many it keeps."""
        layout = CropLayout.of(signals)
        logits = as_float32(signals.last_cls_logits)
        thumbnail = logits[: layout.base_tokens]
        weights = tile_weights(thumbnail.reshape(layout.base), layout.canvas, self.temperature)
        factors = [1.0] + (1.0 + weights - weights.mean()).tolist()
        parts = [(torch.arange(layout.base_tokens), thumbnail), *crop_scores(logits, layout)]
        sizes = [int(tokens.numel()) for tokens, _ in parts]
        if self.allocation == "reference":
            counts = reference_counts(sizes, factors, budget / signals.num_tokens)
        else:
            counts = budget_counts(sizes, factors, budget)
        return [(tokens, scores, count) for (tokens, scores), count in zip(parts, counts)]

    def _select(self, signals: InputSignals, budget: int, generator: torch.Generator | None) -> Selection:
        kept = [
            tokens[top_k_indices(scores, count, self.ties)] for tokens, scores, count in self.allocate(signals, budget)
        ]
        return Selection(kept=torch.cat(kept).sort().values)
