"""Hand-checkable cases and naive references that several selectors' tests share.

Input-level selectors: seeded generators, a dense float64 cosine matrix, the eager facility-location greedy, the
package's tie rule written out, clustered features, flat fp16-like CLS probabilities. In-LLM selectors: small
``LayerSignals`` on a 1 x n grid, a schedule's (layer, keep) pairs.
"""

from __future__ import annotations

import math

import pytest
import torch

from prune_audit.pruners import LayerSignals, Stage, similarity


def random_generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def first_within_tolerance(values: torch.Tensor) -> int:
    """Lowest index within a relative 1e-5 of the maximum: the package's tie rule."""
    top = values.max()
    return int(torch.nonzero(values >= top - 1e-5 * top.abs())[0])


def cosine_matrix(features: torch.Tensor, centre: bool = False) -> torch.Tensor:
    """Dense float64 cosine similarity, written independently of the package."""
    x = features.double()
    if centre:
        x = x - x.mean(dim=0)
    x = x / x.norm(dim=1, keepdim=True)
    return x @ x.T


def naive_facility_location(similarity_matrix, k, candidate_weights=None, demand_weights=None):
    """Eager greedy on a dense matrix: argmax_i c_i * sum_j w_j max(0, S[j, i] - cov_j)."""
    n = similarity_matrix.shape[0]
    c = torch.ones(n, dtype=torch.float64) if candidate_weights is None else candidate_weights.double()
    w = torch.ones(n, dtype=torch.float64) if demand_weights is None else demand_weights.double()
    coverage = torch.zeros(n, dtype=torch.float64)
    picks, gains = [], []
    for _ in range(k):
        score = c * (w[:, None] * (similarity_matrix - coverage[:, None]).clamp(min=0)).sum(dim=0)
        score[picks] = -math.inf
        best = first_within_tolerance(score)
        picks.append(best)
        gains.append(float(score[best]))
        coverage = torch.maximum(coverage, similarity_matrix[:, best])
    return picks, gains


@pytest.fixture
def small_blocks(monkeypatch):
    """Force many similarity blocks so the chunked paths run."""
    monkeypatch.setattr(similarity, "BLOCK_ELEMENTS", 7)


def clustered_features(seed: int, tokens: int, dim: int) -> torch.Tensor:
    """(tokens, dim) draws around 64 random centres, as ``benchmarks/selectors.py`` makes them."""
    generator = random_generator(seed)
    centres = torch.randn(64, dim, generator=generator)
    labels = torch.randint(0, 64, (tokens,), generator=generator)
    return centres[labels] + 0.7 * torch.randn(tokens, dim, generator=generator)


SPECULATION_CASES = [
    (seed, tokens, dim, budget)
    for seed, tokens, dim in [(0, 1024, 512), (1, 700, 96), (2, 2048, 64)]
    for budget in (tokens // 9, tokens // 2)
]


def cls_probabilities(seed: int, heads: int = 16, tokens: int = 576) -> torch.Tensor:
    """(H, N) flat CLS-row probabilities as an fp16 CLIP gives them (fp16 values held in float32), patches only.

    Flat enough that fp16 rounding of the aggregated score reorders the top-k boundary
    (seeds 1, 2, 3 and 8 do for both the head mean at 64 and the head sum at 53).
    """
    logits = torch.randn(heads, tokens + 1, generator=random_generator(seed)) * 0.05
    return torch.softmax(logits, dim=-1)[:, 1:].half().float()


def lower_index_top_k(scores: torch.Tensor, k: int) -> list[int]:
    return sorted(torch.sort(-scores, stable=True).indices[:k].tolist())


def signals(n: int, grid: tuple[int, int] | None = None, alive: list[int] | None = None, **fields) -> LayerSignals:
    alive_tensor = torch.tensor(alive if alive is not None else list(range(n)))
    return LayerSignals(alive=alive_tensor, grid=grid or (1, n), layer=2, num_layers=32, **fields)


def counts(stages: list[Stage]) -> list[tuple[int, int]]:
    return [(stage.layer, stage.keep) for stage in stages]


def averaging(name: str, num_visual: int, budget: int):
    """(selector, budget) for a registry-wide layer-average check: ``name`` with its defaults at ``budget``; one
    whose default does not average the budget (``averages_budget`` False: a video method's official share at its
    official layer) with ``budget_rule="average"`` at ``(num_visual + budget) // 2``, which the layers before a deep
    stage leave reachable (its default's official counts: its own tests)."""
    from prune_audit.pruners import get_selector

    selector = get_selector(name)
    if selector.averages_budget:
        return selector, budget
    return get_selector(name, budget_rule="average"), (num_visual + budget) // 2
