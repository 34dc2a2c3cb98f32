"""Calibration metrics, temperature scaling and the image-clustered bootstrap, against reference libraries."""

import itertools

import numpy as np
import pytest
from sklearn.calibration import calibration_curve
from sklearn.metrics import f1_score, log_loss, precision_score, recall_score, roc_auc_score

from prune_audit.analysis import metrics
from prune_audit.analysis.bootstrap import bootstrap_replicates, estimate, image_counts, percentile_interval
from prune_audit.analysis.calibration import CalibrationSettings, calibration_audit
from prune_audit.analysis.outputs import estimates, to_json
from prune_audit.analysis.questions import QuestionTable
from prune_audit.analysis.temperature import fit_temperature, scaled_probabilities, split_images
from prune_audit.errors import PruneAuditError


def two_way_sample(n, seed, temperature=1.0):
    """Logits, labels drawn from sigmoid(d / temperature), answers, correctness, confidences."""
    rng = np.random.default_rng(seed)
    logit_diff = rng.normal(0.0, 3.0, n)
    label_yes = rng.random(n) < 1.0 / (1.0 + np.exp(-logit_diff / temperature))
    answer_yes = logit_diff > 0
    p_yes = 1.0 / (1.0 + np.exp(-logit_diff))
    confidence = np.maximum(p_yes, 1.0 - p_yes)
    return logit_diff, label_yes, answer_yes, answer_yes == label_yes, confidence, p_yes


def direct_ece(confidence, correct, edges):
    """Plain loop over bins (lower, upper], with confidence 0 counted in the first bin."""
    total = 0.0
    for k in range(len(edges) - 1):
        inside = (confidence > edges[k]) & (confidence <= edges[k + 1])
        if k == 0:
            inside |= confidence == 0
        if inside.any():
            total += inside.sum() / len(confidence) * abs(correct[inside].mean() - confidence[inside].mean())
    return total


# netcal 1.4's ECE on two_way_sample(2000, seed=1, temperature=2.0), pinned so the test extra does not
# pull netcal (tensorboard, pyro, gpytorch). Recompute with netcal==1.4.0 installed:
#   python -c "import sys; sys.path.insert(0, 'tests'); import numpy as np; from netcal.metrics import ECE; \
#   from test_calibration import two_way_sample as s; _, y, _, c, p, q = s(2000, 1, 2.0); \
#   print(ECE(bins=15).measure(p, c.astype(int)), ECE(bins=15).measure(np.stack([1 - q, q], 1), y.astype(int)))"
# netcal reads 1-D input as p(class 1) with "matched" = (y == 1): top-label ECE with y = correct;
# two columns with binary labels give the p(yes) reliability ECE instead.
NETCAL_TOP_LABEL_ECE = 0.11290164703485855
NETCAL_P_YES_ECE = 0.11801246332450414


def test_ece_matches_pinned_netcal_values_and_a_direct_loop():
    _, label_yes, _, correct, confidence, p_yes = two_way_sample(2000, seed=1, temperature=2.0)
    ours = metrics.expected_calibration_error(confidence, correct, bins=15)
    assert ours == pytest.approx(NETCAL_TOP_LABEL_ECE, abs=1e-12)
    assert ours == pytest.approx(direct_ece(confidence, correct, np.linspace(0, 1, 16)), abs=1e-12)
    assert ours > 0.02  # labels drawn at T = 2 make the T = 1 confidences overconfident
    p_yes_ece = metrics.expected_calibration_error(p_yes, label_yes, bins=15)
    assert p_yes_ece == pytest.approx(NETCAL_P_YES_ECE, abs=1e-12)
    assert p_yes_ece == pytest.approx(direct_ece(p_yes, label_yes, np.linspace(0, 1, 16)), abs=1e-12)


def test_bin_edges_are_upper_inclusive_with_zero_and_one_inside():
    edges = np.linspace(0.0, 1.0, 16)
    index = metrics.width_bin_index(np.concatenate([edges, [0.5 + 1e-12]]), 15)
    assert index[0] == 0 and index[-2] == 14  # 0 in the first bin, 1.0 in the last
    assert list(index[1:-2]) == list(range(14))  # an inner edge k/15 belongs to bin k-1
    assert index[-1] == 7  # just above 0.5 = edge 7.5/15 lies in (7/15, 8/15]
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        metrics.width_bin_index(np.array([1.5]), 15)


