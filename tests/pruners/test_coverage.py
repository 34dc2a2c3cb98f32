"""coverage: centred, clipped facility location weighted by tempered demand, against the eager greedy."""

from __future__ import annotations

import pytest
import torch
from selector_cases import cosine_matrix, naive_facility_location, random_generator, small_blocks  # noqa: F401 (small_blocks: fixture)

from prune_audit.pruners import InputSignals, get_selector


def test_coverage_with_uniform_demand_is_centred_clipped_facility_location(small_blocks):
    generator = random_generator(6)
    # a shared offset makes raw cosines all positive; centring must remove it
    features = torch.randn(30, 5, generator=generator) + 4.0
    expected, _ = naive_facility_location(cosine_matrix(features, centre=True), 9)
    for demand in (torch.full((30,), 1 / 30), torch.full((30,), 5.0)):
        signals = InputSignals(grid=(5, 6), features=features, demand=demand)
        assert get_selector("coverage").select(signals, 9).kept.tolist() == sorted(expected)


@pytest.mark.parametrize("tau", [0.5, 1.0, 3.0])
def test_coverage_weights_the_covered_tokens_by_tempered_demand(tau, small_blocks):
    generator = random_generator(7)
    features = torch.randn(30, 5, generator=generator)
    demand = torch.rand(30, generator=generator) ** 4
    weights = demand ** (1 / tau)
    weights = weights / weights.mean()
    expected, _ = naive_facility_location(cosine_matrix(features, centre=True), 9, demand_weights=weights)
    signals = InputSignals(grid=(5, 6), features=features, demand=demand * 0.01)  # scale-free
    assert get_selector("coverage", tau=tau).select(signals, 9).kept.tolist() == sorted(expected)


def test_coverage_rejects_negative_demand():
    signals = InputSignals(grid=(2, 2), features=torch.randn(4, 3), demand=torch.tensor([0.1, -0.2, 0.3, 0.4]))
    with pytest.raises(ValueError, match="non-negative"):
        get_selector("coverage").select(signals, 2)
