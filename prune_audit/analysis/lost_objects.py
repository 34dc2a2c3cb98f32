"""Lost objects vs the unpruned model: does accuracy fall while confidence stays? (issue 16)

The calibration study's mechanism on one pruned run and its unpruned reference over the
same questions: on the yes-questions whose object lost every visual token at the first
pruning stage (the records' ``lost`` column), accuracy falls but confidence does not.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from prune_audit.analysis.metrics import auroc, expected_calibration_error
from prune_audit.analysis.questions import QuestionTable


@dataclass(frozen=True)
class LostObjectSummary:
    """One pruned run against the unpruned model on the same questions.

    Attributes:
        questions: questions in the run.
        accuracy, mean_confidence, ece, auroc: over all questions (two-way top-label confidence,
            ECE with 15 equal-width bins).
        yes_with_mask: yes-questions whose object has a known mask (the ``lost`` denominator).
        lost: yes-questions whose object lost every token.
        lost_share: ``lost / yes_with_mask`` (NaN when no mask is known).
        lost_accuracy, lost_confidence: the pruned run on the lost questions (NaN when none).
        dense_lost_accuracy, dense_lost_confidence: the unpruned model on the same questions.
        diluted, diluted_share, diluted_accuracy, diluted_confidence, dense_diluted_accuracy,
            dense_diluted_confidence: the same for the yes-questions whose object reached the model
            only in merged tokens' cells (the records' ``diluted``; none without merging).
    """

    questions: int
    accuracy: float
    mean_confidence: float
    ece: float
    auroc: float
    yes_with_mask: int
    lost: int
    lost_share: float
    lost_accuracy: float
    lost_confidence: float
    dense_lost_accuracy: float
    dense_lost_confidence: float
    diluted: int
    diluted_share: float
    diluted_accuracy: float
    diluted_confidence: float
    dense_diluted_accuracy: float
    dense_diluted_confidence: float

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def _mean(values: np.ndarray) -> float:
    return float(values.mean()) if values.size else float("nan")


def lost_object_summary(pruned: QuestionTable, dense: QuestionTable) -> LostObjectSummary:
    """Accuracy and confidence of ``pruned`` overall and on its lost objects, vs ``dense``.

    Raises PruneAuditError when the two runs do not hold the same questions.
    """
    dense = dense.aligned_to(pruned)
    known = pruned.label_yes & ~np.isnan(pruned.lost)
    return LostObjectSummary(
        questions=len(pruned),
        accuracy=_mean(pruned.correct),
        mean_confidence=_mean(pruned.confidence),
        ece=float(expected_calibration_error(pruned.confidence, pruned.correct)),
        auroc=float(auroc(pruned.confidence, pruned.correct)),
        yes_with_mask=int(known.sum()),
        **_group("lost", known & (pruned.lost == 1.0), known, pruned, dense),
        **_group("diluted", known & (pruned.diluted == 1.0), known, pruned, dense),
    )


def _group(name: str, members: np.ndarray, known: np.ndarray, pruned: QuestionTable, dense: QuestionTable) -> dict:
    """The ``name`` fields of :class:`LostObjectSummary` for the (n,) bool ``members`` among ``known``."""
    return {
        name: int(members.sum()),
        f"{name}_share": float(members.sum() / known.sum()) if known.any() else float("nan"),
        f"{name}_accuracy": _mean(pruned.correct[members]),
        f"{name}_confidence": _mean(pruned.confidence[members]),
        f"dense_{name}_accuracy": _mean(dense.correct[members]),
        f"dense_{name}_confidence": _mean(dense.confidence[members]),
    }


__all__ = ["LostObjectSummary", "lost_object_summary"]
