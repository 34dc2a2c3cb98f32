"""Per-frame runs of image selectors on a video clip (``Selector.per_frame``): a project convention, not an
official one (no official per-frame code of these image selectors exists).

A clip's N = T x h x w merged tokens are time-major (token ``t*h*w + r*w + c``, ``InputSignals.video_grid`` =
(T, h, w)); each temporal step (two sampled frames on Qwen2.5-VL) is one frame here. The clip's budget is split
evenly over its T steps as ``budget_scope=crop`` splits an image's over its crops (:func:`crop_budgets`: ``budget //
T`` each, the first ``budget % T`` steps one more, capped at a step's h x w tokens), and the selector runs on each
step's tokens alone, laid on the step's (h, w) grid (:func:`~prune_audit.pruners.crop_scope.select_per_crop`); the
kept indices are clip indices, ascending. Its own FLOPs are its formula on each step at the step's share, summed
(:func:`frame_flops`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from prune_audit.pruners.arithmetic import SelectorWork
from prune_audit.pruners.base import InputSelector, Selection, Selector, validate_budget
from prune_audit.pruners.crop_scope import crop_budgets, select_per_crop
from prune_audit.pruners.signals import InputSignals


def runs_per_frame(selector: Selector | type[Selector] | None, video_grid: tuple[int, int, int] | None) -> bool:
    """Whether ``selector`` runs on each temporal step alone: an input selector declaring ``per_frame``, on a clip
    (``video_grid`` given; None on a still image)."""
    return video_grid is not None and selector is not None and selector.stage == "input" and selector.per_frame


def frame_parts(video_grid: tuple[int, int, int]) -> list[tuple[Tensor, tuple[int, int]]]:
    """Per temporal step of a (T, h, w) clip: its (h * w,) ascending clip token indices and its (h, w) grid."""
    steps, rows, cols = video_grid
    size = rows * cols
    return [(torch.arange(step * size, (step + 1) * size), (rows, cols)) for step in range(steps)]


def select_per_frame(
    selector: InputSelector, signals: InputSignals, budget: int, generator: torch.Generator | None = None
) -> Selection:
    """``selector`` on each temporal step's tokens alone at its even share of ``budget`` (module docstring).

    Args:
        signals: the clip's signals (N = T x h x w tokens, ``video_grid`` set).
        budget: visual tokens to keep over the clip.

    Returns:
        The union of the steps' kept tokens, ascending, as clip indices.

    Raises:
        ValueError: a budget that is not a positive integer, no ``video_grid``, one that does not hold the clip's
            tokens, or a merging ``selector``.
    """
    budget = validate_budget(budget)
    if signals.video_grid is None:
        raise ValueError("a per-frame run needs the clip's video_grid (T, h, w)")
    steps, rows, cols = signals.video_grid
    if steps * rows * cols != signals.num_tokens:
        raise ValueError(f"video grid {steps}x{rows}x{cols} does not hold the clip's {signals.num_tokens} tokens")
    if selector.merges:
        raise ValueError("a per-frame run keeps plain tokens of each step, and this selector merges tokens")
    return select_per_crop(selector, signals, frame_parts(signals.video_grid), budget, generator)


def frame_flops(selector: Selector | type[Selector], work: SelectorWork, video_grid: tuple[int, int, int]) -> int:
    """The selector's own FLOPs on a clip run per frame: its formula on each step's h x w tokens (``grid`` (h, w))
    at the step's share of ``work.kept``, summed over the steps given a share (a step with none runs nothing)."""
    steps, rows, cols = video_grid
    shares = crop_budgets(work.kept, [rows * cols] * steps)
    step = dataclasses.replace(work, tokens=rows * cols, grid=(rows, cols))
    return sum(selector.flops(dataclasses.replace(step, kept=share)) for share in shares if share > 0)


__all__ = ["frame_flops", "frame_parts", "runs_per_frame", "select_per_frame"]