def test_reliability_curve_matches_scikit_learn_including_edge_values():
    _, _, _, correct, confidence, _ = two_way_sample(3000, seed=2)
    confidence = np.concatenate([confidence, np.linspace(0.5, 1.0, 8), [1.0, 1.0]])
    correct = np.concatenate([correct, np.ones(10, dtype=bool)])
    curve = metrics.reliability_curve(confidence, correct, bins=15)
    accuracy, mean_confidence = calibration_curve(correct, confidence, n_bins=15, strategy="uniform")
    nonempty = np.array(curve["count"]) > 0
    assert np.allclose(np.array(curve["accuracy"])[nonempty], accuracy)
    assert np.allclose(np.array(curve["confidence"])[nonempty], mean_confidence)
    assert sum(curve["count"]) == len(confidence)
    assert curve["lower"][7] == pytest.approx(7 / 15) and curve["upper"][14] == 1.0


def test_equal_mass_ece_matches_array_split_and_ignores_tie_order():
    _, _, _, correct, confidence, _ = two_way_sample(1003, seed=3)
    order = np.argsort(confidence)
    chunks = np.array_split(order, 15)
    expected = sum(len(c) / 1003 * abs(correct[c].mean() - confidence[c].mean()) for c in chunks)
    assert metrics.expected_calibration_error(confidence, correct, 15, "mass") == pytest.approx(expected, abs=1e-12)
    mce = max(abs(correct[c].mean() - confidence[c].mean()) for c in chunks)
    assert metrics.maximum_calibration_error(confidence, correct, 15, "mass") == pytest.approx(mce, abs=1e-12)
    # a block of ties straddling a cut: any order of the tied questions gives the same value
    tied = np.round(confidence, 1)
    values = {
        round(metrics.expected_calibration_error(tied[p], correct[p], 15, "mass"), 12)
        for p in (np.arange(1003), np.random.default_rng(0).permutation(1003), np.arange(1003)[::-1])
    }
    assert len(values) == 1


def test_mce_is_the_worst_bin():
    confidence = np.array([0.55, 0.56, 0.95, 0.97, 0.99])
    correct = np.array([1, 0, 0, 1, 1], dtype=bool)
    # bins (8/15, 9/15] holds the first two, (14/15, 1] the last three
    worst = max(abs(0.5 - 0.555), abs(2 / 3 - np.mean([0.95, 0.97, 0.99])))
    assert metrics.maximum_calibration_error(confidence, correct, 15) == pytest.approx(worst)


def direct_debiased(confidence, correct, bins):
    order = np.argsort(confidence)
    total = 0.0
    for chunk in np.array_split(order, bins):
        if len(chunk) >= 2:
            accuracy = correct[chunk].mean()
            gap = (accuracy - confidence[chunk].mean()) ** 2 - accuracy * (1 - accuracy) / (len(chunk) - 1)
            total += len(chunk) / len(confidence) * gap
    return np.sqrt(max(total, 0.0))


def test_debiased_error_matches_formula_and_removes_the_plug_in_bias():
    _, _, _, correct, confidence, _ = two_way_sample(600, seed=4, temperature=1.5)
    assert metrics.debiased_calibration_error(confidence, correct, 15) == pytest.approx(
        direct_debiased(confidence, correct, 15), abs=1e-12
    )
    # perfectly calibrated data: the plug-in L2 error stays well above 0, the debiased one near 0
    rng = np.random.default_rng(5)
    plug_in, debiased = [], []
    for _ in range(40):
        conf = rng.uniform(0.5, 1.0, 300)
        right = rng.random(300) < conf
        totals = metrics.bin_totals(conf, right, 15, "mass")
        plug_in.append(np.sqrt(np.sum(totals.count * (totals.accuracy - totals.mean_confidence) ** 2) / 300))
        debiased.append(metrics.debiased_calibration_error(conf, right, 15))
    assert np.mean(debiased) < 0.5 * np.mean(plug_in)
    # a constant gap is recovered: confidence 0.9, accuracy 0.7
    conf = np.full(20000, 0.9)
    right = rng.random(20000) < 0.7
    assert metrics.debiased_calibration_error(conf, right, 15) == pytest.approx(0.2, abs=0.01)


