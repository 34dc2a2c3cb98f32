"""Issue 46, item 8: the smaller CLI frictions a newcomer hit (figure names, --help, score, export, messages)."""

from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest
from cli_checks import refused, snapshot
from test_scienceqa import scienceqa_file
from typer.testing import CliRunner

from prune_audit.cli.help_text import unwrapped
from prune_audit.cli.main import app
from prune_audit.runner.visualize import live_stem

runner = CliRunner()


def test_live_figure_name_holds_model_and_budget():
    assert live_stem("demo model", 36) == "tokens-demo-model-36"
    assert live_stem("llava-1.5-7b-hf", 64) != live_stem("llava-1.5-7b-hf", 32)
    assert "/" not in live_stem("org/model name", 8)


def test_help_paragraphs_wrap_at_the_terminal_width_without_one_word_lines():
    assert (
        unwrapped("First line\nstill first.\n\nSecond\n   paragraph.") == "First line still first.\n\nSecond paragraph."
    )
    for command in (["run"], ["study"], ["calibrate"], ["cascade"], ["intervene"]):
        result = runner.invoke(app, [*command, "--help"], env={"COLUMNS": "80"})
        assert result.exit_code == 0, result.output
        text_lines = [line.strip() for line in result.stdout.split("╭")[0].splitlines() if line.strip()]
        assert text_lines and all(len(line.split()) > 1 for line in text_lines[1:]), text_lines


@pytest.mark.parametrize("command", ["run", "study", "score"])
def test_help_of_commands_with_task_names_the_registered_tasks(command):
    from prune_audit.tasks import list_tasks

    result = runner.invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    assert f"Registered tasks (--task): {', '.join(list_tasks())}" in result.stdout


def test_demo_questions_puts_a_space_after_every_label():
    result = runner.invoke(app, ["demo", "questions"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert any(line.startswith("adversarial: ") for line in lines)
    assert all(re.match(r"^[a-z_]+: +\S", line) for line in lines), lines


def sqa_answers(path, rows):
    path.write_text("".join(json.dumps({"question_id": qid, "text": text}) + "\n" for qid, text in rows))
    return path


def test_score_prints_the_answers_file_whole_and_scores_the_img_subset(workspace, tmp_path):
    questions = scienceqa_file(workspace, tmp_path / "sqa")
    truth = {e["id"]: e["conversations"][1]["value"] for e in json.loads(questions.read_text())}
    folder = tmp_path / "a-rather-long-folder-name-that-a-table-title-would-break-mid-word"
    folder.mkdir()
    answers = sqa_answers(
        folder / "answers-of-a-long-named-run.jsonl", [(qid, letter) for qid, letter in truth.items() if qid != "99"]
    )  # IMG only, as run answers
    result = runner.invoke(
        app,
        ["score", str(answers), "--task", "scienceqa", "--questions", str(questions), "--subset", "img"],
        env={"COLUMNS": "60"},
    )
    assert result.exit_code == 0, result.output
    assert f"scienceqa scores of {answers}" in result.stdout.splitlines()
    report = json.loads(
        runner.invoke(
            app,
            ["score", str(answers), "--task", "scienceqa", "--questions", str(questions), "--subset", "img", "--json"],
        ).stdout
    )
    assert report["subset"] == "img" and (report["n"], report["correct"]) == (5, 5)
    # without --subset every question needs an answer: the refusal stays, one line
    refused(runner.invoke(app, ["score", str(answers), "--task", "scienceqa", "--questions", str(questions)]), "99")


@pytest.mark.parametrize(
    "task, subset, needles",
    [
        ("scienceqa", "txt", ("--subset txt is not a subset of scienceqa", "img: the questions with an image")),
        ("pope", "img", ("pope has no question subsets", "drop --subset img")),
    ],
)
def test_an_unknown_subset_is_refused_in_one_line(tmp_path, task, subset, needles):
    answers = sqa_answers(tmp_path / "a.jsonl", [("1", "A")])
    refused(
        runner.invoke(app, ["score", str(answers), "--task", task, "--questions", str(answers), "--subset", subset]),
        *needles,
    )


def test_export_answers_feeds_score_of_a_scienceqa_run(workspace, letters_model, tmp_path):  # noqa: F811
    questions = scienceqa_file(workspace, tmp_path / "sqa")
    run = tmp_path / "run"
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
            str(run),
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    answers = tmp_path / "answers.jsonl"
    result = runner.invoke(app, ["export", str(run), "--answers", str(answers)])
    assert result.exit_code == 0, result.output
    assert f"exported 5 answers to {answers}" in result.stdout
    records = pq.read_table(run / "records.parquet").to_pylist()
    lines = [json.loads(line) for line in answers.read_text().splitlines()]
    assert lines == [{"question_id": r["question_id"], "text": r["answer_text"]} for r in records]
    report = json.loads(
        runner.invoke(
            app,
            ["score", str(answers), "--task", "scienceqa", "--questions", str(questions), "--subset", "img", "--json"],
        ).stdout
    )
    assert report["correct"] == sum(r["correct"] for r in records) and report["n"] == len(records)

    before = snapshot(tmp_path)
    refused(runner.invoke(app, ["export", str(run), "--answers", str(answers)]), "exists", "pass a new file name")
    refused(
        runner.invoke(app, ["export", str(run), "--out", str(tmp_path / "kept.jsonl"), "--answers", str(answers)]),
        "exists",
    )
    refused(runner.invoke(app, ["export", str(run), "--answers", str(tmp_path / "a.json")]), "FILE.jsonl")
    refused(runner.invoke(app, ["export", str(run)]), "--answers FILE.jsonl")
    assert snapshot(tmp_path) == before  # nothing written by a refusal, --out included

    result = runner.invoke(app, ["visualize", "--run", str(run), "--question-id", "77"])
    refused(result, "question 77 is not in", "e.g. 10, 11, 12, 13, 14", "--question-id")
