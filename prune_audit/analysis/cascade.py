"""Confidence-gated cascade: answer with the pruned model when it is confident, else escalate.

Policy with threshold t: the first pruned stage (cheapest first) whose confidence exceeds
t (strictly) answers; when none does, the dense model answers. Loss of image j: the share
of its questions answered by a pruned stage with an answer different from the dense
model's (the dense answer is the reference, so escalated questions never add loss).

Threshold by conformal risk control (Angelopoulos, Bates, Fisch, Lei & Schuster, ICLR 2024,
arXiv 2208.02814; reference code aangelopoulos/conformal-risk ``get_lhat``) with images as
the exchangeable unit and loss bound B = 1: on n calibration images,
t = the smallest t with (n / (n + 1)) * mean_j L_j(t) + 1 / (n + 1) <= epsilon,
which guarantees E[L_new(t)] <= epsilon for a new image. Candidate thresholds are 0 and
the observed confidences (the total loss only changes there); a 1e-9 slack absorbs
floating-point round-off in the sum. CRC needs non-increasing losses: a single pruned
stage gives them (raising t only escalates more), but with several stages raising t can
hand a question from a stage that agrees with the dense model to a later one that does
not, so every image's loss is replaced by its running maximum from the right,
sup_{t' >= t} L_j(t') (an upper bound, so the guarantee still holds for the actual loss).

Cost: summed over the stages a question visits (an escalated question pays every pruned
stage it passed and the dense model), relative to the dense model on every question, in one
of ``COST_UNITS``: prefill tokens (the layer-averaged sequence length, the default), analytic
FLOPs, or measured latency.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from prune_audit.analysis.questions import QuestionTable
from prune_audit.analysis.temperature import split_images
from prune_audit.errors import PruneAuditError

ROUND_OFF = 1e-9

COST_UNITS = {"tokens": "cost_tokens", "flops": "flops", "latency": "latency_ms"}
"""Cascade cost unit -> the question column that measures it (``QuestionTable``)."""
COST_LABELS = {"tokens": "prefill tokens", "flops": "prefill FLOPs", "latency": "prefill latency"}
"""Cascade cost unit -> how tables and plots name it."""


@dataclass(frozen=True)
class CascadeQuestions:
    """Questions of the pruned stages and the dense model, aligned by (split, question_id).

    Attributes:
        image_index: (n,) position of each question's image in ``image_ids``.
        image_ids: (J,) sorted distinct image ids.
        confidence: (S, n) top-label confidence of each pruned stage.
        disagree: (S, n) bool, the stage's answer differs from the dense model's.
        stage_cost: (S, n) prefill cost of each pruned stage (in the unit the table was built with).
        dense_cost: (n,) prefill cost of the dense model.
    """

    image_index: np.ndarray
    image_ids: np.ndarray
    confidence: np.ndarray
    disagree: np.ndarray
    stage_cost: np.ndarray
    dense_cost: np.ndarray

    @classmethod
    def from_tables(
        cls, stages: Sequence[QuestionTable], dense: QuestionTable, cost: str = "tokens"
    ) -> CascadeQuestions:
        """Align every stage and the dense run to the first stage's question order; cost in unit ``cost``."""
        if cost not in COST_UNITS:
            raise PruneAuditError(f"unknown cascade cost {cost!r}; choose {', '.join(COST_UNITS)}")
        column = COST_UNITS[cost]
        if not stages:
            raise PruneAuditError("a cascade needs at least one pruned run")
        first = stages[0]
        aligned = [first, *(stage.aligned_to(first) for stage in stages[1:])]
        dense = dense.aligned_to(first)
        image_ids = np.unique(first.image_id)
        return cls(
            image_index=first.image_index(image_ids),
            image_ids=image_ids,
            confidence=np.stack([stage.confidence for stage in aligned]),
            disagree=np.stack([_disagree(stage, dense) for stage in aligned]),
            stage_cost=np.stack([getattr(stage, column) for stage in aligned]).astype(np.float64),
            dense_cost=getattr(dense, column).astype(np.float64),
        )

    @property
    def stages(self) -> int:
        return len(self.confidence)


