"""Reference tests of the input-level selectors on small hand-checkable cases."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from prune_audit.pruners import InputSignals, get_selector, similarity
from prune_audit.pruners.cdpruner import greedy_dpp_map
from prune_audit.pruners.similarity import TIE_TOLERANCE, facility_location_greedy, farthest_point_order, unit_rows

BENCHMARK = Path(__file__).resolve().parents[1] / "benchmarks" / "selectors.py"


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


# --- DivPrune -------------------------------------------------------------------------------------


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


def clustered_features(seed: int, tokens: int, dim: int) -> torch.Tensor:
    """(tokens, dim) draws around 64 random centres, as ``benchmarks/selectors.py`` makes them."""
    generator = random_generator(seed)
    centres = torch.randn(64, dim, generator=generator)
    labels = torch.randint(0, 64, (tokens,), generator=generator)
    return centres[labels] + 0.7 * torch.randn(tokens, dim, generator=generator)


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


SPECULATION_CASES = [
    (seed, tokens, dim, budget)
    for seed, tokens, dim in [(0, 1024, 512), (1, 700, 96), (2, 2048, 64)]
    for budget in (tokens // 9, tokens // 2)
]


@pytest.mark.parametrize("seed, tokens, dim, budget", SPECULATION_CASES)
@pytest.mark.parametrize("rows", [8, 32, 128, None])
def test_divprune_speculative_rows_keep_the_one_row_per_pick_order(seed, tokens, dim, budget, rows, monkeypatch):
    """Speculative rows (blocks forced below N x N) and, with ``rows`` None, the whole S held at once."""
    if rows is not None:
        monkeypatch.setattr(similarity, "SPECULATIVE_ROWS", rows)
        monkeypatch.setattr(similarity, "BLOCK_ELEMENTS", tokens * tokens // 3)
    unit = unit_rows(clustered_features(seed, tokens, dim))
    assert farthest_point_order(unit, budget).tolist() == one_row_per_pick_farthest_points(unit, budget)


# --- CDPruner -------------------------------------------------------------------------------------


def naive_dpp_greedy(kernel: torch.Tensor, k: int) -> list[int]:
    """Each step: argmax_i det L[S + i] by explicit determinants (float64)."""
    picks: list[int] = []
    for _ in range(k):
        determinants = torch.full((kernel.shape[0],), -math.inf, dtype=torch.float64)
        for i in range(kernel.shape[0]):
            if i not in picks:
                index = torch.tensor(picks + [i])
                determinants[i] = torch.linalg.det(kernel[index][:, index])
        picks.append(first_within_tolerance(determinants))
    return picks


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_cdpruner_fast_greedy_equals_naive_log_det_greedy(seed):
    factor = torch.randn(12, 9, generator=random_generator(seed), dtype=torch.float64)
    kernel = factor @ factor.T
    fast = greedy_dpp_map(lambda j: kernel[j].float(), torch.diagonal(kernel).float(), 5)
    assert fast.tolist() == naive_dpp_greedy(kernel, 5)


@pytest.mark.parametrize("theta", [None, 0.5])
def test_cdpruner_selector_uses_relevance_scaled_cosine_kernel(theta):
    generator = random_generator(3)
    features = torch.randn(12, 8, generator=generator)
    raw = torch.randn(12, generator=generator)
    relevance = (raw - raw.min() + 1e-6) / (raw.max() - raw.min())
    if theta is not None:
        relevance = torch.exp(theta / (2 * (1 - theta)) * relevance)
    kernel = relevance.double()[:, None] * cosine_matrix(features) * relevance.double()[None, :]
    selection = get_selector("cdpruner", theta=theta).select(
        InputSignals(grid=(3, 4), features=features, text_relevance=raw), 5
    )
    assert selection.kept.tolist() == sorted(naive_dpp_greedy(kernel, 5))


def one_row_per_pick_dpp(kernel_row, diagonal: torch.Tensor, k: int) -> tuple[list[int], int]:
    """Fast greedy MAP as it was before the speculative rows: one kernel row and one correction per pick.

    Returns the picks and the first step whose two best gains are within ``TIE_TOLERANCE``
    (relative) of each other (``k`` if none): a near-tie at float32 row noise, where the pick
    depends on the last bits of the rows (on AVX-512 MKL a row's bits depend on how many rows
    share its matrix product).
    """
    floor = 1e-6 * float(diagonal.max())
    gains = torch.where(diagonal > floor, diagonal, 0.0)
    vectors = torch.zeros(k, diagonal.numel())
    picks: list[int] = []
    first_near_tie = k
    for step in range(k):
        scores = gains.clone()
        scores[picks] = -math.inf
        top = torch.topk(scores, min(2, scores.numel())).values
        if first_near_tie == k and top.numel() == 2 and top[0] > floor and top[0] - top[1] < TIE_TOLERANCE * top[0]:
            first_near_tie = step
        best = int(torch.argmax(scores))
        picks.append(best)
        if gains[best] > floor:
            vectors[step] = (kernel_row(best) - vectors[:step, best] @ vectors[:step]) / math.sqrt(float(gains[best]))
            gains = gains - vectors[step] ** 2
            gains = torch.where(gains > floor, gains, 0.0)
    return picks, first_near_tie


@pytest.mark.parametrize("seed, tokens, dim, budget", SPECULATION_CASES)
@pytest.mark.parametrize("rows", [8, 32, 128])
def test_cdpruner_speculative_rows_keep_the_one_row_per_pick_order(seed, tokens, dim, budget, rows, monkeypatch):
    """Clustered features; a budget above the width (700 / 2, 2048 / 2) exhausts the kernel's rank.

    Identical picks up to the first near-tie (two best gains within TIE_TOLERANCE): past it the
    order depends on the rows' last bits, which need not survive a change of product shape.
    """
    monkeypatch.setattr(similarity, "SPECULATIVE_ROWS", rows)
    unit = unit_rows(clustered_features(seed, tokens, dim))
    relevance = get_selector("cdpruner").relevance(torch.randn(tokens, generator=random_generator(10 + seed)))
    diagonal = relevance**2 * (unit * unit).sum(dim=1)
    expected, near_tie = one_row_per_pick_dpp(lambda j: relevance[j] * relevance * (unit @ unit[j]), diagonal, budget)
    fast = greedy_dpp_map(lambda j: relevance[j, None] * relevance * (unit[j] @ unit.T), diagonal, budget)
    assert fast.tolist()[:near_tie] == expected[:near_tie] and near_tie > budget // 2


def test_cdpruner_exhausted_kernel_gives_lowest_indices_without_nan():
    # rank-1 kernel: after the first (most relevant) pick every conditional gain is 0
    features = torch.ones(10, 4)
    raw = torch.zeros(10)
    raw[7] = 1.0
    kept = get_selector("cdpruner").select(InputSignals(grid=(2, 5), features=features, text_relevance=raw), 4).kept
    assert kept.tolist() == [0, 1, 2, 7]


def test_cdpruner_rejects_theta_outside_unit_interval():
    with pytest.raises(ValueError, match="theta"):
        get_selector("cdpruner", theta=1.0)


# --- SCOPE and coverage ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", [0, 1])
def test_scope_alpha_zero_is_plain_facility_location(seed, small_blocks):
    generator = random_generator(seed)
    features = torch.randn(30, 5, generator=generator)
    attention = torch.rand(4, 30, generator=generator)
    expected, expected_gains = naive_facility_location(cosine_matrix(features), 9)
    picks, gains = facility_location_greedy(unit_rows(features), 9)
    assert picks.tolist() == expected
    torch.testing.assert_close(gains.double(), torch.tensor(expected_gains, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    signals = InputSignals(grid=(5, 6), vision_features=features, cls_attention=attention)
    assert get_selector("scope", alpha=0.0).select(signals, 9).kept.tolist() == sorted(expected)


def test_scope_weights_candidates_by_summed_cls_attention(small_blocks):
    generator = random_generator(4)
    features = torch.randn(30, 5, generator=generator)
    attention = torch.rand(4, 30, generator=generator)
    saliency = attention.sum(dim=0) ** 0.5
    expected, _ = naive_facility_location(cosine_matrix(features), 9, candidate_weights=saliency)
    signals = InputSignals(grid=(5, 6), vision_features=features, cls_attention=attention)
    assert get_selector("scope", alpha=0.5).select(signals, 9).kept.tolist() == sorted(expected)


@pytest.mark.parametrize("gap_power", [1.0, 2.0])
def test_scope_gains_never_increase(gap_power):
    generator = random_generator(5)
    features = torch.randn(200, 16, generator=generator)
    saliency = torch.rand(200, generator=generator)
    _, gains = facility_location_greedy(unit_rows(features), 60, candidate_weights=saliency, gap_power=gap_power)
    assert bool((gains[1:] <= gains[:-1] * (1 + 1e-5)).all())
    assert float(gains[-1]) < float(gains[0])


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


# --- VisionZip ------------------------------------------------------------------------------------


def test_visionzip_default_splits_match_the_reference():
    selector = get_selector("visionzip")
    assert [selector.split(b) for b in (64, 128, 192)] == [(54, 10), (108, 20), (162, 30)]


def test_visionzip_output_layout_and_contextual_merge():
    generator = random_generator(8)
    rows, cols, heads, width = 6, 6, 3, 5
    n = rows * cols
    signals = InputSignals(
        grid=(rows, cols),
        vision_features=torch.randn(n, width, generator=generator),
        cls_attention=torch.rand(heads, n, generator=generator),
        vision_keys=torch.randn(heads, n + 1, 4, generator=generator),
        cls_feature=torch.randn(width, generator=generator),
    )
    selection = get_selector("visionzip", contextual_fraction=0.25).select(signals, 16)  # D = 12, C = 4
    dominant = torch.sort(torch.topk(signals.cls_attention.sum(dim=0), 11).indices).values
    assert selection.kept.tolist() == dominant.tolist()
    assert selection.num_output_tokens == 16 and selection.vision_tokens.shape == (16, width)
    assert selection.sources[0].numel() == 0
    torch.testing.assert_close(selection.vision_tokens[0], signals.cls_feature)
    assert [s.tolist() for s in selection.sources[1:12]] == [[j] for j in dominant.tolist()]
    torch.testing.assert_close(selection.vision_tokens[1:12], signals.vision_features[dominant])

    rest = [j for j in range(n) if j not in dominant.tolist()]  # 25 patches, step 25 // 4 = 6
    targets = [rest[0], rest[6], rest[12], rest[18]]
    keys = signals.vision_keys.mean(dim=0)[1:]
    keys = keys / keys.norm(dim=1, keepdim=True)
    groups = {t: [t] for t in targets}
    for j in rest:
        if j not in targets:
            groups[targets[int(torch.argmax(keys[j] @ keys[targets].T))]].append(j)
    assert [s.tolist() for s in selection.sources[12:]] == [groups[t] for t in targets]
    for token, group in zip(selection.vision_tokens[12:], selection.sources[12:]):
        members = signals.vision_features[group[1:]]
        expected = signals.vision_features[group[0]] + (members.mean(dim=0) if len(members) else 0)
        torch.testing.assert_close(token, expected)
    # every patch is carried exactly once
    carried = torch.cat(selection.sources)
    assert sorted(carried.tolist()) == list(range(n))


# --- CLS attention --------------------------------------------------------------------------------


def test_cls_attn_is_top_k_of_head_mean():
    attention = torch.rand(5, 48, generator=random_generator(9))
    expected = sorted(torch.topk(attention.mean(dim=0), 10).indices.tolist())
    signals = InputSignals(grid=(6, 8), cls_attention=attention)
    assert get_selector("cls_attn").select(signals, 10).kept.tolist() == expected
    assert get_selector("cls_attn", head_aggregation="sum").select(signals, 10).kept.tolist() == expected


def test_cls_attn_breaks_ties_by_lower_index():
    attention = torch.zeros(2, 12)
    attention[:, 9] = 1.0
    signals = InputSignals(grid=(3, 4), cls_attention=attention)
    assert get_selector("cls_attn").select(signals, 3).kept.tolist() == [0, 1, 9]


def cls_probabilities(seed: int, heads: int = 16, tokens: int = 576) -> torch.Tensor:
    """(H, N) flat CLS-row probabilities as an fp16 CLIP gives them (fp16 values held in float32), patches only.

    Flat enough that fp16 rounding of the aggregated score reorders the top-k boundary
    (seeds 1, 2, 3 and 8 do for both the head mean at 64 and the head sum at 53).
    """
    logits = torch.randn(heads, tokens + 1, generator=random_generator(seed)) * 0.05
    return torch.softmax(logits, dim=-1)[:, 1:].half().float()


def lower_index_top_k(scores: torch.Tensor, k: int) -> list[int]:
    return sorted(torch.sort(-scores, stable=True).indices[:k].tolist())


def test_cls_attn_model_dtype_ranks_the_rounded_head_mean():
    """FasterVLM in fp16: the head mean is an fp16 value; its ties go to the lower index."""
    attention = cls_probabilities(1)
    signals = InputSignals(grid=(24, 24), cls_attention=attention, model_dtype=torch.float16)
    expected = lower_index_top_k(attention.mean(dim=0).half().float(), 64)
    assert get_selector("cls_attn", score_dtype="model").select(signals, 64).kept.tolist() == expected
    assert get_selector("cls_attn").select(signals, 64).kept.tolist() != expected  # float32 ranks unrounded means


def test_score_dtype_model_is_float32_on_hand_built_signals():
    attention = cls_probabilities(5)
    signals = InputSignals(grid=(24, 24), cls_attention=attention)
    assert signals.model_dtype == torch.float32
    for name in ("cls_attn", "visionzip"):
        if name == "visionzip":
            signals = InputSignals(grid=(24, 24), cls_attention=attention, vision_features=torch.randn(576, 8),
                                   vision_keys=torch.randn(16, 577, 4), cls_feature=torch.randn(8))  # fmt: skip
        model, default = (get_selector(name, score_dtype=d).select(signals, 64) for d in ("model", "float32"))
        assert torch.equal(model.kept, default.kept)


def test_visionzip_model_dtype_rounds_saliency_keys_and_cosines():
    generator = random_generator(6)
    attention = cls_probabilities(2)
    signals = InputSignals(
        grid=(24, 24), cls_attention=attention, vision_features=torch.randn(576, 8, generator=generator),
        vision_keys=torch.randn(16, 577, 64, generator=generator).half().float(),
        cls_feature=torch.randn(8, generator=generator), model_dtype=torch.float16,
    )  # fmt: skip
    selection = get_selector("visionzip", score_dtype="model").select(signals, 64)  # 54 + 10
    dominant = lower_index_top_k(attention.sum(dim=0).half().float(), 53)
    assert selection.kept.tolist() == dominant
    assert get_selector("visionzip").select(signals, 64).kept.tolist() != dominant
    keys = signals.vision_keys.mean(dim=0)[1:].half().float()
    keys = keys / keys.norm(dim=1, keepdim=True)
    rest = [j for j in range(576) if j not in dominant]
    targets = rest[0 : 10 * (len(rest) // 10) : len(rest) // 10]
    members = [j for j in rest if j not in targets]
    slots = torch.argmax((keys[members] @ keys[targets].T).half().float(), dim=1).tolist()
    groups = [[t] + [j for j, slot in zip(members, slots) if slot == index] for index, t in enumerate(targets)]
    assert [group.tolist() for group in selection.sources[54:]] == groups


# --- shared similarity code -----------------------------------------------------------------------


def test_similarity_blocks_cover_the_matrix_within_the_block_size(small_blocks):
    unit = unit_rows(torch.randn(9, 3, generator=random_generator(10)))
    blocks = list(similarity.similarity_blocks(unit))
    assert all(block.numel() <= 9 for _, block in blocks)  # one row of 9 > 7 entries at the least
    torch.testing.assert_close(torch.cat([b for _, b in blocks]), unit @ unit.T)


def test_unit_rows_computes_in_float32_and_keeps_zero_rows_zero():
    rows = unit_rows(torch.tensor([[3.0, 4.0], [0.0, 0.0]], dtype=torch.bfloat16))
    assert rows.dtype == torch.float32
    torch.testing.assert_close(rows, torch.tensor([[0.6, 0.8], [0.0, 0.0]]))


def peak_extra_mib(name: str, tokens: int) -> float:
    """Peak extra RSS of one selection, measured by the benchmark in a fresh process.

    Features are (tokens, 128) float32 and similarity blocks 1 MiB, so a dense
    tokens x tokens float32 matrix dwarfs everything a chunked method may hold.
    """
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to reset the peak RSS")
    command = [
        sys.executable,
        str(BENCHMARK),
        "--measure",
        name,
        "--tokens",
        str(tokens),
        "--dim",
        "128",
        "--budget",
        "64",
        "--repeats",
        "1",
        "--threads",
        "1",
        "--block-elements",
        str(1 << 18),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)["peak_extra_mib"]


TOKENS = 4096
DENSE_MIB = TOKENS**2 * 4 / 2**20  # 64 MiB


@pytest.mark.parametrize("name", ["divprune", "cdpruner"])
def test_row_on_demand_selectors_hold_no_dense_matrix(name):
    assert peak_extra_mib(name, TOKENS) < DENSE_MIB / 4


@pytest.mark.parametrize("name", ["scope", "coverage"])
def test_facility_location_holds_exactly_one_dense_matrix(name):
    extra = peak_extra_mib(name, TOKENS)
    assert DENSE_MIB * 0.9 < extra < DENSE_MIB * 1.25


def test_gprune_holds_exactly_one_dense_matrix():
    """Its transition matrix is built, softmaxed and counted in place, block by block."""
    extra = peak_extra_mib("gprune", TOKENS)
    assert DENSE_MIB * 0.9 < extra < DENSE_MIB * 1.25


def test_signals_subset_slices_every_per_token_signal_and_keeps_the_cls_first():
    """``InputSignals.subset`` (per-crop budgets): per-token signals along their token axis, CLS columns kept at 0."""
    generator = torch.Generator().manual_seed(0)
    signals = InputSignals(
        grid=(2, 3),
        features=torch.randn(6, 4, generator=generator),
        cls_attention=torch.rand(2, 6, generator=generator),
        cls_logits=torch.randn(2, 7, generator=generator),
        vision_keys=torch.randn(2, 7, 5, generator=generator),
        layer_attention=torch.rand(3, 6, generator=generator),
        cls_feature=torch.ones(4),
    )
    tokens = torch.tensor([1, 2, 4, 5])
    part = signals.subset(tokens, (2, 2))
    assert part.grid == (2, 2) and part.num_tokens == 4
    torch.testing.assert_close(part.features, signals.features[tokens])
    torch.testing.assert_close(part.cls_attention, signals.cls_attention[:, tokens])
    torch.testing.assert_close(part.layer_attention, signals.layer_attention[:, tokens])
    torch.testing.assert_close(part.cls_logits, signals.cls_logits[:, [0, 2, 3, 5, 6]])
    torch.testing.assert_close(part.vision_keys, signals.vision_keys[:, [0, 2, 3, 5, 6]])
    assert part.cls_feature is signals.cls_feature and part.demand is None
    assert signals.subset(tokens).grid == (1, 4)
    with pytest.raises(ValueError, match="cannot hold"):
        signals.subset(tokens, (3, 2))


# ---------------------------------------------------------------- per grid (LLaVA-NeXT's base view and tile grid)


def test_grid_budgets_split_in_proportion_by_largest_remainder():
    from prune_audit.pruners.crop_scope import grid_budgets

    assert grid_budgets(100, [576, 2304]) == [20, 80]
    assert grid_budgets(11, [4, 8]) == [4, 7]  # 3.67 and 7.33: the leftover token to the larger fraction
    assert grid_budgets(3, [4, 8]) == [1, 2] and grid_budgets(1, [1, 1]) == [1, 0]  # tie: the earlier grid
    assert grid_budgets(50, [4, 8]) == [4, 8]


def test_pool_merges_within_each_grid_by_hand():
    """Tokens 0..3 a 2 x 2 grid, 4..11 a 2 x 4 grid. Budget 3 -> shares 1 and 2: the base grid pools to one
    token of its four cells, the tile grid to 1 x 2 (two 2 x 2 windows). Budget 11 -> shares 4 and 7: the base
    grid is kept whole (one-cell outputs, its own features), the tile grid pools to 1 x 3 with torch's
    overlapping adaptive bins (columns 0-1, 1-2, 2-3)."""
    from prune_audit.pruners.crop_scope import select_per_grid

    features = torch.arange(12, dtype=torch.float32)[:, None] * torch.tensor([[1.0, -1.0]])
    signals = InputSignals(grid=(1, 12), vision_features=features)
    grids = [(torch.arange(4), (2, 2)), (torch.arange(4, 12), (2, 4))]
    pool = get_selector("pool")
    selection = select_per_grid(pool, signals, grids, 3)
    assert [group.tolist() for group in selection.sources] == [[0, 1, 2, 3], [4, 5, 8, 9], [6, 7, 10, 11]]
    assert selection.vision_tokens[:, 0].tolist() == [1.5, 6.5, 8.5] and selection.kept.numel() == 0
    selection = select_per_grid(pool, signals, grids, 11)
    assert [group.tolist() for group in selection.sources] == [
        [0],
        [1],
        [2],
        [3],
        [4, 5, 8, 9],
        [5, 6, 9, 10],
        [6, 7, 10, 11],
    ]
    assert selection.vision_tokens[:, 0].tolist() == [0, 1, 2, 3, 6.5, 7.5, 8.5]
    assert selection.kept.tolist() == [0, 1, 2, 3]
    assert select_per_grid(pool, signals, grids, 12).sources is None  # everything kept: plain tokens


def test_tome_merges_within_each_grid_and_keeps_a_whole_grid_in_the_projected_space():
    """ToMe per grid: no output token mixes the grids; a grid kept whole passes its projected ``features``."""
    from prune_audit.pruners.crop_scope import select_per_grid

    features = torch.randn(12, 6, generator=torch.Generator().manual_seed(0))
    signals = InputSignals(grid=(1, 12), features=features)
    grids = [(torch.arange(4), (2, 2)), (torch.arange(4, 12), (2, 4))]
    tome = get_selector("tome")
    selection = select_per_grid(tome, signals, grids, 6)  # shares 2 and 4
    assert all(bool((group < 4).all()) or bool((group >= 4).all()) for group in selection.sources)
    assert sorted(int(cell) for group in selection.sources for cell in group) == list(range(12))
    assert len(selection.sources) == 6 and selection.llm_tokens.shape == (6, 6)
    whole = select_per_grid(tome, signals, grids, 11)  # shares 4 and 7: the base grid kept whole
    assert [group.tolist() for group in whole.sources[:4]] == [[0], [1], [2], [3]]
    assert torch.equal(whole.llm_tokens[:4], features[:4])
