"""The task seam in the reports: calibrate's table follows ``Task.report_metrics``, ScienceQA's validity experiment."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from typer.testing import CliRunner

from prune_audit.cli.main import app
from test_tasks import gqa_args, gqa_inputs, letters_model, scienceqa_file  # noqa: F401 (letters_model: fixture)

runner = CliRunner()


@pytest.fixture(scope="module")
def gqa_runs(workspace, tmp_path_factory) -> dict[str, Path]:
    """A dense and a pruned GQA run (2 new tokens) over the workspace's scenes."""
    folder = tmp_path_factory.mktemp("gqa-runs")
    inputs = gqa_inputs(workspace, folder / "inputs")
    runs = {"pruned": folder / "pruned", "dense": folder / "dense"}
    for name, extra in (("pruned", ("--selector", "random", "--budget", "6")), ("dense", ())):
        result = runner.invoke(app, gqa_args(workspace, inputs, runs[name], "--max-new-tokens", "2", *extra))
        assert result.exit_code == 0, result.output
    return runs


def table_rows(output: str) -> list[str]:
    """The first cell of each row of a printed rich table."""
    return [line.split("│")[1].strip() for line in output.splitlines() if line.count("│") > 2]


def test_calibrate_table_shows_the_metrics_the_task_reports(gqa_runs, tmp_path, monkeypatch):
    from prune_audit.analysis.metric_table import metric
    from prune_audit.tasks.gqa import GqaTask

    args = ["calibrate", str(gqa_runs["pruned"]), "--reference", str(gqa_runs["dense"]), "--bootstrap", "10"]
    shown = runner.invoke(app, [*args, "--out", str(tmp_path / "all")], env={"COLUMNS": "250"})
    assert shown.exit_code == 0, shown.output
    rows = table_rows(shown.stdout)
    assert metric("aurc").label in rows and metric("ece").label in rows and metric("f1").label not in rows
    # a task that stops reporting a metric loses its row (calibration.json keeps every computed metric)
    monkeypatch.setattr(GqaTask, "report_metrics", tuple(m for m in GqaTask.report_metrics if m != "aurc"))
    fewer = runner.invoke(app, [*args, "--out", str(tmp_path / "fewer")], env={"COLUMNS": "250"})
    assert fewer.exit_code == 0, fewer.output
    assert metric("aurc").label not in table_rows(fewer.stdout) and metric("ece").label in table_rows(fewer.stdout)


def test_scienceqa_cascade_reports_the_validity_experiment(workspace, letters_model, tmp_path):  # noqa: F811
    questions = scienceqa_file(workspace, tmp_path / "sqa")
    runs = {"pruned": tmp_path / "pruned", "dense": tmp_path / "dense"}
    for name, extra in (("pruned", ("--selector", "random", "--budget", "6")), ("dense", ())):
        result = runner.invoke(app, ["run", "--task", "scienceqa", "--model", str(letters_model), "--images",
                                     str(workspace["images"]), "--questions", str(questions), "--out", str(runs[name]),
                                     *extra])
        assert result.exit_code == 0, result.output
    args = ["cascade", str(runs["pruned"]), "--reference", str(runs["dense"]), "--epsilon", "0.4", "--splits", "200"]
    printed = runner.invoke(app, [*args, "--out", str(tmp_path / "printed")], env={"COLUMNS": "250"})
    assert printed.exit_code == 0, printed.output
    words = " ".join(printed.stdout.split())
    assert "over 200 random image splits" in words and "mean ± its standard error, against epsilon" in words
    reported = runner.invoke(app, [*args, "--json", "--out", str(tmp_path / "json")])
    assert reported.exit_code == 0, reported.output
    report = json.loads(reported.stdout)
    validity = report["cascades"][0]["validity"]
    assert report["settings"]["splits"] == 200
    assert validity["sem_disagreement"] == pytest.approx(validity["std_disagreement"] / math.sqrt(200))
    assert validity["mean_within_one_sem_of_epsilon"] == (
        validity["mean_disagreement"] <= 0.4 + validity["sem_disagreement"])