def _disagree(stage: QuestionTable, dense: QuestionTable) -> np.ndarray:
    """(n,) the pruned stage answers otherwise than the dense run: the answers compared as recorded
    (``QuestionTable.answer``: POPE's yes/no, a short answer after its task's normalisation), else yes/no."""
    if stage.answer is not None and dense.answer is not None:
        return stage.answer != dense.answer
    return stage.answer_yes != dense.answer_yes


def answering_stage(confidence: np.ndarray, threshold: float | np.ndarray) -> np.ndarray:
    """Index of the stage that answers each question: the first with confidence > threshold, S for dense.

    Args:
        confidence: (S, n) stage confidences.
        threshold: a scalar, or (K,) thresholds giving a (K, n) result.
    """
    thresholds = np.atleast_1d(np.asarray(threshold, dtype=np.float64))
    above = confidence[None, :, :] > thresholds[:, None, None]
    stage = np.where(above.any(axis=1), above.argmax(axis=1), len(confidence))
    return stage[0] if np.ndim(threshold) == 0 else stage


def question_loss(disagree: np.ndarray, stage: np.ndarray) -> np.ndarray:
    """(..., n) bool: the answering stage is a pruned one that disagrees with the dense model."""
    pruned = stage < len(disagree)
    columns = np.broadcast_to(np.arange(disagree.shape[1]), stage.shape)
    return pruned & disagree[np.minimum(stage, len(disagree) - 1), columns]


@dataclass(frozen=True)
class LossJumps:
    """Every image's monotone loss curve as jumps, sorted by threshold.

    The loss of image ``image[k]`` changes by ``change[k]`` at ``threshold[k]`` (the first
    jump of an image, at threshold 0, is its loss at t = 0), so the summed loss of a set of
    images at t is the sum of their changes at thresholds <= t.
    """

    image: np.ndarray
    threshold: np.ndarray
    change: np.ndarray


