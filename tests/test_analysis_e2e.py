"""One analysis chain end to end on the tiny offline LLaVA, every step through the CLI:

run dense + run pruned -> calibrate -> cascade -> visualize --run -> intervene --mode remove,
checking exit codes, the files each step writes and a few numbers against the run records.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from test_run_cli import base_args
from typer.testing import CliRunner

from prune_audit.analysis.temperature import split_images
from prune_audit.cli.main import app

runner = CliRunner()


def invoke(*args: str):
    result = runner.invoke(app, list(args))
    assert result.exit_code == 0, f"{args[0]}: {result.output}"
    return result


def records(directory):
    return pq.read_table(directory / "records.parquet").to_pandas().set_index(["split", "question_id"]).sort_index()


def test_run_calibrate_cascade_visualize_intervene(workspace, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # intervene's default folder, intervene/<run name>-MODE, is relative to the cwd
    dense_dir, pruned_dir = tmp_path / "dense", tmp_path / "pruned"
    invoke(*base_args(workspace, dense_dir, "--split", "random"))
    invoke(*base_args(workspace, pruned_dir, "--split", "random", "--selector", "random", "--budget", "4"))
    dense, pruned = records(dense_dir), records(pruned_dir)
    assert dense.index.equals(pruned.index) and len(pruned) == 60

    calibration_dir = tmp_path / "calibration"
    result = invoke(
        "calibrate",
        str(pruned_dir),
        "--reference",
        str(dense_dir),
        "--bootstrap",
        "50",
        "--out",
        str(calibration_dir),
        "--json",
    )
    calibration = json.loads(result.stdout)
    assert (calibration_dir / "calibration.csv").is_file()
    assert json.loads((calibration_dir / "calibration.json").read_text()) == calibration
    pruned_metrics = calibration["runs"][0]["metrics"]["all"]
    assert pruned_metrics["accuracy"]["value"] == pytest.approx(pruned["correct"].mean())
    difference = calibration["runs"][0]["difference_vs_reference"]["metrics"]["all"]["accuracy"]["value"]
    assert difference == pytest.approx(pruned["correct"].mean() - dense["correct"].mean())

    cascade_dir = tmp_path / "cascade"
    result = invoke(
        "cascade",
        str(pruned_dir),
        "--reference",
        str(dense_dir),
        "--epsilon",
        "0.2",
        "--splits",
        "20",
        "--out",
        str(cascade_dir),
        "--json",
    )
    cascade = json.loads(result.stdout)["cascades"][0]
    assert (cascade_dir / "cascade.json").is_file()
    # the chosen threshold's outcome on the seeded test images, from the records
    _, test_images = split_images(pruned["image_id"].to_numpy(), 0.5, seed=0)
    test = pruned[pruned["image_id"].isin(test_images)]
    answered = test["confidence"] > cascade["threshold"]
    assert cascade["escalation_rate"] == pytest.approx(1 - answered.mean())
    loss = answered & (test["answer"] != dense.loc[test.index, "answer"])
    assert cascade["disagreement"] == pytest.approx(loss.groupby(test["image_id"]).mean().mean())

    split, question_id = pruned[pruned["label"] == "yes"].index[0]
    picture = tmp_path / "tokens.png"
    invoke(
        "visualize",
        "--run",
        str(pruned_dir),
        "--question-id",
        str(question_id),
        "--split",
        split,
        "--out",
        str(picture),
    )
    assert picture.read_bytes()[:4] == b"\x89PNG"

    result = invoke("intervene", str(pruned_dir), "--mode", "remove", "--bootstrap", "50", "--json")
    report = json.loads(result.stdout)
    swapped = pq.read_table(tmp_path / "intervene" / "pruned-remove" / "records.parquet").to_pandas()
    eligible = pruned["object_tokens_kept"].between(1, 32)
    assert report["questions"]["eligible"] == int(eligible.sum())
    assert report["questions"]["intervened"] == len(swapped) // 2 > 0
    treated = swapped[swapped["condition"] == "intervention"]
    assert report["intervention"]["accuracy"]["value"] == pytest.approx(treated["correct"].mean())
    assert (treated["lost"] == True).all()  # noqa: E712 (nullable column): every kept object cell was removed
    assert np.isclose(
        report["recorded"]["accuracy"]["value"],
        pruned.loc[list(zip(treated["split"], treated["question_id"])), "correct"].mean(),
    )