def test_auroc_matches_scikit_learn_with_ties():
    _, _, _, correct, confidence, _ = two_way_sample(1500, seed=6)
    assert metrics.auroc(confidence, correct) == pytest.approx(roc_auc_score(correct, confidence), abs=1e-12)
    tied = np.round(confidence, 2)
    assert metrics.auroc(tied, correct) == pytest.approx(roc_auc_score(correct, tied), abs=1e-12)
    assert np.isnan(metrics.auroc(confidence, np.ones(1500, dtype=bool)))


def test_aurc_matches_risk_coverage_without_ties_and_tie_order_average():
    _, _, _, correct, confidence, _ = two_way_sample(500, seed=7)
    order = np.argsort(-confidence)
    risks = np.cumsum(~correct[order]) / np.arange(1, 501)
    assert metrics.aurc(confidence, correct) == pytest.approx(risks.mean(), abs=1e-12)
    confidence = np.array([0.9, 0.9, 0.9, 0.7, 0.7, 0.6])
    correct = np.array([1, 0, 1, 0, 1, 1], dtype=bool)
    over_orders = []
    for first in itertools.permutations(range(3)):
        for second in itertools.permutations(range(3, 5)):
            wrong = ~correct[list(first) + list(second) + [5]]
            over_orders.append(np.mean(np.cumsum(wrong) / np.arange(1, 7)))
    assert metrics.aurc(confidence, correct) == pytest.approx(np.mean(over_orders), abs=1e-12)


def test_brier_nll_and_pope_scores_against_scikit_learn():
    logit_diff, label_yes, answer_yes, correct, confidence, p_yes = two_way_sample(800, seed=8)
    assert metrics.brier(p_yes, label_yes) == pytest.approx(np.mean((p_yes - label_yes) ** 2))
    assert metrics.brier(p_yes, label_yes) == pytest.approx(np.mean((confidence - correct) ** 2))
    assert metrics.nll(logit_diff, label_yes) == pytest.approx(log_loss(label_yes, p_yes), rel=1e-9)
    scores = metrics.pope_scores(label_yes, answer_yes)
    assert scores["accuracy"] == pytest.approx(np.mean(correct))
    assert scores["precision"] == pytest.approx(precision_score(label_yes, answer_yes))
    assert scores["recall"] == pytest.approx(recall_score(label_yes, answer_yes))
    assert scores["f1"] == pytest.approx(f1_score(label_yes, answer_yes))
    assert scores["yes_ratio"] == pytest.approx(np.mean(answer_yes))
    assert np.isnan(metrics.pope_scores(label_yes, np.zeros(800, dtype=bool))["precision"])


def test_pope_scores_agree_with_the_data_layer_when_present():
    pope = pytest.importorskip("prune_audit.data.pope", reason="prune_audit.data.pope not written yet")
    _, label_yes, answer_yes, _, _, _ = two_way_sample(300, seed=9)
    theirs = pope.pope_metrics(np.where(label_yes, "yes", "no"), np.where(answer_yes, "yes", "no"))
    ours = metrics.pope_scores(label_yes, answer_yes)
    for name in ("accuracy", "precision", "recall", "f1", "yes_ratio"):
        assert ours[name] == pytest.approx(theirs[name])


WEIGHTED_METRICS = {
    "ece_width": lambda c, r, w: metrics.expected_calibration_error(c, r, 15, "width", w),
    "ece_mass": lambda c, r, w: metrics.expected_calibration_error(c, r, 7, "mass", w),
    "mce_mass": lambda c, r, w: metrics.maximum_calibration_error(c, r, 7, "mass", w),
    "debiased": lambda c, r, w: metrics.debiased_calibration_error(c, r, 7, "mass", w),
    "auroc": lambda c, r, w: metrics.auroc(c, r, w),
    "aurc": lambda c, r, w: metrics.aurc(c, r, w),
    "accuracy": lambda c, r, w: metrics.weighted_mean(r, w),
}


