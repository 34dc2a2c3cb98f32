"""A task owns its record columns: a plug-in task declares its own, runs end to end and records them."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import prune_audit.plugins
from prune_audit.cli.main import app
from prune_audit.errors import PruneAuditError
from prune_audit.plugins import PluginRegistry
from prune_audit.record_columns import column
from prune_audit.records.schema import run_columns, run_schema, task_columns
from prune_audit.records.store import read_run
from prune_audit.tasks import Task, list_tasks, registry
from prune_audit.tasks.pope import PopeTask

runner = CliRunner()


class WordCountTask(PopeTask):
    """POPE's questions, answered and scored as POPE, recording one column of the plug-in's own (and none of
    POPE's, which are POPE's alone)."""

    record_columns = (column("question_words", pa.int64(), "words in the question"),)
    required_columns = ()
    report_metrics = ("accuracy", "ece", "brier", "auroc")
    binary_view = Task.binary_view  # POPE's reads POPE's own columns

    def score(self, question, reduced):
        return replace(super().score(question, reduced), columns={"question_words": len(question.text.split())})


def install_plugin(monkeypatch) -> str:
    """``WordCountTask`` installed as the entry point ``wordcount`` of a registry private to the test."""

    class Entry:
        name = "wordcount"

        def load(self):
            return WordCountTask

    tasks = PluginRegistry("task", "prune_audit.tasks")
    tasks.classes.update(registry.TASKS.classes)
    monkeypatch.setattr(registry, "TASKS", tasks)
    monkeypatch.setattr(
        prune_audit.plugins, "entry_points", lambda group: [Entry()] if group == "prune_audit.tasks" else []
    )
    return Entry.name


@pytest.fixture
def plugin(monkeypatch) -> str:
    return install_plugin(monkeypatch)


def run_args(ws: dict[str, Path], out: Path, task: str, *extra: str) -> list[str]:
    """``run`` of ``task`` over the workspace's POPE files (a plug-in task reads them with --questions)."""
    files = [arg for path in ws["pope"] for arg in ("--pope" if task == "pope" else "--questions", str(path))]
    return [
        "run",
        "--task",
        task,
        "--model",
        str(ws["model"]),
        "--images",
        str(ws["images"]),
        "--annotations",
        str(ws["instances"]),
        "--out",
        str(out),
        *files,
        *extra,
    ]


def test_the_schema_holds_a_plugin_tasks_column_after_the_builtin_tasks(plugin):
    names = [c.name for c in run_columns()]
    assert plugin in list_tasks() and [c.name for c in task_columns(plugin)] == ["question_words"]
    builtin = [c.name for c in run_columns() if c.tasks and plugin not in c.tasks]
    assert names.index("question_words") == max(map(names.index, builtin)) + 1  # after every built-in task's
    assert run_schema().field("question_words").nullable  # null in every other task's rows


def test_a_plugin_task_with_its_own_column_runs_and_records_it(plugin, workspace, tmp_path):
    out = tmp_path / "run"
    result = runner.invoke(
        app, run_args(workspace, out, plugin, "--limit", "8", "--selector", "random", "--budget", "6")
    )
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    manifest, records = read_run(out)
    assert manifest["task"] == plugin and records.num_rows == 8
    questions = {(q.split, q.question_id): q.text for q in PopeTask().read_questions(workspace["pope"])}
    for row in records.to_pylist():
        assert row["question_words"] == len(questions[row["split"], row["question_id"]].split()) > 0
        assert row["task"] == plugin and row["label"] is None  # POPE's columns are POPE's alone
    assert pq.read_table(out / "records.parquet").column_names == run_schema().names


def test_a_plugin_column_named_as_another_is_refused_in_one_line(plugin, monkeypatch):
    monkeypatch.setattr(WordCountTask, "record_columns", (column("label", pa.string(), "clashes with POPE's"),))
    with pytest.raises(
        PruneAuditError,
        match=r"^record column 'label' is declared by pope, video_presence and again by task "
        r"wordcount; rename the task's column \(Task.record_columns\)$",
    ):
        run_columns()


def test_a_run_recorded_before_a_plugin_column_existed_still_reads(workspace, tmp_path, monkeypatch):
    out = tmp_path / "pope"
    assert runner.invoke(app, run_args(workspace, out, "pope", "--limit", "4")).exit_code == 0
    before = pq.read_table(out / "records.parquet")
    install_plugin(monkeypatch)
    _, records = read_run(out)
    assert records.column_names == run_schema().names and records["question_words"].null_count == records.num_rows
    assert repr(records.drop_columns(["question_words"]).to_pylist()) == repr(before.to_pylist())  # NaN-aware
