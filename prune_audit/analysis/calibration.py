"""The calibration audit of runs: POPE and confidence metrics, temperature scaling, object survival.

Every number comes with a 95% image-clustered bootstrap interval (``bootstrap``); with a
reference (dense) run, pruned-minus-reference differences use the same resampled images
for both runs (paired). Conventions of the metrics are in ``prune_audit.analysis.metrics``.

Temperature scaling: T is fitted by NLL on the calibration images (a seeded split by
image over all POPE splits, ``temperature.split_images``) and every after-scaling metric is
reported on the disjoint test images next to the same metric before scaling (T = 1), with
T held fixed in the bootstrap. T is fitted separately for every run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from prune_audit.analysis import metrics
from prune_audit.analysis.bootstrap import bootstrap_replicates, estimate, image_counts, percentile_interval
from prune_audit.analysis.metric_table import CONFIDENCE_METRICS, METRICS, Metric, ScoredQuestions, metric
from prune_audit.analysis.questions import QuestionTable
from prune_audit.analysis.temperature import TemperatureFit, fit_temperature, scaled_probabilities, split_images
from prune_audit.errors import PruneAuditError

RETENTION_BINS: tuple[tuple[str, float, float], ...] = (
    ("0", 0.0, 0.0),
    ("(0, 0.25]", 0.0, 0.25),
    ("(0.25, 0.5]", 0.25, 0.5),
    ("(0.5, 1]", 0.5, 1.0),
)
"""Retention bins (label, lower, upper): exactly 0, then (lower, upper]."""

HISTOGRAM_EDGES = np.linspace(0.5, 1.0, 21)
"""Confidence histogram edges: two-way top-label confidence lies in [0.5, 1]."""
TOP_LABEL_HISTOGRAM_EDGES = np.linspace(0.0, 1.0, 21)
"""The same for a task without a yes/no answer, whose confidence lies in [0, 1] (``QuestionTable.top_label``)."""


MAX_BINS = 1000
"""Most confidence bins (``--bins``): the per-bin bootstrap holds a questions x bins matrix, and a POPE
run of 9,000 questions leaves fewer than 10 questions per bin beyond this."""


@dataclass(frozen=True)
class CalibrationSettings:
    """Options of the audit. ``binning`` applies to MCE and the reliability curve; the ECE is reported
    with both binnings and the debiased error always uses equal-mass bins (its estimator's default).

    Every field is checked on construction (``calibrate`` and ``study`` build it before writing)."""

    bins: int = 15
    binning: metrics.Binning = "width"
    bootstrap: int = 2000
    calibration_fraction: float = 0.5
    seed: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.bins <= MAX_BINS:
            raise PruneAuditError(f"--bins must be 1 to {MAX_BINS}, got {self.bins}; 10 to 20 is usual")
        if self.binning not in metrics.BINNINGS:
            raise PruneAuditError(f"--binning must be one of {', '.join(metrics.BINNINGS)}, got {self.binning!r}")
        if self.bootstrap < 1:
            raise PruneAuditError(f"--bootstrap must be at least 1, got {self.bootstrap}")
        if not 0.0 < self.calibration_fraction < 1.0:  # also refuses nan
            raise PruneAuditError(
                f"--calibration-fraction must lie strictly between 0 and 1, got {self.calibration_fraction}"
            )


def check_confidences(table: QuestionTable, source: str) -> None:
    """Refuse records whose two-way probabilities cannot come from a model: p_yes outside [0, 1], a top-label
    confidence outside [0.5, 1], or NaN in either or in the logit difference. ``calibrate``, ``cascade`` and
    ``study`` read every run through this one check."""
    columns = {"p_yes_2way": (table.p_yes, 0.0), "confidence": (table.confidence, 0.0 if table.top_label else 0.5)}
    for name, (values, low) in columns.items():
        bad = np.flatnonzero(~((values >= low) & (values <= 1.0)))  # NaN fails both comparisons
        if bad.size:
            row = bad[0]
            raise PruneAuditError(
                f"records of {source}: {name} {values[row]} of question ({table.split[row]}, {table.question_id[row]}) "
                f"is not a probability in [{low:g}, 1] ({bad.size} such rows); re-run the run to rewrite its records"
            )
    if np.isnan(table.logit_diff).any():
        raise PruneAuditError(f"records of {source}: logit_diff holds NaN; re-run the run to rewrite its records")


@dataclass(frozen=True)
class Measured:
    """Point values and (B,) bootstrap replicates of named metrics on one group of questions."""

    point: dict[str, float]
    replicates: dict[str, np.ndarray]

    def summary(self) -> dict[str, dict]:
        return {name: estimate(value, self.replicates[name]) for name, value in self.point.items()}

    def minus(self, other: Measured) -> dict[str, dict]:
        """Paired differences self - other on the metrics both hold (same resamples)."""
        return {
            name: estimate(value - other.point[name], self.replicates[name] - other.replicates[name])
            for name, value in self.point.items()
            if name in other.point
        }


@dataclass
class RunAudit:
    """All measurements of one run; ``reference_survival`` holds the reference run on this run's groups."""

    groups: dict[str, Measured]
    fit: TemperatureFit
    scaled: dict[str, Measured]
    survival: dict[str, Measured]
    reliability: dict
    histogram: dict
    reference_survival: dict[str, Measured] = field(default_factory=dict)


def confidence_metrics(
    confidence: np.ndarray,
    correct: np.ndarray,
    p_yes: np.ndarray,
    logit_diff: np.ndarray,
    label_yes: np.ndarray,
    settings: CalibrationSettings,
    weights: np.ndarray | None = None,
) -> dict:
    """The confidence metrics of ``metric_table`` (ECE both binnings, MCE, debiased L2 error, Brier, NLL, AUROC,
    AURC) of one set."""
    scored = ScoredQuestions(
        confidence, correct, p_yes, logit_diff, label_yes, None, settings.bins, settings.binning, weights
    )
    return {metric.name: metric.compute(scored) for metric in CONFIDENCE_METRICS}


def question_metrics(
    table: QuestionTable,
    settings: CalibrationSettings,
    weights: np.ndarray | None = None,
    reference: QuestionTable | None = None,
) -> dict:
    """Every metric of ``metric_table`` on the recorded answers: accuracy, then with ``reference`` (the reference
    run's rows in ``table``'s order, ``QuestionTable.aligned_to``) loyalty, then POPE's other answer scores (none
    for a task without a yes/no answer), then the confidence metrics."""
    scored = ScoredQuestions(
        table.confidence,
        table.correct,
        table.p_yes,
        table.logit_diff,
        table.label_yes,
        table.answer_yes,
        settings.bins,
        settings.binning,
        weights,
        _compared_answers(table),
        None if reference is None else _compared_answers(reference),
    )
    return {metric.name: metric.compute(scored) for metric in METRICS if _applies(metric, table, reference)}


def _compared_answers(table: QuestionTable) -> np.ndarray:
    """(n,) the answers two runs compare: as the task normalises them, else POPE's yes/no."""
    return table.answer if table.answer is not None else table.answer_yes


def _applies(metric: Metric, table: QuestionTable, reference: QuestionTable | None = None) -> bool:
    """POPE's answer scores other than accuracy need a yes/no answer; loyalty needs a reference run, and its
    token-overlap form a generated answer."""
    if metric.needs_reference:
        return reference is not None and (table.generated or not metric.generated_only)
    return not (table.top_label and metric.answer_score and metric.name != "accuracy")


def answer_scores(table: QuestionTable, weights: np.ndarray | None = None) -> dict:
    """The answer scores of one split: POPE's (accuracy, precision, recall, F1, yes ratio), or accuracy alone for a
    task without a yes/no answer."""
    scores = metrics.pope_scores(table.label_yes, table.answer_yes, weights)
    return {name: value for name, value in scores.items() if _applies(metric(name), table)}


def scaled_metrics(
    table: QuestionTable, temperature: float, settings: CalibrationSettings, weights: np.ndarray | None = None
) -> dict:
    """Accuracy and confidence metrics with p_yes = sigmoid(d / T), answers re-derived from the scaled p_yes.

    A question with d = 0 (p_yes = 0.5 at any T) keeps its recorded answer. For a task without a yes/no answer
    (``top_label``) the answer never changes and its confidence is the scaled p_yes itself.
    """
    p_yes, confidence = scaled_probabilities(table.logit_diff, temperature)
    if table.top_label:
        confidence = p_yes
    answer_yes = np.where(p_yes == 0.5, table.answer_yes, p_yes > 0.5)
    correct = table.correct if table.top_label else answer_yes == table.label_yes
    return {
        "accuracy": metrics.weighted_mean(correct, weights),
        **confidence_metrics(
            confidence, correct, p_yes, table.logit_diff / temperature, table.label_yes, settings, weights
        ),
    }


def group_metrics(table: QuestionTable, rows: np.ndarray, weights: np.ndarray | None = None) -> dict:
    """Question count, accuracy and mean confidence of the rows selected by the boolean mask ``rows``."""
    matrix = metrics.weight_matrix(weights, len(table))[:, rows]
    columns = np.stack([np.ones(rows.sum()), table.correct[rows], table.confidence[rows]], axis=1)
    count, correct, confidence = (matrix @ columns).T
    with np.errstate(invalid="ignore", divide="ignore"):
        values = {"count": count, "accuracy": correct / count, "confidence": confidence / count}
    return {name: metrics.finish(value, weights) for name, value in values.items()}


def survival_groups(table: QuestionTable) -> dict[str, np.ndarray]:
    """Boolean masks (n,): ``lost`` / ``survived`` objects and the retention bins.

    Questions whose object mask is unknown (lost is NaN) belong to neither; "no" questions
    have NaN retention and fall in no retention bin.
    """
    groups = {"lost": table.lost == 1.0, "survived": table.lost == 0.0}
    retention = table.retention
    for label, lower, upper in RETENTION_BINS:
        inside = retention == 0.0 if upper == 0.0 else (retention > lower) & (retention <= upper)
        groups[f"retention {label}"] = inside
    return groups


def _measure(statistic: Callable, image_index: np.ndarray, counts: np.ndarray) -> Measured:
    point = {name: float(value) for name, value in statistic(None).items()}
    return Measured(point, bootstrap_replicates(statistic, image_index, counts))


@dataclass(frozen=True)
class ImageResamples:
    """Resamples shared by every run of one audit: over all images and over the test images."""

    images: np.ndarray
    counts: np.ndarray
    calibration_images: np.ndarray
    test_images: np.ndarray
    test_counts: np.ndarray

    @classmethod
    def draw(cls, tables: Sequence[QuestionTable], settings: CalibrationSettings) -> ImageResamples:
        images = np.unique(np.concatenate([table.image_id for table in tables]))
        calibration_images, test_images = split_images(images, settings.calibration_fraction, settings.seed)
        return cls(
            images=images,
            counts=image_counts(len(images), settings.bootstrap, settings.seed),
            calibration_images=calibration_images,
            test_images=test_images,
            test_counts=image_counts(len(test_images), settings.bootstrap, settings.seed),
        )


def audit_run(
    table: QuestionTable,
    settings: CalibrationSettings,
    resamples: ImageResamples,
    reference: QuestionTable | None = None,
) -> RunAudit:
    """Measure one run: every metric overall (loyalty to ``reference``, its rows in ``table``'s order, where given),
    POPE scores per split, temperature scaling, survival groups."""
    image_index = table.image_index(resamples.images)
    groups = {"all": _measure(lambda w: question_metrics(table, settings, w, reference), image_index, resamples.counts)}
    for split in sorted(set(table.split.tolist())):
        subset = table.take(table.split == split)
        groups[split] = _measure(
            lambda w, subset=subset: answer_scores(subset, w),
            subset.image_index(resamples.images),
            resamples.counts,
        )
    calibration = table.take(np.isin(table.image_id, resamples.calibration_images))
    test = table.take(np.isin(table.image_id, resamples.test_images))
    fit = fit_temperature(calibration.logit_diff, calibration.label_yes)
    test_index = test.image_index(resamples.test_images)
    scaled = {
        name: _measure(lambda w, t=temperature: scaled_metrics(test, t, settings, w), test_index, resamples.test_counts)
        for name, temperature in (("before", 1.0), ("after", fit.temperature))
    }
    return RunAudit(
        groups=groups,
        fit=fit,
        scaled=scaled,
        survival=survival_measures(table, survival_groups(table), image_index, resamples.counts),
        reliability=reliability_with_intervals(table, settings, image_index, resamples.counts),
        histogram=_histogram(table),
    )


def _histogram(table: QuestionTable) -> dict:
    """Counts of correct and incorrect answers per confidence interval (edges: the confidence's range)."""
    edges = TOP_LABEL_HISTOGRAM_EDGES if table.top_label else HISTOGRAM_EDGES
    return {
        "edges": edges.tolist(),
        "correct": np.histogram(table.confidence[table.correct], edges)[0].tolist(),
        "incorrect": np.histogram(table.confidence[~table.correct], edges)[0].tolist(),
    }


def bin_membership(confidence: np.ndarray, bins: int, binning: metrics.Binning) -> np.ndarray:
    """(n,) reliability bin of each question; equal-mass bins cut the confidence order (ties by position)."""
    if binning == "width":
        return metrics.width_bin_index(confidence, bins)
    members = np.empty(len(confidence), dtype=np.int64)
    for index, positions in enumerate(np.array_split(np.argsort(confidence, kind="stable"), bins)):
        members[positions] = index
    return members


def reliability_with_intervals(
    table: QuestionTable, settings: CalibrationSettings, image_index: np.ndarray, counts: np.ndarray
) -> dict:
    """The reliability curve plus ``accuracy_ci95``: each bin's 95% image-bootstrap accuracy interval.

    Bin membership is held fixed at the full data's bins (so the interval is the accuracy
    uncertainty of the questions in that confidence range); an empty bin gets [NaN, NaN].
    """
    curve = metrics.reliability_curve(table.confidence, table.correct, settings.bins, settings.binning)
    one_hot = np.eye(settings.bins)[bin_membership(table.confidence, settings.bins, settings.binning)]  # (n, bins)

    def accuracy_per_bin(weights: np.ndarray | None) -> dict[str, np.ndarray]:
        matrix = metrics.weight_matrix(weights, len(table))
        with np.errstate(invalid="ignore", divide="ignore"):
            accuracy = (matrix @ (one_hot * table.correct[:, None])) / (matrix @ one_hot)  # (B, bins)
        return {str(k): accuracy[:, k] for k in range(settings.bins)}

    replicates = bootstrap_replicates(accuracy_per_bin, image_index, counts)
    curve["accuracy_ci95"] = [list(percentile_interval(replicates[str(k)])) for k in range(settings.bins)]
    return curve


def survival_measures(
    table: QuestionTable, groups: dict[str, np.ndarray], image_index: np.ndarray, counts: np.ndarray
) -> dict[str, Measured]:
    """Count, accuracy and confidence of ``table`` on each group mask (masks may come from another run)."""
    return {
        name: _measure(lambda w, rows=rows: group_metrics(table, rows, w), image_index, counts)
        for name, rows in groups.items()
    }


def run_summary(audit: RunAudit, reference: RunAudit | None = None) -> dict:
    """JSON-ready results of one run; with ``reference`` also the paired differences run - reference."""
    summary = {
        "metrics": {name: measured.summary() for name, measured in audit.groups.items()},
        "temperature": {
            "temperature": audit.fit.temperature,
            "at_bound": audit.fit.at_bound,
            "calibration_nll_before": audit.fit.nll_before,
            "calibration_nll_after": audit.fit.nll_after,
            "test_before": audit.scaled["before"].summary(),
            "test_after": audit.scaled["after"].summary(),
            "invariant": {
                name: bool(abs(audit.scaled["before"].point[name] - audit.scaled["after"].point[name]) <= 1e-12)
                for name in ("accuracy", "auroc")
            },
        },
        "survival": {name: measured.summary() for name, measured in audit.survival.items()},
        "reliability": audit.reliability,
        "confidence_histogram": audit.histogram,
    }
    if reference is not None:
        for name, measured in audit.reference_survival.items():
            summary["survival"][name].update(
                {f"reference_{metric}": value for metric, value in measured.summary().items() if metric != "count"}
            )
        summary["difference_vs_reference"] = {
            "metrics": {
                name: measured.minus(reference.groups[name])
                for name, measured in audit.groups.items()
                if name in reference.groups
            },
            "temperature": {
                f"test_{stage}": audit.scaled[stage].minus(reference.scaled[stage]) for stage in ("before", "after")
            },
            "survival": {
                name: {k: v for k, v in measured.minus(audit.reference_survival[name]).items() if k != "count"}
                for name, measured in audit.survival.items()
            },
        }
    return summary


def calibration_audit(
    tables: Sequence[QuestionTable], settings: CalibrationSettings, reference: QuestionTable | None = None
) -> dict:
    """Audit every run (and the reference); returns {"runs": [...], "reference": ... or None, "split": ...}.

    With a reference, each run's questions must be the reference's (paired by (split, question_id)).
    """
    # pair every run with the reference before any heavy work, so a mismatch fails fast
    aligned = [reference.aligned_to(table) if reference is not None else None for table in tables]
    resamples = ImageResamples.draw([*tables, *([reference] if reference is not None else [])], settings)
    reference_audit = audit_run(reference, settings, resamples) if reference is not None else None
    runs = []
    for table, paired in zip(tables, aligned):
        audit = audit_run(table, settings, resamples, paired)
        if paired is not None:
            audit.reference_survival = survival_measures(
                paired, survival_groups(table), paired.image_index(resamples.images), resamples.counts
            )
        runs.append(run_summary(audit, reference_audit))
    return {
        "runs": runs,
        "reference": run_summary(reference_audit) if reference_audit is not None else None,
        "split": {
            "seed": settings.seed,
            "calibration_fraction": settings.calibration_fraction,
            "calibration_images": len(resamples.calibration_images),
            "test_images": len(resamples.test_images),
        },
    }


def metrics_against_reference(
    tables: Sequence[QuestionTable], reference: QuestionTable, settings: CalibrationSettings
) -> dict:
    """Every metric of ``question_metrics`` of the reference and of each run (loyalty to the reference included),
    with image-clustered intervals, and each run's paired differences run - reference: the overall part of
    ``calibration_audit`` alone (no temperature scaling or survival groups), for a subset of the questions too
    small to split. Returns {"reference": entry, "runs": [entry, ...]}, entries shaped as calibration.json's."""
    images = np.unique(np.concatenate([reference.image_id, *(table.image_id for table in tables)]))
    counts = image_counts(len(images), settings.bootstrap, settings.seed)
    dense = _measure(lambda w: question_metrics(reference, settings, w), reference.image_index(images), counts)
    runs = []
    for table in tables:
        paired = reference.aligned_to(table)
        measured = _measure(
            lambda w, table=table, paired=paired: question_metrics(table, settings, w, paired),
            table.image_index(images),
            counts,
        )
        runs.append(
            {
                "metrics": {"all": measured.summary()},
                "difference_vs_reference": {"metrics": {"all": measured.minus(dense)}},
            }
        )
    return {"reference": {"metrics": {"all": dense.summary()}}, "runs": runs}
