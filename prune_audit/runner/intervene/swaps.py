"""Intervention swaps (pure): which kept cells leave and which enter, per mode and condition.

- restore (questions whose object lost every token): the same ``m`` kept cells, drawn
  at random, are replaced by the ``m`` object cells holding the most object area
  (ties to the lower index) in the intervention and by ``m`` random cells that are
  neither kept nor object cells in the control; ``m = min(max_cells, object cells,
  kept cells, free cells)``.
- remove (questions whose object kept 1..32 cells): the same ``k`` random cells that
  are neither kept nor object cells are added; the intervention removes the ``k``
  kept object cells, the control ``k`` random kept non-object cells.

"Kept" is the kept set of the stage chosen with ``--stage`` (default the first: the
earliest point at which tokens leave the model); eligibility (lost, object tokens kept)
is read at that stage too. In-LLM stage sets are nested (S_0 ⊇ S_1 ⊇ ...); a swap
(removed R ⊆ S_c, added A outside S_c, c the chosen stage) is applied to every stage:

- up to c: S_i' = (S_i \\ R_i) ∪ A, where R_i is the first |A \\ S_i| cells of R in the
  swap's (random) order;
- after c: S_i' = (S_i \\ R) ∪ A_i, where A_i is the first |S_i ∩ R| cells of A (ascending).

Each stage keeps its size and every later stage stays a subset of the earlier one;
stages that were empty (a schedule ending at 0) stay empty. With c the last non-empty
stage the second rule never applies.

All draws come from one generator per question, seeded like ``prune-audit run``
(``question_seed``), so the result does not depend on the order of questions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MODES = ("restore", "remove")
REMOVE_MAX_OBJECT_CELLS = 32
"""Remove mode takes questions whose object kept 1..32 cells (the issue's range)."""


class NoSwap(Exception):
    """A question on which the requested swap is impossible; the message says why."""


@dataclass(frozen=True)
class Swap:
    """Cells taken out of and put into one kept set; ``removed`` in the order stages drop them."""

    removed: tuple[int, ...]
    added: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.added)

    def object_area_changed(self, area_per_token: np.ndarray) -> int:
        """Object pixels gained (positive) or lost (negative) by the swap."""
        return int(area_per_token[list(self.added)].sum() - area_per_token[list(self.removed)].sum())


@dataclass(frozen=True)
class SwapPair:
    intervention: Swap
    control: Swap

    def by_condition(self) -> dict[str, Swap]:
        return {"intervention": self.intervention, "control": self.control}


# ----- swaps (pure) --------------------------------------------------------------------


def _cells(kept: Sequence[int], area_per_token: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(kept, object cells, free cells): ascending int64; free = neither kept nor object."""
    kept_cells = np.unique(np.asarray(kept, dtype=np.int64))
    object_cells = np.flatnonzero(area_per_token > 0)
    free = np.setdiff1d(np.arange(len(area_per_token)), np.union1d(kept_cells, object_cells))
    return kept_cells, object_cells, free


def _draw(cells: np.ndarray, count: int, rng: np.random.Generator) -> tuple[int, ...]:
    return tuple(int(i) for i in rng.choice(cells, size=count, replace=False))


def restore_swaps(
    kept: Sequence[int], area_per_token: np.ndarray, max_cells: int, rng: np.random.Generator
) -> SwapPair:
    """Put the lost object's largest cells back in place of random kept cells.

    Args:
        kept: the kept grid indices (no object cell among them).
        area_per_token: (N,) object pixels per grid cell.
        max_cells: most cells to swap.
        rng: draws the replaced kept cells, then the control's cells.
    """
    kept_cells, object_cells, free = _cells(kept, area_per_token)
    if np.intersect1d(kept_cells, object_cells).size:
        raise NoSwap("object still holds kept cells")
    if not object_cells.size:
        raise NoSwap("object covers no grid cell")
    count = min(max_cells, object_cells.size, kept_cells.size, free.size)
    if count == 0:
        raise NoSwap("no kept cell or no free non-object cell for the control")
    removed = _draw(kept_cells, count, rng)
    by_area = object_cells[np.lexsort((object_cells, -area_per_token[object_cells]))]
    added = tuple(sorted(int(i) for i in by_area[:count]))
    control = tuple(sorted(_draw(free, count, rng)))
    return SwapPair(Swap(removed, added), Swap(removed, control))


def remove_swaps(kept: Sequence[int], area_per_token: np.ndarray, rng: np.random.Generator) -> SwapPair:
    """Take the object's kept cells out (control: as many kept non-object cells) for the same free cells.

    Args:
        kept: the kept grid indices (1..32 of them hold object pixels).
        area_per_token: (N,) object pixels per grid cell.
        rng: draws the added cells, the intervention's removal order, then the control's cells.
    """
    kept_cells, _, free = _cells(kept, area_per_token)
    on_object = area_per_token[kept_cells] > 0
    kept_object, kept_other = kept_cells[on_object], kept_cells[~on_object]
    count = kept_object.size
    if not 1 <= count <= REMOVE_MAX_OBJECT_CELLS:
        raise NoSwap(f"object holds {count} kept cells, not 1..{REMOVE_MAX_OBJECT_CELLS}")
    if kept_other.size < count:
        raise NoSwap("fewer kept non-object cells than kept object cells for the control")
    if free.size < count:
        raise NoSwap("fewer free non-object cells than kept object cells")
    added = tuple(sorted(_draw(free, count, rng)))
    removed = tuple(int(i) for i in rng.permutation(kept_object))
    control = _draw(kept_other, count, rng)
    return SwapPair(Swap(removed, added), Swap(control, added))


def swap_stages(kept_stages: Sequence[Sequence[int]], swap: Swap, stage: int | None = None) -> list[list[int]]:
    """Apply ``swap`` to nested stage sets; the result is nested with the same sizes.

    ``stage`` is the stage the swap was planned on (default: the last non-empty one): the
    removed cells must lie in it and the added cells outside it. Up to that stage, stage i
    drops the first |added \\ S_i| removed cells; after it, stage i trades its removed cells
    for as many added cells (module docstring).
    """
    removed, added = list(swap.removed), sorted(set(swap.added))
    if len(removed) != len(added):
        raise ValueError(f"a swap removes as many cells as it adds, got {len(removed)} and {len(added)}")
    if stage is None:
        stage = max((i for i, cells in enumerate(kept_stages) if cells), default=0)
    swapped = []
    for index, cells in enumerate(set(stage_cells) for stage_cells in kept_stages):
        if not cells:
            swapped.append([])
        elif index <= stage:
            if not set(removed) <= cells:
                raise ValueError("removed cells must be kept at every stage up to the chosen one")
            dropped = set(removed[: len(set(added) - cells)])
            swapped.append(sorted((cells - dropped) | set(added)))
        else:
            taken = cells & set(removed)
            swapped.append(sorted((cells - taken) | set(added[: len(taken)])))
    return swapped


def plan_swaps(
    mode: str, kept: Sequence[int], area_per_token: np.ndarray, max_cells: int, rng: np.random.Generator
) -> SwapPair:
    """The intervention and control swaps of one question under ``mode``."""
    if mode == "restore":
        return restore_swaps(kept, area_per_token, max_cells, rng)
    return remove_swaps(kept, area_per_token, rng)
