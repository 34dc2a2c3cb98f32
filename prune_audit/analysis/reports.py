"""The ``calibrate`` and ``cascade`` reports: run metadata around the analyses, and their files."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict

from prune_audit.analysis import figures
from prune_audit.analysis.calibration import RETENTION_BINS, CalibrationSettings, calibration_audit, check_confidences
from prune_audit.analysis.cascade import COST_LABELS, cascade_audit
from prune_audit.analysis.cascade_plots import cascade_figures
from prune_audit.analysis.metric_table import METRICS
from prune_audit.analysis.outputs import estimates_csv, to_json
from prune_audit.analysis.runs import Run, display_model, unique_labels
from prune_audit.tasks import Task

CALIBRATION_CONVENTIONS = {
    **{metric.name: metric.meaning for metric in METRICS},
    "reliability": "per-bin count, mean confidence and accuracy with --binning; accuracy_ci95: 95% image-bootstrap "
    "interval of each bin's accuracy, bin membership fixed",
    "temperature": "T minimising NLL of sigmoid(d/T) on the calibration images, d = POPE's logit_diff or another "
    "task's confidence logit (bounded search over log T in [0.01, 100]); after-scaling metrics on the disjoint test "
    "images, T fixed in the bootstrap",
    "intervals": "95% percentile intervals from an image-clustered bootstrap (images resampled with replacement); "
    "differences are paired (same resampled images for both runs)",
    "retention_bins": [label for label, _, _ in RETENTION_BINS],
}
"""Definitions written into calibration.json besides the task's (``calibration_conventions``): every metric of
``metric_table``, the rest."""


def calibration_conventions(runs: Sequence[Run], labels: Sequence[str]) -> dict:
    """calibration.json's conventions: ``confidence`` and ``correct`` as the runs' task defines them
    (``Task.confidence_in_use``, ``Task.correct_definition``), then ``CALIBRATION_CONVENTIONS``.

    Runs whose definitions differ (different ``--confidence`` choices, or tasks compared with ``--force``) get a
    definition per run label instead of one.
    """
    definitions = {}
    for kind in ("confidence", "correct"):
        per_run = {label: _task_definition(run.task, kind) for run, label in zip(runs, labels)}
        distinct = set(per_run.values())
        definitions[kind] = distinct.pop() if len(distinct) == 1 else per_run
    return {**definitions, **CALIBRATION_CONVENTIONS}


def _task_definition(task: Task, kind: str) -> str:
    """The task's definition of its ``confidence`` or ``correct`` column, prefixed with its name."""
    text = task.confidence_in_use() if kind == "confidence" else task.correct_definition
    return f"{task.name}: {text}"


CSV_SECTIONS = ("metrics", "temperature", "survival", "difference_vs_reference")


def check_runs(runs: Sequence[Run]) -> None:
    """Every run's probabilities are valid (``check_confidences``), the same check for every analysis."""
    for run in runs:
        check_confidences(run.questions, str(run.path))


def run_identity(run: Run, label: str) -> dict:
    return {
        "run": str(run.path),
        "label": label,
        "model": run.model,
        "selector": run.selector,
        "budget": run.budget,
        "stage": run.stage,
    }


def calibration_report(
    runs: Sequence[Run], reference: Run | None, settings: CalibrationSettings, differences: Sequence[str]
) -> dict:
    """The calibration.json content for ``runs`` (and the reference), labels unique across all of them."""
    labels = unique_labels([*runs, *([reference] if reference else [])])
    check_runs([*runs, *([reference] if reference else [])])
    audit = calibration_audit([run.questions for run in runs], settings, reference.questions if reference else None)
    report = {
        "conventions": calibration_conventions([*runs, *([reference] if reference else [])], labels),
        "settings": asdict(settings),
        "compared_despite_differences": list(differences),
        "split": audit["split"],
        "runs": [{**run_identity(run, label), **summary} for run, label, summary in zip(runs, labels, audit["runs"])],
        "reference": None,
    }
    if reference is not None:
        report["reference"] = {**run_identity(reference, labels[-1]), **audit["reference"]}
        _compare_with_reference(report, runs, reference)
    return report


