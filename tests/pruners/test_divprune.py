"""DivPrune: the farthest-point order on hand-checkable points, against the one-row-per-pick greedy, and against the
official half-precision picks (vbdi/divprune)."""

from __future__ import annotations

import math

import pytest
import torch
from rederivation import CASES, agreement
from selector_cases import (  # noqa: F401 (small_blocks: fixture)
    SPECULATION_CASES,
    clustered_features,
    cosine_matrix,
    first_within_tolerance,
    random_generator,
    small_blocks,
)

from prune_audit.pruners import InputSignals, get_selector, similarity
from prune_audit.pruners.similarity import farthest_point_order, unit_rows


def points_at_angles(degrees: list[float], norms: list[float]) -> torch.Tensor:
    radians = torch.tensor(degrees, dtype=torch.float64) * math.pi / 180
    return (torch.stack([radians.cos(), radians.sin()], dim=1) * torch.tensor(norms)[:, None]).float()


def test_divprune_farthest_point_order_on_2d_points():
    # nearest angular gaps: 20, 20, 70, 85, 90 degrees -> the point at 270 is most isolated;
    # then 90 (180 away), 0 (min gap 90 vs 70 and 85), 175 (85 vs 20), 20. Norms must not matter.
    points = points_at_angles([0, 20, 90, 175, 270], [1.0, 3.0, 0.5, 2.0, 7.0])
    assert farthest_point_order(unit_rows(points), 5).tolist() == [4, 2, 0, 3, 1]
    signals = InputSignals(grid=(1, 5), features=points)
    assert get_selector("divprune").select(signals, 3).kept.tolist() == [0, 2, 4]


def test_divprune_first_pick_is_most_isolated(small_blocks):
    features = torch.randn(40, 6, generator=random_generator(1))
    distance = 1 - cosine_matrix(features)
    distance.fill_diagonal_(math.inf)
    order = farthest_point_order(unit_rows(features), 8)
    assert int(order[0]) == first_within_tolerance(distance.min(dim=1).values)
    # each later pick maximises the distance to its nearest earlier pick
    distance.fill_diagonal_(0)
    for step in range(1, 8):
        nearest = distance[:, order[:step]].min(dim=1).values
        nearest[order[:step]] = -math.inf
        assert int(order[step]) == first_within_tolerance(nearest)


def one_row_per_pick_farthest_points(unit: torch.Tensor, k: int) -> list[int]:
    """The greedy as it was before the speculative rows: one matrix-vector product per pick."""
    similarity_matrix = unit @ unit.T
    similarity_matrix.fill_diagonal_(-math.inf)
    picks = [int(torch.argmax(1.0 - similarity_matrix.max(dim=1).values))]
    distance = torch.full((unit.shape[0],), math.inf)
    for _ in range(k - 1):
        distance = torch.minimum(distance, 1.0 - unit @ unit[picks[-1]])
        distance[picks[-1]] = -math.inf
        picks.append(int(torch.argmax(distance)))
    return picks


@pytest.mark.parametrize("seed, tokens, dim, budget", SPECULATION_CASES)
@pytest.mark.parametrize("rows", [8, 32, 128, None])
def test_divprune_speculative_rows_keep_the_one_row_per_pick_order(seed, tokens, dim, budget, rows, monkeypatch):
    """Speculative rows (blocks forced below N x N) and, with ``rows`` None, the whole S held at once."""
    if rows is not None:
        monkeypatch.setattr(similarity, "SPECULATIVE_ROWS", rows)
        monkeypatch.setattr(similarity, "BLOCK_ELEMENTS", tokens * tokens // 3)
    unit = unit_rows(clustered_features(seed, tokens, dim))
    assert farthest_point_order(unit, budget).tolist() == one_row_per_pick_farthest_points(unit, budget)


# --- official half-precision picks (vbdi/divprune, llava_arch.py::DivPrune) -------------------------------------------


def test_divprune_model_dtype_reproduces_the_official_half_precision_picks():
    """fp16 distances tie often; score_dtype=model computes them as the reference does, float32 does not.

    Half-precision matrix products are slow on CPU: 6 of the 30 cases (1024-dim) run here.
    """
    cases = [case for case in CASES if case[2] == 1024][:6]
    assert agreement("divprune", torch.float16, cases, score_dtype="model") == len(cases)
    assert agreement("divprune", torch.float16, cases) < len(cases)


def test_divprune_model_dtype_reproduces_the_official_bf16_picks():
    """In bf16 (fast on CPU) all 30 cases: score_dtype=model 30 of 30, float32 distances 0 of 30 (measured)."""
    assert agreement("divprune", torch.bfloat16, score_dtype="model") == len(CASES)
    assert agreement("divprune", torch.bfloat16) < len(CASES)
