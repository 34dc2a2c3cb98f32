"""Every metric of the calibration reports, declared once: name, function, label, meaning, direction.

``calibration`` computes the metrics from this table, ``reports`` writes their meanings into
calibration.json, ``study`` takes its summary columns from it, ``report_html`` its table columns
and the direction of its findings, and ``cli/calibrate`` its rows; so a metric is added here
and nowhere else. A task (``prune_audit.tasks``) names the metrics its reports show
(``Task.report_metrics``); the POPE answer scores need a yes/no answer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from prune_audit.analysis import metrics


@dataclass
class ScoredQuestions:
    """One set of answered questions, arrays of shape (n,), and what several metrics share, computed once.

    Attributes:
        confidence: float64 top-label confidence; correct: bool.
        p_yes, logit_diff, label_yes: the yes/no event the Brier score and NLL read.
        answer_yes: bool, the yes/no answer POPE's scores read (None where no metric needs it).
        bins, binning: the confidence binning (``CalibrationSettings``).
        weights: (B, n) bootstrap resample counts, or None for the point estimate.
        answer, reference_answer: (n,) the answers as the task compares them (``QuestionTable.answer``) and the
            reference (dense) run's answers to the same questions, which the loyalty metrics read (None: no
            reference, no loyalty).
    """

    confidence: np.ndarray
    correct: np.ndarray
    p_yes: np.ndarray
    logit_diff: np.ndarray
    label_yes: np.ndarray
    answer_yes: np.ndarray | None
    bins: int
    binning: str
    weights: np.ndarray | None = None
    answer: np.ndarray | None = None
    reference_answer: np.ndarray | None = None

    @cached_property
    def ranked(self) -> metrics.RankedQuestions:
        return metrics.RankedQuestions(self.confidence, self.correct, self.weights)

    @cached_property
    def width(self) -> metrics.BinTotals:
        return metrics.bin_totals(self.confidence, self.correct, self.bins, "width", self.weights)

    @cached_property
    def mass(self) -> metrics.BinTotals:
        return self.ranked.mass_totals(self.bins)

    @property
    def chosen(self) -> metrics.BinTotals:
        """The bins of ``--binning``."""
        return self.width if self.binning == "width" else self.mass

    @cached_property
    def pope(self) -> dict[str, Any]:
        return metrics.pope_scores(self.label_yes, self.answer_yes, self.weights)


@dataclass(frozen=True)
class Metric:
    """One metric.

    Attributes:
        name: its key in calibration.json, the study summary and ``Task.report_metrics``.
        label: how tables and figures title it.
        meaning: its definition, written into calibration.json's conventions.
        higher_is_better: the good direction (None: neither, such as the yes ratio).
        compute: its value on a :class:`ScoredQuestions` (a float, or (B,) replicates with weights).
        answer_score: one of POPE's answer scores (computed together, from a yes/no answer).
        in_study: a column of the study summary (with its 95 % interval).
        in_table: a row of ``calibrate``'s printed table (all are in calibration.json and its CSV).
        precise: printed with 4 significant digits (small by nature: an AURC of 0.0004 is not 0.000).
        needs_reference: compares the run's answers with a reference run's (loyalty): computed only for a run
            audited against a reference (``calibrate --reference``, a study's pruned runs).
        generated_only: applies to generated answers only (``QuestionTable.generated``).
    """

    name: str
    label: str
    meaning: str
    higher_is_better: bool | None
    compute: Callable[[ScoredQuestions], Any]
    answer_score: bool = False
    in_study: bool = False
    precise: bool = False
    in_table: bool = True
    needs_reference: bool = False
    generated_only: bool = False


def _answer(name: str) -> Callable[[ScoredQuestions], Any]:
    return lambda scored: scored.pope[name]


def _finished(value: Callable[[ScoredQuestions], Any]) -> Callable[[ScoredQuestions], Any]:
    """A confidence metric as reported: ``metrics.finish`` turns replicates into floats or arrays."""
    return lambda scored: metrics.finish(value(scored), scored.weights)


POPE_ANSWERS = "POPE's evaluate.py, yes as the positive class"

METRICS: tuple[Metric, ...] = (
    Metric(
        "accuracy", "accuracy", "share of correct answers", True, _answer("accuracy"), answer_score=True, in_study=True
    ),
    Metric(
        "loyalty",
        "loyalty",
        "EffiVLM-Bench's loyalty: share of questions whose answer equals the reference (dense) run's answer to the "
        "same question, answers compared as the task normalises them",
        True,
        lambda s: metrics.loyalty(s.answer, s.reference_answer, s.weights),
        in_study=True,
        needs_reference=True,
    ),
    Metric(
        "loyalty_overlap",
        "loyalty (token F1)",
        "mean over questions of the token-level F1 between the answer and the reference run's answer (lower-cased "
        "word tokens counted as multisets; two empty answers agree): loyalty for generated answers",
        True,
        lambda s: metrics.loyalty_overlap(s.answer, s.reference_answer, s.weights),
        in_study=True,
        needs_reference=True,
        generated_only=True,
    ),
    Metric(
        "precision",
        "precision",
        f"{POPE_ANSWERS}: yes answers that are right",
        True,
        _answer("precision"),
        answer_score=True,
        in_table=False,
    ),
    Metric(
        "recall",
        "recall",
        f"{POPE_ANSWERS}: yes questions answered yes",
        True,
        _answer("recall"),
        answer_score=True,
        in_table=False,
    ),
    Metric(
        "f1",
        "F1",
        f"{POPE_ANSWERS}: harmonic mean of precision and recall",
        True,
        _answer("f1"),
        answer_score=True,
        in_study=True,
    ),
    Metric(
        "yes_ratio",
        "yes ratio",
        "share of yes predictions (POPE's evaluate.py)",
        None,
        _answer("yes_ratio"),
        answer_score=True,
        in_study=True,
    ),
    Metric(
        "ece",
        "ECE (width)",
        "sum_b (n_b/N)|acc_b - conf_b| over `bins` equal-width bins (lower, upper]; 0 in the "
        "first bin, 1.0 in the last",
        False,
        _finished(lambda s: s.width.ece()),
        in_study=True,
    ),
    Metric(
        "ece_mass",
        "ECE (mass)",
        "the same over equal-mass bins (np.array_split of the questions sorted by confidence; ties share evenly)",
        False,
        _finished(lambda s: s.mass.ece()),
        in_study=True,
    ),
    Metric(
        "mce",
        "MCE",
        "max over non-empty bins of |acc_b - conf_b|, with --binning",
        False,
        _finished(lambda s: s.chosen.mce()),
    ),
    Metric(
        "ce_debiased_l2",
        "debiased L2 error (equal-mass)",
        "Kumar, Liang & Ma 2019 debiased L2 calibration error "
        "(root of the bias-corrected squared error) over `bins` equal-mass bins, the estimator's own default, "
        "whatever --binning",
        False,
        _finished(lambda s: s.mass.debiased_l2()),
    ),
    Metric(
        "brier",
        "Brier",
        "mean (p_yes - y)^2, y = 1 for yes (equal to the top-label Brier score for two classes)",
        False,
        _finished(lambda s: metrics.brier(s.p_yes, s.label_yes, s.weights)),
        in_study=True,
    ),
    Metric(
        "nll",
        "NLL",
        "mean -log p(label) in nats",
        False,
        _finished(lambda s: metrics.nll(s.logit_diff, s.label_yes, s.weights)),
    ),
    Metric(
        "auroc",
        "AUROC",
        "AUROC of confidence as a score for correctness, ties one half",
        True,
        _finished(lambda s: s.ranked.auroc()),
        in_study=True,
    ),
    Metric(
        "aurc",
        "AURC",
        "mean error rate of the k most confident questions over k = 1..N (ties share errors evenly)",
        False,
        _finished(lambda s: s.ranked.aurc()),
        in_study=True,
        precise=True,
    ),
)
"""Every metric, in report order: accuracy and loyalty, POPE's answer scores, then the confidence metrics."""

ANSWER_METRICS = tuple(metric for metric in METRICS if metric.answer_score)
LOYALTY_METRICS = tuple(metric for metric in METRICS if metric.needs_reference)
CONFIDENCE_METRICS = tuple(metric for metric in METRICS if not (metric.answer_score or metric.needs_reference))
METRIC_NAMES = tuple(metric.name for metric in METRICS)


def metric(name: str) -> Metric:
    """The metric called ``name``; a KeyError naming the known ones otherwise."""
    for candidate in METRICS:
        if candidate.name == name:
            return candidate
    raise KeyError(f"unknown metric {name!r}; metrics: {', '.join(METRIC_NAMES)}")


def reported_metrics(report_metrics: Iterable[str]) -> tuple[Metric, ...]:
    """The metrics a report shows for tasks whose ``Task.report_metrics`` are ``report_metrics`` (several tasks'
    names together: their union), in report order."""
    names = set(report_metrics)
    return tuple(candidate for candidate in METRICS if candidate.name in names)


__all__ = [
    "ANSWER_METRICS",
    "CONFIDENCE_METRICS",
    "LOYALTY_METRICS",
    "METRICS",
    "METRIC_NAMES",
    "Metric",
    "ScoredQuestions",
    "metric",
    "reported_metrics",
]
