"""``prune-audit calibrate``: calibration audit of runs, side by side."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated

import typer

from prune_audit.cli.common import STAGE_HELP, handle_errors


@handle_errors
def calibrate(
    run_dirs: Annotated[
        list[Path], typer.Argument(help="Run directories written by prune-audit run.", show_default=False)
    ],
    reference: Annotated[
        Path | None,
        typer.Option(
            "--reference",
            help="Run over the same questions to compare with (usually the dense run; a pruned "
            "run compares two selectors): paired run-minus-reference differences.",
        ),
    ] = None,
    bins: Annotated[int, typer.Option("--bins", help="Number of confidence bins, 1 to 1000.")] = 15,
    binning: Annotated[
        str, typer.Option("--binning", help="width or mass: bins for MCE and the reliability diagrams.")
    ] = "width",
    bootstrap: Annotated[int, typer.Option("--bootstrap", help="Image-clustered bootstrap resamples.")] = 2000,
    calibration_fraction: Annotated[
        float, typer.Option("--calibration-fraction", help="Share of images used to fit the temperature.")
    ] = 0.5,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the image split and the bootstrap.")] = 0,
    out: Annotated[Path, typer.Option("--out", help="Directory for calibration.json, .csv and the pictures.")] = Path(
        "calibration"
    ),
    json_output: Annotated[bool, typer.Option("--json", help="Print calibration.json instead of a table.")] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Compare runs even when model, question files or prompt differ.")
    ] = False,
    stage: Annotated[str, typer.Option("--stage", help=STAGE_HELP)] = "first",
) -> None:
    """Calibration audit: the task's scores, confidence quality, temperature scaling and object survival.

    Confidence and correct: as the runs' task defines them (docs/tasks.md; calibration.json's
    conventions). POPE: max(p_yes, 1 - p_yes), p_yes = sigmoid(logit_diff); correct = answer == label.

    ECE = sum_b (n_b/N) |acc_b - conf_b| over equal-width bins (lower, upper]
    (0 in the first bin, 1.0 in the last) and over equal-mass bins
    (ties share evenly). MCE = worst bin. Debiased error: Kumar et al. 2019
    debiased L2 error over equal-mass bins (its own default). Brier = mean (p_yes - y)^2. NLL in nats. AUROC of
    confidence for correctness. AURC = mean error rate of the k most
    confident questions, k = 1..N.

    Loyalty (with --reference; EffiVLM-Bench): share of questions answered as the reference answers them, and for
    generated answers also the mean token F1 between the two answers.

    Temperature T (p = sigmoid(d/T), d = POPE's logit_diff or the confidence's logit) is fitted by NLL on a seeded split
    of the images (all POPE splits together); scaled metrics are shown on the
    other images. Intervals: 95% percentile, bootstrap over images;
    differences to --reference are paired (same resampled images).
    """
    from prune_audit.analysis.calibration import CalibrationSettings
    from prune_audit.analysis.outputs import to_json, write_files
    from prune_audit.analysis.reports import calibration_files, calibration_report
    from prune_audit.analysis.runs import check_comparable, completeness, load_run
    from prune_audit.records.stages import parse_stage
    from prune_audit.safety.ownership import check_output_dir, hold_output_dir

    settings = CalibrationSettings(bins, binning, bootstrap, calibration_fraction, seed)  # type: ignore[arg-type]
    choice = parse_stage(stage)
    outputs = {
        "runs": [str(p.resolve()) for p in run_dirs],
        "reference": reference and str(reference.resolve()),
        "bins": bins,
        "binning": binning,
        "bootstrap": bootstrap,
        "calibration_fraction": calibration_fraction,
        "seed": seed,
        "stage": choice.name,
    }
    runs = [load_run(path, choice) for path in run_dirs]
    reference_run = load_run(reference, choice) if reference is not None else None
    differences = check_comparable([*runs, *([reference_run] if reference_run else [])], force)
    check_output_dir(out, "calibrate", outputs)  # after the inputs: a mistyped run is named as such
    report = calibration_report(runs, reference_run, settings, differences)
    every = [*report["runs"], *([report["reference"]] if reference_run is not None else [])]
    report["completeness"] = completeness(
        [*runs, *([reference_run] if reference_run else [])], [entry["label"] for entry in every]
    )
    titles = {entry["label"]: run.title for entry, run in zip(report["runs"], runs)}
    if reference_run is not None:
        titles[report["reference"]["label"]] = reference_run.title
    with hold_output_dir(out, "calibrate", outputs):
        write_files(out, calibration_files(report, titles, runs[0].task))
    if json_output:
        print(to_json(report), end="")
    else:
        tasks = [run.task for run in [*runs, *([reference_run] if reference_run else [])]]
        print_calibration_table(
            report, out, [name for task in tasks for name in task.report_metrics], runs[0].task.names_evidence
        )


SCALED_ROWS = ("accuracy", "auroc", "ece", "ece_mass", "nll", "brier")
"""Metrics shown before and after temperature scaling (on the test images)."""


def _cell(estimate: dict | None, precise: bool = False) -> str:
    """An estimate and its interval; ``precise``: 4 significant digits (``Metric.precise``), else 3 decimals."""
    if not estimate or estimate["value"] is None:
        return "-"
    form = "#.4g" if precise else ".3f"
    low, high = estimate["ci95"]
    interval = "" if low is None else f" [{low:{form}}, {high:{form}}]"
    return f"{estimate['value']:{form}}{interval}"


def _temperature(fit: dict) -> str:
    return f"{fit['temperature']:.3f}" + (" (at search bound)" if fit["at_bound"] else "")


def _number(value: float | int | None) -> str:
    """A plain number of a task's reference comparison: a count as is, a share with 3 decimals."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return str(value) if isinstance(value, int) else f"{value:.3f}"


