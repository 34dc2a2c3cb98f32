"""``prune-audit study`` on the tiny offline LLaVA: numbers equal calibrate/cascade, resume, HTML, --plan."""

from __future__ import annotations

import base64
import json
import math
import os
import shlex
import signal
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.errors import PruneAuditError

runner = CliRunner()

GRID = ("--selectors", "divprune,random", "--budgets", "6", "--limit", "40")
ANALYSIS = ("--epsilons", "0.2,0.3", "--bootstrap", "50", "--splits", "10", "--seed", "3")
TIMING = ["latency_ms", "mean_latency_vision_ms", "mean_latency_selection_ms", "mean_latency_prefill_ms"]


def data_args(ws: dict[str, Path]) -> list[str]:
    args = ["--model", str(ws["model"]), "--images", str(ws["images"]), "--annotations", str(ws["instances"])]
    for path in ws["pope"]:
        args += ["--pope", str(path)]
    return args


def study_args(ws: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return ["study", *data_args(ws), *GRID, *ANALYSIS, "--out", str(out), *extra]


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "prune_audit.cli.main", *args]


@pytest.fixture(scope="module")
def study(workspace, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("study") / "study"
    result = runner.invoke(app, study_args(workspace, out))
    assert result.exit_code == 0, result.output
    assert "3 runs under" in result.stdout and "(3 answered now)" in result.stdout  # none was there before
    return out


def summary(out: Path) -> pd.DataFrame:
    return pd.read_csv(out / "summary.csv", dtype={"budget": str}).set_index("run")


def test_summary_equals_calibrate_and_cascade(study, tmp_path):
    table = summary(study)
    assert list(table.index) == ["dense", "divprune@6", "random@6"]
    assert pd.read_parquet(study / "summary.parquet").set_index("run").drop(columns=TIMING).equals(
        table.drop(columns=TIMING)
    ) or _close(pd.read_parquet(study / "summary.parquet").set_index("run"), table)
    runs = [str(study / "runs" / name) for name in ("divprune-6", "random-6")]
    reference = str(study / "runs" / "dense")
    calibrate = runner.invoke(
        app,
        [
            "calibrate",
            *runs,
            "--reference",
            reference,
            "--bootstrap",
            "50",
            "--seed",
            "3",
            "--out",
            str(tmp_path / "calibration"),
            "--json",
        ],
    )
    assert calibrate.exit_code == 0, calibrate.output
    calibration = json.loads(calibrate.stdout)
    cascade = runner.invoke(
        app,
        [
            "cascade",
            *runs,
            "--reference",
            reference,
            "--epsilon",
            "0.2",
            "--sweep",
            "0.3",
            "--splits",
            "10",
            "--seed",
            "3",
            "--out",
            str(tmp_path / "cascade"),
            "--json",
        ],
    )
    assert cascade.exit_code == 0, cascade.output
    cascades = {entry["label"]: entry for entry in json.loads(cascade.stdout)["cascades"]}
    entries = {entry["label"]: entry for entry in [calibration["reference"], *calibration["runs"]]}
    checks = {
        "accuracy": ("metrics", "all", "accuracy"),
        "f1": ("metrics", "all", "f1"),
        "ece": ("metrics", "all", "ece"),
        "ece_mass": ("metrics", "all", "ece_mass"),
        "ece_test_after": ("temperature", "test_after", "ece"),
        "ece_mass_test_before": ("temperature", "test_before", "ece_mass"),
        "auroc": ("metrics", "all", "auroc"),
        "aurc": ("metrics", "all", "aurc"),
        "brier": ("metrics", "all", "brier"),
        "lost_accuracy": ("survival", "lost", "accuracy"),
        "lost_reference_confidence": ("survival", "lost", "reference_confidence"),
        "accuracy_minus_reference": ("difference_vs_reference", "metrics", "all", "accuracy"),
    }
    for label, entry in entries.items():
        row = table.loc[label]
        for column, path in checks.items():
            node = entry
            for key in path:
                node = node.get(key) if node else None
            if node is None:  # the reference has no differences to itself
                assert math.isnan(row[column]), (label, column)
                continue
            _same(row[column], node["value"], (label, column))
            _same(row[f"{column}_low"], node["ci95"][0], (label, column, "low"))
            _same(row[f"{column}_high"], node["ci95"][1], (label, column, "high"))
        lost, survived = entry["survival"]["lost"]["count"]["value"], entry["survival"]["survived"]["count"]["value"]
        _same(row["lost_share"], lost / (lost + survived) if lost + survived else None, (label, "lost_share"))
        _same(row["temperature"], entry["temperature"]["temperature"], (label, "temperature"))
        if label == "dense":
            assert math.isnan(row["cascade_cost_eps0.2"])
            continue
        for result in cascades[label]["results"]:
            epsilon = f"{result['epsilon']:g}"
            _same(row[f"cascade_cost_eps{epsilon}"], result["relative_cost"], (label, epsilon))
            _same(row[f"savings_share_eps{epsilon}"], result.get("savings_share"), (label, epsilon, "savings"))


def _same(actual: float, expected: float | None, where) -> None:
    if expected is None or (isinstance(expected, float) and math.isnan(expected)):
        assert math.isnan(actual), where
    else:
        assert actual == pytest.approx(expected, rel=1e-12, abs=1e-15), where


def _close(left: pd.DataFrame, right: pd.DataFrame) -> bool:
    pd.testing.assert_frame_equal(left.drop(columns=TIMING), right.drop(columns=TIMING), check_dtype=False)
    return True


class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.sources: list[str] = []
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        attributes = dict(attrs)
        if tag == "img":
            self.sources.append(attributes["src"])
        for name in ("href", "src"):
            if name in attributes and tag != "img":
                self.links.append(attributes[name])


def test_html_is_self_contained_with_every_figure(study):
    from prune_audit.analysis.report_html import FIGURES

    parser = _Images()
    parser.feed((study / "report.html").read_text(encoding="utf-8"))
    assert len(parser.sources) == len(FIGURES) and not parser.links
    for source, (stem, _) in zip(parser.sources, FIGURES):
        prefix = "data:image/png;base64,"
        assert source.startswith(prefix)
        assert base64.b64decode(source[len(prefix) :]) == (study / f"{stem}.png").read_bytes()
    markdown = (study / "report.md").read_text(encoding="utf-8")
    assert all(f"({stem}.png)" in markdown for stem, _ in FIGURES)
    assert "## Findings" in markdown and "divprune@6" in markdown.split("## Findings")[1]


def test_plan_commands_executed_give_the_same_summary(workspace, study, tmp_path):
    out = tmp_path / "planned"
    planned = runner.invoke(app, study_args(workspace, out, "--plan"))
    assert planned.exit_code == 0, planned.output
    commands = planned.stdout.strip().splitlines()
    assert len(commands) == 3 and all(line.startswith("prune-audit run ") for line in commands)
    for command in commands:  # executed as a shell would, in this process (no interpreter start-up per run)
        result = runner.invoke(app, shlex.split(command)[1:])
        assert result.exit_code == 0, result.output
    reported = runner.invoke(app, ["study", "--report", "--out", str(out), *ANALYSIS])
    assert reported.exit_code == 0, reported.output
    _close(summary(out), summary(study))
    # a SLURM array of one shard holds every second command
    script = runner.invoke(app, study_args(workspace, out, "--plan", "--plan-format", "slurm", "--shard", "1/2"))
    assert script.exit_code == 0, script.output
    assert "#SBATCH --array=0-0" in script.stdout and commands[1] in script.stdout.replace("'", "")


def test_a_selector_option_reaches_that_selector_runs_only(workspace, tmp_path):
    out = tmp_path / "options"
    planned = runner.invoke(app, study_args(workspace, out, "--option", "divprune:ties=tolerance", "--plan"))
    assert planned.exit_code == 0, planned.output
    commands = planned.stdout.strip().splitlines()
    assert [("--option ties=tolerance" in line) for line in commands] == [False, True, False]  # dense, divprune, random
    result = runner.invoke(app, shlex.split(commands[1])[1:])
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "runs" / "divprune-6" / "manifest.json").read_text())
    assert manifest["selector"]["options"]["ties"] == "tolerance"
    for option, words in (
        ("ties=tolerance", "name the selector it applies to"),
        ("fastv:layer=3", "'fastv' is not among --selectors"),
        ("none:ties=tolerance", "'none' is not among --selectors"),
        ("divprune:ties=never", "ties"),
    ):
        bad = tmp_path / "bad"
        result = runner.invoke(app, study_args(workspace, bad, "--option", option))
        assert result.exit_code == 2 and words in result.stderr, (option, result.output)
        assert len(result.stderr.strip().splitlines()) == 1 and not bad.exists()


