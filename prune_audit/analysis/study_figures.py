"""Pictures of the study report, drawn from the summary rows and the calibrate / cascade reports.

Each function returns {file name: bytes} (PNG and SVG, through ``figures``' renderer); the
cascade's cost-vs-epsilon picture is ``figures.cascade_figures``' own.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from prune_audit.analysis.figures import _figure, _render, cascade_figures  # one renderer for every report


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


def metric_vs_budget(rows: Sequence[dict], metrics: Sequence[tuple[str, str]], title: str, stem: str) -> dict[str, bytes]:
    """One panel per (column, axis label): each selector's value against realised visual tokens, dense dashed."""
    figure, axes = _figure(1, len(metrics), size=(5.2 * len(metrics), 4.0))
    reference = next(row for row in rows if row["selector"] == "dense")
    for axis, (name, label) in zip(axes[0], metrics):
        for selector, group in _pruned_by_selector(rows).items():
            value, error = _interval(group, name)
            tokens = [row["visual_tokens"] for row in group]
            axis.errorbar(tokens, value, yerr=error, marker="o", capsize=3, label=selector)
        axis.axhline(reference[name], color="black", linestyle="--", linewidth=1, label="dense (all tokens)")
        axis.set(xlabel="realised visual tokens per question", ylabel=label)
        axis.legend(fontsize=8)
    figure.suptitle(f"{title} (95% image-bootstrap intervals)", fontsize=10)
    return _render(figure, stem)


def lost_objects(rows: Sequence[dict], title: str) -> dict[str, bytes]:
    """Accuracy against mean confidence on the questions whose object was lost: pruned -> reference arrows."""
    figure, axes = _figure(size=(6.4, 5.0))
    axis = axes[0, 0]
    axis.plot([0.5, 1], [0.5, 1], color="gray", linestyle=":", linewidth=1, label="accuracy = confidence")
    for row in rows:
        if row["selector"] == "dense" or not np.isfinite(row["lost_accuracy"]):
            continue
        pruned = (row["lost_confidence"], row["lost_accuracy"])
        dense = (row["lost_reference_confidence"], row["lost_reference_accuracy"])
        point = axis.plot(*pruned, marker="o", linestyle="none", label=f"{row['run']} (lost {row['lost_share']:.0%})")[0]
        axis.plot(*dense, marker="s", fillstyle="none", linestyle="none", color=point.get_color())
        axis.annotate("", dense, pruned, arrowprops={"arrowstyle": "->", "color": point.get_color(), "alpha": 0.5})
    axis.set(xlabel="mean confidence on lost-object questions", ylabel="accuracy on lost-object questions")
    axis.set_title(f"{title}\nfilled: pruned model; open square: dense model on the same questions", fontsize=10)
    axis.legend(fontsize=8)
    return _render(figure, "lost_objects")


def reliability_grid(entries: Sequence[dict], title: str) -> dict[str, bytes]:
    """Reliability diagrams of every run side by side (calibrate entries, the reference first)."""
    columns = min(4, len(entries))
    rows = -(-len(entries) // columns)
    figure, axes = _figure(rows, columns, size=(3.2 * columns, 3.2 * rows))
    for axis in axes.flat[len(entries) :]:
        axis.set_axis_off()
    for axis, entry in zip(axes.flat, entries):
        reliability = entry["reliability"]
        counts = np.array(reliability["count"])
        shown = counts > 0
        confidence = np.array(reliability["confidence"], dtype=float)[shown]
        accuracy = np.array(reliability["accuracy"], dtype=float)[shown]
        axis.plot([0, 1], [0, 1], color="black", linestyle="--", linewidth=1)
        axis.plot(confidence, accuracy, marker="o", markersize=3)
        ece = entry["metrics"]["all"]["ece"]["value"]
        axis.set(xlim=(0.45, 1), ylim=(0, 1), title=f"{entry['label']}\nECE {ece:.3f}")
        axis.title.set_fontsize(9)
    figure.supxlabel("mean confidence in bin")
    figure.supylabel("accuracy in bin")
    figure.suptitle(title, fontsize=10)
    return _render(figure, "reliability_grid")


def study_figures(rows: Sequence[dict], calibration: dict, cascade: dict, title: str) -> dict[str, bytes]:
    """Every picture of the study report, by file name."""
    entries = [calibration["reference"], *calibration["runs"]]
    files = metric_vs_budget(rows, [("accuracy", "accuracy")], f"{title}: accuracy", "accuracy_vs_budget")
    calibration_metrics = [("ece", "ECE (equal-width bins)"), ("auroc", "AUROC (confidence vs correctness)")]
    files.update(metric_vs_budget(rows, calibration_metrics, f"{title}: calibration", "calibration_vs_budget"))
    files.update(lost_objects(rows, f"{title}: lost objects"))
    files.update(reliability_grid(entries, f"{title}: reliability"))
    cost = {name: data for name, data in cascade_figures(cascade["cascades"], title, cascade["reference"]["label"]).items() if "cost" in name}
    files.update(cost)
    return files
