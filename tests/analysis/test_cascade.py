"""Confidence-gated cascade: CRC thresholds, monotone losses, cost accounting and validity."""

import numpy as np
import pytest

from prune_audit.analysis.cascade import (
    CascadeQuestions,
    answering_stage,
    cascade_audit,
    crc_thresholds,
    evaluate_policy,
    image_loss_curve,
    loss_jumps,
    question_loss,
    split_masks,
)
from prune_audit.analysis.questions import QuestionTable
from prune_audit.errors import PruneAuditError


def table(image_id, answer_yes, confidence, tokens, label_yes=None):
    n = len(image_id)
    label_yes = np.ones(n, dtype=bool) if label_yes is None else label_yes
    return QuestionTable(
        split=np.full(n, "random"),
        question_id=np.arange(n),
        image_id=np.asarray(image_id),
        label_yes=label_yes,
        answer_yes=np.asarray(answer_yes, dtype=bool),
        correct=np.asarray(answer_yes, dtype=bool) == label_yes,
        confidence=np.asarray(confidence, dtype=np.float64),
        p_yes=np.where(answer_yes, confidence, 1 - np.asarray(confidence)),
        logit_diff=np.zeros(n),
        retention=np.full(n, np.nan),
        lost=np.full(n, np.nan),
        diluted=np.full(n, np.nan),
        cost_tokens=np.full(n, tokens) if np.isscalar(tokens) else np.asarray(tokens),
        flops=np.full(n, 1e6),
        latency_ms=np.full(n, 5.0),
    )


def synthetic_cascade(images, per_image, seed, informative=True):
    """A pruned run whose disagreement with the dense run falls with its confidence (or not)."""
    rng = np.random.default_rng(seed)
    n = images * per_image
    image_id = np.repeat(np.arange(images) * 3 + 5, per_image)
    confidence = rng.uniform(0.5, 1.0, n)
    chance = 0.9 * (1.0 - confidence) * 2 if informative else np.full(n, 0.2)
    disagree = rng.random(n) < chance
    dense_answer = rng.random(n) < 0.5
    pruned = table(image_id, dense_answer ^ disagree, confidence, 40)
    dense = table(image_id, dense_answer, np.full(n, 0.9), 100)
    return pruned, dense


def direct_crc(confidence, disagree, image, epsilon):
    """The reference formula, looping over candidate thresholds and images."""
    images = np.unique(image)
    n = len(images)
    for t in np.unique(np.concatenate([[0.0], confidence])):
        losses = [np.mean((confidence[image == j] > t) & disagree[image == j]) for j in images]
        if n / (n + 1) * np.mean(losses) + 1 / (n + 1) <= epsilon:
            return t
    return None


def lhat_on_grid(loss_table, grid, epsilon):
    """conformal-risk's rule: on a grid where mean loss grows along the grid, the index before the first
    value whose adjusted risk reaches epsilon (written from its description, with B = 1)."""
    n = len(loss_table)
    adjusted = n / (n + 1) * loss_table.mean(axis=0) + 1 / (n + 1)
    return grid[max(int(np.argmax(adjusted > epsilon)) - 1, 0)]


@pytest.mark.parametrize("seed", range(5))
def test_crc_threshold_matches_the_reference_formula(seed):
    pruned, dense = synthetic_cascade(images=40, per_image=6, seed=seed)
    questions = CascadeQuestions.from_tables([pruned], dense)
    calibration = np.random.default_rng(seed).random(40) < 0.5
    rows = calibration[questions.image_index]
    confidence, disagree = questions.confidence[0][rows], questions.disagree[0][rows]
    image = questions.image_index[rows]
    epsilons = np.array([0.06, 0.1, 0.2, 0.3])
    ours = crc_thresholds(loss_jumps(questions), calibration, epsilons)
    grid = np.unique(np.concatenate([[0.0], confidence]))[::-1]  # mean loss grows as t falls
    loss_table = np.array(
        [[np.mean((confidence[image == j] > t) & disagree[image == j]) for t in grid] for j in np.unique(image)]
    )
    for epsilon, threshold in zip(epsilons, ours):
        assert threshold == direct_crc(confidence, disagree, image, epsilon)
        assert threshold == lhat_on_grid(loss_table, grid, epsilon)


def test_single_stage_losses_are_monotone_and_multi_stage_ones_are_monotonised():
    pruned, dense = synthetic_cascade(images=30, per_image=6, seed=1)
    questions = CascadeQuestions.from_tables([pruned], dense)
    for j in range(30):
        rows = questions.image_index == j
        levels, monotone = image_loss_curve(questions.confidence[:, rows], questions.disagree[:, rows])
        raw = question_loss(questions.disagree[:, rows], answering_stage(questions.confidence[:, rows], levels))
        assert np.array_equal(raw.mean(axis=1), monotone)
        assert np.all(np.diff(monotone) <= 0) and monotone[-1] == 0
    # stage 1 agrees at 0.8, stage 2 disagrees at 0.9: raising t past 0.8 hands the question to stage 2
    confidence = np.array([[0.8], [0.9]])
    disagree = np.array([[False], [True]])
    levels, monotone = image_loss_curve(confidence, disagree)
    assert levels.tolist() == [0.0, 0.8, 0.9]
    raw = question_loss(disagree, answering_stage(confidence, levels)).mean(axis=1)
    assert raw.tolist() == [0.0, 1.0, 0.0]
    assert monotone.tolist() == [1.0, 1.0, 0.0]


