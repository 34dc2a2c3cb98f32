"""The control selectors (``pruners/controls.py``): seeded random and spatially uniform subsampling."""

from __future__ import annotations

import torch

from prune_audit.pruners import get_selector
from prune_audit.pruners.signals import InputSignals


def grid_signals(rows: int, cols: int) -> InputSignals:
    return InputSignals(
        grid=(rows, cols), features=torch.randn(rows * cols, 8, generator=torch.Generator().manual_seed(0))
    )


def test_random_keeps_the_budget_in_order_and_repeats_under_the_same_seed():
    selector, signals = get_selector("random"), grid_signals(6, 6)
    first = selector.select(signals, 9, torch.Generator().manual_seed(3)).kept
    again = selector.select(signals, 9, torch.Generator().manual_seed(3)).kept
    other = selector.select(signals, 9, torch.Generator().manual_seed(4)).kept
    assert first.tolist() == again.tolist() == sorted(set(first.tolist())) and len(first) == 9
    assert first.tolist() != other.tolist()


def test_random_keeps_every_token_about_equally_often():
    selector, signals = get_selector("random"), grid_signals(4, 4)
    kept = torch.zeros(16)
    for seed in range(400):
        kept[selector.select(signals, 4, torch.Generator().manual_seed(seed)).kept] += 1
    assert kept.sum() == 1600 and kept.min() > 60 and kept.max() < 140  # 100 each in expectation


def test_uniform_takes_the_cell_nearest_each_lattice_point():
    selector = get_selector("uniform")
    # a 2 x 2 lattice at (1, 1), (1, 3), (3, 1), (3, 3) of a 4 x 4 grid: each point's nearest cells tie, the first wins
    assert selector.select(grid_signals(4, 4), 4).kept.tolist() == [0, 2, 8, 10]
    assert selector.select(grid_signals(4, 4), 16).kept.tolist() == list(range(16))


def test_uniform_spreads_over_the_whole_grid_and_needs_no_generator():
    selector = get_selector("uniform")
    kept = selector.select(grid_signals(24, 24), 64).kept
    again = selector.select(grid_signals(24, 24), 64).kept
    rows, cols = kept // 24, kept % 24
    assert kept.tolist() == again.tolist() and len(set(kept.tolist())) == 64
    assert rows.min() <= 2 and rows.max() >= 21 and cols.min() <= 2 and cols.max() >= 21
    per_quadrant = torch.bincount((rows >= 12).long() * 2 + (cols >= 12).long(), minlength=4)
    assert per_quadrant.tolist() == [16, 16, 16, 16]
