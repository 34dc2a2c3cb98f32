"""Object-area retention: how much of the queried object's mask the kept tokens still see.

Per (image, category) the mask is decoded once and reduced to a vector of mask pixels
per token (``ObjectArea``); retention of a kept set is then a gather and a sum:

    retention = sum(area_per_token[kept]) / total_area

The denominator is the whole mask, so preprocessing that crops part of the object away
caps retention at the visible fraction even when every token is kept (evaluation spec,
sections D and I.4). A question without object pixels (a "no" question, or a "yes"
object with no instance mask) has no retention: NaN, ``object_tokens_kept`` -1, and
``lost`` undefined, never a silent zero.

An image seen through several token grids (LLaVA-NeXT's base view and tiles) counts each mask
pixel once per grid, so the denominator is the mask area times the grids (``ObjectArea.counted_area``):
retention is then the mean over grids of each grid's kept share, at most 1.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from prune_audit.data.coco import CocoInstances
from prune_audit.data.geometry import TokenGeometry, mask_area_per_token
from prune_audit.data.multigrid import grid_pieces
from prune_audit.errors import PruneAuditError


@dataclass(frozen=True)
class ObjectArea:
    """The queried object's mask seen through one token geometry.

    Attributes:
        area_per_token: (N,) int64 mask pixels per token (pixel centres).
        total_area: mask pixels in the whole original image.
        visible_fraction: share of the mask inside any token footprint, averaged over the token grids (NaN
            without a mask).
        grids: token grids that each see the image (2 for LLaVA-NeXT's base view and tiles, ``data.multigrid``):
            ``area_per_token`` counts a mask pixel once per grid, so shares divide by ``counted_area``.
    """

    area_per_token: np.ndarray
    total_area: int
    visible_fraction: float
    grids: int = 1

    @property
    def has_mask(self) -> bool:
        return self.total_area > 0

    @property
    def counted_area(self) -> int:
        """Mask pixels once per token grid: the denominator of retention, which keep-all brings to
        ``visible_fraction`` (at most 1) whatever the number of grids."""
        return self.total_area * self.grids


def object_area(mask: np.ndarray, geometry: TokenGeometry) -> ObjectArea:
    """Reduce an (H, W) boolean mask to per-token areas under ``geometry`` (one or several token grids)."""
    area = mask_area_per_token(mask, geometry)
    total = int(np.count_nonzero(mask))
    grids = len(grid_pieces(geometry))
    visible = float(area.sum() / (total * grids)) if total else math.nan
    return ObjectArea(area_per_token=area, total_area=total, visible_fraction=visible, grids=grids)


class ObjectAreaCache:
    """Per-(image, category, geometry) ``ObjectArea`` for one COCO file, each mask decoded once.

    The runner and ``benchmarks/retention.py`` share this cache and ``retention_by_stage``.

    Args:
        coco: the instances file the masks come from.
        geometry_for: maps an image's (width, height) to its token geometry, e.g.
            ``lambda size: geometry_from_processor(processor, size)``; used when ``get``
            is given no geometry (the runner passes each prepared image's own).
    """

    def __init__(
        self, coco: CocoInstances, geometry_for: Callable[[tuple[int, int]], TokenGeometry] | None = None
    ) -> None:
        self.coco = coco
        self.geometry_for = geometry_for
        self._areas: dict[tuple[int, str, TokenGeometry], ObjectArea] = {}

    def get(self, image_id: int, category_name: str, geometry: TokenGeometry | None = None) -> ObjectArea:
        if geometry is None:
            if self.geometry_for is None:
                raise ValueError("ObjectAreaCache.get needs a geometry when the cache has no geometry_for")
            geometry = self.geometry_for(self.coco.image(image_id).size)
        key = (image_id, category_name, geometry)
        if key not in self._areas:
            self._areas[key] = object_area(self.coco.category_mask(image_id, category_name), geometry)
        return self._areas[key]

    def __len__(self) -> int:
        return len(self._areas)


def retention(
    area_per_token: np.ndarray, total_area: int, kept: Sequence[int] | np.ndarray
) -> tuple[float, int, bool | None]:
    """Retention of one kept set.

    Args:
        area_per_token: (N,) mask pixels per token.
        total_area: all mask pixels of the object.
        kept: indices of kept tokens (any order; repeats count once).

    Returns:
        (retention, object_tokens_kept, lost): retention in [0, 1]; number of kept tokens
        holding object pixels; lost = no object pixel in any kept token. Without object
        pixels: (NaN, -1, None).
    """
    kept_index = _check_kept(np.unique(np.asarray(kept, dtype=np.int64)), len(area_per_token))
    if total_area <= 0:
        return math.nan, -1, None
    kept_area = area_per_token[kept_index]
    retained = float(kept_area.sum() / total_area)
    tokens = int(np.count_nonzero(kept_area))
    return retained, tokens, tokens == 0


def _check_kept(kept: np.ndarray, num_tokens: int) -> np.ndarray:
    if kept.size and (kept.min() < 0 or kept.max() >= num_tokens):
        raise PruneAuditError(f"kept token index out of range [0, {num_tokens})")
    return kept


@dataclass(frozen=True)
class RetentionBatch:
    """Retention of many questions; all arrays have shape (Q,).

    Attributes:
        retention: float64, NaN where the question has no object pixels.
        object_tokens_kept: int64, -1 where it has no object pixels.
        lost: bool, object pixels exist but none is in a kept token (False without pixels).
        has_mask: bool, the question has object pixels.
    """

    retention: np.ndarray
    object_tokens_kept: np.ndarray
    lost: np.ndarray
    has_mask: np.ndarray


def retention_batch(
    areas: Sequence[np.ndarray], total_areas: Sequence[int] | np.ndarray, kept: Sequence[Sequence[int] | np.ndarray]
) -> RetentionBatch:
    """Vectorised ``retention`` for Q questions whose token counts may differ (Qwen).

    Args:
        areas: Q vectors (N_q,) of mask pixels per token.
        total_areas: (Q,) mask pixels of each question's object.
        kept: Q kept index sets, each within [0, N_q); repeats count once.
    """
    count = len(areas)
    if len(kept) != count or len(total_areas) != count:
        raise PruneAuditError(
            f"retention_batch needs one kept set and one total per question, got "
            f"{count} areas, {len(kept)} kept sets, {len(total_areas)} totals"
        )
    lengths = np.fromiter((len(a) for a in areas), dtype=np.int64, count=count)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    flat_area = np.concatenate([np.asarray(a, dtype=np.int64) for a in areas]) if count else np.zeros(0, np.int64)
    kept_sizes = np.fromiter((len(k) for k in kept), dtype=np.int64, count=count)
    flat_kept = np.concatenate([np.asarray(k, dtype=np.int64) for k in kept]) if count else np.zeros(0, np.int64)
    question_of_kept = np.repeat(np.arange(count), kept_sizes)
    if flat_kept.size and ((flat_kept < 0).any() or (flat_kept >= lengths[question_of_kept]).any()):
        raise PruneAuditError("kept token index out of range for its question's token grid")
    # A flat keep mask over all questions' tokens makes repeated indices count once.
    keep = np.zeros(flat_area.size, dtype=bool)
    keep[starts[question_of_kept] + flat_kept] = True
    positions = np.flatnonzero(keep)
    question_of_position = np.searchsorted(starts, positions, side="right") - 1
    kept_area = flat_area[positions]
    area_kept = np.bincount(question_of_position, weights=kept_area, minlength=count)
    tokens_kept = np.bincount(question_of_position, weights=kept_area > 0, minlength=count).astype(np.int64)
    totals = np.asarray(total_areas, dtype=np.int64)
    has_mask = totals > 0
    retained = np.where(has_mask, area_kept / np.where(has_mask, totals, 1), np.nan)
    return RetentionBatch(
        retention=retained,
        object_tokens_kept=np.where(has_mask, tokens_kept, -1),
        lost=has_mask & (tokens_kept == 0),
        has_mask=has_mask,
    )


@dataclass(frozen=True)
class StageRetention:
    """Retention of one question's kept set at each of its S stages (lists of length S).

    Without object pixels every stage holds NaN, -1 and None, as ``retention`` returns.
    """

    retention: list[float]
    object_tokens_kept: list[int]
    lost: list[bool | None]


def retention_by_stage(
    areas: Sequence[ObjectArea | None], kept_stages: Sequence[Sequence[Sequence[int] | np.ndarray]]
) -> list[StageRetention]:
    """Retention of every stage of Q questions in one ``retention_batch`` call.

    Args:
        areas: Q objects seen through each question's geometry; None when the question has
            no object (a "no" question, or a run without annotations).
        kept_stages: Q lists of S_q kept index sets (S_q may differ between questions).
    """
    if len(areas) != len(kept_stages):
        raise PruneAuditError(
            f"retention_by_stage needs one kept-stage list per question, got "
            f"{len(areas)} areas and {len(kept_stages)} stage lists"
        )
    measured = [q for q, area in enumerate(areas) if area is not None and area.has_mask]
    pairs = [(q, kept) for q in measured for kept in kept_stages[q]]
    batch = retention_batch(
        [areas[q].area_per_token for q, _ in pairs], [areas[q].counted_area for q, _ in pairs], [k for _, k in pairs]
    )
    unmeasured = set(range(len(areas))) - set(measured)
    results = [
        StageRetention([math.nan] * len(stages), [-1] * len(stages), [None] * len(stages))
        if q in unmeasured
        else StageRetention([], [], [])
        for q, stages in enumerate(kept_stages)
    ]
    values = zip(batch.retention.tolist(), batch.object_tokens_kept.tolist(), batch.lost.tolist())
    for (q, _), (retained, tokens, lost) in zip(pairs, values):
        results[q].retention.append(retained)
        results[q].object_tokens_kept.append(tokens)
        results[q].lost.append(lost)
    return results
