"""The task seam across tasks: the registry, plug-ins and docs/tasks.md, generation limits and confidences, the
manifest's task, the task columns and the metric table, bad task options refused in one line, and what the
analyses, ``score`` and ``study`` do with a task other than POPE. Each task's own checks are in
tests/tasks/test_<task>.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from cli_checks import answers_file, refused
from test_gqa import gqa_args, gqa_inputs
from test_pope import pope_args
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.errors import PruneAuditError
from prune_audit.plugins import PluginRegistry
from prune_audit.records.schema import RUN_COLUMNS, task_columns
from prune_audit.tasks import Scored, Task, get_task, list_tasks, manifest_task, register_task, registry

runner = CliRunner()


def test_committed_tasks_doc_matches_the_task_classes():
    from prune_audit.tasks.docs import tasks_markdown

    doc = Path(__file__).resolve().parents[2] / "docs" / "tasks.md"
    assert doc.read_text(encoding="utf-8") == tasks_markdown(), (
        "docs/tasks.md is stale: run python -m prune_audit.tasks.docs"
    )


def test_builtin_tasks_are_listed_and_unknown_names_refused():
    assert {"pope", "gqa"} <= set(list_tasks())
    with pytest.raises(PruneAuditError, match=r"unknown task 'vqa'; choose one of .*gqa.*pope"):
        get_task("vqa")


def test_a_plugin_task_registers_under_its_entry_point_name(monkeypatch):
    class Plugin(Task):
        def read_questions(self, paths):
            return []

        def answer_mode(self, question):
            raise NotImplementedError

        def score(self, question, reduced):
            return Scored("", (), False, 0.0, {})

        def load_evidence(self, path, questions):
            raise NotImplementedError

        def score_answers(self, answers, question_files):
            return {}

    class Entry:
        name = "myplugin"

        def load(self):
            return Plugin

    import prune_audit.plugins

    tasks = PluginRegistry("task", "prune_audit.tasks")
    tasks.classes.update(registry.TASKS.classes)
    monkeypatch.setattr(registry, "TASKS", tasks)
    monkeypatch.setattr(
        prune_audit.plugins, "entry_points", lambda group: [Entry()] if group == "prune_audit.tasks" else []
    )
    assert "myplugin" in list_tasks()
    assert isinstance(get_task("myplugin"), Plugin)
    with pytest.raises(ValueError, match="already registered"):
        register_task(type("Other", (Plugin,), {"name": "myplugin"}))


def test_generation_limit_belongs_to_generating_tasks():
    assert get_task("gqa").max_new_tokens == 128 and get_task("gqa", 5).max_new_tokens == 5
    assert get_task("pope").max_new_tokens is None
    with pytest.raises(PruneAuditError, match="pope answers by its first token"):
        get_task("pope", 4)
    with pytest.raises(PruneAuditError, match="whole number from 1 to 1,000,000"):
        get_task("gqa", 0)
    assert (get_task("gqa").confidence, get_task("caption").confidence, get_task("pope").confidence) == (
        "sequence",
        "mean-token",
        None,
    )
    with pytest.raises(PruneAuditError, match="choose sequence or mean-token"):
        get_task("gqa", None, "mean")
    with pytest.raises(PruneAuditError, match="pope; it has one definition"):
        get_task("pope", None, "sequence")


def test_manifest_names_the_task_and_an_older_manifest_means_pope():
    assert manifest_task({"task": "gqa", "max_new_tokens": 7}).max_new_tokens == 7
    assert manifest_task({}).name == "pope"


def test_every_task_column_belongs_to_a_registered_task_and_is_nullable():
    """... and a task's scored columns are exactly its schema columns (pyarrow would drop any other silently)."""
    for column in RUN_COLUMNS:
        assert set(column.tasks) <= set(list_tasks()), column.name
        if column.tasks:
            assert column.field().nullable
    assert [c.name for c in task_columns("pope")] == [
        "object",
        "label",
        "answer",
        "p_yes",
        "p_no",
        "p_yes_2way",
        "logit_diff",
    ]


# ----- runs through the seam -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "needles"),
    [
        (("--task", "vqa"), ("unknown task 'vqa'",)),
        (("--task", "gqa"), ("--pope names POPE question files", "--questions")),
        (("--max-new-tokens", "4"), ("pope answers by its first token",)),
    ],
)
def test_bad_task_options_are_refused_in_one_line(workspace, tmp_path, extra, needles):
    out = tmp_path / "bad"
    refused(runner.invoke(app, pope_args(workspace, out, *extra)), *needles)
    assert not out.exists()


