"""HoliTom's outer-LLM merge against a loop-by-loop re-derivation of the official forward (cokeshao/HoliTom e9b2972f,
``holitom/llava_arch.py``: ``select_static_windows``, ``get_static_dynamic_features``, ``holitom``,
``merge_tokens_by_attention_density``, ``merge_tokens_by_density``, ``cluster_dpc_knn``,
``merge_tokens_by_clustering``) in float64 on random clips at Qwen2.5-VL-like shapes, token by token: kept sets,
each output token's members and merged features."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from prune_audit.pruners import get_selector
from prune_audit.pruners.signals import InputSignals

# (T, h, w, D)
GRIDS = [(4, 6, 8, 64), (6, 8, 10, 96), (8, 6, 6, 64), (5, 12, 9, 128)]
TAU, BETA, K, MAX_WINDOW = 0.8, 0.6, 7, 1024


def clip_signals(grid: tuple[int, int, int], width: int, seed: int) -> InputSignals:
    """Each step a scene cut, or per token a small (static, cosine near 1) or large (dynamic, near 0.55) change."""
    steps, rows, cols = grid
    generator = torch.Generator().manual_seed(seed)
    frames = [torch.randn(rows * cols, width, generator=generator)]
    for _ in range(1, steps):
        if float(torch.rand(1, generator=generator)) < 0.15:
            frames.append(torch.randn(rows * cols, width, generator=generator))
            continue
        still = torch.rand(rows * cols, 1, generator=generator) < 0.6
        change = torch.where(still, 0.1, 1.5)
        step = frames[-1] + change * torch.randn(rows * cols, width, generator=generator)
        frames.append(step / torch.sqrt(1 + change**2))
    attention = torch.softmax(2 * torch.randn(steps, rows * cols, generator=generator), dim=-1).flatten()
    return InputSignals(
        grid=(steps * rows, cols), features=torch.cat(frames), video_grid=grid, step_attention=attention
    )


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(a @ b) / math.sqrt(float(a @ a) * float(b @ b))


def official_windows(sim: list[list[float]], steps: int, tokens: int) -> tuple[list[tuple[int, int]], int]:
    """``select_static_windows``: saved counts per window, then the dynamic programme and its backtrack."""
    saved = [[0] * steps for _ in range(steps)]
    for s in range(steps):
        for e in range(s + 1, steps):
            static = sum(all(sim[t][j] > TAU for t in range(s, e)) for j in range(tokens))
            saved[s][e] = static * (e - s)
    dp, prev = [0] * steps, [0] * steps
    for i in range(steps):
        best, best_j = (dp[i - 1] if i > 0 else 0), i
        for size in range(2, min(i + 1, MAX_WINDOW) + 1):
            j = i - size
            value = (dp[j] if j >= 0 else 0) + saved[j + 1][i]
            if value > best:
                best, best_j = value, j + 1
        dp[i], prev[i] = best, best_j
    windows, i = [], steps - 1
    while i >= 0:
        windows.append((prev[i], i))
        i = prev[i] - 1
    return windows[::-1], dp[-1]


def official_count(plan, ratio: float, share: float) -> int:
    """Tokens the official forward feeds at segment ratio ``ratio``: per window (frames, static, dynamic)."""
    total = 0
    for frames, static, dynamic in plan:
        kept = math.ceil(dynamic * ratio)
        total += frames * (round(kept * (1 - share)) + kept - round(kept * (1 - share)))
        if frames > 1:
            total += round(static * ratio)
    return total


def project_ratio(plan, budget: int, n: int, saved: int, share: float) -> float:
    """The retention ratio: budget / N, or, where the official counts exceed the budget, the largest one that fits
    (the selector's documented rule, bisected the same 60 times)."""

    def raised(r: float) -> float:
        return min(r / ((n - saved) / n), 1)

    low, high = 0.0, budget / n
    if official_count(plan, raised(high), share) <= budget:
        return raised(high)
    for _ in range(60):
        middle = (low + high) / 2
        if official_count(plan, raised(middle), share) <= budget:
            low = middle
        else:
            high = middle
    return raised(low)


def dpc_knn(x: list[torch.Tensor], cluster_num: int, k: int, noise: list[float]):
    """``cluster_dpc_knn``: ascending centres and the distance table."""
    n, width = len(x), x[0].numel()
    dist = [[math.sqrt(float((a - b) @ (a - b))) / math.sqrt(width) for b in x] for a in x]
    density = [math.exp(-sum(d * d for d in sorted(row)[:k]) / k) + noise[i] for i, row in enumerate(dist)]
    largest = max(max(row) for row in dist)
    score = []
    for i in range(n):
        denser = [dist[i][j] for j in range(n) if density[j] > density[i]]
        score.append((min(denser) if denser else largest) * density[i])
    return sorted(sorted(range(n), key=lambda i: (-score[i], i))[:cluster_num]), dist


def clustering(x: list[torch.Tensor], targets: list[int], dist) -> list[tuple[int, torch.Tensor, list[int]]]:
    """``merge_tokens_by_clustering`` with BETA: (target row, merged feature, rows)."""
    members = {t: [] for t in targets}
    for i in range(len(x)):
        if i not in targets:
            row = [dist[i][t] for t in targets]
            members[targets[row.index(min(row))]].append(i)
    out = []
    for t in targets:
        if members[t]:
            mean = sum((x[i] for i in members[t]), torch.zeros_like(x[t])) / len(members[t])
            out.append((t, BETA * x[t] + (1 - BETA) * mean, [t, *members[t]]))
        else:
            out.append((t, x[t], [t]))
    return out


def draws(count: int, noise: torch.Generator | None) -> list[float]:
    return (torch.rand(count, generator=noise) * 1e-6).tolist() if noise else [0.0] * count


def rederived(signals: InputSignals, budget: int, share: float = 0.0, noise: torch.Generator | None = None):
    """The official forward at the selector's ratio: (clip index, feature, clip members) in clip order."""
    steps, rows, cols = signals.video_grid
    s_tok, n = rows * cols, signals.num_tokens
    x = signals.features.double().reshape(steps, s_tok, -1)
    attn = signals.step_attention.double().reshape(steps, s_tok)
    sim = [[cosine(x[t, j], x[t + 1, j]) for j in range(s_tok)] for t in range(steps - 1)]
    windows, saved = official_windows(sim, steps, s_tok)
    statics = [[e > s and all(sim[t][j] > TAU for t in range(s, e)) for j in range(s_tok)] for s, e in windows]
    plan = [(e - s + 1, sum(st), s_tok - sum(st)) for (s, e), st in zip(windows, statics)]
    ratio = project_ratio(plan, budget, n, saved, share)
    output = []
    for (start, end), static in zip(windows, statics):
        dynamic = [j for j in range(s_tok) if not static[j]]
        kept = math.ceil(len(dynamic) * ratio)
        dominant = round(kept * (1 - share))
        for f in range(start, end + 1):
            order = sorted(range(len(dynamic)), key=lambda i: (-float(attn[f, dynamic[i]]), i))[:dominant]
            output += [(f * s_tok + dynamic[i], x[f, dynamic[i]], [f * s_tok + dynamic[i]]) for i in order]
            if kept - dominant > 0:
                rest = [dynamic[i] for i in range(len(dynamic)) if i not in order]
                feats = [x[f, j] for j in rest]
                targets, dist = dpc_knn(feats, kept - dominant, min(K, kept - dominant), draws(len(rest), noise))
                for t, vector, group in clustering(feats, targets, dist):
                    output.append((f * s_tok + rest[t], vector, sorted(f * s_tok + rest[g] for g in group)))
        cells = [j for j in range(s_tok) if static[j]]
        count = round(len(cells) * ratio)
        if end > start and count > 0:
            means = [x[start : end + 1, j].mean(dim=0) for j in cells]
            targets, dist = dpc_knn(means, count, min(K, count), draws(len(cells), noise))
            for t, vector, group in clustering(means, targets, dist):
                members = sorted(f * s_tok + cells[g] for f in range(start, end + 1) for g in group)
                output.append((start * s_tok + cells[t], vector, members))
    return sorted(output, key=lambda entry: entry[0])


def assert_same_output(selection, expected) -> None:
    assert selection.kept.tolist() == [index for index, _, _ in expected]
    if selection.sources is None:  # nothing merged: every output token its own
        assert all(group == [index] for index, _, group in expected)
        return
    assert [sorted(group.tolist()) for group in selection.sources] == [group for _, _, group in expected]
    reference = torch.stack([vector for _, vector, _ in expected]).float()
    torch.testing.assert_close(selection.llm_tokens, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.4])
