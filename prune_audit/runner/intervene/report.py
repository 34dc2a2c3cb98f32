"""``prune-audit intervene``, step 4: intervention.json from the intervention records."""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import pyarrow as pa

from prune_audit.analysis.bootstrap import image_counts
from prune_audit.analysis.calibration import survival_measures
from prune_audit.analysis.reports import run_identity
from prune_audit.analysis.runs import question_table
from prune_audit.runner.intervene.plan import InterveneRequest, InterventionSource
from prune_audit.tasks import manifest_task

CONDITIONS = ("intervention", "control")
REPORT_FILE = "intervention.json"

CONVENTIONS = {
    "restore": "lost objects: m random kept cells replaced by the m object cells with the most object area "
    "(intervention) or by m random cells neither kept nor object (control); m = min(max_cells, object cells, "
    "kept cells, free cells)",
    "remove": "objects with 1..32 kept cells: the same k random cells neither kept nor object are added; the "
    "intervention removes the k kept object cells, the control k random kept non-object cells",
    "stage": "kept set, lost and object tokens read at the --stage stage c (default first); in-LLM stages up to c: "
    "S_i' = (S_i minus the first |A minus S_i| removed cells) plus A; after c: S_i' = (S_i minus R) plus the first "
    "|S_i and R| cells of A; sizes fixed, stages stay nested, empty stages stay empty",
    "clips": "on a clip task's run the object is its pixels in the question's window (the window's sampled frames; "
    "the whole clip without a window), a token's pixels its cell's in its two frames: restore takes the questions "
    "lost in the window (lost_in_window), remove those with window pixels kept; the stage is the first",
    "object_area_changed": "object pixels of the added cells minus those of the removed cells",
    "intervals": "95% percentile intervals from an image-clustered bootstrap; differences are paired "
    "(intervention minus control on the same resampled images)",
}


def intervention_report(
    request: InterveneRequest, source: InterventionSource, table: pa.Table, eligible: int, skipped: Counter
) -> dict[str, Any]:
    """intervention.json: per condition accuracy and mean confidence with 95% image-bootstrap intervals,
    the paired difference intervention - control, the run's own answers on the same questions, and the
    object area and cells changed."""
    conditions = table["condition"].to_numpy(zero_copy_only=False)
    tables = {
        name: question_table(
            table.filter(conditions == name), REPORT_FILE, source.stage, manifest_task(source.manifest)
        )
        for name in CONDITIONS
    }
    position = {key: index for index, key in enumerate(source.run.questions.keys())}
    intervened = [position[key] for key in tables["intervention"].keys()]
    tables["recorded"] = source.run.questions.take(np.array(intervened, dtype=np.int64))
    images = np.unique(tables["intervention"].image_id)
    counts = image_counts(len(images), request.bootstrap, request.seed)
    measured = {
        name: survival_measures(
            questions, {"all": np.ones(len(questions), dtype=bool)}, questions.image_index(images), counts
        )["all"]
        for name, questions in tables.items()
    }
    report: dict[str, Any] = {
        **run_identity(source.run, source.run.label),
        "mode": request.mode,
        "settings": {
            "max_cells": request.max_cells,
            "controls": request.controls,
            "bootstrap": request.bootstrap,
            "seed": request.seed,
        },
        "threads": request.threads,
        "conventions": CONVENTIONS,
        "questions": {
            "eligible": eligible,
            "intervened": len(tables["intervention"]),
            "images": len(images),
            "skipped": dict(sorted(skipped.items())),
        },
    }
    for name, measure in measured.items():
        report[name] = {**_scores(measure.summary()), "mean_retention": float(np.mean(tables[name].retention))}
        if name in CONDITIONS:
            rows = table.filter(conditions == name)
            report[name]["mean_cells_changed"] = float(np.mean(rows["cells_changed"].to_numpy()))
            report[name]["mean_object_area_changed"] = float(np.mean(rows["object_area_changed"].to_numpy()))
    report["difference"] = _scores(measured["intervention"].minus(measured["control"]))
    if manifest_task(source.manifest).reads_clips:
        _add_window_retention(report, source, table, tables["intervention"].keys())
    return report


def _add_window_retention(
    report: dict[str, Any], source: InterventionSource, table: pa.Table, keys: list[tuple[str, int]]
) -> None:
    """On clips, each part's mean ``window_retention``: the share of the asked window's object pixels kept (the
    region the swaps move), over the intervened questions (NaN-free: they all have pixels in their window)."""
    recorded = {(row["split"], row["question_id"]): row["window_retention"] for row in source.records}
    report["recorded"]["mean_window_retention"] = float(np.mean([recorded[key] for key in keys]))
    conditions = table["condition"].to_numpy(zero_copy_only=False)
    for name in CONDITIONS:
        values = table.filter(conditions == name)["window_retention"].to_numpy()
        report[name]["mean_window_retention"] = float(np.mean(values))


def _scores(estimates: dict[str, dict]) -> dict[str, dict]:
    return {"accuracy": estimates["accuracy"], "mean_confidence": estimates["confidence"]}