def test_policy_costs_and_stages():
    image_id = [1, 1, 2, 2]
    dense = table(image_id, [True, True, False, False], [0.9] * 4, 100)
    small = table(image_id, [True, False, False, True], [0.95, 0.6, 0.7, 0.99], 30)
    large = table(image_id, [True, True, False, True], [0.9, 0.85, 0.6, 0.9], 60)
    questions = CascadeQuestions.from_tables([small, large], dense)
    assert answering_stage(questions.confidence, 0.8).tolist() == [0, 1, 2, 0]
    outcome = evaluate_policy(questions, np.array([True, True]), 0.8)
    # question 4 is answered by the small stage and disagrees: image 2 loses 1/2
    assert outcome["disagreement"] == pytest.approx((0 + 0.5) / 2)
    assert outcome["escalation_rate"] == 0.25
    assert outcome["answered_by"].tolist() == [0.5, 0.25, 0.25]
    assert outcome["relative_cost"] == pytest.approx((30 + 90 + 190 + 30) / 400)
    assert "savings_share" not in outcome  # defined for two-stage cascades only
    single = CascadeQuestions.from_tables([small], dense)
    outcome = evaluate_policy(single, np.array([True, True]), 0.8)
    assert outcome["relative_cost"] == pytest.approx((30 + 130 + 130 + 30) / 400)
    # D = 1/2, realised r = 1/4: random escalation needs 1/2 of all questions, perfect 1/2 of the two disagreeing
    assert outcome["uninformative_cost"] == pytest.approx(120 / 400 + 0.5)
    assert outcome["perfect_cost"] == pytest.approx(120 / 400 + 0.5 * 200 / 400)
    assert outcome["savings_share"] == pytest.approx((0.8 - 0.8) / (0.8 - 0.55))


def test_validity_on_synthetic_data_with_known_behaviour():
    pruned, dense = synthetic_cascade(images=300, per_image=6, seed=2)
    results = cascade_audit([pruned], dense, [0.05, 0.1], splits=150, seed=3)
    for result in results:
        checks = result["validity"]
        # CRC bounds the expected held-out disagreement; the mean over 150 splits estimates it closely
        assert checks["mean_disagreement"] <= result["epsilon"] + 0.003
        assert checks["mean_disagreement"] > result["epsilon"] - 0.03  # not vacuously conservative
        assert checks["worst_disagreement"] >= checks["mean_disagreement"]
        assert result["relative_cost"] < 1.4
    assert results[0]["relative_cost"] > results[1]["relative_cost"]  # a looser target saves more
    # informative confidence recovers much of the possible savings, an uninformative one little
    assert results[1]["savings_share"] > 0.3
    blind, dense = synthetic_cascade(images=300, per_image=6, seed=2, informative=False)
    assert abs(cascade_audit([blind], dense, [0.1], splits=20, seed=3)[0]["savings_share"]) < 0.25


def test_an_always_agreeing_pruned_model_never_escalates():
    pruned, dense = synthetic_cascade(images=50, per_image=6, seed=4)
    agreeing = table(pruned.image_id, dense.answer_yes, pruned.confidence, 40)
    result = cascade_audit([agreeing], dense, [0.05], splits=10)[0]
    assert result["threshold"] == 0.0 and result["escalation_rate"] == 0.0
    assert result["relative_cost"] == pytest.approx(0.4)


def test_infeasible_targets_are_clear_errors():
    pruned, dense = synthetic_cascade(images=20, per_image=6, seed=5)
    with pytest.raises(PruneAuditError, match=r"infeasible with 10 calibration images.*1/\(n\+1\) = 0.09091"):
        cascade_audit([pruned], dense, [0.05], splits=5)
    # exactly 1/(n+1) is feasible and admits only thresholds without loss on the calibration images
    edge = cascade_audit([pruned], dense, [1 / 11], splits=5)[0]
    questions = CascadeQuestions.from_tables([pruned], dense)
    calibration, _ = split_masks(questions.image_ids, 0.5, seed=0)
    assert evaluate_policy(questions, calibration, edge["threshold"])["disagreement"] == 0.0
    with pytest.raises(PruneAuditError, match="strictly between 0 and 1"):
        cascade_audit([pruned], dense, [1.5], splits=5)
    other = table(np.arange(len(pruned)), dense.answer_yes, pruned.confidence, 40)
    mismatched = QuestionTable(**{**other.columns(), "question_id": other.question_id + 1000})
    with pytest.raises(PruneAuditError, match="same questions"):
        cascade_audit([mismatched], dense, [0.2], splits=5)