def test_holitom_equals_the_rederived_forward(seed, grid, fraction):
    steps, rows, cols, width = grid
    signals = clip_signals((steps, rows, cols), width, seed)
    budget = round(fraction * signals.num_tokens)
    selection = get_selector("holitom", density_noise=0.0).select(signals, budget)
    assert_same_output(selection, rederived(signals, budget))
    assert 1 <= selection.num_output_tokens <= budget


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("grid", GRIDS[:2])
def test_the_contextual_share_merges_alike(seed, grid):
    steps, rows, cols, width = grid
    signals = clip_signals((steps, rows, cols), width, seed)
    budget = signals.num_tokens // 4
    selection = get_selector("holitom", density_noise=0.0, context_share=0.5).select(signals, budget)
    assert_same_output(selection, rederived(signals, budget, share=0.5))


def test_the_density_noise_is_drawn_from_the_runs_generator():
    signals = clip_signals((6, 8, 10), 96, 4)
    selection = get_selector("holitom", context_share=0.3).select(signals, 120, torch.Generator().manual_seed(3))
    assert_same_output(selection, rederived(signals, 120, 0.3, torch.Generator().manual_seed(3)))


def test_without_merging_the_centres_keep_their_own_tokens():
    signals = clip_signals((6, 8, 10), 96, 1)
    merged = get_selector("holitom", density_noise=0.0).select(signals, 100)
    plain = get_selector("holitom", density_noise=0.0, merge=False).select(signals, 100)
    assert merged.sources is not None and plain.sources is None and torch.equal(plain.kept, merged.kept)


