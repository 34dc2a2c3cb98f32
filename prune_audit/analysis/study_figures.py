"""Pictures of the study report, drawn from the summary rows and the calibrate / cascade reports.

Each function returns {file name: bytes} (PNG and SVG, through ``figures``' renderer); the
cascade's pictures are ``cascade_plots.cascade_figures``' own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from prune_audit.analysis.cascade_plots import cascade_figures
from prune_audit.analysis.figures import (  # one renderer and one run style for every report
    RELIABILITY_LIMITS,
    SPARSE_LABEL,
    RunStyle,
    _figure,
    _render,
    reliability_points,
    run_styles,
)

if TYPE_CHECKING:
    from prune_audit.tasks import Task


def _pruned_by_selector(rows: Sequence[dict]) -> dict[str, list[dict]]:
    """Pruned rows grouped by selector, each group sorted by realised visual tokens."""
    groups: dict[str, list[dict]] = {}
    for row in rows:
        if row["selector"] != "dense":
            groups.setdefault(row["selector"], []).append(row)
    return {name: sorted(group, key=lambda row: row["visual_tokens"]) for name, group in groups.items()}


def _interval(rows: Sequence[dict], name: str) -> tuple[np.ndarray, list[np.ndarray]]:
    """Values of column ``name`` and their error bars (distance to the 95 % interval ends, at least 0)."""
    value = np.array([row[name] for row in rows], dtype=float)
    low = np.array([row[f"{name}_low"] for row in rows], dtype=float)
    high = np.array([row[f"{name}_high"] for row in rows], dtype=float)
    # a percentile interval need not contain the point estimate: clip the bars at the point
    return value, [np.clip(np.nan_to_num(value - low), 0, None), np.clip(np.nan_to_num(high - value), 0, None)]


BUDGET_AXIS = ("visual_tokens", "realised visual tokens per question")
FLOPS_AXIS = ("flops_relative", "prefill FLOPs relative to dense (docs/compute.md)")


def study_styles(rows: Sequence[dict]) -> dict[str, RunStyle]:
    """Every run's colour and marker in the study's figures (``run_styles`` over the summary rows, dense black)."""
    return run_styles([row["run"] for row in rows], next(row["run"] for row in rows if row["selector"] == "dense"))


def metric_vs_budget(
    rows: Sequence[dict],
    metrics: Sequence[tuple[str, str]],
    title: str,
    stem: str,
    x: tuple[str, str] = BUDGET_AXIS,
) -> dict[str, bytes]:
    """One panel per (column, axis label): each run's value against ``x`` (column, axis label; realised visual
    tokens by default, or relative FLOPs) in its ``study_styles``, a selector's runs joined by a grey line named
    at its end, dense dashed."""
    figure, axes = _figure(1, len(metrics), size=(5.2 * len(metrics), 4.0))
    reference = next(row for row in rows if row["selector"] == "dense")
    styles = study_styles(rows)
    for axis, (name, label) in zip(axes[0], metrics):
        for selector, group in _pruned_by_selector(rows).items():
            value, error = _interval(group, name)
            position = [row[x[0]] for row in group]
            axis.plot(position, value, color="0.6", linewidth=1, zorder=1)
            axis.annotate(
                selector,
                (position[-1], value[-1]),
                xytext=(5, 0),
                textcoords="offset points",
                va="center",
                fontsize=7,
                color="0.3",
            )
            for row, at, centre, low, high in zip(group, position, value, *error):
                style = styles[row["run"]]
                axis.errorbar(
                    at,
                    centre,
                    yerr=[[low], [high]],
                    marker=style.marker,
                    color=style.colour,
                    capsize=3,
                    label=row["run"],
                )
        axis.axhline(reference[name], color="black", linestyle="--", linewidth=1, label="dense (all tokens)")
        axis.set(xlabel=x[1], ylabel=label)
        axis.margins(x=0.2)  # room for the selector names at the lines' ends
        axis.legend(fontsize=7)
    figure.suptitle(f"{title} (95% image-bootstrap intervals)", fontsize=10)
    return _render(figure, stem)


def _lost_point(row: dict, prefix: str) -> tuple[float, float, list[list[float]], list[list[float]]]:
    """(confidence, accuracy, x error, y error) of the lost-object questions, ``prefix`` "lost" or "lost_reference"."""
    confidence, confidence_error = _interval([row], f"{prefix}_confidence")
    accuracy, accuracy_error = _interval([row], f"{prefix}_accuracy")
    return float(confidence[0]), float(accuracy[0]), confidence_error, accuracy_error


def lost_objects(rows: Sequence[dict], title: str, evidence_questions: str) -> dict[str, bytes]:
    """Accuracy against mean confidence on the questions whose object was lost, pruned and dense, with 95% intervals.

    Each run's pruned point (filled, its ``study_styles``) and the dense model on the same questions (open square
    of the run's colour) are joined by a thin line. Both axes span the same range, from the lowest point or
    interval end to 1, so the diagonal (accuracy = confidence) runs corner to corner and a confident but wrong
    run is visibly far below it. Runs that lost no object (or have no object masks) are listed under the plot.
    """
    figure, axes = _figure(size=(6.6, 6.2))
    axis = axes[0, 0]
    styles = study_styles(rows)
    values: list[float] = []
    absent = []
    for row in rows:
        if row["selector"] == "dense":
            continue
        if not np.isfinite(row["lost_accuracy"]):
            reason = "no object masks" if not np.isfinite(row["lost_share"]) else "lost no object"
            absent.append(f"{row['run']} ({reason})")
            continue
        pruned, dense = _lost_point(row, "lost"), _lost_point(row, "lost_reference")
        style = styles[row["run"]]
        label = f"{row['run']} (lost {row['lost_share']:.0%} of {evidence_questions})"
        axis.errorbar(
            pruned[0],
            pruned[1],
            xerr=pruned[2],
            yerr=pruned[3],
            marker=style.marker,
            capsize=2,
            color=style.colour,
            label=label,
        )
        axis.errorbar(
            dense[0],
            dense[1],
            xerr=dense[2],
            yerr=dense[3],
            marker="s",
            markerfacecolor="white",
            capsize=2,
            color=style.colour,
            alpha=0.8,
        )
        axis.plot([pruned[0], dense[0]], [pruned[1], dense[1]], color=style.colour, linewidth=0.8, alpha=0.5)
        for point in (pruned, dense):
            values += [point[0] - point[2][0][0], point[1] - point[3][0][0]]
    axis.plot(
        [],
        [],
        marker="s",
        markerfacecolor="white",
        color="gray",
        linestyle="-",
        linewidth=0.8,
        label="open square: dense model on the same questions (line joins the pair)",
    )
    limits = diagonal_limits(values)
    axis.plot(limits, limits, color="gray", linestyle=":", linewidth=1, label="accuracy = confidence")
    axis.set(
        xlim=limits,
        ylim=limits,
        aspect="equal",
        xlabel="mean confidence on lost-object questions",
        ylabel="accuracy on lost-object questions",
    )
    axis.set_title(f"{title}\nfilled: pruned model; bars: 95% image-bootstrap intervals", fontsize=10)
    axis.legend(fontsize=7, loc="upper left")
    if absent:
        figure.text(0.01, 0.0, "not drawn: " + "; ".join(absent), fontsize=8, ha="left", va="top", wrap=True)
    return _render(figure, "lost_objects")


def diagonal_limits(values: Sequence[float]) -> tuple[float, float]:
    """The one range of both axes of an accuracy-against-confidence plot: from 0.05 below the lowest finite value
    (the points' lower interval ends), at least -0.05, to just above 1."""
    finite = [value for value in values if np.isfinite(value)]
    low = min(finite, default=0.0)
    return max(-0.05, low - 0.05), 1.03


def reliability_grid(
    entries: Sequence[dict], title: str, styles: dict[str, RunStyle] | None = None
) -> dict[str, bytes]:
    """Reliability curves of every run side by side (calibrate entries, the reference first).

    Each run in its style (``styles``: the study's; default: the entries' order, the reference first and black).
    As in ``reliability_overlay``: marker area proportional to the bin's questions (one scale for
    every panel), 95% intervals, bins of fewer than ``MIN_BIN_QUESTIONS`` questions open and not joined.
    """
    columns = min(4, len(entries))
    rows = -(-len(entries) // columns)
    figure, axes = _figure(rows, columns, size=(3.2 * columns, 3.2 * rows + 0.4))
    for axis in axes.flat[len(entries) :]:
        axis.set_axis_off()
    largest = max(max(entry["reliability"]["count"], default=1) for entry in entries)
    styles = styles or run_styles([entry["label"] for entry in entries], entries[0]["label"])
    for axis, entry in zip(axes.flat, entries):
        axis.plot([0, 1], [0, 1], color="0.5", linestyle="--", linewidth=1)
        reliability_points(
            axis, entry["reliability"], largest, entry["label"], styles[entry["label"]], marker_scale=0.5
        )
        ece = entry["metrics"]["all"]["ece"]["value"]
        axis.set(**RELIABILITY_LIMITS, title=f"{entry['label']}\nECE {ece:.3f}")
        axis.title.set_fontsize(9)
    figure.supxlabel("mean confidence in bin")
    figure.supylabel("accuracy in bin")
    figure.suptitle(
        f"{title}\nmarker area: questions in the bin; bars: 95% image-bootstrap interval; {SPARSE_LABEL}", fontsize=9
    )
    return _render(figure, "reliability_grid")


def study_figures(rows: Sequence[dict], calibration: dict, cascade: dict, title: str, task: Task) -> dict[str, bytes]:
    """Every picture of the study report, by file name (the lost-objects figure only where ``task``'s questions
    name evidence)."""
    entries = [calibration["reference"], *calibration["runs"]]
    files = metric_vs_budget(rows, [("accuracy", "accuracy")], f"{title}: accuracy", "accuracy_vs_budget")
    calibration_metrics = [("ece", "ECE (equal-width bins)"), ("auroc", "AUROC (confidence vs correctness)")]
    files.update(metric_vs_budget(rows, calibration_metrics, f"{title}: calibration", "calibration_vs_budget"))
    files.update(
        metric_vs_budget(
            rows,
            [("accuracy", "accuracy"), ("auroc", "AUROC (confidence vs correctness)")],
            f"{title}: at matched compute",
            "quality_vs_flops",
            x=FLOPS_AXIS,
        )
    )
    if task.names_evidence:
        files.update(lost_objects(rows, f"{title}: lost objects", task.evidence_questions))
    files.update(reliability_grid(entries, f"{title}: reliability", study_styles(rows)))
    files.update(cascade_figures(cascade["cascades"], title, cascade["reference"]["label"], styles=study_styles(rows)))
    return files
