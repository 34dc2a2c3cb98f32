"""POPE and confidence-quality metrics, each evaluable under bootstrap weights.

Every metric takes per-question arrays of length n and an optional ``weights`` matrix
(B, n) of non-negative integer multiplicities. ``weights=None`` returns the plain
estimate as a float; a (B, n) matrix returns (B,) values, value b being the metric on
the dataset in which question i appears ``weights[b, i]`` times. The image-clustered
bootstrap (``prune_audit.analysis.bootstrap``) evaluates thousands of resamples this
way without materialising them; every metric needs at least one question. Undefined
values (a ratio with an empty denominator, AUROC with one class) are NaN.

Conventions:
- Top-label: ``confidence`` = max(p_yes, 1 - p_yes) of the two-way probabilities and
  ``correct`` = answer == label.
- Equal-width bins: edges ``np.linspace(0, 1, bins + 1)``, bins (lower, upper]; a
  confidence of exactly 0 falls in the first bin and exactly 1.0 in the last (the
  convention of scikit-learn's ``calibration_curve``).
- Equal-mass bins: questions sorted by confidence, positions cut into ``bins`` runs of
  sizes as ``np.array_split``; a group of tied confidences that straddles a cut
  contributes its mean correctness to both sides (so the result does not depend on the
  order of ties).
- ECE = sum_b (n_b / N) |acc_b - conf_b|; MCE = max over non-empty bins of |acc_b - conf_b|.
- Brier = mean (p_yes - y)^2 with y = 1 for "yes"; for two classes this equals the
  top-label Brier mean (confidence - correct)^2.
- NLL = mean -log p(label) from the two-way logit, computed as softplus(-s d), s = +1 for
  "yes" and -1 for "no".
- AUROC of confidence as a score for correctness, ties counted one half (as scikit-learn).
- AURC = mean over coverages k/N, k = 1..N, of the error rate among the k most confident
  questions; tied confidences share their errors evenly (the expectation over tie orders).
- Loyalty = share of questions whose answer equals the reference (dense) run's answer to the same
  question; loyalty (token F1) = mean over questions of the token-level F1 between the two answers.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import numpy as np

from prune_audit.data.pope import pope_ratios

Binning = Literal["width", "mass"]
BINNINGS: tuple[str, ...] = ("width", "mass")


def weight_matrix(weights: np.ndarray | None, n: int) -> np.ndarray:
    """(B, n) float64 multiplicities; ``None`` means one copy of every question (B = 1)."""
    if weights is None:
        return np.ones((1, n))
    weights = np.asarray(weights, dtype=np.float64)
    if weights.ndim != 2 or weights.shape[1] != n:
        raise ValueError(f"weights must have shape (B, {n}), got {weights.shape}")
    return weights


def finish(values: np.ndarray, weights: np.ndarray | None) -> float | np.ndarray:
    """(B,) values as returned to the caller: a float when ``weights`` was None (B = 1)."""
    values = np.atleast_1d(values)
    return float(values[0]) if weights is None else values


def _divide(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
    """Elementwise ratio, NaN where the denominator is 0."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denominator != 0, numerator / np.where(denominator != 0, denominator, 1.0), np.nan)


def weighted_mean(values: np.ndarray, weights: np.ndarray | None = None) -> float | np.ndarray:
    """Mean of ``values`` (n,) under each weight row."""
    values = np.asarray(values, dtype=np.float64)
    matrix = weight_matrix(weights, len(values))
    return finish(_divide(matrix @ values, matrix.sum(axis=1)), weights)


def pope_scores(label_yes: np.ndarray, answer_yes: np.ndarray, weights: np.ndarray | None = None) -> dict:
    """POPE's metrics with "yes" as the positive class.

    Returns accuracy, precision, recall, f1 and yes_ratio (share of *predictions* that are
    yes, as POPE's evaluate.py), floats or (B,) arrays.
    """
    label_yes = np.asarray(label_yes, dtype=bool)
    answer_yes = np.asarray(answer_yes, dtype=bool)
    matrix = weight_matrix(weights, len(label_yes))
    outcomes = np.stack(
        [answer_yes & label_yes, answer_yes & ~label_yes, ~answer_yes & ~label_yes, ~answer_yes & label_yes], axis=1
    )
    true_pos, false_pos, true_neg, false_neg = (matrix @ outcomes.astype(np.float64)).T
    scores = pope_ratios(true_pos, false_pos, true_neg, false_neg)
    return {name: finish(np.asarray(value), weights) for name, value in scores.items()}


