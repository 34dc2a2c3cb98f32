"""``visualize --run`` draws every task's evidence region: GQA's scene-graph boxes, a caption's annotated objects,
POPE's queried object; ScienceQA names none and the figure says so."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from test_gqa import gqa_args, gqa_inputs
from test_scienceqa import scienceqa_file
from typer.testing import CliRunner

from prune_audit.cli.main import app

runner = CliRunner()


@pytest.fixture
def drawn_masks(monkeypatch) -> list:
    """The mask of every panel ``visualize --run`` draws, captured before the figure is written."""
    from prune_audit.runner import visualize_record

    masks: list = []
    original = visualize_record.draw_panels

    def capture(pixels, panels, out, **kwargs):
        masks.extend(panel.mask for panel in panels)
        return original(pixels, panels, out, **kwargs)

    monkeypatch.setattr(visualize_record, "draw_panels", capture)
    return masks


@pytest.fixture
def drawn_panels(monkeypatch) -> list:
    """Every panel ``visualize --run`` draws (its mask, boxes, legend words), captured before the figure is written."""
    from prune_audit.runner import visualize_record

    panels: list = []
    original = visualize_record.draw_panels

    def capture(pixels, drawn, out, **kwargs):
        panels.extend(drawn)
        return original(pixels, drawn, out, **kwargs)

    monkeypatch.setattr(visualize_record, "draw_panels", capture)
    return panels


def redraw(run: Path, row: dict, out: Path):
    result = runner.invoke(
        app,
        [
            "visualize",
            "--run",
            str(run),
            "--question-id",
            str(row["question_id"]),
            "--split",
            row["split"],
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    return result


def test_gqa_figure_draws_the_union_of_the_annotated_boxes(workspace, tmp_path, drawn_masks):
    inputs = gqa_inputs(workspace, tmp_path / "gqa")
    run = tmp_path / "run"
    result = runner.invoke(
        app, gqa_args(workspace, inputs, run, "--selector", "random", "--budget", "6", "--max-new-tokens", "2")
    )
    assert result.exit_code == 0, result.output
    row = pq.read_table(run / "records.parquet").to_pylist()[0]
    redraw(run, row, tmp_path / "figure.png")
    graph = json.loads(inputs["graphs"].read_text())[Path(row["image"]).stem]
    expected = np.zeros((graph["height"], graph["width"]), dtype=bool)
    for object_id in row["evidence_object_ids"]:
        box = graph["objects"][object_id]
        expected[box["y"] : box["y"] + box["h"], box["x"] : box["x"] + box["w"]] = True
    assert expected.any() and np.array_equal(drawn_masks[0], expected)


def test_caption_figure_draws_every_annotated_object(workspace, tmp_path, drawn_masks):
    from prune_audit.data.coco import CocoInstances

    instances = str(workspace["instances"])
    run = tmp_path / "run"
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
            str(run),
            "--limit",
            "2",
            "--max-new-tokens",
            "2",
        ],
    )
    assert result.exit_code == 0, result.output
    row = pq.read_table(run / "records.parquet").to_pylist()[0]
    redraw(run, row, tmp_path / "figure.png")
    coco = CocoInstances.load(workspace["instances"])
    expected = np.logical_or.reduce([coco.category_mask(row["image_id"], name) for name in row["evidence_objects"]])
    assert len(row["evidence_objects"]) > 1 and np.array_equal(drawn_masks[0], expected)


def test_pope_figure_draws_the_queried_object_of_yes_questions_only(workspace, tmp_path, drawn_masks):
    from prune_audit.data.coco import CocoInstances

    run = tmp_path / "run"
    args = [
        "run",
        "--model",
        str(workspace["model"]),
        "--images",
        str(workspace["images"]),
        "--annotations",
        str(workspace["instances"]),
        "--pope",
        str(workspace["pope"][0]),
        "--out",
        str(run),
        "--limit",
        "6",
    ]
    assert runner.invoke(app, args).exit_code == 0
    rows = pq.read_table(run / "records.parquet").to_pylist()
    yes, no = (next(r for r in rows if r["label"] == label) for label in ("yes", "no"))
    redraw(run, yes, tmp_path / "yes.png")
    coco = CocoInstances.load(workspace["instances"])
    assert np.array_equal(drawn_masks[0], coco.category_mask(yes["image_id"], yes["object"]))
    said = redraw(run, no, tmp_path / "no.png")
    assert drawn_masks[1] is None and "this question names no region" in " ".join(said.stdout.split())


def test_scienceqa_figure_says_it_has_no_evidence_region(workspace, letters_model, tmp_path, drawn_masks):  # noqa: F811
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
        ],
    )
    assert result.exit_code == 0, result.output
    said = redraw(run, pq.read_table(run / "records.parquet").to_pylist()[0], tmp_path / "figure.png")
    assert drawn_masks == [None]
    assert "no evidence mask: scienceqa questions name no image region" in " ".join(said.stdout.split())


def test_each_task_names_its_evidence_outline_in_the_figure_legend():
    from prune_audit.tasks import get_task, list_tasks

    labels = {name: get_task(name).evidence_label for name in list_tasks()}
    assert labels["pope"] == "queried object" and labels["textvqa"] == "answer's OCR text"
    assert labels["refcoco"] == "referred object" and all(labels.values())
