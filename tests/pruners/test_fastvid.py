"""FastVID (``pruners.fastvid``) against an independent float64 re-derivation of the official Qwen2.5-VL forward
(LunarShen/FastVID ``fastvid_qwen25vl/.../modeling_qwen2_5_vl.py``, a40a109c), written loop by loop as that forward
runs: DySeg's cuts, the per-segment and per-sub-segment counts, each frame's salient top-k, the density peaks
among its other tokens, and DTM's assignment and weighted means; random clips at Qwen2.5-VL-like shapes with
near-static stretches and scene cuts, several seeds, grids and budgets."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from prune_audit.pruners import get_selector
from prune_audit.pruners.arithmetic import SelectorWork
from prune_audit.pruners.signals import InputSignals

# (T, h, w, D): at least 8 steps, as the official DySeg's top-(c - 1) needs
GRIDS = [(10, 6, 8, 64), (24, 4, 6, 64), (20, 6, 6, 96), (16, 5, 6, 64)]
C, TAU, IGNORE, SHARE, STRIDE, BETA = 8, 0.84, 0.95, 0.4, 4, 0.6


def clip_signals(grid: tuple[int, int, int], width: int, seed: int) -> InputSignals:
    """Scenes of a few steps: each step a small (static), larger (moving) or complete (cut) change of the last."""
    steps, rows, cols = grid
    generator = torch.Generator().manual_seed(seed)
    frames = [torch.randn(rows * cols, width, generator=generator)]
    for _ in range(1, steps):
        kind = float(torch.rand(1, generator=generator))
        change = 0.05 if kind < 0.3 else 0.45 if kind < 0.9 else 3.0  # cosines near 1, between 0.84 and 0.95, low
        step = frames[-1] + change * torch.randn(rows * cols, width, generator=generator)
        frames.append(step / math.sqrt(1 + change**2))  # unit spread: densities far from underflow
    attention = torch.softmax(2 * torch.randn(steps, rows * cols, generator=generator), dim=-1).flatten()
    return InputSignals(
        grid=(steps * rows, cols), features=torch.cat(frames), video_grid=grid, step_attention=attention
    )


def unit(vector: torch.Tensor) -> torch.Tensor:
    return vector / math.sqrt(float(vector @ vector))


def runs(cuts: list[int], length: int) -> list[int]:
    sizes = [cuts[0] + 1] + [cuts[i] - cuts[i - 1] for i in range(1, len(cuts))] + [length - cuts[-1] - 1]
    return sizes if cuts else [length]


def split(total: int, parts: int) -> list[int]:
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def official_counts(means: list[torch.Tensor], per_frame: int, tokens: int) -> tuple[list[int], list[int]]:
    """The official per-frame (salient, context) counts of one segment whose frames have unit means ``means``."""
    length = len(means)
    retain = per_frame * length
    context = max(int(retain * SHARE), 1)
    salient = retain - context
    if length == 1:
        return [salient], [context]
    similar = [float(means[i] @ means[i + 1]) for i in range(length - 1)]
    cuts = [i for i in range(length - 1) if similar[i] < IGNORE]
    inner = runs(cuts, length) if cuts else [length]
    salient_parts = split(salient, len(inner))
    temporal = split(context, (len(inner) + STRIDE - 1) // STRIDE)
    anchors = [min(temporal[i // STRIDE], tokens // 2) if i % STRIDE == 0 else 0 for i in range(len(inner))]
    anchors.reverse()
    salients, contexts = [], []
    for size, kept_salient, kept_context in zip(inner, salient_parts, anchors):
        salients += [0] * (size - 1)
        contexts += [0] * (size - 1)
        if kept_context == 0:
            salients.append(min(kept_salient, tokens))
            contexts.append(0)
        else:
            contexts.append(min(kept_context, tokens // 2))
            salients.append(min(kept_salient, tokens - contexts[-1]))
    return salients, contexts


def official_peaks(vectors: list[torch.Tensor], count: int, noise: list[float]) -> list[int]:
    """Density peaks, token by token: density over the 4 nearest (itself included), distance to a denser token."""
    n, width = len(vectors), vectors[0].numel()
    distance = [[math.sqrt(float((a - b) @ (a - b))) / math.sqrt(width) for b in vectors] for a in vectors]
    density = [math.exp(-sum(d * d for d in sorted(row)[:4]) / 4) + noise[i] for i, row in enumerate(distance)]
    largest = max(max(row) for row in distance)
    score = []
    for i in range(n):
        denser = [distance[i][j] for j in range(n) if density[j] > density[i]]
        score.append((min(denser) if denser else largest) * density[i])
    return sorted(sorted(range(n), key=lambda i: (-score[i], i))[:count])


def official_merge(x, salient: list[int], targets: list[int]) -> list[tuple[int, torch.Tensor, list[int]]]:
    """DTM of one frame's context targets over the segment's rows ``x``."""
    others = [i for i in range(len(x)) if i not in set(salient) | set(targets)]
    members = {t: [] for t in targets}
    for i in others:
        similar = [float(unit(x[i]) @ unit(x[t])) for t in targets]
        members[targets[similar.index(max(similar))]].append(i)
    merged = []
    for t in targets:
        weight = max(1 / (len(members[t]) + 1), BETA)
        mean = sum((x[i] for i in members[t]), torch.zeros_like(x[t])) / max(len(members[t]), 1)
        merged.append((t, weight * x[t] + (1 - weight) * mean, sorted([t, *members[t]])))
    return merged


def official_segment(x, attention, counts, tokens, noise) -> list[tuple[int, torch.Tensor, list[int]]]:
    """One segment's output (segment row, feature, sources), salient tokens first."""
    salient, contexts = [], []
    for frame, (kept, context) in enumerate(zip(*counts)):
        base = frame * tokens
        order = sorted(range(tokens), key=lambda j: (-float(attention[base + j]), j))
        salient += [base + j for j in order[:kept]]
        if context:
            rest = [j for j in range(tokens) if j not in set(order[:kept])]
            draws = (torch.rand(len(rest), generator=noise) * 1e-6).tolist() if noise else [0.0] * len(rest)
            peaks = official_peaks([x[base + j] for j in rest], context, draws)
            contexts.append([base + rest[p] for p in peaks])
    output = [(i, x[i], [i]) for i in salient]
    for targets in contexts:
        output += official_merge(x, salient, targets)
    return output