def brier(p_yes: np.ndarray, label_yes: np.ndarray, weights: np.ndarray | None = None) -> float | np.ndarray:
    """Mean squared error of p(yes) against y = 1 for "yes" (equals the top-label Brier score)."""
    return weighted_mean((np.asarray(p_yes, dtype=np.float64) - np.asarray(label_yes, dtype=np.float64)) ** 2, weights)


def nll(logit_diff: np.ndarray, label_yes: np.ndarray, weights: np.ndarray | None = None) -> float | np.ndarray:
    """Mean negative log-likelihood of the label under p_yes = sigmoid(logit_diff), in nats."""
    sign = np.where(np.asarray(label_yes, dtype=bool), 1.0, -1.0)
    return weighted_mean(np.logaddexp(0.0, -sign * np.asarray(logit_diff, dtype=np.float64)), weights)


def _check_confidence(confidence: np.ndarray) -> np.ndarray:
    confidence = np.asarray(confidence, dtype=np.float64)
    if confidence.size and (np.isnan(confidence).any() or confidence.min() < 0 or confidence.max() > 1):
        raise ValueError("confidence values must lie in [0, 1] (no NaN)")
    return confidence


def width_bin_index(confidence: np.ndarray, bins: int) -> np.ndarray:
    """(n,) equal-width bin of each confidence: bins (lower, upper], 0 in the first, 1.0 in the last."""
    inner_edges = np.linspace(0.0, 1.0, bins + 1)[1:-1]
    return np.searchsorted(inner_edges, _check_confidence(confidence), side="left")


@dataclass(frozen=True)
class BinTotals:
    """Per-bin sums under each weight row, all (B, bins): question count, confidence sum, correct count."""

    count: np.ndarray
    confidence: np.ndarray
    correct: np.ndarray

    @property
    def accuracy(self) -> np.ndarray:
        return _divide(self.correct, self.count)

    @property
    def mean_confidence(self) -> np.ndarray:
        return _divide(self.confidence, self.count)

    def ece(self) -> np.ndarray:
        """(B,) sum_b (n_b / N) |acc_b - conf_b|."""
        return _divide(np.abs(self.correct - self.confidence).sum(axis=1), self.count.sum(axis=1))

    def mce(self) -> np.ndarray:
        """(B,) max over non-empty bins of |acc_b - conf_b|."""
        gap = np.where(self.count > 0, np.abs(self.accuracy - self.mean_confidence), -np.inf)
        worst = gap.max(axis=1)
        return np.where(np.isfinite(worst), worst, np.nan)

    def debiased_l2(self) -> np.ndarray:
        """(B,) debiased L2 error; see ``debiased_calibration_error``."""
        enough = self.count >= 2
        accuracy = np.where(enough, self.accuracy, 0.0)
        squared_gap = (accuracy - np.where(enough, self.mean_confidence, 0.0)) ** 2
        bias = np.divide(accuracy * (1 - accuracy), self.count - 1, out=np.zeros_like(accuracy), where=enough)
        per_bin = np.where(enough, squared_gap - bias, 0.0)
        squared = _divide((self.count * per_bin).sum(axis=1), self.count.sum(axis=1))
        return np.sqrt(np.maximum(squared, 0.0))