def test_resume_after_kill_reruns_nothing_finished(workspace, tmp_path):
    from prune_audit.runner.request import RunRequest
    from prune_audit.runner.study.execute import plan_grid, run_grid
    from prune_audit.runner.study.grid import StudyGrid

    out = tmp_path / "killed"
    process = subprocess.Popen(
        cli(*study_args(workspace, out)), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    second = out / "runs" / "divprune-6"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and process.poll() is None:
        if (second / "parts").is_dir() and any((second / "parts").iterdir()):
            break
        time.sleep(0.02)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # it finished first: the resume must then answer nothing
        pass
    process.wait()
    finished = {path.name for path in (out / "runs").iterdir() if (path / "records.parquet").is_file()}
    assert "dense" in finished
    ws = workspace
    grid = StudyGrid(
        ("divprune", "random"),
        ("6",),
        out,
        RunRequest(
            model=str(ws["model"]),
            question_files=list(ws["pope"]),
            images=ws["images"],
            annotations=ws["instances"],
            limit=40,
            seed=3,
        ),
    )
    outcomes = run_grid(grid, plan_grid(grid))
    for outcome in outcomes:
        if outcome.cell.name in finished:
            assert outcome.answered == 0, outcome
    assert sum(outcome.answered for outcome in outcomes) < 3 * 40


def test_refusals(workspace, tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "calibration.json").write_text("{}")
    result = runner.invoke(app, study_args(workspace, foreign))
    assert result.exit_code == 2 and "outputs of prune-audit calibrate" in result.stderr
    assert sorted(p.name for p in foreign.iterdir()) == ["calibration.json"]
    result = runner.invoke(app, study_args(workspace, tmp_path / "bad", "--selectors", "nonesuch"))
    assert result.exit_code == 2 and "unknown selector 'nonesuch'" in result.stderr
    assert not (tmp_path / "bad").exists()
    result = runner.invoke(app, ["study", "--report", "--out", str(tmp_path / "empty")])
    assert result.exit_code == 2 and "--plan" in result.stderr


def test_a_changed_configuration_is_refused(workspace, study, tmp_path):
    import shutil

    out = tmp_path / "changed"
    shutil.copytree(study, out)
    result = runner.invoke(app, study_args(workspace, out, "--batch-size", "4", "--limit", "30"))
    assert result.exit_code == 2 and "different configuration (limit" in result.stderr, result.output
    # other analysis settings rebuild the report from the same runs (the report names them)
    result = runner.invoke(app, study_args(workspace, out, "--bootstrap", "60", "--quiet"))
    assert result.exit_code == 0, result.output
    assert "3 runs under" in result.stdout and "(3 finished before, reused)" in result.stdout
    assert "(60 resamples" in (out / "report.md").read_text(encoding="utf-8")


def test_grid_names_and_budgets():
    from prune_audit.compute.budget import parse_requested_budget as parse_budget
    from prune_audit.runner.study.grid import StudyCell, parse_list

    assert StudyCell("none", None).name == "dense" and StudyCell("fastv", "64").name == "fastv-64"
    assert parse_list(" a, b ", "--x") == ("a", "b")
    with pytest.raises(PruneAuditError, match="repeats"):
        parse_list("a,a", "--x")
    with pytest.raises(PruneAuditError, match="positive"):
        parse_budget("0")
