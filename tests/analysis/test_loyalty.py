"""Issue 41 item 3: loyalty (EffiVLM-Bench), the share of answers equal to the dense run's, and its token-F1 form.

Hand-computed cases of the pure metrics (ties, repeated tokens, empty input, an image-clustered interval small
enough to enumerate), then where ``calibrate`` reports them.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest
from test_calibrate_cli import frame, write_run
from typer.testing import CliRunner

from prune_audit.analysis import metrics
from prune_audit.analysis.bootstrap import bootstrap_replicates, image_counts, percentile_interval
from prune_audit.analysis.calibration import CalibrationSettings, question_metrics
from prune_audit.analysis.questions import QuestionTable
from prune_audit.cli.main import app

runner = CliRunner()


def test_loyalty_is_the_share_of_answers_equal_to_the_reference():
    assert metrics.loyalty(np.array(["yes", "no", "yes", "no"]), np.array(["yes", "yes", "yes", "no"])) == 0.75
    same = np.array(["a cat", "two", "no"])
    assert metrics.loyalty(same, same.copy()) == 1.0  # every answer tied with the reference's
    assert metrics.loyalty(np.array([True, False]), np.array([False, True])) == 0.0  # POPE's yes/no as booleans


def test_loyalty_of_no_questions_is_nan():
    assert math.isnan(metrics.loyalty(np.array([], dtype=str), np.array([], dtype=str)))
    assert math.isnan(metrics.loyalty_overlap(np.array([], dtype=str), np.array([], dtype=str)))


def test_token_f1_by_hand():
    # tokens {a: 2, dog: 2, and: 1} against {a: 1, dog: 1}: 2 shared of 5 + 2 -> 2 * 2 / 7
    assert metrics.token_f1("a dog and a dog", "a dog") == pytest.approx(4 / 7)
    assert metrics.token_f1("A dog.", "a dog") == 1.0  # case and punctuation do not count
    assert metrics.token_f1("dog a", "a dog") == 1.0  # order does not count
    assert metrics.token_f1("", ".") == 1.0  # neither has a token: they agree
    assert metrics.token_f1("", "a dog") == 0.0
    assert metrics.token_f1("a cat", "a dog") == 0.5
    answers, reference = np.array(["a cat", "a dog", ""]), np.array(["a dog", "a dog", "x"])
    assert metrics.loyalty_overlap(answers, reference) == pytest.approx((0.5 + 1.0 + 0.0) / 3)


def test_weighted_loyalty_counts_each_question_its_weight_times():
    answers, reference = np.array(["yes", "no", "no"]), np.array(["yes", "yes", "no"])
    weights = np.array([[1, 1, 1], [2, 0, 0], [0, 3, 1], [0, 0, 0]])
    values = metrics.loyalty(answers, reference, weights)
    assert values[:3] == pytest.approx([2 / 3, 1.0, 1 / 4]) and math.isnan(values[3])


def test_image_clustered_interval_on_two_images():
    """Image 1 holds two answers equal to the reference's, image 2 one of two: a resample draws (2, 0), (1, 1) or
    (0, 2) copies of the images, so loyalty is 1, 3/4 or 1/2, and the interval spans what was drawn."""
    answers, reference = np.array(["a", "b", "c", "d"]), np.array(["a", "b", "c", "x"])
    image_index = np.array([0, 0, 1, 1])
    counts = image_counts(2, 400, seed=0)
    replicates = bootstrap_replicates(
        lambda w: {"loyalty": metrics.loyalty(answers, reference, w)}, image_index, counts
    )["loyalty"]
    expected = (2 * counts[:, 0] + counts[:, 1]) / (2 * counts.sum(axis=1))
    assert replicates == pytest.approx(expected)
    assert set(np.round(replicates, 6)) == {1.0, 0.75, 0.5}
    low, high = percentile_interval(replicates)
    assert (low, high) == (0.5, 1.0)  # each extreme is drawn with probability 1/4, far beyond the 2.5% tails


def _table(answers: list[str], correct: list[bool], generated: bool) -> QuestionTable:
    n = len(answers)
    confidence = np.linspace(0.3, 0.9, n)
    return QuestionTable(
        split=np.array(["all"] * n),
        question_id=np.arange(n),
        image_id=np.arange(n) // 2,
        label_yes=np.array(correct),
        answer_yes=np.ones(n, dtype=bool),
        correct=np.array(correct),
        confidence=confidence,
        p_yes=confidence,
        logit_diff=np.log(confidence / (1 - confidence)),
        retention=np.full(n, np.nan),
        lost=np.full(n, np.nan),
        diluted=np.full(n, np.nan),
        cost_tokens=np.ones(n),
        flops=np.ones(n),
        latency_ms=np.ones(n),
        answer=np.array(answers),
        top_label=True,
        generated=generated,
    )


def test_question_metrics_report_loyalty_only_against_a_reference():
    settings = CalibrationSettings(bins=2, bootstrap=10)
    pruned = _table(["a red car", "two", "a dog", "yes"], [True, False, True, True], generated=True)
    dense = _table(["a car", "two", "a dog", "no"], [True, True, True, False], generated=True)
    alone = question_metrics(pruned, settings)
    assert "loyalty" not in alone and "loyalty_overlap" not in alone
    paired = question_metrics(pruned, settings, reference=dense)
    assert paired["loyalty"] == 0.5
    assert paired["loyalty_overlap"] == pytest.approx((0.8 + 1.0 + 1.0 + 0.0) / 4)
    letters = _table(["A", "B"], [True, False], generated=False)  # a letter choice: exact match only
    assert "loyalty_overlap" not in question_metrics(letters, settings, reference=letters)


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    root = tmp_path_factory.mktemp("loyalty")
    runs = {
        "pruned": write_run(root / "pruned", seed=1, strength=1.5, tokens=100),
        "dense": write_run(root / "dense", seed=2, strength=3.0, tokens=600, selector=None, budget=None),
    }
    out = root / "calibration"
    arguments = ["calibrate", str(runs["pruned"]), "--reference", str(runs["dense"]), "--bootstrap", "200"]
    result = runner.invoke(app, [*arguments, "--out", str(out)])
    assert result.exit_code == 0, result.output
    return runs, out, result.stdout


def test_calibrate_reports_loyalty_beside_accuracy(calibrated):
    runs, out, printed = calibrated
    report = json.loads((out / "calibration.json").read_text())
    pruned, dense = frame(runs["pruned"]), frame(runs["dense"])
    paired = pruned.merge(dense, on=["split", "question_id"], suffixes=("", "_dense"))
    loyalty = report["runs"][0]["metrics"]["all"]["loyalty"]
    assert loyalty["value"] == pytest.approx((paired["answer"] == paired["answer_dense"]).mean())
    assert loyalty["ci95"][0] < loyalty["value"] < loyalty["ci95"][1]
    assert "loyalty_overlap" not in report["runs"][0]["metrics"]["all"]  # POPE's answers are not generated
    assert "loyalty" not in report["reference"]["metrics"]["all"]
    assert "loyalty" not in report["runs"][0]["difference_vs_reference"]["metrics"]["all"]
    assert "EffiVLM-Bench" in report["conventions"]["loyalty"]
    table = pd.read_csv(out / "calibration.csv")
    row = table[(table.metric == "loyalty") & (table.section == "metrics")]
    assert list(row.run) == ["divprune@64"] and row.value.iloc[0] == pytest.approx(loyalty["value"])
    line = next(line for line in printed.splitlines() if line.strip("│┃ ").startswith("loyalty"))
    assert f"{loyalty['value']:.3f}" in line


def test_calibrate_without_reference_shows_no_loyalty_row(calibrated, tmp_path):
    runs, _, _ = calibrated
    result = runner.invoke(app, ["calibrate", str(runs["pruned"]), "--bootstrap", "20", "--out", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    assert "loyalty" not in result.stdout
