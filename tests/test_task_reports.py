"""The task seam in the reports: calibrate's table follows ``Task.report_metrics``, ScienceQA's validity experiment."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_gqa import gqa_args, gqa_inputs
from test_scienceqa import scienceqa_file
from typer.testing import CliRunner

from prune_audit.cli.main import app

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
    conventions = json.loads((tmp_path / "all" / "calibration.json").read_text())["conventions"]
    assert (
        conventions["confidence"] == "gqa: --confidence sequence: the product of the generated tokens' "
        "probabilities (sequence_prob)"
    )
    assert conventions["correct"].startswith("gqa: GQA's exact match")
    # a task that stops reporting a metric loses its row (calibration.json keeps every computed metric)
    monkeypatch.setattr(GqaTask, "report_metrics", tuple(m for m in GqaTask.report_metrics if m != "aurc"))
    fewer = runner.invoke(app, [*args, "--out", str(tmp_path / "fewer")], env={"COLUMNS": "250"})
    assert fewer.exit_code == 0, fewer.output
    assert metric("aurc").label not in table_rows(fewer.stdout) and metric("ece").label in table_rows(fewer.stdout)


@pytest.mark.parametrize(
    ("task", "confidence", "expected"),
    [
        ("pope", None, "pope: max(p_yes_2way, 1 - p_yes_2way), p_yes_2way = sigmoid(logit_diff)"),
        ("gqa", None, "gqa: --confidence sequence: the product of the generated tokens' probabilities"),
        ("gqa", "mean-token", "gqa: --confidence mean-token: the geometric mean of the generated tokens'"),
        ("scienceqa", None, "scienceqa: the chosen letter's first-token probability renormalised over the offered"),
        ("caption", None, "caption: --confidence mean-token: the geometric mean of the generated tokens'"),
        ("caption", "sequence", "caption: --confidence sequence: the product of the generated tokens' probabilities"),
    ],
)
def test_calibration_conventions_define_the_runs_task_confidence(task, confidence, expected):
    from types import SimpleNamespace

    from prune_audit.analysis.reports import calibration_conventions
    from prune_audit.tasks import get_task

    run = SimpleNamespace(task=get_task(task, None, confidence))
    conventions = calibration_conventions([run, run], ["a", "b"])
    assert conventions["confidence"].startswith(expected)
    assert conventions["correct"] == f"{task}: {run.task.correct_definition}" and run.task.correct_definition
    assert "ece" in conventions and "temperature" in conventions


def test_calibration_conventions_of_runs_that_differ_define_each_runs_confidence():
    from types import SimpleNamespace

    from prune_audit.analysis.reports import calibration_conventions
    from prune_audit.tasks import get_task

    runs = [SimpleNamespace(task=get_task("gqa", None, form)) for form in ("sequence", "mean-token")]
    conventions = calibration_conventions(runs, ["seq", "mean"])
    assert set(conventions["confidence"]) == {"seq", "mean"}
    assert "geometric mean" in conventions["confidence"]["mean"] and "product" in conventions["confidence"]["seq"]
    assert conventions["correct"] == f"gqa: {runs[0].task.correct_definition}"


def test_scienceqa_cascade_reports_the_validity_experiment(workspace, letters_model, tmp_path):  # noqa: F811
    questions = scienceqa_file(workspace, tmp_path / "sqa")
    runs = {"pruned": tmp_path / "pruned", "dense": tmp_path / "dense"}
    for name, extra in (("pruned", ("--selector", "random", "--budget", "6")), ("dense", ())):
        result = runner.invoke(
            app,
            [
                "run",
                "--task",
                "scienceqa",
                "--model",
                str(letters_model),
                "--images",
                str(workspace["images"]),
                "--questions",
                str(questions),
                "--out",
                str(runs[name]),
                *extra,
            ],
        )
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
        validity["mean_disagreement"] <= 0.4 + validity["sem_disagreement"]
    )


def test_study_of_several_tasks_has_a_task_column_and_a_report_section_per_task(workspace, tmp_path):
    import pandas as pd

    gqa = gqa_inputs(workspace, tmp_path / "gqa")
    out = tmp_path / "study"
    common = [
        "study",
        "--tasks",
        "pope,gqa",
        "--model",
        str(workspace["model"]),
        "--selectors",
        "random",
        "--budgets",
        "6",
        "--out",
        str(out),
        "--limit",
        "40",
        "--max-new-tokens",
        "2",
        *(arg for path in workspace["pope"] for arg in ("--questions", f"pope={path}")),
        "--questions",
        f"gqa={gqa['questions']}",
        "--questions",
        f"gqa={gqa['llava']}",
        "--images",
        f"pope={workspace['images']}",
        "--images",
        f"gqa={workspace['images']}",
        "--annotations",
        f"pope={workspace['instances']}",
        "--annotations",
        f"gqa={gqa['graphs']}",
    ]
    planned = runner.invoke(app, [*common, "--plan"])
    assert planned.exit_code == 0, planned.output
    lines = planned.stdout.splitlines()
    assert len(lines) == 4 and sum("--task gqa" in line for line in lines) == 2
    assert "--max-new-tokens 2" in lines[2] and "--max-new-tokens" not in lines[0]  # POPE answers by its first token
    assert str(out / "runs" / "gqa-random-6") in lines[3] and str(out / "runs" / "pope-dense") in lines[0]
    result = runner.invoke(app, [*common, "--epsilons", "0.34", "--bootstrap", "10", "--splits", "5", "--quiet"])
    assert result.exit_code == 0, result.output
    summary = pd.read_csv(out / "summary.csv")
    assert list(zip(summary["task"], summary["run"])) == [
        ("pope", "dense"),
        ("pope", "random@6"),
        ("gqa", "dense"),
        ("gqa", "random@6"),
    ]
    gqa_records = pq.read_table(out / "runs" / "gqa-random-6" / "records.parquet").to_pylist()
    gqa_row = summary[(summary["task"] == "gqa") & (summary["run"] == "random@6")].iloc[0]
    assert gqa_row["accuracy"] == pytest.approx(sum(r["correct"] for r in gqa_records) / len(gqa_records))
    # POPE's answer scores are reported (a tiny random model's run answering no throughout has no F1), GQA's never
    pope_f1, gqa_f1 = (summary[summary["task"] == name]["f1"] for name in ("pope", "gqa"))
    assert gqa_f1.isna().all() and pope_f1.notna().any()
    report = (out / "report.md").read_text()
    pope_part, gqa_part = report.split("## Task pope")[1].split("## Task gqa")
    assert "| F1 |" in pope_part
    assert "| F1 |" not in gqa_part and "| ECE |" in gqa_part  # each section shows the metrics its task reports
    assert "![Reliability diagrams, every run](gqa_reliability_grid.png)" in gqa_part
    for name in ("pope_calibration.json", "gqa_cascade.json", "gqa_reliability_grid.png", "report.html"):
        assert (out / name).is_file(), name
    assert "<h2>Task gqa</h2>" in (out / "report.html").read_text()
    # the report alone, rebuilt from the runs
    rebuilt = runner.invoke(
        app,
        [
            "study",
            "--tasks",
            "pope,gqa",
            "--out",
            str(out),
            "--report",
            "--epsilons",
            "0.34",
            "--bootstrap",
            "10",
            "--splits",
            "5",
        ],
    )
    assert rebuilt.exit_code == 0, rebuilt.output
    assert pd.read_csv(out / "summary.csv").equals(summary)
    refused_single = runner.invoke(app, ["study", "--out", str(out), "--report"])
    assert refused_single.exit_code != 0 and "study them with --tasks" in refused_single.output


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (("--tasks", "pope,vqa"), ("unknown task 'vqa'",)),
        (("--tasks", "pope,gqa", "--task", "gqa"), ("not both",)),
        (("--tasks", "pope,gqa", "--questions", "q.json"), ("with several --tasks", "TASK=PATH")),
        (("--tasks", "pope,gqa", "--images", "gqa=a", "--images", "gqa=b"), ("names task gqa 2 times",)),
        (("--tasks", "pope,scienceqa", "--max-new-tokens", "3"), ("--max-new-tokens",)),
    ],
)
def test_study_task_options_are_refused_in_one_line(tmp_path, extra, needles):
    from cli_checks import refused

    refused(runner.invoke(app, ["study", "--out", str(tmp_path / "study"), *extra]), *needles)
    assert not (tmp_path / "study").exists()


def test_paired_omission_counts_the_same_objects_by_hand():
    from prune_audit.tasks.caption import paired_omission_by_fate

    rows = [
        {
            "split": "caption",
            "question_id": 1,
            "evidence_objects": ["dog", "cat", "car"],
            "evidence_objects_lost": [True, False, None],
            "omitted": ["dog"],
        },
        {
            "split": "caption",
            "question_id": 2,
            "evidence_objects": ["cup"],
            "evidence_objects_lost": [True],
            "omitted": ["cup"],
        },
        {
            "split": "caption",
            "question_id": 3,
            "evidence_objects": ["cat"],
            "evidence_objects_lost": [True],
            "omitted": [],
        },
    ]
    dense = [
        {"split": "caption", "question_id": 1, "omitted": ["cat", "car"]},
        {"split": "caption", "question_id": 2, "omitted": []},
    ]  # image 3 has no dense caption: left out
    # lost: dog (run omits, dense names it), cup (run omits, dense names it); kept: cat (run names, dense omits)
    assert paired_omission_by_fate(rows, dense) == {"lost": (2, 2, 0), "kept": (1, 0, 1)}


def test_caption_omissions_of_lost_and_kept_objects_beside_the_dense_model(workspace, tmp_path):
    from prune_audit.tasks.caption import paired_omission_by_fate

    instances = str(workspace["instances"])
    runs = {"pruned": tmp_path / "pruned", "dense": tmp_path / "dense"}
    for name, extra in (("pruned", ("--selector", "random", "--budget", "2")), ("dense", ())):
        result = runner.invoke(
            app,
            [
                "run",
                "--task",
                "caption",
                "--model",
                str(workspace["model"]),
                "--images",
                str(workspace["images"]),
                "--questions",
                instances,
                "--annotations",
                instances,
                "--out",
                str(runs[name]),
                "--max-new-tokens",
                "3",
                *extra,
            ],
        )
        assert result.exit_code == 0, result.output
    pruned, dense = (pq.read_table(run / "records.parquet").to_pylist() for run in runs.values())
    (lost, lost_run, lost_dense), (kept, kept_run, kept_dense) = paired_omission_by_fate(pruned, dense).values()
    assert lost > 0 and kept > 0
    args = ["calibrate", str(runs["pruned"]), "--reference", str(runs["dense"]), "--bootstrap", "10"]
    reported = runner.invoke(app, [*args, "--json", "--out", str(tmp_path / "json")])
    assert reported.exit_code == 0, reported.output
    report = json.loads(reported.stdout)
    assert report["runs"][0]["reference_comparison"] == pytest.approx(
        {
            "objects_lost": lost,
            "omitted_lost": lost_run / lost,
            "omitted_lost_reference": lost_dense / lost,
            "objects_kept": kept,
            "omitted_kept": kept_run / kept,
            "omitted_kept_reference": kept_dense / kept,
        }
    )
    assert "omitted_lost_reference" in report["conventions"]
    printed = runner.invoke(app, [*args, "--out", str(tmp_path / "table")], env={"COLUMNS": "250"})
    assert printed.exit_code == 0, printed.output
    assert (
        f"{lost_dense / lost:.3f}"
        in dict(
            (cells[0], cells[1])
            for cells in (
                [c.strip() for c in line.split("│")[1:]] for line in printed.stdout.splitlines() if line.count("│") > 2
            )
        )["omitted lost reference"]
    )
    # the study pairs its dense run with each pruned one: summary columns and a finding
    study = tmp_path / "study"
    result = runner.invoke(
        app,
        [
            "study",
            "--task",
            "caption",
            "--model",
            str(workspace["model"]),
            "--images",
            str(workspace["images"]),
            "--questions",
            instances,
            "--annotations",
            instances,
            "--max-new-tokens",
            "3",
            "--selectors",
            "random",
            "--budgets",
            "2",
            "--out",
            str(study),
            "--epsilons",
            "0.34",
            "--bootstrap",
            "10",
            "--splits",
            "5",
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    import pandas as pd

    summary = pd.read_csv(study / "summary.csv").set_index("run")
    assert math.isnan(summary.loc["dense", "omitted_lost"]) and summary.loc["random@2", "objects_lost"] > 0
    assert (
        "captions omit" in (study / "report.md").read_text()
        and "the dense model's captions omit" in (study / "report.md").read_text()
    )
