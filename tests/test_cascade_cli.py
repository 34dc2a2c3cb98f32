"""``prune-audit cascade`` on synthetic run directories (docs/records.md)."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from test_calibrate_cli import write_run
from typer.testing import CliRunner

from prune_audit.analysis.temperature import split_images
from prune_audit.cli.main import app

runner = CliRunner()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("cascade_runs")
    return {
        "p64": write_run(root / "p64", seed=1, strength=1.5, tokens=100, images=80, lost_share=0.3),
        "p128": write_run(root / "p128", seed=5, strength=2.2, tokens=160, images=80, budget=128),
        "dense": write_run(root / "dense", seed=2, strength=3.0, tokens=600, images=80, selector=None, budget=None),
    }


def frame(directory):
    return pq.read_table(directory / "records.parquet").to_pandas().set_index(["split", "question_id"]).sort_index()


def test_json_report_matches_a_direct_recomputation(runs, tmp_path):
    arguments = ["cascade", str(runs["p64"]), str(runs["p128"]), "--reference", str(runs["dense"])]
    options = ["--epsilon", "0.1", "--sweep", "0.05,0.2", "--splits", "30", "--seed", "4"]
    result = runner.invoke(app, [*arguments, *options, "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert json.loads((tmp_path / "cascade.json").read_text()) == report
    for stem in ("cascade_cost_vs_epsilon", "cascade_validity"):
        assert (tmp_path / f"{stem}.png").read_bytes()[:4] == b"\x89PNG"
        assert (tmp_path / f"{stem}.svg").stat().st_size > 1000
    assert [entry["label"] for entry in report["cascades"]] == ["divprune@64", "divprune@128"]
    entry = report["cascades"][0]
    assert [r["epsilon"] for r in entry["results"]] == [0.05, 0.1, 0.2]
    assert entry["epsilon"] == 0.1 and entry["validity"]["splits"] == 30
    # recompute the seeded split's threshold and outcome from the records
    pruned, dense = frame(runs["p64"]), frame(runs["dense"])
    disagree = (pruned["answer"] != dense["answer"]).to_numpy()
    confidence, image = pruned["confidence"].to_numpy(), pruned["image_id"].to_numpy()
    calibration_ids, test_ids = split_images(image, 0.5, seed=4)
    n = len(calibration_ids)
    chosen = None
    for t in np.unique(np.concatenate([[0.0], confidence[np.isin(image, calibration_ids)]])):
        losses = [np.mean((confidence[image == j] > t) & disagree[image == j]) for j in calibration_ids]
        if n / (n + 1) * np.mean(losses) + 1 / (n + 1) <= 0.1:
            chosen = t
            break
    assert entry["threshold"] == chosen
    test = np.isin(image, test_ids)
    escalated = confidence[test] <= chosen
    assert entry["escalation_rate"] == pytest.approx(escalated.mean())
    tokens = pruned["cost_tokens"].to_numpy()[test] + escalated * dense["cost_tokens"].to_numpy()[test]
    assert entry["relative_cost"] == pytest.approx(tokens.sum() / dense["cost_tokens"].to_numpy()[test].sum())
    assert entry["disagreement"] == pytest.approx(np.mean(disagree[test] & ~escalated))
    assert entry["validity"]["mean_disagreement"] <= 0.1 + 0.01
    assert -1.0 < entry["savings_share"] < 1.5


def test_multi_stage_chains_the_runs_and_table_output(runs, tmp_path):
    arguments = ["cascade", str(runs["p64"]), str(runs["p128"]), "--reference", str(runs["dense"]), "--multi-stage"]
    result = runner.invoke(app, [*arguments, "--epsilon", "0.1", "--splits", "10", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    (entry,) = json.loads(result.stdout)["cascades"]
    assert entry["label"] == "divprune@64 -> divprune@128 -> dense"
    assert len(entry["answered_by"]) == 3 and sum(entry["answered_by"]) == pytest.approx(1.0)
    assert "savings_share" not in entry
    options = ["--epsilon", "0.1", "--splits", "10", "--out", str(tmp_path)]
    table = runner.invoke(app, [*arguments, *options], env={"COLUMNS": "200"})
    assert table.exit_code == 0
    assert "divprune@64 -> divprune@128 -> dense" in table.stdout and "held-out" in table.stdout


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--epsilon", "0.01"], "infeasible with 40 calibration images"),
        (["--sweep", "0.1,x"], "--sweep takes comma-separated numbers, got 'x'"),
        (["--splits", "0"], "--splits must be at least 1"),
        (["--cost", "joules"], "--cost must be one of tokens, flops, latency, got 'joules'"),
    ],
)
def test_user_errors_are_one_line_without_output(runs, tmp_path, extra, message):
    arguments = ["cascade", str(runs["p64"]), "--reference", str(runs["dense"]), *extra, "--out", str(tmp_path / "out")]
    result = runner.invoke(app, arguments)
    assert result.exit_code == 2 and result.stderr.count("\n") == 1 and message in result.stderr
    assert not (tmp_path / "out").exists()


def test_cost_units_charge_an_escalated_question_both_stages(runs, tmp_path):
    """The synthetic runs' FLOPs are 1000 x their tokens and every latency is 10 ms: FLOPs give the token
    costs, latency gives 1 + the escalation rate (an escalated question pays the pruned run and dense)."""
    reports = {}
    for cost in ("tokens", "flops", "latency"):
        arguments = [
            "cascade",
            str(runs["p64"]),
            "--reference",
            str(runs["dense"]),
            "--cost",
            cost,
            "--splits",
            "5",
            "--epsilon",
            "0.1",
        ]
        result = runner.invoke(app, [*arguments, "--out", str(tmp_path / cost), "--json"])
        assert result.exit_code == 0, result.output
        reports[cost] = json.loads(result.stdout)
        assert reports[cost]["settings"]["cost"] == cost
    tokens, flops, latency = (reports[cost]["cascades"][0] for cost in ("tokens", "flops", "latency"))
    assert flops["relative_cost"] == pytest.approx(tokens["relative_cost"])
    assert latency["relative_cost"] == pytest.approx(1 + latency["escalation_rate"])


def test_reference_is_required_and_must_hold_the_same_questions(runs, tmp_path):
    missing = runner.invoke(app, ["cascade", str(runs["p64"]), "--out", str(tmp_path / "out")])
    assert missing.exit_code == 2 and "--reference RUN is required" in missing.stderr
    smaller = write_run(tmp_path / "smaller", seed=2, strength=3.0, tokens=600, images=40, selector=None, budget=None)
    options = ["--epsilon", "0.1", "--out", str(tmp_path / "out")]
    result = runner.invoke(app, ["cascade", str(runs["p64"]), "--reference", str(smaller), *options])
    assert result.exit_code == 2 and "do not hold the same questions" in result.stderr
    model = {"id": "other", "config_hash": "y"}
    other = write_run(
        tmp_path / "other", seed=2, strength=3.0, tokens=600, images=80, selector=None, budget=None, model=model
    )
    refused = runner.invoke(app, ["cascade", str(runs["p64"]), "--reference", str(other), *options])
    assert refused.exit_code == 2 and "model.id" in refused.stderr
    assert not (tmp_path / "out").exists()


def test_default_is_a_sweep_from_half_a_percent_to_ten_percent(runs, tmp_path):
    arguments = ["cascade", str(runs["p64"]), "--reference", str(runs["dense"]), "--splits", "5", "--epsilon", "0.05"]
    result = runner.invoke(app, [*arguments, "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    computed = [r["epsilon"] for r in report["cascades"][0]["results"]]
    skipped = report["settings"]["sweep_skipped_infeasible"]
    assert sorted(computed + skipped) == [0.005, 0.01, 0.02, 0.03, 0.05, 0.075, 0.1]
    assert skipped == [0.005, 0.01, 0.02]  # 40 calibration images: 1/(n+1) = 0.024
    assert report["settings"]["sweep"] == [0.03, 0.075, 0.1]  # besides --epsilon
    table = runner.invoke(app, [*arguments, "--out", str(tmp_path / "table")], env={"COLUMNS": "160"})
    assert "Epsilon sweep" in table.stdout and "0.075" in table.stdout