def test_keep_all_and_no_matrix_product():
    signals = clip_signals((4, 6, 8), 64, 2)
    n = signals.num_tokens
    for budget in (n, n + 3):
        assert get_selector("holitom").select(signals, budget).kept.tolist() == list(range(n))
    with FlopCounterMode(display=False) as counter:
        selection = get_selector("holitom", context_share=0.5).select(signals, n // 4)
    assert counter.get_total_flops() == 0 and selection.sources is not None  # as flops_exact's zero says


def test_a_budget_below_one_token_a_frame_keeps_the_top_attention():
    """Every step a cut: single-frame windows, the least positive ratio keeps one token a frame (4 > 3)."""
    generator = torch.Generator().manual_seed(5)
    attention = torch.rand(4 * 20, generator=generator)
    signals = InputSignals(
        grid=(16, 5), features=torch.randn(80, 32, generator=generator), video_grid=(4, 4, 5), step_attention=attention
    )
    kept = get_selector("holitom").select(signals, 3).kept.tolist()
    assert kept == sorted(sorted(range(80), key=lambda i: (-float(attention[i]), i))[:3])
    assert get_selector("holitom").select(signals, 4).kept.tolist() == [
        20 * t + max(range(20), key=lambda j: float(attention[20 * t + j])) for t in range(4)
    ]


def test_a_still_image_or_a_clip_without_attention_is_refused():
    signals = clip_signals((4, 4, 5), 32, 2)
    for missing in ("video_grid", "step_attention"):
        fields = {"video_grid": signals.video_grid, "step_attention": signals.step_attention, missing: None}
        with pytest.raises(ValueError, match=missing):
            get_selector("holitom").select(InputSignals(grid=signals.grid, features=signals.features, **fields), 20)
