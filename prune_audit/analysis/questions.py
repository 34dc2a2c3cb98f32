"""The per-question arrays every analysis reads (one row per question of a run, any task)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from prune_audit.errors import PruneAuditError


@dataclass(frozen=True)
class QuestionTable:
    """Columns of a run's records needed by the analyses, as aligned numpy arrays of length n.

    Attributes:
        split: (n,) str, POPE split of each question.
        question_id: (n,) int64; (split, question_id) is the row key.
        image_id: (n,) int64, the exchangeable unit for bootstrap and conformal splits.
        label_yes: (n,) bool, ground truth is "yes".
        answer_yes: (n,) bool, the model answered "yes".
        correct: (n,) bool, answer == label.
        confidence: (n,) float64, top-label two-way confidence max(p_yes_2way, 1 - p_yes_2way).
        p_yes: (n,) float64, two-way p(yes) = sigmoid(logit_diff).
        logit_diff: (n,) float64, log p_yes - log p_no.
        retention: (n,) float64, object-area retention of the kept tokens (NaN when undefined).
        lost: (n,) float64, 1.0 when the object lost every token, 0.0 when not, NaN when unknown.
        diluted: (n,) float64, 1.0 when the object reached the model only in merged tokens' cells,
            0.0 when not, NaN when unknown.
        cost_tokens: (n,) float64, prefill cost: the sequence length averaged over decoder layers.
        flops: (n,) float64, analytic prefill FLOPs (docs/compute.md).
        latency_ms: (n,) float64, measured prefill wall time per question.
        answer: (n,) str, the answer as compared across runs (a cascade's disagreement with the dense run);
            None: compare ``answer_yes``.
        top_label: the task has no yes/no answer (``Task.binary_view``): the yes/no event is "the answer is
            correct" at probability ``confidence`` (``label_yes`` = correct, ``answer_yes`` all true, ``p_yes`` =
            confidence, ``logit_diff`` its logit), so confidence may lie below 0.5 and POPE's answer scores do not
            apply.
        generated: the task generates its answers (``Task.generates``: free text, GQA's short answers, captions),
            so two runs' answers may also be compared by their words (``metrics.loyalty_overlap``).
    """

    split: np.ndarray
    question_id: np.ndarray
    image_id: np.ndarray
    label_yes: np.ndarray
    answer_yes: np.ndarray
    correct: np.ndarray
    confidence: np.ndarray
    p_yes: np.ndarray
    logit_diff: np.ndarray
    retention: np.ndarray
    lost: np.ndarray
    diluted: np.ndarray
    cost_tokens: np.ndarray
    flops: np.ndarray
    latency_ms: np.ndarray
    answer: np.ndarray | None = None
    top_label: bool = False
    generated: bool = False

    def __post_init__(self) -> None:
        lengths = {name: len(value) for name, value in self.columns().items()}
        if len(set(lengths.values())) != 1:
            raise PruneAuditError(f"question columns have different lengths: {lengths}")

    def __len__(self) -> int:
        return len(self.question_id)

    def columns(self) -> dict[str, np.ndarray]:
        """The per-question arrays (``answer`` only when present; ``top_label`` and ``generated`` are not columns)."""
        return {
            field.name: getattr(self, field.name)
            for field in dataclasses.fields(self)
            if isinstance(getattr(self, field.name), np.ndarray)
        }

    def take(self, rows: np.ndarray) -> QuestionTable:
        """The rows selected by a boolean mask or an index array, in that order."""
        return QuestionTable(
            **{name: value[rows] for name, value in self.columns().items()},
            top_label=self.top_label,
            generated=self.generated,
        )

    def keys(self) -> list[tuple[str, int]]:
        return list(zip(self.split.tolist(), self.question_id.tolist()))

    def aligned_to(self, other: QuestionTable) -> QuestionTable:
        """This table's rows reordered to ``other``'s (split, question_id) order.

        Raises PruneAuditError naming how many keys are unmatched when the key sets differ.
        """
        position = {key: index for index, key in enumerate(self.keys())}
        wanted = other.keys()
        missing = sum(key not in position for key in wanted)
        extra = len(self) - (len(wanted) - missing)
        if missing or extra:
            raise PruneAuditError(
                f"the runs do not hold the same questions ({missing} missing, {extra} extra by (split, question_id)); "
                "paired comparisons need runs over the same question files"
            )
        return self.take(np.array([position[key] for key in wanted], dtype=np.int64))

    def image_index(self, image_ids: np.ndarray) -> np.ndarray:
        """(n,) position of each row's image in the sorted array ``image_ids``."""
        index = np.searchsorted(image_ids, self.image_id)
        if np.any(index >= len(image_ids)) or np.any(image_ids[np.minimum(index, len(image_ids) - 1)] != self.image_id):
            raise PruneAuditError("an image id is missing from the image index")
        return index
