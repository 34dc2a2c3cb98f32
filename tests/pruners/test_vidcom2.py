"""VidCom2 (``pruners.vidcom2``) against independent re-derivations of the reference's ``_compute_keep_indices``
(xuyang-liu16/VidCom2 ``token_compressor/vidcom2``, 944a17d1) and of vLLM's ``compute_retention_mask``
(vllm-project/vllm ``vllm/multimodal/video_prune/vidcom2.py``, 0f17ee06): loops over channels, steps and tokens in
float64, each step's picks and vLLM's reconcile read off sorts with ties to the lower index; random clips at
Qwen2.5-VL-like shapes, several seeds, grids, budgets and pruning rates."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from prune_audit.pruners import get_selector
from prune_audit.pruners.signals import InputSignals

# (T, h, w, D) clips: T temporal steps of h x w merged tokens of width D
GRIDS = [(4, 6, 8, 64), (8, 6, 6, 128), (5, 9, 12, 64), (2, 10, 7, 96)]
ALPHAS = [0.125, 0.25, 0.5, 1.0, 2.0]


def clip_signals(grid: tuple[int, int, int], width: int, seed: int) -> InputSignals:
    """A clip whose steps drift from the previous one, with a scene cut at a random step and channels of very
    different spreads (what the low-variance channels and the frame uniqueness look at)."""
    steps, rows, cols = grid
    generator = torch.Generator().manual_seed(seed)
    spread = 0.2 + 2 * torch.rand(width, generator=generator)
    cut = int(torch.randint(1, max(2, steps), (1,), generator=generator))
    frames = [torch.randn(rows * cols, width, generator=generator)]
    for step in range(1, steps):
        fresh = torch.randn(rows * cols, width, generator=generator)
        frames.append(fresh if step == cut else frames[-1] + 0.3 * fresh)
    features = torch.cat(frames) * spread
    return InputSignals(grid=(steps * rows, cols), features=features, video_grid=grid)


def rederived_scores(features: torch.Tensor, grid: tuple[int, int, int]) -> tuple[list[list[float]], list[float]]:
    """(similarity per step and token, uniqueness per step), token by token in float64."""
    steps, rows, cols = grid
    per_step, width = rows * cols, features.shape[1]
    values = features.double()
    variances = []
    for channel in range(width):
        column = [float(v) for v in values[:, channel]]
        mean = sum(column) / len(column)
        variances.append(sum((v - mean) ** 2 for v in column) / len(column))
    channels = sorted(range(width), key=lambda c: (variances[c], c))[: width // 2]
    tokens = []
    for index in range(steps * per_step):
        vector = values[index, channels]
        tokens.append(vector / max(math.sqrt(float(vector @ vector)), 1e-12))
    clip_mean = sum(tokens) / len(tokens)
    similarity, uniqueness = [], []
    for step in range(steps):
        own = tokens[step * per_step : (step + 1) * per_step]
        step_mean = sum(own) / per_step
        to_clip = [sum(math.exp(-float((t - clip_mean) @ (t - clip_mean)) / (2 * a)) for a in ALPHAS) for t in own]
        to_step = [sum(math.exp(-float((t - step_mean) @ (t - step_mean)) / (2 * a)) for a in ALPHAS) for t in own]
        similarity.append([c + s for c, s in zip(to_clip, to_step, strict=True)])
        uniqueness.append(-sum(to_clip) / per_step)
    return similarity, uniqueness


def rederived_reference(features: torch.Tensor, grid: tuple[int, int, int], ratio: float) -> tuple[list[int], list]:
    """The reference's kept set at retention ``ratio`` (``R_RATIO``) and the flat similarity: per step
    ``round(min(1, ratio (1 + p - mean p)) h w)`` tokens, at least one, its least similar ones."""
    steps, rows, cols = grid
    per_step = rows * cols
    similarity, uniqueness = rederived_scores(features, grid)
    top = max(uniqueness)
    exps = [math.exp((u - top) / 0.01) for u in uniqueness]
    shares = [e / sum(exps) for e in exps]
    mean = sum(shares) / steps
    kept = []
    for step in range(steps):
        count = max(1, round(min(1.0, ratio * (1 + shares[step] - mean)) * per_step))  # round: half to even
        order = sorted(range(per_step), key=lambda j: (similarity[step][j], j))
        kept += [step * per_step + j for j in order[:count]]
    return sorted(kept), [value for row in similarity for value in row]


def rederived_vllm(features: torch.Tensor, grid: tuple[int, int, int], ratio: float, target: int) -> list[int]:
    """vLLM's mask: the reference's kept set, then its most similar kept tokens dropped beyond ``target`` or its
    least similar others added short of it."""
    kept, similarity = rederived_reference(features, grid, ratio)
    if len(kept) > target:
        kept = sorted(sorted(kept, key=lambda i: (similarity[i], i))[:target])
    others = sorted((i for i in range(len(similarity)) if i not in set(kept)), key=lambda i: (similarity[i], i))
    return sorted(kept + others[: max(0, target - len(kept))])


def vllm_count(grid: tuple[int, int, int], rate: float) -> int:
    steps, rows, cols = grid
    return max(steps, min(int(steps * rows * cols * (1 - rate)), steps * rows * cols))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.5, 0.9])
def test_vidcom2_equals_the_rederived_vllm_mask(seed, grid, fraction):
    steps, rows, cols, width = grid
    signals = clip_signals((steps, rows, cols), width, seed)
    n = signals.num_tokens
    budget = max(1, round(fraction * n))
    kept = get_selector("vidcom2").select(signals, budget).kept.tolist()
    assert kept == rederived_vllm(signals.features, (steps, rows, cols), budget / n, budget)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("rate", [0.25, 0.5, 0.75, 0.9])
def test_pruning_rate_with_count_reference_is_the_reference(seed, grid, rate):
    steps, rows, cols, width = grid
    signals = clip_signals((steps, rows, cols), width, seed)
    selector = get_selector("vidcom2", pruning_rate=rate, count="reference")
    kept = selector.select(signals, signals.num_tokens).kept.tolist()  # a budget of every token: R_RATIO = 1 - rate
    expected, similarity = rederived_reference(signals.features, (steps, rows, cols), 1 - rate)
    assert kept == expected
    assert len({i // (rows * cols) for i in kept}) == steps  # every step keeps one token at least
    capped = selector.select(signals, len(expected) - 3).kept.tolist()  # beyond the budget: the most similar go
    assert capped == sorted(sorted(expected, key=lambda i: (similarity[i], i))[: len(expected) - 3])


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("rate", [0.25, 0.5, 0.75, 0.9])
def test_pruning_rate_is_vllms_video_pruning_rate(seed, grid, rate):
    steps, rows, cols, width = grid
    signals = clip_signals((steps, rows, cols), width, seed)
    selector = get_selector("vidcom2", pruning_rate=rate)
    kept = selector.select(signals, signals.num_tokens).kept.tolist()
    count = vllm_count((steps, rows, cols), rate)
    assert kept == rederived_vllm(signals.features, (steps, rows, cols), 1 - rate, count)
    capped = selector.select(signals, count // 2 + 1).kept  # the budget caps vLLM's count
    assert capped.tolist() == rederived_vllm(signals.features, (steps, rows, cols), 1 - rate, count // 2 + 1)


@pytest.mark.parametrize("grid", GRIDS)
def test_count_reference_at_the_budgets_ratio_feeds_at_most_the_budget(grid):
    steps, rows, cols, width = grid
    signals = clip_signals((steps, rows, cols), width, 1)
    n = signals.num_tokens
    for budget in (steps, n // 4, n // 2):
        kept = get_selector("vidcom2", count="reference").select(signals, budget).kept.tolist()
        expected, similarity = rederived_reference(signals.features, (steps, rows, cols), budget / n)
        if len(expected) > budget:
            expected = sorted(sorted(expected, key=lambda i: (similarity[i], i))[:budget])
        assert kept == expected


@pytest.mark.parametrize("grid", GRIDS)
def test_keep_all_is_dense(grid):
    steps, rows, cols, width = grid
    signals = clip_signals((steps, rows, cols), width, 0)
    for count in ("vllm", "reference"):
        for budget in (signals.num_tokens, signals.num_tokens + 3):
            kept = get_selector("vidcom2", count=count).select(signals, budget).kept.tolist()
            assert kept == list(range(signals.num_tokens))


def test_the_unique_step_keeps_more_tokens():
    """The most unique step (the scene cut) gets more than the ratio's share of its tokens, every other step less."""
    signals = clip_signals((6, 6, 6), 64, 3)
    steps = [0] * 6
    for index in get_selector("vidcom2", count="reference").select(signals, 54).kept.tolist():
        steps[index // 36] += 1
    _, uniqueness = rederived_scores(signals.features, (6, 6, 6))
    unique = max(range(6), key=lambda s: uniqueness[s])
    assert steps[unique] > 9 and all(count <= 9 for step, count in enumerate(steps) if step != unique)  # 54 / 6 = 9


def test_a_budget_below_the_steps_keeps_the_least_similar_tokens():
    signals = clip_signals((5, 3, 4), 32, 2)
    kept = get_selector("vidcom2").select(signals, 3).kept.tolist()
    assert kept == rederived_vllm(signals.features, (5, 3, 4), 3 / 60, 3)


def test_one_step_clip_and_degenerate_features():
    one = clip_signals((1, 4, 4), 16, 0)
    assert get_selector("vidcom2").select(one, 5).kept.tolist() == rederived_vllm(one.features, (1, 4, 4), 5 / 16, 5)
    flat = InputSignals(grid=(12, 4), features=torch.ones(48, 16), video_grid=(3, 4, 4))
    assert get_selector("vidcom2").select(flat, 10).kept.numel() == 10


def test_a_still_image_or_a_wrong_grid_is_refused():
    signals = clip_signals((3, 2, 4), 8, 1)
    still = InputSignals(grid=signals.grid, features=signals.features)
    with pytest.raises(ValueError, match="video_grid"):
        get_selector("vidcom2").select(still, 5)
    wrong = InputSignals(grid=signals.grid, features=signals.features, video_grid=(2, 2, 4))
    with pytest.raises(ValueError, match="does not hold"):
        get_selector("vidcom2").select(wrong, 5)


def test_half_precision_features_are_scored_in_float32():
    signals = clip_signals((4, 6, 6), 64, 2)
    for dtype in (torch.float16, torch.bfloat16):
        half = InputSignals(grid=signals.grid, features=signals.features.to(dtype), video_grid=signals.video_grid)
        upcast = InputSignals(
            grid=signals.grid, features=signals.features.to(dtype).float(), video_grid=signals.video_grid
        )
        assert torch.equal(
            get_selector("vidcom2").select(half, 40).kept, get_selector("vidcom2").select(upcast, 40).kept
        )


def test_selection_runs_no_matrix_product():
    """``flops_exact`` with no formula: the counter sees no FLOP in ``select``."""
    signals = clip_signals((4, 6, 8), 64, 0)
    with FlopCounterMode(display=False) as counter:
        get_selector("vidcom2", pruning_rate=0.5).select(signals, 100)
    assert counter.get_total_flops() == 0
