"""Per-frame runs of image selectors on a clip (``pruners.frame_scope``): each temporal step selected alone at an even
share of the clip's budget equals the selector run by hand on that step's slice of the signals; shares not divisible
by the steps, a share above a step's tokens, keep-all, steps without a share; the per-step FLOPs; the selectors that
declare it."""

from __future__ import annotations

import pytest
import torch

from prune_audit.flop_convention import matmul
from prune_audit.pruners import InputSignals, get_selector, list_selectors, selector_class
from prune_audit.pruners.arithmetic import SelectorWork
from prune_audit.pruners.frame_scope import frame_flops, frame_parts, runs_per_frame, select_per_frame
from prune_audit.pruners.signals import VIDEO_GRID

PER_FRAME = ["coverage", "divprune", "gprune", "random", "uniform"]
WIDTH = 64


def clip_signals(steps: int, rows: int, cols: int, seed: int) -> InputSignals:
    """Random (T * h * w, D) features and (T * h * w,) demand of a time-major clip."""
    generator = torch.Generator().manual_seed(seed)
    tokens = steps * rows * cols
    return InputSignals(
        grid=(steps * rows, cols),
        features=torch.randn(tokens, WIDTH, generator=generator),
        demand=torch.rand(tokens, generator=generator),
        video_grid=(steps, rows, cols),
    )


def by_hand(name: str, signals: InputSignals, budget: int, seed: int) -> torch.Tensor:
    """The selector on each step's slice alone (its own signals on an (h, w) grid) at ``budget // T``, the first
    ``budget % T`` steps one more, capped at the step's tokens; kept indices offset to the clip's."""
    steps, rows, cols = signals.video_grid
    size, selector, generator = rows * cols, get_selector(name), torch.Generator().manual_seed(seed)
    kept = []
    for step in range(steps):
        share = min(size, budget // steps + (step < budget % steps))
        if share == 0:
            continue
        window = slice(step * size, (step + 1) * size)
        alone = InputSignals(grid=(rows, cols), features=signals.features[window], demand=signals.demand[window])
        kept.append(step * size + selector.select(alone, share, generator).kept)
    return torch.cat(kept).sort().values


CASES = [  # (T, h, w, budget): even, not divisible by T, fewer than T, one short of all, above all
    (4, 6, 8, 48),
    (4, 6, 8, 50),
    (5, 7, 6, 37),
    (6, 6, 10, 4),
    (3, 6, 6, 107),
    (3, 6, 6, 109),
]


@pytest.mark.parametrize("name", PER_FRAME)
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("steps", "rows", "cols", "budget"), CASES)
def test_per_frame_kept_sets_equal_each_step_selected_alone(name, seed, steps, rows, cols, budget):
    signals = clip_signals(steps, rows, cols, seed)
    selection = select_per_frame(get_selector(name), signals, budget, torch.Generator().manual_seed(seed))
    assert selection.sources is None
    assert torch.equal(selection.kept, by_hand(name, signals, budget, seed))
    assert selection.kept.numel() == min(budget, steps * rows * cols)  # equal steps: nothing lost to a cap


def test_shares_follow_crop_budgets_a_capped_share_is_not_moved_and_keep_all_is_all():
    signals = clip_signals(3, 6, 6, 0)
    kept = select_per_frame(get_selector("divprune"), signals, 10).kept
    assert [int(((kept >= 36 * t) & (kept < 36 * (t + 1))).sum()) for t in range(3)] == [4, 3, 3]
    for budget in (108, 109, 500):  # the first step's share above its 36 tokens: capped, every token kept
        assert torch.equal(select_per_frame(get_selector("divprune"), signals, budget).kept, torch.arange(108))
    few = select_per_frame(get_selector("uniform"), signals, 2).kept  # steps without a share keep nothing
    assert few.numel() == 2 and bool((few < 72).all()) and int((few < 36).sum()) == 1


def test_a_step_is_its_own_grid_time_major():
    assert [(tokens.tolist(), grid) for tokens, grid in frame_parts((2, 1, 3))] == [
        ([0, 1, 2], (1, 3)),
        ([3, 4, 5], (1, 3)),
    ]
    # uniform lays its lattice on each step's 6 x 6 grid: the same cells in every step at an even share
    kept = select_per_frame(get_selector("uniform"), clip_signals(3, 6, 6, 0), 12).kept
    cells = [set((kept[(kept >= 36 * t) & (kept < 36 * (t + 1))] - 36 * t).tolist()) for t in range(3)]
    assert cells[0] == cells[1] == cells[2] and len(cells[0]) == 4


def test_a_per_frame_run_refuses_a_merging_selector_and_a_still_image_in_one_line():
    signals = clip_signals(2, 4, 4, 0)
    with pytest.raises(ValueError, match="merges tokens"):
        select_per_frame(get_selector("tome"), signals, 8)
    with pytest.raises(ValueError, match="needs the clip's video_grid"):
        select_per_frame(get_selector("divprune"), InputSignals(grid=(4, 4), features=signals.features[:16]), 8)
    signals.video_grid = (3, 4, 4)
    with pytest.raises(ValueError, match="does not hold the clip's 32 tokens"):
        select_per_frame(get_selector("divprune"), signals, 8)


def test_frame_flops_sum_the_formula_over_the_steps_given_a_share():
    work = SelectorWork(tokens=4 * 36, kept=50, feature_width=WIDTH, grid=(24, 6))
    divprune, gprune = selector_class("divprune"), selector_class("gprune")
    assert frame_flops(divprune, work, (4, 6, 6)) == 4 * matmul(36, WIDTH, 36)  # one 36 x 36 cosine per step
    assert frame_flops(divprune, work, (4, 6, 6)) < divprune.flops(work)  # the whole clip's 144 x 144 is not run
    iterations = gprune().iterations
    per_step = matmul(36, WIDTH, 36) + iterations * matmul(1, 36, 36)
    assert frame_flops(gprune, work, (4, 6, 6)) == 4 * per_step
    few = SelectorWork(tokens=4 * 36, kept=3, feature_width=WIDTH, grid=(24, 6))
    assert frame_flops(divprune, few, (4, 6, 6)) == 3 * matmul(36, WIDTH, 36)  # a step with no share runs nothing
    everything = SelectorWork(tokens=4 * 36, kept=500, feature_width=WIDTH, grid=(24, 6))
    assert frame_flops(gprune, everything, (4, 6, 6)) == 0  # every step kept whole: no propagation


def test_the_selectors_that_run_per_frame_declare_it_and_are_plain_input_selectors():
    declared = [name for name in list_selectors() if selector_class(name).per_frame]
    assert declared == PER_FRAME
    for name in declared:
        cls = selector_class(name)
        assert "per_frame" in vars(cls)  # on the class itself, in its own module
        assert cls.stage == "input" and not cls.merges and VIDEO_GRID not in cls.requires and not cls.clip_method
        assert runs_per_frame(cls, (2, 3, 3)) and not runs_per_frame(cls, None)
    assert not runs_per_frame(selector_class("fastv"), (2, 3, 3)) and not runs_per_frame(None, (2, 3, 3))
