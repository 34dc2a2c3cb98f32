"""Issue 41 items 3 and 4 in ``study``: loyalty beside accuracy, and ``--subset difficult`` (VTC-Bench's hard
subset: the questions a baseline run of the same budget answers wrongly), on the tiny LLaVA study of test_study."""

from __future__ import annotations

import shutil

import pandas as pd
import pytest
from test_study import ANALYSIS, GRID, runner, study, study_args, summary  # noqa: F401 (study: the fixture)

from prune_audit.analysis.study import subset_columns
from prune_audit.cli.main import app

SUBSET = ("--subset", "difficult", "--subset-baseline", "random")


def _records(out, name: str) -> pd.DataFrame:
    return pd.read_parquet(out / "runs" / name / "records.parquet").set_index(["split", "question_id"]).sort_index()


def test_summary_holds_loyalty_to_the_dense_run(study):
    table = summary(study)
    dense = _records(study, "dense")
    for run, folder in (("divprune@6", "divprune-6"), ("random@6", "random-6")):
        pruned = _records(study, folder)
        assert table.loc[run, "loyalty"] == pytest.approx((pruned["answer"] == dense["answer"]).mean())
        assert table.loc[run, "loyalty_low"] <= table.loc[run, "loyalty"] <= table.loc[run, "loyalty_high"]
    assert pd.isna(table.loc["dense", "loyalty"])
    assert table["loyalty_overlap"].isna().all()  # POPE's answers are not generated
    report = (study / "report.md").read_text(encoding="utf-8")
    assert "| run | visual tokens | accuracy | loyalty | F1 |" in report
    least = table.drop("dense")["loyalty"].idxmin()
    assert f"{least} is the least loyal to the dense model: it gives the dense answer to" in report


@pytest.fixture(scope="module")
def difficult(study, tmp_path_factory):
    out = tmp_path_factory.mktemp("subset") / "study"
    shutil.copytree(study, out)
    result = runner.invoke(app, ["study", "--report", *GRID, *ANALYSIS, *SUBSET, "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "summary_difficult.csv" in result.stdout
    assert "Difficult questions\n\n| budget | run | questions | accuracy | loyalty |" in result.stdout
    return out


def test_difficult_rows_are_the_questions_the_baseline_answers_wrongly(difficult):
    rows = pd.read_csv(difficult / "summary_difficult.csv", dtype={"budget": str}).set_index("run")
    baseline, dense = _records(difficult, "random-6"), _records(difficult, "dense")
    wrong = baseline.index[~baseline["correct"]]
    assert list(rows.index) == ["dense", "divprune@6", "random@6"]
    assert (rows["questions"] == len(wrong)).all() and (rows["baseline"] == "random@6").all()
    assert (rows["budget"] == "6").all() and (rows["subset"] == "difficult").all()
    assert rows.loc["random@6", "accuracy"] == 0.0  # by construction
    assert rows.loc["dense", "accuracy"] == pytest.approx(dense.loc[wrong, "correct"].mean())
    pruned = _records(difficult, "divprune-6").loc[wrong]
    assert rows.loc["divprune@6", "accuracy"] == pytest.approx(pruned["correct"].mean())
    assert rows.loc["divprune@6", "loyalty"] == pytest.approx((pruned["answer"] == dense.loc[wrong, "answer"]).mean())
    assert rows.loc["divprune@6", "accuracy_minus_reference"] == pytest.approx(
        pruned["correct"].mean() - dense.loc[wrong, "correct"].mean()
    )
    parquet = pd.read_parquet(difficult / "summary_difficult.parquet")
    assert list(parquet.columns) == list(pd.read_csv(difficult / "summary_difficult.csv").columns) == subset_columns()


def test_report_shows_the_full_and_the_difficult_tables(difficult, study):
    report = (difficult / "report.md").read_text(encoding="utf-8")
    full = report.split("## Findings")[0]
    assert (
        full.split("\n| run |")[1]
        == (study / "report.md").read_text(encoding="utf-8").split("## Findings")[0].split("\n| run |")[1]
    )  # the full table is unchanged by --subset
    part = report.split("## Difficult questions")[1]
    assert "| budget | run | questions | accuracy | loyalty | F1 | ECE | AUROC | accuracy minus dense |" in part
    assert "random answers wrongly at each budget" in part and "summary_difficult.csv" in part
    page = (difficult / "report.html").read_text(encoding="utf-8")
    assert "<h2>Difficult questions</h2>" in page and page.count("<table>") == 2
    assert pd.read_csv(difficult / "summary.csv").shape == pd.read_csv(study / "summary.csv").shape


@pytest.mark.parametrize(
    "extra, message",
    [
        (("--subset", "hard"), "--subset must be one of difficult, got 'hard'"),
        (("--subset-baseline", "random"), "--subset-baseline names the baseline of --subset difficult"),
        (("--subset", "difficult"), "--selectors has no downsample: add downsample to --selectors"),
        (("--subset", "difficult", "--subset-baseline", "fastv"), "--selectors has no fastv"),
    ],
)
def test_subset_options_are_refused_before_anything_is_written(workspace, tmp_path, extra, message):
    out = tmp_path / "out"
    result = runner.invoke(app, study_args(workspace, out, *extra))
    assert result.exit_code == 2 and message in result.stderr, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output
    assert not out.exists()


def test_report_without_the_baseline_runs_is_refused(study, tmp_path):
    out = tmp_path / "study"
    shutil.copytree(study, out)
    before = sorted(path.name for path in out.iterdir())
    arguments = ["study", "--report", *GRID, *ANALYSIS, "--subset", "difficult", "--subset-baseline", "fastv"]
    result = runner.invoke(app, [*arguments, "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "needs a fastv run at budget 6" in result.stderr and "--subset-baseline" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert sorted(path.name for path in out.iterdir()) == before