def rederived(signals: InputSignals, budget: int, noise: torch.Generator | None = None):
    """The official forward on ``signals`` at retention budget / N: (index, feature, sources) in clip order."""
    steps, rows, cols = signals.video_grid
    tokens = rows * cols
    x = list(signals.features.double())
    means = [unit(sum(x[t * tokens : (t + 1) * tokens]) / tokens) for t in range(steps)]
    similar = [float(means[t] @ means[t + 1]) for t in range(steps - 1)]
    lowest = sorted(range(steps - 1), key=lambda t: (similar[t], t))[: C - 1]
    cuts = sorted(set(lowest) | {t for t in range(steps - 1) if similar[t] < TAU})
    output, start = [], 0
    for length in runs(cuts, steps):
        counts = official_counts(means[start : start + length], budget // steps, tokens)
        rows_of = slice(start * tokens, (start + length) * tokens)
        segment = official_segment(x[rows_of], signals.step_attention.double()[rows_of], counts, tokens, noise)
        output += [(start * tokens + i, v, [start * tokens + s for s in group]) for i, v, group in segment]
        start += length
    return sorted(output, key=lambda entry: entry[0])


def assert_same_output(selection, expected) -> None:
    assert selection.kept.tolist() == [index for index, _, _ in expected]
    assert [sorted(group.tolist()) for group in selection.sources] == [group for _, _, group in expected]
    reference = torch.stack([vector for _, vector, _ in expected]).float()
    torch.testing.assert_close(selection.llm_tokens, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("grid", GRIDS)
@pytest.mark.parametrize("fraction", [0.1, 0.25, 0.4])
def test_fastvid_equals_the_rederived_forward(seed, grid, fraction):
    steps, rows, cols, width = grid
    signals = clip_signals((steps, rows, cols), width, seed)
    budget = max(steps, round(fraction * signals.num_tokens))
    selection = get_selector("fastvid", density_noise=0.0).select(signals, budget)
    expected = rederived(signals, budget)
    assert_same_output(selection, expected)
    assert selection.num_output_tokens <= budget


def test_the_density_noise_is_drawn_from_the_runs_generator():
    signals = clip_signals((10, 6, 8), 64, 7)
    selection = get_selector("fastvid").select(signals, 96, torch.Generator().manual_seed(3))
    assert_same_output(selection, rederived(signals, 96, torch.Generator().manual_seed(3)))


def test_without_merging_the_context_tokens_keep_their_own_features():
    signals = clip_signals((10, 6, 8), 64, 1)
    merged = get_selector("fastvid", density_noise=0.0).select(signals, 96)
    plain = get_selector("fastvid", density_noise=0.0, merge=False).select(signals, 96)
    assert plain.sources is None and torch.equal(plain.kept, merged.kept)


def test_keep_all_and_a_budget_below_the_steps():
    signals = clip_signals((9, 4, 5), 32, 2)
    n = signals.num_tokens
    assert get_selector("fastvid").select(signals, n).kept.tolist() == list(range(n))
    low = get_selector("fastvid").select(signals, 5).kept.tolist()
    assert low == sorted(sorted(range(n), key=lambda i: (-float(signals.step_attention[i]), i))[:5])


def test_short_clips_and_small_frames_run():
    """Fewer steps than DySeg's c and frames of fewer than 4 candidates (where the official code raises)."""
    for grid in ((3, 2, 2), (1, 3, 3), (5, 1, 3)):
        signals = clip_signals(grid, 16, 0)
        selection = get_selector("fastvid").select(signals, max(grid[0], signals.num_tokens // 2))
        assert 1 <= selection.num_output_tokens <= signals.num_tokens // 2 or grid[0] > signals.num_tokens // 2


def test_a_still_image_or_a_clip_without_attention_is_refused():
    signals = clip_signals((9, 4, 5), 32, 2)
    for missing in ("video_grid", "step_attention"):
        fields = {"video_grid": signals.video_grid, "step_attention": signals.step_attention, missing: None}
        with pytest.raises(ValueError, match=missing):
            get_selector("fastvid").select(InputSignals(grid=signals.grid, features=signals.features, **fields), 20)


@pytest.mark.parametrize("seed, grid", [(0, GRIDS[0]), (1, GRIDS[1]), (2, (3, 2, 2)), (3, (5, 1, 3))])
@pytest.mark.parametrize("merge", [True, False])
def test_the_flops_equal_the_counted_flops_of_select(seed, grid, merge):
    """``flops`` on the sizes the selection reports equals ``FlopCounterMode`` around ``select`` (each frame's
    density Gram, DTM's similarities and sums), at budgets below the steps, between and at every token."""
    signals = clip_signals(grid[:3], grid[3] if len(grid) > 3 else 16, seed)
    selector = get_selector("fastvid", merge=merge)
    n = signals.num_tokens
    counts = []
    for budget in sorted({1, grid[0], n // 4, n // 2, n}):
        with FlopCounterMode(display=False) as counter:
            selection = selector.select(signals, budget, torch.Generator().manual_seed(seed))
        counts.append(counter.get_total_flops())
        work = SelectorWork(feature_width=signals.features.shape[1], sizes=selection.work_sizes)
        assert type(selector).flops(work) == counts[-1], budget
    assert type(selector).flops_exact and max(counts) > 0 and counts[0] == counts[-1] == 0  # below T, keep-all: none