@pytest.mark.parametrize("name", sorted(WEIGHTED_METRICS))
def test_weights_equal_materialised_duplicates(name):
    function = WEIGHTED_METRICS[name]
    rng = np.random.default_rng(10)
    confidence = np.round(rng.uniform(0.5, 1.0, 60), 2)  # many ties, some straddling cuts
    correct = rng.random(60) < confidence
    weights = rng.integers(0, 4, size=(5, 60))
    batched = function(confidence, correct, weights)
    for row, value in zip(weights, batched):
        rows = np.repeat(np.arange(60), row)
        assert value == pytest.approx(function(confidence[rows], correct[rows], None), abs=1e-12)


def test_temperature_fit_matches_a_brute_force_grid_and_recovers_the_truth():
    logit_diff, label_yes, answer_yes, correct, confidence, _ = two_way_sample(10000, seed=11, temperature=2.5)
    fit = fit_temperature(logit_diff, label_yes)
    grid = np.exp(np.linspace(np.log(0.5), np.log(10.0), 6001))
    sign = np.where(label_yes, 1.0, -1.0)
    losses = [np.logaddexp(0.0, -sign * logit_diff / part[:, None]).mean(axis=1) for part in np.array_split(grid, 60)]
    best = grid[int(np.argmin(np.concatenate(losses)))]
    assert fit.temperature == pytest.approx(best, rel=1e-3)  # the grid step is 5e-4 in log T
    assert fit.temperature == pytest.approx(2.5, rel=0.05)
    assert fit.nll_after < fit.nll_before and not fit.at_bound
    p_scaled, confidence_scaled = scaled_probabilities(logit_diff, fit.temperature)
    assert np.array_equal(p_scaled > 0.5, answer_yes)  # accuracy is invariant
    assert metrics.auroc(confidence_scaled, correct) == pytest.approx(metrics.auroc(confidence, correct), abs=1e-12)
    ece_before = metrics.expected_calibration_error(confidence, correct)
    assert metrics.expected_calibration_error(confidence_scaled, correct) < ece_before


def test_separable_data_hits_the_lower_temperature_bound():
    logit_diff = np.array([-3.0, -1.0, 2.0, 4.0])
    fit = fit_temperature(logit_diff, logit_diff > 0)
    assert fit.at_bound and fit.temperature == pytest.approx(0.01, rel=1e-3)


def test_image_split_is_disjoint_seeded_and_by_image():
    image_ids = np.repeat(np.arange(100, 140), 6)
    calibration, test = split_images(image_ids, 0.5, seed=3)
    assert len(calibration) == len(test) == 20
    assert not set(calibration) & set(test) and set(calibration) | set(test) == set(range(100, 140))
    again = split_images(image_ids[::-1], 0.5, seed=3)
    assert np.array_equal(again[0], calibration)
    assert not np.array_equal(split_images(image_ids, 0.5, seed=4)[0], calibration)
    with pytest.raises(PruneAuditError, match="one side empty"):
        split_images(image_ids, 0.01, seed=0)
    with pytest.raises(PruneAuditError, match="strictly between"):
        split_images(image_ids, 1.0, seed=0)


def test_image_counts_are_reproducible_resamples_of_all_images():
    counts = image_counts(50, 300, seed=12)
    assert counts.shape == (300, 50) and np.all(counts.sum(axis=1) == 50)
    assert np.array_equal(counts, image_counts(50, 300, seed=12))
    assert not np.array_equal(counts, image_counts(50, 300, seed=13))
    # each image is drawn once per resample on average
    assert counts.mean() == pytest.approx(1.0) and abs(counts[:, 0].mean() - 1.0) < 0.2


def test_bootstrap_replicates_equal_explicit_resampling():
    rng = np.random.default_rng(14)
    image_index = np.repeat(np.arange(30), 4)
    correct = rng.random(120) < 0.7
    counts = image_counts(30, 600, seed=15)

    def statistic(weights):
        return {"accuracy": metrics.weighted_mean(correct, weights)}

    replicates = bootstrap_replicates(statistic, image_index, counts)["accuracy"]
    for b in (0, 299, 599):  # across chunk boundaries
        drawn = np.repeat(np.arange(30), counts[b])
        rows = np.concatenate([np.flatnonzero(image_index == image) for image in drawn])
        assert replicates[b] == pytest.approx(correct[rows].mean())
    low, high = percentile_interval(replicates)
    assert (low, high) == pytest.approx(tuple(np.percentile(replicates, [2.5, 97.5])))
    assert estimate(statistic(None)["accuracy"], replicates)["ci95"] == [low, high]


