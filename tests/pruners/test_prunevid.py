"""PruneVid (``pruners.prunevid``) against an independent float64 transcription of the official stage before the LLM
(Visual-AI/PruneVid ``models/pllava/modeling_pllava.py`` b12600c6: ``cluster_dpc_knn``, ``refine_clusters``,
``segment_lengths``, ``merge_frames_dynamic``, ``compute_cluster_vectors``), written as that code runs, without the
density noise: output tokens in the official order, their sources and merged features, on random clips at
Qwen2.5-VL-like shapes with static and moving tokens and scene cuts, several seeds, grids and budgets."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from prune_audit.pruners import get_selector
from prune_audit.pruners.arithmetic import SelectorWork
from prune_audit.pruners.signals import InputSignals

# (T, h, w, D): at least 7 steps, as the official k = 7 temporal DPC-KNN needs
GRIDS = [(8, 6, 8, 64), (12, 6, 6, 96), (10, 8, 8, 64), (16, 5, 6, 128)]
TAU, SEGMENT_RATIO, CLUSTER_RATIO, K = 0.8, 0.25, 0.5, 7
FRACTIONS = [0.1, 0.25, 0.4]


def clip_signals(grid: tuple[int, int, int, int], seed: int) -> InputSignals:
    """Scenes of a few steps: a share of positions nearly still within a scene (static), the others moving."""
    steps, rows, cols, width = grid
    generator = torch.Generator().manual_seed(seed)
    tokens = rows * cols
    frames: list[torch.Tensor] = []
    while len(frames) < steps:
        scene = torch.randn(tokens, width, generator=generator)
        still = torch.rand(tokens, 1, generator=generator) < 0.5
        for _ in range(int(torch.randint(2, 8, (1,), generator=generator))):
            change = torch.where(still, 0.1, 1.0) * torch.randn(tokens, width, generator=generator)
            frames.append((scene + change) / math.sqrt(2))
    features = torch.cat(frames[:steps])
    return InputSignals(grid=(steps * rows, cols), features=features, video_grid=(steps, rows, cols))


def official_dpc(x: torch.Tensor, count: int) -> tuple[list[int], list[int]]:
    """``cluster_dpc_knn`` on (n, C) float64 tokens without the noise: (centres best first, each token's cluster)."""
    n, width = x.shape
    dist = torch.cdist(x, x) / math.sqrt(width)
    nearest = torch.sort(dist, dim=-1).values[:, : min(K, n)]
    density = torch.exp(-(nearest**2).mean(dim=-1)).tolist()
    biggest = float(dist.max())
    score = []
    for i in range(n):
        denser = [float(dist[i, j]) for j in range(n) if density[j] > density[i]]
        score.append((min(denser) if denser else biggest) * density[i])
    centres = sorted(range(n), key=lambda i: -score[i])[:count]
    labels = [min(range(count), key=lambda j: float(dist[i, centres[j]])) for i in range(n)]
    for j, centre in enumerate(centres):
        labels[centre] = j
    return centres, labels


def official_refine(labels: list[int]) -> list[int]:
    """``refine_clusters`` for one clip, step by step."""
    n, refined = len(labels), list(labels)
    for cluster in sorted(set(labels)):
        indices = [i for i in range(n) if labels[i] == cluster]
        pieces, start, prev = [], indices[0], indices[0]
        for i in indices[1:]:
            if i == prev + 1:
                prev = i
            else:
                pieces.append((start, prev))
                start = prev = i
        pieces.append((start, prev))
        longest = max(end - start + 1 for start, end in pieces)
        for start, end in pieces:
            if longest == 1 or end - start + 1 != longest:
                refined[start : end + 1] = [-1] * (end - start + 1)
    i = 0
    while i < n:
        if refined[i] != -1:
            i += 1
            continue
        start = i
        while i < n and refined[i] == -1:
            i += 1
        end = i - 1
        left_label, left_length, right_label, right_length = None, 0, None, 0
        if start > 0:
            left_label, l_idx = refined[start - 1], start - 1
            while l_idx >= 0 and refined[l_idx] == left_label:
                l_idx -= 1
            left_length = start - l_idx - 1
        if end < n - 1:
            right_label, r_idx = refined[end + 1], end + 1
            while r_idx < n and refined[r_idx] == right_label:
                r_idx += 1
            right_length = r_idx - end - 1
        if left_length > right_length:
            label = left_label
        elif right_length > left_length:
            label = right_label
        else:
            label = left_label if left_label is not None else right_label
        refined[start : end + 1] = [0 if label is None else label] * (end - start + 1)
    return refined


def official_groups(features: torch.Tensor, grid: tuple[int, int, int]) -> list[tuple[torch.Tensor, list[list[int]]]]:
    """``merge_frames_dynamic`` up to the spatial clustering: per segment its static group (features averaged over
    the segment, each member's clip cells), then each step's dynamic group; empty groups left out."""
    steps, rows, cols = grid
    per_step = rows * cols
    frames = features.double().reshape(steps, per_step, -1)
    _, labels = official_dpc(frames.mean(dim=1), max(1, int(steps * SEGMENT_RATIO)))
    refined = official_refine(labels)
    lengths = [1]
    for i in range(1, steps):
        lengths[-1:] = [lengths[-1] + 1] if refined[i] == refined[i - 1] else [lengths[-1], 1]
    groups, start = [], 0
    for window in lengths:
        static = []
        for pos in range(per_step):
            pairs = [
                float(torch.nn.functional.cosine_similarity(frames[start + a, pos], frames[start + b, pos], dim=0))
                for a in range(window)
                for b in range(window)
                if a != b
            ]
            static.append(window > 1 and sum(pairs) / (window * (window - 1)) > TAU)
        still = [pos for pos in range(per_step) if static[pos]]
        moving = [pos for pos in range(per_step) if not static[pos]]
        span = range(start, start + window)
        if still:
            groups.append(
                (frames[start : start + window, still].mean(dim=0), [[s * per_step + p for s in span] for p in still])
            )
        for s in span:
            if moving:
                groups.append((frames[s, moving], [[s * per_step + p] for p in moving]))
        start += window
    return groups


def largest_remainder(budget: int, sizes: list[int]) -> list[int]:
    total = sum(sizes)
    if budget >= total:
        return sizes
    shares = [budget * size // total for size in sizes]
    order = sorted(range(len(sizes)), key=lambda g: (-(budget * sizes[g] % total), g))
    for g in order[: budget - sum(shares)]:
        shares[g] += 1
    return shares


def official_outputs(signals: InputSignals, budget: int | None) -> list[tuple[list[int], torch.Tensor, int]]:
    """(sorted sources, merged feature, anchor cell) of each output token in the official order: at ``budget``
    None the official counts (int(m 0.5) clusters above 14 tokens), else the budget split over the groups' sizes."""
    groups = official_groups(signals.features, signals.video_grid)
    sizes = [len(cells) for _, cells in groups]
    if budget is None:
        counts = [int(m * CLUSTER_RATIO) if m > 14 else m for m in sizes]
    else:
        counts = largest_remainder(budget, sizes)
    outputs = []
    for (feats, cells), count in zip(groups, counts):
        if count >= len(cells):
            outputs += [(sorted(cells[i]), feats[i], cells[i][0]) for i in range(len(cells))]
            continue
        centres, labels = official_dpc(feats, count)
        for j in range(count):
            members = [i for i in range(len(cells)) if labels[i] == j]
            mean = sum(feats[i] for i in members) / len(members)
            outputs.append((sorted(c for i in members for c in cells[i]), mean, cells[centres[j]][0]))
    return outputs


def assert_same_outputs(signals, selector, budget, reference) -> None:
    selection = selector.select(signals, budget, torch.Generator().manual_seed(0))
    assert [s.tolist() for s in selection.sources] == [sources for sources, _, _ in reference]
    torch.testing.assert_close(
        selection.llm_tokens.double(), torch.stack([f for _, f, _ in reference]), atol=1e-5, rtol=1e-5
    )
    singles = sorted(sources[0] for sources, _, _ in reference if len(sources) == 1)
    assert selection.kept.tolist() == singles
    anchored = get_selector("prunevid", **{**selector.options(), "merge": False}).select(signals, budget)
    assert anchored.kept.tolist() == sorted(anchor for _, _, anchor in reference)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("grid", GRIDS)
def test_official_ratio_equals_the_rederived_merge_frames_dynamic(seed, grid):
    signals = clip_signals(grid, seed)
    selector = get_selector("prunevid", cluster_ratio=CLUSTER_RATIO, density_noise=0.0)
    assert_same_outputs(signals, selector, signals.num_tokens, official_outputs(signals, None))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("fraction", FRACTIONS)
def test_budget_split_equals_the_rederived_groups_clustered(seed, grid, fraction):
    signals = clip_signals(grid, seed)
    budget = int(signals.num_tokens * fraction)
    reference = official_outputs(signals, budget)
    assert len(reference) <= budget
    assert_same_outputs(signals, get_selector("prunevid", density_noise=0.0), budget, reference)


def test_the_density_noise_is_drawn_from_the_runs_generator():
    signals = clip_signals(GRIDS[0], 0)
    generator = torch.Generator().manual_seed(3)
    before = generator.get_state()
    first = get_selector("prunevid").select(signals, 96, generator)
    assert not torch.equal(generator.get_state(), before)
    second = get_selector("prunevid").select(signals, 96, torch.Generator().manual_seed(3))
    assert [s.tolist() for s in first.sources] == [s.tolist() for s in second.sources]
    assert torch.equal(first.llm_tokens, second.llm_tokens)


def test_keep_all_and_the_official_count_at_every_token():
    signals = clip_signals(GRIDS[1], 1)
    n = signals.num_tokens
    for budget in (n, n + 7):
        selection = get_selector("prunevid").select(signals, budget)
        assert selection.kept.tolist() == list(range(n)) and selection.sources is None
    official = get_selector("prunevid", cluster_ratio=CLUSTER_RATIO).select(signals, n)
    assert official.num_output_tokens == len(official_outputs(signals, None)) < n
    capped = get_selector("prunevid", cluster_ratio=CLUSTER_RATIO).select(signals, 50)
    assert capped.num_output_tokens == 50


def test_without_merging_each_output_is_its_anchor_cells_own_token():
    signals = clip_signals(GRIDS[2], 2)
    plain = get_selector("prunevid", merge=False, density_noise=0.0).select(signals, 120)
    merged = get_selector("prunevid", density_noise=0.0).select(signals, 120)
    assert plain.sources is None and plain.kept.numel() == merged.num_output_tokens
    assert set(plain.kept.tolist()) <= set(torch.cat(merged.sources).tolist())


def test_short_clips_and_small_grids_run():
    """Fewer steps than the official k = 7 neighbours (where the official code raises) and groups of one token."""
    for grid in ((1, 3, 3, 16), (2, 2, 2, 16), (3, 4, 5, 32), (6, 1, 1, 16)):
        signals = clip_signals(grid, 0)
        for budget in (1, 2, signals.num_tokens // 2, signals.num_tokens - 1):
            for options in ({}, {"merge": False}, {"cluster_ratio": CLUSTER_RATIO}):
                selection = get_selector("prunevid", **options).select(signals, max(budget, 1))
                assert 1 <= selection.num_output_tokens <= max(budget, 1)


def test_a_still_image_is_refused():
    signals = clip_signals(GRIDS[0], 0)
    with pytest.raises(ValueError, match="video_grid"):
        get_selector("prunevid").select(InputSignals(grid=signals.grid, features=signals.features), 20)


@pytest.mark.parametrize("seed, grid", [(0, GRIDS[0]), (1, GRIDS[1]), (2, (3, 4, 5, 32)), (3, (1, 3, 3, 16))])
@pytest.mark.parametrize("options", [{}, {"merge": False}, {"cluster_ratio": CLUSTER_RATIO}])
def test_the_flops_equal_the_counted_flops_of_select(seed, grid, options):
    """``flops`` on the sizes the selection reports equals ``FlopCounterMode`` around ``select`` (every DPC-KNN
    Gram), at budgets from a few tokens to every token; none at keep-all."""
    signals = clip_signals(grid, seed)
    selector = get_selector("prunevid", **options)
    counts = []
    for budget in (2, signals.num_tokens // 4, signals.num_tokens // 2, signals.num_tokens):
        with FlopCounterMode(display=False) as counter:
            selection = selector.select(signals, budget, torch.Generator().manual_seed(seed))
        counts.append(counter.get_total_flops())
        assert type(selector).flops(SelectorWork(feature_width=grid[3], sizes=selection.work_sizes)) == counts[-1]
    assert type(selector).flops_exact and counts[0] > 0
    assert counts[-1] == 0 or "cluster_ratio" in options  # keep-all runs nothing
