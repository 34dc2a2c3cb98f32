"""Kept-set interchange: ``prune-audit export`` and ``prune-audit import`` (docs/interchange.md)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from test_run_cli import base_args
from typer.testing import CliRunner

from prune_audit.cli.main import app

runner = CliRunner()
# columns that say where and when the records were made rather than what they hold
PROVENANCE = ("latency_ms", "latency_vision_ms", "latency_selection_ms", "latency_prefill_ms", "latency_decode_ms")
SELECTORS = [("none", ()), ("divprune", ("--budget", "6")), ("visionzip", ("--budget", "6")),
             ("fastv", ("--budget", "6")), ("pdrop", ("--budget", "6")), ("sparsevlm", ("--budget", "6"))]


def question_args(ws: dict[str, Path]) -> list[str]:
    args = ["--images", str(ws["images"]), "--annotations", str(ws["instances"])]
    for path in ws["pope"]:
        args += ["--pope", str(path)]
    return args


def same_values(left, right) -> bool:
    if isinstance(left, float) and isinstance(right, float):
        return (math.isnan(left) and math.isnan(right)) or left == right
    if isinstance(left, list) and isinstance(right, list):
        return len(left) == len(right) and all(same_values(a, b) for a, b in zip(left, right))
    return left == right


@pytest.fixture(scope="module")
def runs(workspace, tmp_path_factory):
    root = tmp_path_factory.mktemp("interchange")
    made = {}
    for name, extra in SELECTORS:
        out = root / f"run-{name}"
        result = runner.invoke(app, base_args(workspace, out, "--selector", name, *extra, "--limit", "24", "--quiet"))
        assert result.exit_code == 0, result.output
        made[name] = out
    return made


@pytest.mark.parametrize("name", [name for name, _ in SELECTORS])
@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_export_then_import_gives_the_same_records(runs, workspace, tmp_path, name, suffix):
    exported = tmp_path / f"kept{suffix}"
    result = runner.invoke(app, ["export", str(runs[name]), "--out", str(exported)])
    assert result.exit_code == 0, result.output
    out = tmp_path / "imported"
    result = runner.invoke(app, ["import", str(exported), "--geometry", str(workspace["model"]), *question_args(workspace),
                                 "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    original = pq.read_table(runs[name] / "records.parquet").to_pylist()
    imported = pq.read_table(out / "records.parquet").to_pylist()
    assert len(original) == len(imported) == 24
    for before, after in zip(original, imported):
        for column, value in before.items():
            if column not in PROVENANCE:
                assert same_values(value, after[column]), (column, value, after[column])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["selector"]["name"] == name and manifest["selector"]["imported"]["answers"] == "file"
    # the analyses read it as a run
    result = runner.invoke(app, ["calibrate", str(out), "--out", str(tmp_path / "calibration"), "--bootstrap", "20"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("name", ["divprune", "fastv"])
def test_import_with_a_model_reanswers_under_the_forced_kept_sets(runs, workspace, tmp_path, name):
    exported = tmp_path / "kept.jsonl"
    assert runner.invoke(app, ["export", str(runs[name]), "--out", str(exported)]).exit_code == 0
    out = tmp_path / "reanswered"
    result = runner.invoke(app, ["import", str(exported), "--model", str(workspace["model"]),
                                 *question_args(workspace), "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    original = pq.read_table(runs[name] / "records.parquet").to_pylist()
    imported = pq.read_table(out / "records.parquet").to_pylist()
    for before, after in zip(original, imported):
        assert after["kept_stages"] == before["kept_stages"] and after["stage_layers"] == before["stage_layers"]
        assert after["p_yes"] == pytest.approx(before["p_yes"], abs=1e-6)
    assert json.loads((out / "manifest.json").read_text())["selector"]["imported"]["answers"] == "model"