def test_clustered_intervals_are_wider_than_question_level_ones_for_correlated_images():
    rng = np.random.default_rng(16)
    image_right = rng.random(200) < 0.6  # every question of an image shares its outcome
    image_index = np.repeat(np.arange(200), 6)
    correct = image_right[image_index]

    def statistic(weights):
        return {"accuracy": metrics.weighted_mean(correct, weights)}

    clustered = bootstrap_replicates(statistic, image_index, image_counts(200, 1000, seed=0))["accuracy"]
    naive = bootstrap_replicates(statistic, np.arange(1200), image_counts(1200, 1000, seed=0))["accuracy"]
    assert np.std(clustered) > 2.0 * np.std(naive)  # sqrt(6) in theory


def question_table(n_images, seed):
    logit_diff, label_yes, answer_yes, correct, confidence, p_yes = two_way_sample(6 * n_images, seed)
    retention = np.where(label_yes, np.random.default_rng(seed).choice([0.0, 0.2, 0.6], 6 * n_images), np.nan)
    return QuestionTable(
        split=np.tile(["random", "popular"], 3 * n_images),
        question_id=np.arange(6 * n_images),
        image_id=np.repeat(np.arange(n_images) + 100, 6),
        label_yes=label_yes,
        answer_yes=answer_yes,
        correct=correct,
        confidence=confidence,
        p_yes=p_yes,
        logit_diff=logit_diff,
        retention=retention,
        lost=np.where(label_yes, retention == 0.0, np.nan),
        diluted=np.where(label_yes, 0.0, np.nan),
        cost_tokens=np.full(6 * n_images, 50.0),
        flops=np.full(6 * n_images, 1e6),
        latency_ms=np.full(6 * n_images, 5.0),
    )


def test_differences_against_an_identical_reference_are_exactly_zero():
    pruned = question_table(30, seed=17)
    report = calibration_audit([pruned], CalibrationSettings(bootstrap=200, seed=1), reference=pruned)
    differences = report["runs"][0]["difference_vs_reference"]
    values = [leaf for _, leaf in estimates(differences)]
    assert len(values) > 30
    for leaf in values:  # paired resamples: the same images for both, so every replicate difference is 0
        assert leaf["value"] == 0.0 or np.isnan(leaf["value"])
        assert leaf["ci95"] == [0.0, 0.0] or np.isnan(leaf["ci95"][0])
    survival = report["runs"][0]["survival"]
    lost = pruned.lost == 1.0
    assert survival["lost"]["count"]["value"] == lost.sum()
    assert survival["lost"]["accuracy"]["value"] == pytest.approx(pruned.correct[lost].mean())
    assert survival["retention (0, 0.25]"]["confidence"]["value"] == pytest.approx(
        pruned.confidence[pruned.retention == 0.2].mean()
    )
    assert set(report["runs"][0]["metrics"]) == {"all", "random", "popular"}


def test_same_seed_same_audit_other_seed_other_intervals():
    table = question_table(20, seed=19)
    first, again, other = (calibration_audit([table], CalibrationSettings(bootstrap=100, seed=s)) for s in (3, 3, 4))
    assert to_json(first) == to_json(again)
    one, two = (report["runs"][0]["metrics"]["all"]["accuracy"] for report in (first, other))
    assert one["value"] == two["value"] and one["ci95"] != two["ci95"]


def test_a_reference_over_other_questions_is_refused_before_any_work():
    pruned = question_table(10, seed=18)
    other = QuestionTable(**{**pruned.columns(), "question_id": np.r_[pruned.question_id[:-1], 10_000]})
    with pytest.raises(PruneAuditError, match=r"1 missing, 1 extra"):
        calibration_audit([pruned], CalibrationSettings(bootstrap=10), reference=other)
