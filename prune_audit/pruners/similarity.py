"""Cosine similarity in bounded blocks and the greedy loops built on it.

The similarity-based selectors (DivPrune, CDPruner, SCOPE, coverage) conceptually
use the full ``N x N`` cosine matrix ``S``; at high resolution (N = 16384 tokens for
Qwen2.5-VL) it alone is 1 GiB in float32. Full passes walk ``S`` in row blocks of at
most :data:`BLOCK_ELEMENTS` entries. The max-min and DPP greedy loops need one row of
``S`` per pick and compute it on demand (no N x N matrix), a few rows per matrix
product (:class:`SpeculativeRows`). Facility location needs,
after every pick, the rows of all tokens whose coverage improved, so it stores ``S``
once (the only N x N matrix anywhere; its temporaries stay block-sized).

Everything runs in float32 (facility location can instead round to the model's half dtype,
as SCOPE's official code computes). Greedy steps take the plain argmax (the first index only
on exact equality), as the official DivPrune and CDPruner code do; the rows of ``S``
they compare come from matrix products of at least 8 rows, whose entries (measured with
the MKL build torch ships on AVX2) do not depend on which other rows share the product nor on
the thread count; on AVX-512 a row's last bits can depend on how many rows share its product,
so where two gains are within float32 noise (relative 1e-5) the pick may differ from a
one-row-per-pick greedy's. ``tie_tolerance`` (the selectors' ``ties="tolerance"``)
instead counts scores within :data:`TIE_TOLERANCE` (relative) of the maximum as tied
and takes the lower index: mathematically equal scores often differ in the last bits
(``S[i, j]`` and ``S[j, i]`` come from different BLAS blocks), which that rule makes
irrelevant, at the price of differing from the official picks in a few cases.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

# 2**24 float32 entries = 64 MiB per similarity block, whatever N is
BLOCK_ELEMENTS = 1 << 24
TIE_TOLERANCE = 1e-5
# rows per speculative product: >= 8 keeps every row's bits independent of its batch (see module doc)
SPECULATIVE_ROWS = 32
TIES = ("argmax", "tolerance")
"""The ``ties`` option of the greedy selectors: plain argmax (official) or the tolerance rule."""


def unit_rows(features: Tensor, centre: bool = False) -> Tensor:
    """Rows scaled to unit L2 norm, in float32; all-zero rows stay zero.

    Args:
        features: (N, D) any float dtype.
        centre: subtract the mean row first (mean-centred cosine similarity).

    Returns:
        (N, D) float32, a new tensor.
    """
    rows = features.detach().to(torch.float32, copy=True)
    if centre:
        rows -= rows.mean(dim=0, keepdim=True)
    rows /= torch.linalg.vector_norm(rows, dim=1, keepdim=True).clamp_min(1e-12)
    return rows


def half_dtype(model_dtype: torch.dtype, features: Tensor) -> torch.dtype | None:
    """The reduced-precision dtype official code would compute in, or None for float32.

    The adapters pass float32 signals with the model's dtype beside them; hand-built
    signals (model dtype float32) in a half dtype keep their own.
    """
    dtype = model_dtype if model_dtype != torch.float32 else features.dtype
    return None if dtype in (torch.float32, torch.float64) else dtype


def unit_rows_in(features: Tensor, dtype: torch.dtype) -> Tensor:
    """(N, D) float32 holding ``x / ||x||`` computed in ``dtype`` (norm and quotient rounded to it)."""
    rows = features.detach().to(dtype).float()
    norms = torch.linalg.vector_norm(rows, dim=1, keepdim=True).to(dtype).float()
    return (rows / norms).to(dtype).float()


def first_near_max(values: Tensor, tolerance: float = TIE_TOLERANCE) -> int:
    """Lowest index whose value is within ``tolerance`` (relative) of the maximum; 0 gives the plain argmax.

    Args:
        values: (N,) float32 with a finite maximum; ``-inf`` marks excluded entries.
    """
    if tolerance == 0:
        return int(torch.argmax(values))
    top = values.max()
    return int(torch.argmax((values >= top - tolerance * top.abs()).to(torch.uint8)))


def tie_tolerance(ties: str) -> float:
    """The relative tolerance of a ``ties`` option: ``"argmax"`` (official) 0, ``"tolerance"`` :data:`TIE_TOLERANCE`."""
    return TIE_TOLERANCE if ties == "tolerance" else 0.0


def rows_per_block(n: int) -> int:
    """Rows of an (n-column) block that keep it within :data:`BLOCK_ELEMENTS` entries."""
    return max(1, BLOCK_ELEMENTS // max(n, 1))


def similarity_blocks(unit: Tensor, out: Tensor | None = None) -> Iterator[tuple[slice, Tensor]]:
    """Row blocks of ``S = unit @ unit.T``, each at most :data:`BLOCK_ELEMENTS` entries.

    Args:
        unit: (N, D) float32 unit rows (see :func:`unit_rows`).
        out: optional (N, N) float32 that receives ``S``; the blocks are then its row views.

    Yields:
        ``(rows, block)`` with ``block`` = ``S[rows]``, shape (len(rows), N).
    """
    n = unit.shape[0]
    step = rows_per_block(n)
    for start in range(0, n, step):
        rows = slice(start, min(start + step, n))
        yield rows, torch.matmul(unit[rows], unit.T, out=None if out is None else out[rows])


def nearest_neighbour_similarity(unit: Tensor) -> Tensor:
    """(N,) the highest cosine similarity of each row to any *other* row.

    Args:
        unit: (N, D) unit rows, N >= 2; the result has their dtype.
    """
    best = torch.empty(unit.shape[0], dtype=unit.dtype)
    for rows, block in similarity_blocks(unit):
        own = torch.arange(rows.start, rows.stop)
        block[own - rows.start, own] = float("-inf")
        best[rows] = block.max(dim=1).values
    return best


def farthest_point_order(unit: Tensor, k: int, tolerance: float = 0.0) -> Tensor:
    """Greedy max-min cosine-distance selection (farthest-point traversal).

    The first pick is the most isolated row (largest distance ``1 - cos`` to its
    nearest other row); each later pick maximises the distance to the nearest
    picked row, kept as a running minimum so each step needs one row of ``S``.
    When ``S`` fits one block (N <= 4096 at :data:`BLOCK_ELEMENTS`) it is computed once
    and its rows read, as the official code does (one product beats per-pick products at
    these sizes); above, each row is computed on demand (``O(N D)``) with likely later
    picks' rows by :class:`SpeculativeRows`. Picked rows are excluded, so once every
    remaining distance is 0 the rest follow in index order.

    Args:
        unit: (N, D) unit rows, N >= 2; distances are computed in their dtype.
        k: number of picks, ``1 <= k <= N``.
        tolerance: relative tie tolerance of :func:`first_near_max` (0: plain argmax).

    Returns:
        (k,) row indices in pick order.
    """
    n = unit.shape[0]
    distance_to_picked = torch.full((n,), float("inf"), dtype=unit.dtype)
    if rows_per_block(n) >= n:
        similarity = (unit @ unit.T).fill_diagonal_(float("-inf"))  # a pick's own entry: it is excluded anyway
        isolation, row_of = 1.0 - similarity.max(dim=1).values, similarity.__getitem__
    else:
        isolation, rows = (
            1.0 - nearest_neighbour_similarity(unit),
            SpeculativeRows(lambda indices: unit[indices] @ unit.T),
        )

        def row_of(pick: int) -> Tensor:  # type: ignore[misc]  # the same signature as the other branch's
            if pick not in rows:
                rows.fetch(pick, distance_to_picked)
            return rows[pick]

    picks = [first_near_max(isolation, tolerance)]
    for _ in range(k - 1):
        pick = picks[-1]
        torch.minimum(distance_to_picked, 1.0 - row_of(pick), out=distance_to_picked)
        distance_to_picked[pick] = float("-inf")
        picks.append(first_near_max(distance_to_picked, tolerance))
    return torch.tensor(picks, dtype=torch.long)


class SpeculativeRows:
    """Rows of an (N, N) matrix fetched for a greedy pick and its likely successors in one product.

    A greedy step needs the row of its pick, known only once picked. One row is a
    matrix-vector product, bound by memory bandwidth (it reads all of the (N, D) input
    for N x D multiply-adds, about a tenth of a core's matrix-product rate);
    :meth:`fetch` computes the pick's row together with those of the
    ``SPECULATIVE_ROWS - 1`` best-scoring other tokens as one (B, D) @ (D, N) product,
    which reads the input once for B rows. Greedy picks mostly follow the previous
    ranking, so most later picks find their row already here: 1.2-1.8 rows computed
    per pick on the benchmark's clustered signals. A fetch replaces the previous rows,
    so at most B x N entries are held.
    """

    def __init__(self, rows_of: Callable[[Tensor], Tensor]) -> None:
        """``rows_of``: (B,) long indices -> (B, N) their rows."""
        self._rows_of = rows_of
        self._slots: dict[int, int] = {}
        self._block: Tensor | None = None

    def __contains__(self, index: int) -> bool:
        return index in self._slots

    def __getitem__(self, index: int) -> Tensor:
        """(N,) the row of ``index``, which must have been fetched."""
        return self._block[self._slots[index]]

    def fetch(self, index: int, scores: Tensor) -> None:
        """Compute the rows of ``index`` and of the highest ``scores`` (N,) among the other tokens."""
        others = scores.clone()
        others[index] = float("-inf")
        count = min(SPECULATIVE_ROWS, scores.numel())
        indices = torch.cat([torch.tensor([index]), torch.topk(others, count - 1, sorted=False).indices])
        self._block = self._rows_of(indices)
        self._slots = {int(token): slot for slot, token in enumerate(indices.tolist())}


def _gap_sum(
    rows: Tensor,
    coverage: Tensor,
    weights: Tensor | None,
    gap_power: float,
    scratch: Tensor,
    rounding: torch.dtype | None = None,
) -> Tensor:
    """(N,) ``sum_j w_j * max(0, rows[j, i] - coverage_j) ** gap_power`` over the M rows.

    Args:
        rows: (M, N) rows ``S[j]`` of M covered tokens j.
        coverage: (M,) their coverage.
        weights: (M,) their demand weights, or None for all ones.
        scratch: (>= M, N) float32 reused for the gaps (a fresh M x N tensor per call costs
            page faults that are a large part of the greedy loop at high resolution).
        rounding: a half dtype: each gap is rounded to it and the (unweighted, ``gap_power``
            1) sum is taken in float64, which is exact for half-precision terms.
    """
    gaps = torch.sub(rows, coverage[:, None], out=scratch[: rows.shape[0]])
    if rounding is not None:
        return gaps.copy_(gaps.to(rounding)).clamp_(min=0).sum(dim=0, dtype=torch.float64)
    gaps.clamp_(min=0)
    if gap_power != 1.0:
        gaps.pow_(gap_power)
    return gaps.sum(dim=0) if weights is None else weights @ gaps


def _scores(gains: Tensor, candidate_weights: Tensor | None, rounding: torch.dtype | None) -> Tensor:
    """(N,) float32 ``c_i * g_i`` from the (N,) float64 gains; under ``rounding`` both the gain
    and the product are rounded to that dtype, as half-precision code computes them."""
    if rounding is None:
        return gains.float() if candidate_weights is None else gains.float() * candidate_weights
    score = gains.to(rounding).float()
    return score if candidate_weights is None else (score * candidate_weights).to(rounding).float()


def facility_location_greedy(
    unit: Tensor,
    k: int,
    candidate_weights: Tensor | None = None,
    demand_weights: Tensor | None = None,
    gap_power: float = 1.0,
    tolerance: float = TIE_TOLERANCE,
    rounding: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """Greedy (weighted) facility location on cosine similarity.

    Coverage of token j is ``cov_j = max(0, max_{s in picked} S[j, s])`` (0 before any
    pick). Each step picks the unpicked candidate i maximising

        ``score_i = c_i * g_i``,  ``g_i = sum_j w_j * max(0, S[j, i] - cov_j) ** gap_power``

    with candidate weights ``c`` (SCOPE's saliency) and demand weights ``w``
    (coverage demand). ``g`` is kept up to date incrementally: a pick p changes only
    the terms of the tokens j whose coverage it raises (``S[j, p] > cov_j``), which
    become few as coverage grows, so the loop costs ``O(N * sum_t |changed_t|)`` on the
    stored ``S`` instead of ``O(k N^2)`` for recomputing every gain each step.

    Args:
        unit: (N, D) float32 unit rows.
        k: number of picks, ``1 <= k <= N``.
        candidate_weights: (N,) non-negative, or None for all ones.
        demand_weights: (N,) non-negative, or None for all ones.
        gap_power: exponent of the coverage gap, > 0.
        tolerance: scores within this relative distance of the best are tied, the lower index
            winning (:func:`first_near_max`; 0 is the plain argmax).
        rounding: None (float32 throughout), or a half dtype in which to compute as code
            running in it does (SCOPE's official code in the model dtype): ``S``, every gap,
            every gain and every score rounded to it, the gains' sums accumulated in float64.
            ``unit`` and ``candidate_weights`` must be rounded by the caller; needs no
            demand weights and ``gap_power`` 1.

    Returns:
        ``(picks, scores)``: (k,) indices in pick order and (k,) float32 the score
        of each pick when it was made (non-increasing up to the tie tolerance).
    """
    if rounding is not None and (demand_weights is not None or gap_power != 1.0):
        raise ValueError("rounding to a half dtype needs no demand weights and gap_power 1")
    n = unit.shape[0]
    step = rows_per_block(n)
    matrix = torch.empty(n, n, dtype=torch.float32)
    gathered, scratch = torch.empty(min(step, n), n), torch.empty(min(step, n), n)
    coverage = torch.zeros(n, dtype=torch.float32)
    # float64 so that k rounds of incremental updates do not drift (and sum half-precision terms exactly)
    gains = torch.zeros(n, dtype=torch.float64)
    for span, block in similarity_blocks(unit, out=matrix):
        if rounding is not None:
            block.copy_(block.to(rounding))
        weights = None if demand_weights is None else demand_weights[span]
        gains += _gap_sum(block, coverage[span], weights, gap_power, scratch, rounding)
    picked = torch.zeros(n, dtype=torch.bool)
    picks: list[int] = []
    scores: list[float] = []
    for _ in range(k):
        score = _scores(gains, candidate_weights, rounding)
        best = first_near_max(score.masked_fill_(picked, float("-inf")), tolerance)
        picks.append(best)
        scores.append(float(score[best]))
        picked[best] = True
        new_coverage = torch.maximum(coverage, matrix[best])
        changed = torch.nonzero(new_coverage > coverage).flatten()
        for start in range(0, changed.numel(), step):
            rows = changed[start : start + step]
            weights = None if demand_weights is None else demand_weights[rows]
            block = torch.index_select(matrix, 0, rows, out=gathered[: rows.numel()])
            gains -= _gap_sum(block, coverage[rows], weights, gap_power, scratch, rounding)
            gains += _gap_sum(block, new_coverage[rows], weights, gap_power, scratch, rounding)
        coverage = new_coverage
    return torch.tensor(picks, dtype=torch.long), torch.tensor(scores, dtype=torch.float32)
