"""G-Prune against an independent re-derivation of jytmelon/G-Prune
``LLaVA-NeXT/llava/model/llava_arch.py::prepare_inputs_labels_for_multimodal`` (commit 5e226fb3).

``official_gprune`` follows the official code's steps on one grid (its base-view branch) in float32,
``torch.matrix_power`` included, and shares no code with the package.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode

from prune_audit.pruners import InputSignals, get_selector, selector_class
from prune_audit.pruners.arithmetic import SelectorWork
from prune_audit.pruners.gprune import transition_matrix

TOKENS = 576
BUDGETS = (64, 128, 192)
CASES = [(seed, budget) for seed in range(10) for budget in BUDGETS]


def official_gprune(
    features: torch.Tensor, keep: int, similarity: float = 0.5, temperature: float = 0.03, iterate: int = 5
) -> set[int]:
    """Kept indices of the official graph pruning of one grid's (N, D) projector outputs."""
    normalized = F.normalize(features, p=2, dim=1)
    a = normalized @ normalized.t()
    a[a < similarity] = 0
    a = a / temperature
    a[abs(a) < 1e-6] = -5000
    a = F.softmax(a, dim=1)
    degree = torch.sum(a > 0, dim=1)
    a = torch.matrix_power(a, iterate)
    w = torch.norm(features, dim=-1).view(1, -1).to(dtype=a.dtype)
    result = (w @ a) / degree
    return set(result.topk(keep).indices.flatten().tolist())


def llava_case(seed: int) -> torch.Tensor:
    """(576, 4096) projector-output-like features: a few clusters (objects, background) plus noise, so that
    cosines spread across the 0.5 threshold and the graph has several components of varied degree."""
    generator = torch.Generator().manual_seed(seed)
    centres = torch.randn(6, 4096, generator=generator)
    members = torch.randint(0, 6, (TOKENS,), generator=generator)
    scale = 0.5 + torch.rand(TOKENS, 1, generator=generator)
    noise = torch.rand(TOKENS, 1, generator=generator) * 1.5
    return scale * (centres[members] + noise * torch.randn(TOKENS, 4096, generator=generator))


def signals_of(features: torch.Tensor) -> InputSignals:
    return InputSignals(grid=(24, 24), features=features)


@pytest.mark.parametrize(("seed", "budget"), CASES)
@pytest.mark.parametrize("ties", ["lower", "topk"])
def test_gprune_reproduces_the_official_kept_set(seed, budget, ties):
    features = llava_case(seed)
    kept = get_selector("gprune", ties=ties).select(signals_of(features), budget).kept
    assert set(kept.tolist()) == official_gprune(features, budget)
    assert kept.numel() == budget


def test_the_random_graphs_have_varied_degrees():
    features = llava_case(0)
    unit = F.normalize(features, dim=1)
    degree = ((unit @ unit.T) >= 0.5).sum(dim=1)
    assert 1 < int(degree.min()) < int(degree.max()) < TOKENS


@pytest.mark.parametrize(("threshold", "temperature", "iterations"), [(0.3, 0.1, 2), (0.7, 0.03, 8)])
def test_the_options_are_the_official_constants(threshold, temperature, iterations):
    features = llava_case(3)
    selector = get_selector("gprune", threshold=threshold, temperature=temperature, iterations=iterations)
    kept = selector.select(signals_of(features), 100).kept
    assert set(kept.tolist()) == official_gprune(features, 100, threshold, temperature, iterations)


def test_a_token_without_links_has_degree_one_and_zero_rows_stay_finite():
    """An isolated token keeps its own norm (degree 1: its self loop); an all-zero row has no edge at all
    (its self cosine is 0), so its softmax is uniform and its degree N, as the official code computes it."""
    features = torch.zeros(6, 4)
    features[0] = torch.tensor([1.0, 0, 0, 0])
    features[1:4] = torch.tensor([0, 1.0, 0, 0]) + 0.01 * torch.arange(3.0)[:, None]
    features[4] = torch.tensor([0, 0, 3.0, 0])
    _, degree = transition_matrix(features, 0.5, 0.03)
    assert degree.tolist() == [1.0, 3.0, 3.0, 3.0, 1.0, 6.0]
    scores = get_selector("gprune").score(InputSignals(grid=(2, 3), features=features), None)
    assert torch.isfinite(scores).all() and scores[0] == pytest.approx(1.0) and scores[4] == pytest.approx(3.0)
    assert set(get_selector("gprune").select(InputSignals(grid=(2, 3), features=features), 3).kept.tolist()) == (
        official_gprune(features, 3)
    )


def test_flops_count_every_product_the_selection_runs():
    features = llava_case(1)
    with FlopCounterMode(display=False) as counter:
        get_selector("gprune").select(signals_of(features), 64)
    work = SelectorWork(tokens=TOKENS, kept=64, feature_width=4096, options={"iterations": 5})
    assert selector_class("gprune").flops(work) == counter.get_total_flops() > 0
    assert selector_class("gprune").flops(SelectorWork(tokens=TOKENS, kept=TOKENS, feature_width=4096)) == 0


def test_the_fidelity_row_quotes_these_cases():
    assert selector_class("gprune").fidelity.agreement_cases == len(CASES) == 30