class RankedQuestions:
    """Questions grouped by tied confidence in ascending order, with per-group sums for each weight row.

    Equal-mass bins, AUROC and AURC all read these (B, G) sums, so a caller computing several
    of them builds one ``RankedQuestions`` and calls its methods.
    """

    def __init__(self, confidence: np.ndarray, correct: np.ndarray, weights: np.ndarray | None = None) -> None:
        confidence = _check_confidence(confidence)
        correct = np.asarray(correct, dtype=np.float64)
        order = np.argsort(confidence, kind="stable")
        starts = np.flatnonzero(np.r_[True, np.diff(confidence[order]) != 0])
        sorted_weights = weight_matrix(weights, len(confidence))[:, order]
        sorted_correct = sorted_weights * correct[order]
        self.level = confidence[order][starts]
        """(G,) the confidence of each group, ascending."""
        tied = len(starts) < len(confidence)
        self.weight = np.add.reduceat(sorted_weights, starts, axis=1) if tied else sorted_weights
        """(B, G) questions per group."""
        self.correct = np.add.reduceat(sorted_correct, starts, axis=1) if tied else sorted_correct
        """(B, G) correct answers per group."""
        self.ends = np.cumsum(self.weight, axis=1)
        """(B, G) questions up to and including each group."""
        self.correct_through = np.cumsum(self.correct, axis=1)
        """(B, G) correct answers up to and including each group."""

    @property
    def total(self) -> np.ndarray:
        return self.ends[:, -1]

    def mass_totals(self, bins: int) -> BinTotals:
        """Equal-mass bins: positions cut as ``np.array_split``, tied groups split proportionally."""
        size, extra = np.divmod(np.rint(self.total).astype(np.int64), bins)
        cut = np.arange(bins + 1)[None, :]
        boundaries = (cut * size[:, None] + np.minimum(cut, extra[:, None])).astype(np.float64)
        confidence_sum = self.weight * self.level
        confidence_through = np.cumsum(confidence_sum, axis=1)
        return BinTotals(
            count=np.diff(boundaries, axis=1),
            confidence=np.diff(self._amount_before(confidence_sum, confidence_through, boundaries), axis=1),
            correct=np.diff(self._amount_before(self.correct, self.correct_through, boundaries), axis=1),
        )

    def _amount_before(self, amount: np.ndarray, amount_through: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """(B, P) sum of ``amount`` over the first ``positions`` questions; a group's questions carry equal shares."""
        group = np.stack([np.searchsorted(ends, where, side="left") for ends, where in zip(self.ends, positions)])
        group = np.minimum(group, self.weight.shape[1] - 1)

        def at_group(array: np.ndarray) -> np.ndarray:
            return np.take_along_axis(array, group, axis=1)

        weight, share = at_group(self.weight), at_group(amount)
        per_question = np.divide(share, weight, out=np.zeros_like(share), where=weight > 0)
        return at_group(amount_through) - share + (positions - (at_group(self.ends) - weight)) * per_question

    def auroc(self) -> np.ndarray:
        """(B,) probability that a correct answer is more confident than a wrong one, ties one half."""
        wrong = self.weight - self.correct
        wrong_below = (self.ends - self.correct_through) - wrong
        wins = (self.correct * (wrong_below + 0.5 * wrong)).sum(axis=1)
        return _divide(wins, self.correct_through[:, -1] * (self.total - self.correct_through[:, -1]))

    def aurc(self) -> np.ndarray:
        """(B,) area under the risk-coverage curve; see ``aurc``."""
        total = self.total[:, None]
        # coverage runs from the most confident group: a group starts after every more confident one
        begins = (total - self.ends).astype(np.int64)
        stops = begins + self.weight.astype(np.int64)
        harmonic = np.concatenate([[0.0], np.cumsum(1.0 / np.arange(1, int(total.max(initial=0)) + 1))])
        # S(m) = H(0) + ... + H(m - 1) = m (H(m) - 1)
        partial_sums = np.arange(len(harmonic)) * (harmonic - 1.0)
        errors = self.weight - self.correct
        rate = np.divide(errors, self.weight, out=np.zeros_like(errors), where=self.weight > 0)
        error_total = total[:, 0] - self.correct_through[:, -1]
        spread = (rate * (partial_sums[stops] - partial_sums[begins])).sum(axis=1)
        risk_sum = error_total * harmonic[total[:, 0].astype(np.int64)] - spread
        return _divide(risk_sum, total[:, 0])


def bin_totals(
    confidence: np.ndarray,
    correct: np.ndarray,
    bins: int = 15,
    binning: Binning = "width",
    weights: np.ndarray | None = None,
) -> BinTotals:
    """Per-bin count, confidence sum and correct count (B, bins) under the module's bin conventions."""
    if bins < 1:
        raise ValueError(f"bins must be at least 1, got {bins}")
    if binning == "mass":
        return RankedQuestions(confidence, correct, weights).mass_totals(bins)
    if binning != "width":
        raise ValueError(f"binning must be one of {BINNINGS}, got {binning!r}")
    confidence = _check_confidence(confidence)
    matrix = weight_matrix(weights, len(confidence))
    one_hot = np.zeros((len(confidence), bins))
    one_hot[np.arange(len(confidence)), width_bin_index(confidence, bins)] = 1.0
    correct = np.asarray(correct, dtype=np.float64)
    sums = matrix @ np.concatenate([one_hot, one_hot * confidence[:, None], one_hot * correct[:, None]], axis=1)
    return BinTotals(count=sums[:, :bins], confidence=sums[:, bins : 2 * bins], correct=sums[:, 2 * bins :])


def expected_calibration_error(
    confidence: np.ndarray,
    correct: np.ndarray,
    bins: int = 15,
    binning: Binning = "width",
    weights: np.ndarray | None = None,
) -> float | np.ndarray:
    """Top-label ECE = sum_b (n_b / N) |acc_b - conf_b| (Guo et al. 2017 with ``bins`` bins)."""
    return finish(bin_totals(confidence, correct, bins, binning, weights).ece(), weights)


def maximum_calibration_error(
    confidence: np.ndarray,
    correct: np.ndarray,
    bins: int = 15,
    binning: Binning = "width",
    weights: np.ndarray | None = None,
) -> float | np.ndarray:
    """MCE = max over non-empty bins of |acc_b - conf_b| (NaN with no questions)."""
    return finish(bin_totals(confidence, correct, bins, binning, weights).mce(), weights)


def debiased_calibration_error(
    confidence: np.ndarray,
    correct: np.ndarray,
    bins: int = 15,
    binning: Binning = "mass",
    weights: np.ndarray | None = None,
) -> float | np.ndarray:
    """Debiased top-label L2 calibration error of Kumar, Liang & Ma (2019), "Verified Uncertainty Calibration".

    sqrt(max(0, sum_b (n_b / N) [(acc_b - conf_b)^2 - acc_b (1 - acc_b) / (n_b - 1)])): the binned
    plug-in squared error minus its sampling bias; bins with fewer than 2 questions add 0. This is
    the estimator of their ``uncertainty-calibration`` package (``unbiased_l2_ce``, used by
    ``get_calibration_error(p=2, debias=True)`` with equal-mass bins, its default, hence this
    function's default binning). It is an L2 (root-mean-square) error, not the L1 ECE.
    """
    return finish(bin_totals(confidence, correct, bins, binning, weights).debiased_l2(), weights)


def reliability_curve(confidence: np.ndarray, correct: np.ndarray, bins: int = 15, binning: Binning = "width") -> dict:
    """Reliability diagram data, one entry per bin (empty bins included, with NaN means).

    Returns lists ``lower``/``upper`` (bin edges for equal-width bins; the smallest and largest
    confidence inside each bin for equal-mass bins), ``count``, ``confidence`` (mean) and
    ``accuracy``.
    """
    totals = bin_totals(confidence, correct, bins, binning)
    if binning == "width":
        edges = np.linspace(0.0, 1.0, bins + 1)
        lower, upper = edges[:-1], edges[1:]
    else:
        sorted_confidence = np.sort(_check_confidence(confidence))
        cuts = np.concatenate([[0], np.cumsum(totals.count[0])]).astype(np.int64)
        nonempty = cuts[1:] > cuts[:-1]
        lower = np.where(nonempty, sorted_confidence[np.minimum(cuts[:-1], len(sorted_confidence) - 1)], np.nan)
        upper = np.where(nonempty, sorted_confidence[np.maximum(cuts[1:] - 1, 0)], np.nan)
    return {
        "lower": lower.tolist(),
        "upper": upper.tolist(),
        "count": totals.count[0].astype(np.int64).tolist(),
        "confidence": totals.mean_confidence[0].tolist(),
        "accuracy": totals.accuracy[0].tolist(),
    }


def auroc(confidence: np.ndarray, correct: np.ndarray, weights: np.ndarray | None = None) -> float | np.ndarray:
    """Area under the ROC curve of confidence as a score for correctness (Mann-Whitney, ties one half)."""
    return finish(RankedQuestions(confidence, correct, weights).auroc(), weights)


def aurc(confidence: np.ndarray, correct: np.ndarray, weights: np.ndarray | None = None) -> float | np.ndarray:
    """Area under the risk-coverage curve: mean error rate of the k most confident, k = 1..N.

    sum_k E(k) / k = sum over errors at coverage position p of (H(N) - H(p - 1)), H the harmonic
    numbers. Within a group of w tied questions holding e errors each position holds e / w
    expected errors, so a group at positions s + 1..s + w adds e H(N) - (e / w)(S(s + w) - S(s))
    with S(m) = H(0) + ... + H(m - 1); exact for integer weights.
    """
    return finish(RankedQuestions(confidence, correct, weights).aurc(), weights)


def loyalty(answers: np.ndarray, reference: np.ndarray, weights: np.ndarray | None = None) -> float | np.ndarray:
    """Share of questions whose answer equals the reference run's answer to the same question.

    EffiVLM-Bench's loyalty (Wang et al., ACL 2025, arXiv 2506.00479; github.com/EffiVLM-Bench/EffiVLM-Bench,
    README at commit 5781b7d names it beside performance and generalisation): the accelerated model's outputs are
    scored against the uncompressed model's outputs in place of the labels; their lmms-eval ``from_log`` model
    (LoverLost/EffiVLM-Bench commit e7819c3) replays a logged run's responses for that. Here the reference is the
    dense run of the same questions and the score is exact match of ``answers`` and ``reference``, both (n,)
    arrays compared elementwise as given (the caller passes them as its task normalises them, the task's own
    scoring rule: POPE's yes/no, GQA's normalised string, ScienceQA's letter). ``weights``: (B, n) bootstrap
    multiplicities or None. No questions: NaN.
    """
    return weighted_mean(np.asarray(answers) == np.asarray(reference), weights)


ANSWER_TOKEN = re.compile(r"\w+")
"""A token of the token-overlap loyalty: a run of letters, digits or underscores, lower-cased (punctuation and
white space separate tokens and count for nothing)."""


def answer_tokens(text: str) -> Counter[str]:
    """The multiset of lower-cased word tokens of ``text`` (``ANSWER_TOKEN``)."""
    return Counter(ANSWER_TOKEN.findall(str(text).lower()))


def token_f1(answer: str, reference: str) -> float:
    """Token-level F1 of two texts: 2 |A & R| / (|A| + |R|) over their token multisets (``answer_tokens``; a
    repeated token counts as often as both hold it). Two texts without tokens agree (1.0); one without: 0.0."""
    mine, theirs = answer_tokens(answer), answer_tokens(reference)
    total = sum(mine.values()) + sum(theirs.values())
    return 1.0 if total == 0 else 2.0 * sum((mine & theirs).values()) / total


def loyalty_overlap(
    answers: np.ndarray, reference: np.ndarray, weights: np.ndarray | None = None
) -> float | np.ndarray:
    """Token-overlap loyalty for generated answers: the mean over questions of ``token_f1`` between each answer
    (n,) and the reference run's answer (n,) to the same question, as SQuAD's token F1 compares a prediction with
    a reference. This variant is prune-audit's own (EffiVLM-Bench scores free text with each benchmark's metric):
    it credits a caption that says the dense caption's things in other words or order, which exact match
    (``loyalty``) does not. ``weights``: (B, n) bootstrap multiplicities or None. No questions: NaN."""
    scores = np.array([token_f1(mine, theirs) for mine, theirs in zip(answers, reference)], dtype=np.float64)
    return weighted_mean(scores, weights)
