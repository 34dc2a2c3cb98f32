"""Hard subsets of a study: per budget, the questions a baseline run answers wrongly (``study --subset difficult``).

VTC-Bench (Liao et al. 2025, "Are We Using the Right Benchmark: An Evaluation Framework for Visual Token
Compression Methods", arXiv 2510.07143; Chenfei-Liao/VTC-Bench) finds that plain image downsampling beats many
token-compression methods on the usual benchmarks, and uses it as a filter: the questions downsampling answers
correctly at a compression ratio are easy at that ratio, those it answers wrongly are difficult, and methods are
compared on the difficult ones. ``study --subset difficult`` does the same per budget: every run of a budget, and
the dense reference, restricted to the questions that the baseline selector's run of that budget (``downsample``
by default, ``--subset-baseline`` names another) answers wrongly. The baseline's own accuracy there is 0 by
construction.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from prune_audit.analysis.runs import Run
from prune_audit.errors import PruneAuditError

DIFFICULT = "difficult"
SUBSETS: tuple[str, ...] = (DIFFICULT,)
"""The values of ``study --subset``."""


@dataclass(frozen=True)
class Subset:
    """A hard subset of a study: its name (``SUBSETS``) and the selector whose wrong answers define it."""

    name: str
    baseline: str


@dataclass(frozen=True)
class BudgetSubset:
    """The difficult questions of one budget: the baseline run and the keys (split, question_id) of the questions
    it answers wrongly, which pick the same questions out of every run of the study."""

    budget: str
    baseline: Run
    keys: frozenset[tuple[str, int]]

    def mask(self, run: Run) -> np.ndarray:
        """(n,) bool: which of ``run``'s questions are difficult."""
        return np.array([key in self.keys for key in run.questions.keys()], dtype=bool)


def parse_subset(subset: str | None, baseline: str | None, default_baseline: str) -> Subset | None:
    """``--subset`` and ``--subset-baseline`` checked together: None without ``--subset``."""
    if subset is None:
        if baseline is not None:
            raise PruneAuditError("--subset-baseline names the baseline of --subset difficult; add --subset difficult")
        return None
    if subset not in SUBSETS:
        raise PruneAuditError(f"--subset must be one of {', '.join(SUBSETS)}, got {subset!r}")
    return Subset(subset, baseline or default_baseline)


def check_baseline_in_grid(subset: Subset | None, selectors: Sequence[str]) -> None:
    """Refuse a grid without the subset's baseline selector, before any run is started."""
    if subset is not None and subset.baseline not in selectors:
        raise PruneAuditError(
            f"--subset {subset.name} keeps the questions the {subset.baseline} runs answer wrongly, and --selectors "
            f"has no {subset.baseline}: add {subset.baseline} to --selectors, or name one of "
            f"{', '.join(selectors)} with --subset-baseline"
        )


def budget_subsets(runs: Sequence[Run], subset: Subset) -> list[BudgetSubset]:
    """The difficult questions of every budget among the pruned ``runs``, in their budget order; a budget without a
    baseline run is refused (nothing is written yet)."""
    budgets = list(dict.fromkeys(str(run.budget) for run in runs))
    baselines = {str(run.budget): run for run in runs if run.selector == subset.baseline}
    missing = [budget for budget in budgets if budget not in baselines]
    if missing:
        raise PruneAuditError(
            f"--subset {subset.name} needs a {subset.baseline} run at budget {missing[0]} (its wrong answers make "
            f"the subset): add {subset.baseline} to --selectors, or name a selector of the study with "
            "--subset-baseline"
        )
    subsets = []
    for budget in budgets:
        baseline = baselines[budget]
        wrong = ~baseline.questions.correct
        keys = frozenset(key for key, is_wrong in zip(baseline.questions.keys(), wrong.tolist()) if is_wrong)
        subsets.append(BudgetSubset(budget, baseline, keys))
    return subsets


__all__ = ["DIFFICULT", "SUBSETS", "BudgetSubset", "Subset", "budget_subsets", "check_baseline_in_grid", "parse_subset"]