def test_analyses_read_a_task_without_a_yes_no_answer_by_its_top_label_confidence(workspace, tmp_path):
    from prune_audit.analysis.runs import load_run

    inputs = gqa_inputs(workspace, tmp_path / "gqa")
    pruned, dense = tmp_path / "pruned", tmp_path / "dense"
    for out, extra in ((pruned, ("--selector", "random", "--budget", "6")), (dense, ())):
        result = runner.invoke(app, gqa_args(workspace, inputs, out, "--max-new-tokens", "2", *extra))
        assert result.exit_code == 0, result.output
    run = load_run(pruned)
    records = pq.read_table(pruned / "records.parquet").to_pylist()
    assert run.questions.top_label and list(run.questions.label_yes) == [r["correct"] for r in records]
    assert list(run.questions.p_yes) == [r["confidence"] for r in records]
    assert list(run.questions.answer) == [r["answer_text"].strip().rstrip(".").lower() for r in records]
    calibrated = runner.invoke(
        app,
        [
            "calibrate",
            str(pruned),
            "--reference",
            str(dense),
            "--bootstrap",
            "20",
            "--json",
            "--out",
            str(tmp_path / "calibration"),
        ],
    )
    assert calibrated.exit_code == 0, calibrated.output
    overall = json.loads(calibrated.stdout)["runs"][0]["metrics"]["all"]
    assert {"accuracy", "ece", "brier", "auroc"} <= set(overall) and not {"f1", "yes_ratio"} & set(overall)
    assert overall["accuracy"]["value"] == pytest.approx(np.mean([r["correct"] for r in records]))
    brier = np.mean([(r["confidence"] - r["correct"]) ** 2 for r in records])
    assert overall["brier"]["value"] == pytest.approx(brier)  # the top-label Brier score
    cascade = runner.invoke(
        app,
        [
            "cascade",
            str(pruned),
            "--reference",
            str(dense),
            "--epsilon",
            "0.3",
            "--splits",
            "5",
            "--json",
            "--out",
            str(tmp_path / "cascade"),
        ],
    )
    assert cascade.exit_code == 0, cascade.output
    validity = json.loads(cascade.stdout)["cascades"][0]["validity"]
    assert validity["sem_disagreement"] == pytest.approx(validity["std_disagreement"] / math.sqrt(5))
    assert validity["mean_within_one_sem_of_epsilon"] == (
        validity["mean_disagreement"] <= 0.3 + validity["sem_disagreement"]
    )
    # visualize --run redraws any task's record, naming its evidence objects and reference answers
    row = records[0]
    drawn = runner.invoke(
        app,
        [
            "visualize",
            "--run",
            str(pruned),
            "--question-id",
            str(row["question_id"]),
            "--out",
            str(tmp_path / "figure.png"),
        ],
    )
    assert drawn.exit_code == 0, drawn.output
    assert f"about {row['evidence_objects'][0]} (reference {row['references'][0]})" in drawn.stdout
    assert f"answer {row['answer_text']} (confidence" in drawn.stdout and (tmp_path / "figure.png").is_file()


def test_every_metric_a_task_reports_is_declared_once_in_the_metric_table():
    from prune_audit.analysis.metric_table import ANSWER_METRICS, METRIC_NAMES

    assert len(set(METRIC_NAMES)) == len(METRIC_NAMES)
    for name in list_tasks():
        assert set(get_task(name).report_metrics) <= set(METRIC_NAMES), name
    yes_no_only = {metric.name for metric in ANSWER_METRICS} - {"accuracy"}
    assert yes_no_only <= set(get_task("pope").report_metrics)
    assert not yes_no_only & set(get_task("gqa").report_metrics)


# ----- scoring released answers ------------------------------------------------------------------------------


def test_score_needs_question_files(tmp_path):
    refused(runner.invoke(app, ["score", str(answers_file(tmp_path / "a.jsonl", [])), "--task", "gqa"]), "--questions")


def test_study_runs_another_task_and_plans_its_commands(workspace, tmp_path):
    inputs = gqa_inputs(workspace, tmp_path / "gqa")
    common = [
        "study",
        "--task",
        "gqa",
        "--model",
        str(workspace["model"]),
        "--images",
        str(workspace["images"]),
        "--questions",
        str(inputs["questions"]),
        "--questions",
        str(inputs["llava"]),
        "--annotations",
        str(inputs["graphs"]),
        "--max-new-tokens",
        "2",
        "--selectors",
        "random",
        "--budgets",
        "6",
        "--out",
        str(tmp_path / "study"),
    ]
    planned = runner.invoke(app, [*common, "--plan"])
    assert planned.exit_code == 0, planned.output
    assert "--task gqa --questions" in planned.stdout and "--max-new-tokens 2" in planned.stdout
    assert "--pope" not in planned.stdout
    result = runner.invoke(app, [*common, "--epsilons", "0.34", "--bootstrap", "20", "--splits", "5", "--quiet"])
    assert result.exit_code == 0, result.output
    import pandas as pd

    summary = pd.read_csv(tmp_path / "study" / "summary.csv").set_index("run")
    assert list(summary.index) == ["dense", "random@6"] and summary["f1"].isna().all()
    records = pq.read_table(tmp_path / "study" / "runs" / "random-6" / "records.parquet").to_pylist()
    assert summary.loc["random@6", "accuracy"] == pytest.approx(np.mean([r["correct"] for r in records]))