def _count(estimate: dict) -> str:
    return "-" if estimate["value"] is None else str(int(estimate["value"]))


def print_calibration_table(report: dict, out: Path, report_metrics: Sequence[str], evidence: bool) -> None:
    """Runs side by side: overall metrics, temperature scaling on test images, lost objects.

    ``report_metrics``: the metrics the runs' tasks report (``Task.report_metrics``); the table shows those of
    them that ``analysis.metric_table`` marks ``in_table``. ``evidence``: whether the runs' task names image regions
    (``Task.names_evidence``); without, the retention and lost-object rows are left out.
    """
    from rich.console import Console
    from rich.table import Table

    from prune_audit.analysis.metric_table import metric, reported_metrics
    from prune_audit.analysis.outputs import json_ready

    report = json_ready(report)
    entries = [*report["runs"], *([report["reference"]] if report["reference"] else [])]
    table = Table(title="Calibration audit (95% image-bootstrap intervals)")
    table.add_column("metric")
    for entry in entries:
        table.add_column(entry["label"] + (" (reference)" if entry is report["reference"] else ""))
    shown_rows = (
        shown
        for shown in reported_metrics(report_metrics)
        if shown.in_table and (report["reference"] or not shown.needs_reference)  # loyalty: to the reference
    )
    for row in shown_rows:
        table.add_row(row.label, *(_cell(entry["metrics"]["all"].get(row.name), row.precise) for entry in entries))
    table.add_section()
    table.add_row("temperature T", *(_temperature(entry["temperature"]) for entry in entries))
    for key in SCALED_ROWS:
        for stage in ("test_before", "test_after"):
            label = f"{metric(key).label} {'before' if stage == 'test_before' else 'after'} scaling (test)"
            table.add_row(label, *(_cell(entry["temperature"][stage][key]) for entry in entries))
    if evidence:
        _add_lost_rows(table, report, entries)
    if report["reference"]:
        table.add_section()
        for name, key in (("accuracy", "accuracy"), ("ECE", "ece"), ("AUROC", "auroc")):
            differences = (
                entry.get("difference_vs_reference", {}).get("metrics", {}).get("all", {}) for entry in entries
            )
            table.add_row(
                f"{name} minus reference",
                *(_cell(difference.get(key), metric(key).precise) for difference in differences),
            )
    compared = [entry.get("reference_comparison") or {} for entry in entries]  # the task's own (captions)
    names = list(dict.fromkeys(name for comparison in compared for name in comparison))
    if names:
        table.add_section()
        for name in names:
            table.add_row(name.replace("_", " "), *(_number(comparison.get(name)) for comparison in compared))
    console = Console()
    console.print(table)
    console.print(f"wrote calibration.json, calibration.csv and pictures to {out}")


def _add_lost_rows(table, report: dict, entries: list[dict]) -> None:
    """The retention stage read and the questions whose evidence was lost, with their accuracy and confidence."""
    table.add_section()
    table.add_row("retention stage read", *(entry["stage"] for entry in entries))
    table.add_row("questions with lost object", *(_count(entry["survival"]["lost"]["count"]) for entry in entries))
    for name, key in (("accuracy if lost", "accuracy"), ("confidence if lost", "confidence")):
        table.add_row(name, *(_cell(entry["survival"]["lost"][key]) for entry in entries))
        if report["reference"]:
            reference = (_cell(entry["survival"]["lost"].get(f"reference_{key}")) for entry in entries)
            table.add_row(f"  {report['reference']['label']} {name} (same questions)", *reference)