def image_loss_curve(confidence: np.ndarray, disagree: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(levels (K,), monotone loss (K,)) of one image: 0 and its confidences, and sup_{t' >= t} L(t')."""
    levels = np.unique(np.concatenate([[0.0], confidence.ravel()]))
    loss = question_loss(disagree, answering_stage(confidence, levels)).mean(axis=1)
    return levels, np.maximum.accumulate(loss[::-1])[::-1]


def loss_jumps(questions: CascadeQuestions) -> LossJumps:
    """The loss curves of all images (``image_loss_curve``) as one sorted table of jumps."""
    order = np.argsort(questions.image_index, kind="stable")
    bounds = np.flatnonzero(np.diff(questions.image_index[order])) + 1
    images, thresholds, changes = [], [], []
    for image, rows in enumerate(np.split(order, bounds)):
        levels, loss = image_loss_curve(questions.confidence[:, rows], questions.disagree[:, rows])
        change = np.diff(np.concatenate([[0.0], loss]))
        moves = change != 0
        images.append(np.full(moves.sum(), image))
        thresholds.append(levels[moves])
        changes.append(change[moves])
    threshold = np.concatenate(thresholds)
    by_threshold = np.argsort(threshold, kind="stable")
    return LossJumps(
        image=np.concatenate(images)[by_threshold],
        threshold=threshold[by_threshold],
        change=np.concatenate(changes)[by_threshold],
    )


DEFAULT_SWEEP: tuple[float, ...] = (0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1)
"""Targets of the default cost/validity curve (0.5 % to 10 % disagreement); infeasible ones are skipped."""


def minimum_epsilon(calibration_images: int) -> float:
    """The smallest feasible target, 1 / (n + 1): even a threshold escalating everything pays B / (n + 1)."""
    return 1.0 / (calibration_images + 1)


def loss_allowance(epsilons: np.ndarray, calibration_images: int) -> np.ndarray:
    """(E,) the largest summed calibration loss each target allows: (n + 1) epsilon - 1, plus round-off slack."""
    return (calibration_images + 1) * np.asarray(epsilons, dtype=np.float64) - 1.0 + ROUND_OFF


def check_epsilons(epsilons: Sequence[float], calibration_images: int) -> None:
    """Raise a PruneAuditError naming the bound when a target is out of (0, 1) or infeasible."""
    floor = minimum_epsilon(calibration_images)
    for epsilon in epsilons:
        if not 0.0 < epsilon < 1.0:
            raise PruneAuditError(f"epsilon must lie strictly between 0 and 1, got {epsilon}")
        if loss_allowance(np.array([epsilon]), calibration_images)[0] < 0:
            raise PruneAuditError(
                f"epsilon {epsilon} is infeasible with {calibration_images} calibration images: conformal risk "
                f"control needs epsilon >= 1/(n+1) = {floor:.4g}; use a larger epsilon or more calibration images"
            )


def crc_thresholds(jumps: LossJumps, calibration: np.ndarray, epsilons: np.ndarray) -> np.ndarray:
    """(E,) the CRC threshold for each target on the calibration images (mask over images).

    Every feasible target (``check_epsilons``) has a threshold: at the largest confidence every
    question escalates, the summed loss is 0 and 1 <= (n + 1) epsilon holds.
    """
    count = int(calibration.sum())
    check_epsilons(np.asarray(epsilons).tolist(), count)
    selected = calibration[jumps.image]
    levels = np.concatenate([[0.0], jumps.threshold[selected]])
    totals = np.cumsum(np.concatenate([[0.0], jumps.change[selected]]))
    # the summed loss at a level is the running total after its last jump
    last = np.r_[np.flatnonzero(np.diff(levels)), len(levels) - 1]
    levels, totals = levels[last], totals[last]
    first = np.searchsorted(-totals, -loss_allowance(epsilons, count), side="left")  # totals are non-increasing in t
    return levels[first]


def evaluate_policy(questions: CascadeQuestions, images: np.ndarray, threshold: float) -> dict:
    """Outcome of threshold ``threshold`` on the questions of the images in the mask ``images``."""
    rows = images[questions.image_index]
    confidence, disagree = questions.confidence[:, rows], questions.disagree[:, rows]
    stage = answering_stage(confidence, threshold)
    loss = question_loss(disagree, stage)
    image = questions.image_index[rows]
    per_image = np.bincount(image, loss, len(images))[images] / np.bincount(image, minlength=len(images))[images]
    visited = np.arange(questions.stages)[:, None] <= stage[None, :]
    cost = (questions.stage_cost[:, rows] * visited).sum(axis=0) + np.where(
        stage == questions.stages, questions.dense_cost[rows], 0.0
    )
    dense_total = questions.dense_cost[rows].sum()
    outcome = {
        "threshold": float(threshold),
        "disagreement": float(per_image.mean()),
        "question_disagreement": float(loss.mean()),
        "escalation_rate": float(np.mean(stage == questions.stages)),
        "answered_by": np.bincount(stage, minlength=questions.stages + 1).astype(np.float64) / len(stage),
        "relative_cost": float(cost.sum() / dense_total),
    }
    if questions.stages == 1:
        outcome.update(savings(disagree[0], questions.stage_cost[0, rows], questions.dense_cost[rows], outcome))
    return outcome


def savings(disagree: np.ndarray, pruned_cost: np.ndarray, dense_cost: np.ndarray, outcome: dict) -> dict:
    """Share of the possible savings a two-stage cascade achieves at its realised disagreement r.

    At the same question-level disagreement r, escalating questions at random (an uninformative
    score) must escalate a share 1 - r / D of them (D: disagreement of the pruned model alone),
    costing P + 1 - r / D in expectation (P: pruned cost / dense cost); perfect gating
    escalates a share (D - r) / D of the disagreeing questions only. Share = (cost uninformative
    - cost) / (cost uninformative - cost perfect); NaN when that denominator is 0.
    """
    dense_total = dense_cost.sum()
    base = pruned_cost.sum() / dense_total
    rate, realised = disagree.mean(), outcome["question_disagreement"]
    escalated_share = max(0.0, 1.0 - realised / rate) if rate > 0 else 0.0
    uninformative = base + escalated_share
    perfect = base + escalated_share * dense_cost[disagree].sum() / dense_total
    gap = uninformative - perfect
    return {
        "uninformative_cost": float(uninformative),
        "perfect_cost": float(perfect),
        "savings_share": float((uninformative - outcome["relative_cost"]) / gap) if gap > 0 else float("nan"),
    }


def split_masks(image_ids: np.ndarray, calibration_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(calibration, test) boolean masks over ``image_ids`` from ``split_images``."""
    calibration_ids, _ = split_images(image_ids, calibration_fraction, seed)
    calibration = np.isin(image_ids, calibration_ids)
    return calibration, ~calibration


def validity(
    questions: CascadeQuestions,
    jumps: LossJumps,
    epsilons: np.ndarray,
    splits: int,
    calibration_fraction: float,
    seed: int,
) -> dict[float, dict]:
    """Held-out disagreement, cost and escalation over ``splits`` random image splits, per target.

    The CRC guarantee is on the mean over splits (and new images): the mean held-out
    disagreement should be at most epsilon; single splits can exceed it.
    """
    count = len(questions.image_ids)
    size = int(round(calibration_fraction * count))
    rng = np.random.default_rng(seed)
    outcomes: dict[float, list[dict]] = {float(epsilon): [] for epsilon in epsilons}
    for _ in range(splits):
        calibration = np.zeros(count, dtype=bool)
        calibration[rng.permutation(count)[:size]] = True
        for epsilon, threshold in zip(epsilons, crc_thresholds(jumps, calibration, epsilons)):
            outcomes[float(epsilon)].append(evaluate_policy(questions, ~calibration, threshold))
    return {epsilon: _summarise_splits(results, epsilon) for epsilon, results in outcomes.items()}


def _summarise_splits(results: list[dict], epsilon: float) -> dict:
    disagreement = np.array([result["disagreement"] for result in results])
    spread = float(disagreement.std(ddof=1)) if len(results) > 1 else 0.0
    standard_error = spread / np.sqrt(len(results))
    return {
        "splits": len(results),
        "mean_disagreement": float(disagreement.mean()),
        "std_disagreement": spread,
        # the study's validity check: the mean over splits within one standard error of epsilon (or below it)
        "sem_disagreement": float(standard_error),
        "mean_within_one_sem_of_epsilon": bool(disagreement.mean() <= epsilon + standard_error),
        "worst_disagreement": float(disagreement.max()),
        "share_above_epsilon": float(np.mean(disagreement > epsilon)),
        "mean_relative_cost": float(np.mean([result["relative_cost"] for result in results])),
        "mean_escalation_rate": float(np.mean([result["escalation_rate"] for result in results])),
        "mean_threshold": float(np.mean([result["threshold"] for result in results])),
    }


def cascade_audit(
    stages: Sequence[QuestionTable],
    dense: QuestionTable,
    epsilons: Sequence[float],
    splits: int = 200,
    calibration_fraction: float = 0.5,
    seed: int = 0,
    optional: Sequence[float] = (),
    cost: str = "tokens",
) -> list[dict]:
    """For each target: the threshold and outcome on the seeded calibration/test split, and validity.

    The seeded split is the one ``calibrate`` uses (``split_images``). Every target in
    ``epsilons`` must be feasible; ``optional`` targets join only when feasible (the default
    sweep on a small question set). Returns one dict per target (ascending), with
    ``answered_by`` as a list of shares (stages, then dense); costs in unit ``cost`` (``COST_UNITS``).
    """
    if splits < 1:
        raise PruneAuditError(f"--splits must be at least 1, got {splits}")
    questions = CascadeQuestions.from_tables(stages, dense, cost)
    calibration, test = split_masks(questions.image_ids, calibration_fraction, seed)
    count = int(calibration.sum())
    check_epsilons(list(epsilons), count)  # before the validity splits, which need the same
    feasible = [
        epsilon for epsilon in optional if 0 < epsilon < 1 and loss_allowance(np.array([epsilon]), count)[0] >= 0
    ]
    targets = np.unique(np.asarray([*epsilons, *feasible], dtype=np.float64))
    jumps = loss_jumps(questions)
    checks = validity(questions, jumps, targets, splits, calibration_fraction, seed)
    results = []
    for epsilon, threshold in zip(targets, crc_thresholds(jumps, calibration, targets)):
        outcome = evaluate_policy(questions, test, threshold)
        outcome["answered_by"] = outcome["answered_by"].tolist()
        results.append(
            {
                "epsilon": float(epsilon),
                "calibration_images": int(calibration.sum()),
                "test_images": int(test.sum()),
                **outcome,
                "validity": checks[float(epsilon)],
            }
        )
    return results
