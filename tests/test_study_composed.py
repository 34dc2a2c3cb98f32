"""Composed selectors beyond ``run``: a ``study`` grid cell (``--budgets 96/48``), ``calibrate``, ``study --report``,
``visualize --run`` and live ``visualize`` on the bundled demo (144 visual tokens), and lmms-eval's ``budget=96/48``.

A plain cell of a grid that also holds a composed selector is the run it was before: same folder, same command,
same manifest and answers as in a grid without the composed selector.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
from cli_checks import refused, snapshot
from typer.testing import CliRunner

import prune_audit.runner.visualize as visualize_module
from prune_audit.cli.main import app
from prune_audit.compute.budget import parse_listed_budget
from prune_audit.demo.assets import demo_assets
from prune_audit.errors import PruneAuditError
from prune_audit.runner.study.grid import StudyGrid, parse_budgets

runner = CliRunner()
COMPOSED = "visionzip+fastv"
SMALL = ("--limit", "40", "--epsilons", "0.5", "--bootstrap", "20", "--splits", "5", "--quiet")


def _study(out: Path, selectors: str, budgets: str, *extra: str):
    return runner.invoke(
        app, ["study", "--selectors", selectors, "--budgets", budgets, *SMALL, "--out", str(out), *extra]
    )


@pytest.fixture(scope="module")
def studies(tmp_path_factory) -> tuple[Path, Path]:
    """(a grid of fastv and visionzip+fastv, the same grid of fastv alone)."""
    root = tmp_path_factory.mktemp("composed-study")
    mixed = _study(root / "mixed", f"fastv,{COMPOSED}", "32,96/48")
    assert mixed.exit_code == 0, mixed.output
    plain = _study(root / "plain", "fastv", "32")
    assert plain.exit_code == 0, plain.output
    return root / "mixed", root / "plain"


def test_grid_budgets_join_a_composed_budgets_parts_with_a_slash():
    assert parse_budgets("32, 11%, 96/48, 11%/5%") == ("32", "11%", "96,48", "11%,5%")
    grid = StudyGrid(("fastv", COMPOSED), parse_budgets("32,96/48"), Path("out"))
    assert [cell.name for cell in grid.cells] == ["dense", "fastv-32", "visionzip+fastv-96_48"]
    composed = grid.cells[2]
    assert "--selector visionzip+fastv --budget 96,48 --out out/runs/visionzip+fastv-96_48" in grid.command(composed)
    assert grid.request(composed).budget == (96, 48)
    with pytest.raises(PruneAuditError, match="the same budget"):
        parse_budgets("96/48,096/48")


def test_a_composed_cell_is_calibrated_reported_and_labelled_by_its_parts(studies):
    mixed, _ = studies
    assert sorted(path.name for path in (mixed / "runs").iterdir()) == ["dense", "fastv-32", "visionzip+fastv-96_48"]
    manifest = json.loads((mixed / "runs" / "visionzip+fastv-96_48" / "manifest.json").read_text())
    assert manifest["budget"] == [96, 48] and manifest["selector"]["stage"] == "composed"
    table = pd.read_csv(mixed / "summary.csv", dtype={"budget": str}).set_index("run")
    assert table.loc[f"{COMPOSED}@96,48", "budget"] == "96,48" and "fastv@32" in table.index
    report = (mixed / "report.md").read_text(encoding="utf-8")
    assert f"{COMPOSED}@96,48" in report and "[96, 48]" not in report
    assert f"{COMPOSED}@96,48" in (mixed / "report.html").read_text(encoding="utf-8")
    again = runner.invoke(app, ["study", "--report", *SMALL[2:], "--out", str(mixed)])
    assert again.exit_code == 0, again.output


def test_a_plain_cell_is_unchanged_by_a_composed_neighbour(studies):
    mixed, plain = studies

    def manifest(out: Path) -> dict:
        data = json.loads((out / "runs" / "fastv-32" / "manifest.json").read_text())
        data.pop("run_id")
        return json.loads(json.dumps(data).replace(str(out), "OUT"))

    assert manifest(mixed) == manifest(plain)
    answers = [
        pq.read_table(out / "runs" / "fastv-32" / "records.parquet", columns=["question_id", "answer", "kept_stages"])
        for out in (mixed, plain)
    ]
    assert answers[0].equals(answers[1])


def test_calibrate_and_visualize_a_composed_run(studies, tmp_path):
    runs = studies[0] / "runs"
    out = tmp_path / "calibration"
    result = runner.invoke(
        app,
        ["calibrate", str(runs / "visionzip+fastv-96_48"), "--reference", str(runs / "dense"), "--bootstrap", "20"]
        + ["--out", str(out)],
    )
    assert result.exit_code == 0, result.output
    labels = [run["label"] for run in json.loads((out / "calibration.json").read_text())["runs"]]
    assert f"{COMPOSED}@96,48" in labels
    question = str(pq.read_table(runs / "dense" / "records.parquet").column("question_id")[0])
    picture = tmp_path / "run.png"
    result = runner.invoke(
        app,
        ["visualize", "--run", str(runs / "visionzip+fastv-96_48"), "--question-id", question, "--out", str(picture)],
    )
    assert result.exit_code == 0, result.output
    assert "budget 96,48" in result.output and picture.exists()


def test_visualize_draws_both_parts_stages_live(tmp_path, monkeypatch):
    image = next(iter(sorted(demo_assets().images_dir.glob("*.png"))))
    drawn = {}
    real_draw = visualize_module.draw_panels

    def spy(pixels, panels, path, suptitle="", note=""):
        drawn.update(panels=panels)
        return real_draw(pixels, panels, path, suptitle=suptitle, note=note)

    monkeypatch.setattr(visualize_module, "draw_panels", spy)
    picture = tmp_path / "live.png"
    result = runner.invoke(
        app, ["visualize", str(image), "--selector", COMPOSED, "--budget", "96,48", "--out", str(picture)]
    )
    assert result.exit_code == 0, result.output
    [panel] = drawn["panels"]
    first, second = panel.stage_labels
    assert first.startswith("input: kept") and second.startswith("layer ")
    assert set(panel.stages[1]) <= set(panel.stages[0]) and picture.exists()


@pytest.mark.parametrize(
    ("arguments", "needle"),
    [
        (["--selectors", f"fastv,{COMPOSED}", "--budgets", "32"], "--budgets lists none of 2 part(s)"),
        (["--selectors", "fastv", "--budgets", "32,96/48"], "no selector in --selectors takes that many"),
        (["--selectors", COMPOSED, "--budgets", "48/96"], "96 is not below 48"),
        (["--selectors", "fastv+visionzip", "--budgets", "96/48"], "runs first"),
        (
            ["--selectors", f"fastv,{COMPOSED}", "--budgets", "32,96/48", "--subset", "difficult", "--subset-baseline"]
            + ["fastv"],
            "has no fastv run",
        ),
    ],
)
def test_a_grid_that_does_not_fit_is_refused_in_one_line_before_anything_is_written(tmp_path, arguments, needle):
    before = snapshot(tmp_path)
    result = runner.invoke(app, ["study", *arguments, *SMALL, "--out", str(tmp_path / "study")])
    refused(result, needle)
    assert not (tmp_path / "study").exists() and snapshot(tmp_path) == before


def test_visualize_refuses_a_budget_that_does_not_fit_a_drawn_selector(tmp_path):
    image = next(iter(sorted(demo_assets().images_dir.glob("*.png"))))
    picture = tmp_path / "live.png"
    arguments = ["visualize", str(image), "--selector", COMPOSED, "--selector", "fastv", "--budget", "96,48"]
    refused(runner.invoke(app, [*arguments, "--out", str(picture)]), "'fastv' of 1 part(s)")
    assert not picture.exists()


def test_lmms_eval_model_args_join_a_composed_budgets_parts_with_a_slash():
    assert parse_listed_budget("96/48") == (96, 48) and parse_listed_budget("11%/5%") == ("11%", "5%")
    assert parse_listed_budget("64") == 64 and parse_listed_budget(64) == 64 and parse_listed_budget("11%") == "11%"
    assert (
        parse_listed_budget("all") == "all" and parse_listed_budget("none") is None and parse_listed_budget("") is None
    )
    with pytest.raises(PruneAuditError, match="one budget per part"):
        parse_listed_budget("96/")