def _compare_with_reference(report: dict, runs: Sequence[Run], reference: Run) -> None:
    """Each run's task-specific comparison with the reference (``Task.reference_comparison``: captions' omission
    of lost and kept objects beside the reference's), with its meanings among the conventions."""
    from prune_audit.records.store import RecordStore

    reference_records = RecordStore(reference.path, reference.manifest).read()
    for entry, run in zip(report["runs"], runs):
        comparison = run.task.reference_comparison(RecordStore(run.path, run.manifest).read(), reference_records)
        if comparison is not None:
            entry["reference_comparison"] = comparison
            report["conventions"] = {**report["conventions"], **run.task.reference_comparison_meanings}


def calibration_files(report: dict, titles: dict[str, str], task: Task) -> dict[str, str | bytes]:
    """calibration.json, calibration.csv and the pictures; ``titles`` maps run labels to figure titles; ``task``:
    the runs' task (the retention figure follows its evidence; a task without evidence has none)."""
    everyone = [*report["runs"], *([report["reference"]] if report["reference"] else [])]
    tabled = everyone if task.names_evidence else [_without_survival(entry) for entry in everyone]
    files: dict[str, str | bytes] = {
        "calibration.json": to_json(report),
        "calibration.csv": estimates_csv({entry["label"]: entry for entry in tabled}, CSV_SECTIONS),
    }
    for entry in everyone:
        stem, title = figures.slug(entry["label"]), titles[entry["label"]]
        files.update(figures.reliability_diagram(entry, title, f"reliability_{stem}"))
        files.update(figures.confidence_histogram(entry, title, f"confidence_{stem}"))
    labels = [entry["label"] for entry in everyone]
    model = ", ".join(sorted({display_model(entry["model"]) for entry in everyone}))
    runs = report["runs"]
    reference = report["reference"]["label"] if report["reference"] else None
    files.update(
        figures.reliability_overlay(everyone, labels, f"Reliability: {model}", "reliability_overlay", reference)
    )
    if task.names_evidence:
        files.update(
            figures.retention_figure(runs, [entry["label"] for entry in runs], model, "retention", reference, task)
        )
    return files


def _without_survival(entry: dict) -> dict:
    """A run's report without its survival groups (and their differences): a task without evidence has none."""
    difference = entry.get("difference_vs_reference")
    kept = {key: value for key, value in entry.items() if key != "survival"}
    if difference:
        kept["difference_vs_reference"] = {key: value for key, value in difference.items() if key != "survival"}
    return kept


def cascade_report(
    cascades: Sequence[tuple[str, Sequence[Run]]],
    reference: Run,
    epsilon: float,
    sweep: Sequence[float],
    splits: int,
    calibration_fraction: float,
    seed: int,
    differences: Sequence[str],
    optional_sweep: Sequence[float] = (),
    cost: str = "tokens",
) -> dict:
    """The cascade.json content: for each cascade (label, pruned stages cheapest first) every target's results.

    ``sweep`` targets must be feasible; ``optional_sweep`` ones (the default curve) are skipped when not;
    costs are in unit ``cost`` (``analysis.cascade.COST_UNITS``).
    """
    targets = sorted({epsilon, *sweep})
    every_stage = list({id(stage): stage for _, stages in cascades for stage in stages}.values())
    check_runs([*every_stage, reference])
    entries = []
    for label, stages in cascades:
        results = cascade_audit(
            [stage.questions for stage in stages],
            reference.questions,
            targets,
            splits,
            calibration_fraction,
            seed,
            optional=optional_sweep,
            cost=cost,
        )
        primary = next(result for result in results if result["epsilon"] == epsilon)
        entries.append(
            {
                "label": label,
                "stages": [run_identity(stage, stage.label) for stage in stages],
                **primary,
                "results": results,
            }
        )
    computed = {result["epsilon"] for entry in entries for result in entry["results"]}
    return {
        "settings": {
            "epsilon": epsilon,
            "sweep": sorted(computed - {epsilon}),
            "sweep_skipped_infeasible": sorted(set(optional_sweep) - computed),
            "splits": splits,
            "calibration_fraction": calibration_fraction,
            "seed": seed,
            "cost": cost,
        },
        "reference": run_identity(reference, unique_labels([*every_stage, reference])[-1]),
        "compared_despite_differences": list(differences),
        "cascades": entries,
    }


def cascade_files(report: dict, title: str) -> dict[str, str | bytes]:
    cost = COST_LABELS[report["settings"]["cost"]]
    figures_ = cascade_figures(report["cascades"], title, report["reference"]["label"], cost)
    return {"cascade.json": to_json(report), **figures_}
