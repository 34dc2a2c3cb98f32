"""Pictures of the calibration and cascade reports, drawn from their JSON-ready dicts.

The one analysis module that imports matplotlib (inside the functions, through
``matplotlib.figure.Figure`` only: no pyplot state, no display needed). Every function
returns {file name: bytes} with a PNG and an SVG of each picture, so a command can write
them after everything else succeeded.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

FORMATS = ("png", "svg")


def slug(text: str) -> str:
    """A file-name-safe version of a run label."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "run"


def _render(figure: Any, stem: str) -> dict[str, bytes]:
    files = {}
    for extension in FORMATS:
        buffer = io.BytesIO()
        # no creation date in SVGs, so identical reports give identical files
        metadata = {"Date": None} if extension == "svg" else None
        figure.savefig(buffer, format=extension, dpi=130, bbox_inches="tight", metadata=metadata)
        files[f"{stem}.{extension}"] = buffer.getvalue()
    return files


def _figure(
    rows: int = 1, columns: int = 1, size: tuple[float, float] = (6.4, 4.8), ratios: Sequence[float] | None = None
) -> tuple[Any, np.ndarray]:
    from matplotlib.figure import Figure

    figure = Figure(figsize=size, layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False, gridspec_kw={"height_ratios": ratios} if ratios else None)
    return figure, axes


def _bin_layout(reliability: dict) -> tuple[np.ndarray, np.ndarray]:
    """(left edges, widths) of the bins; an empty equal-mass bin gets width 0."""
    lower = np.array(reliability["lower"], dtype=float)
    upper = np.array(reliability["upper"], dtype=float)
    return np.nan_to_num(lower), np.nan_to_num(upper - lower)


def reliability_diagram(summary: dict, title: str, stem: str) -> dict[str, bytes]:
    """Accuracy per confidence bin against the diagonal, with the count of every bin below."""
    reliability = summary["reliability"]
    figure, axes = _figure(2, 1, size=(6.0, 6.0), ratios=(3, 1))
    top, bottom = axes[0, 0], axes[1, 0]
    left, width = _bin_layout(reliability)
    accuracy = np.nan_to_num(np.array(reliability["accuracy"], dtype=float))
    confidence = np.array(reliability["confidence"], dtype=float)
    top.bar(left, accuracy, width=width, align="edge", color="tab:blue", edgecolor="white", label="accuracy")
    gap = np.nan_to_num(confidence) - accuracy
    style = {"color": "tab:red", "alpha": 0.3, "edgecolor": "tab:red", "hatch": "//"}
    top.bar(left, gap, bottom=accuracy, width=width, align="edge", label="gap to mean confidence", **style)
    top.plot([0, 1], [0, 1], color="black", linestyle="--", linewidth=1, label="perfect calibration")
    if "accuracy_ci95" in reliability:
        interval = np.array(reliability["accuracy_ci95"], dtype=float)
        shown = np.array(reliability["count"]) > 0
        centre = (left + width / 2)[shown]
        error = np.abs(interval[shown] - accuracy[shown, None]).T
        top.errorbar(centre, accuracy[shown], yerr=np.nan_to_num(error), fmt="none", ecolor="black", capsize=2,
                     linewidth=0.8, label="95% image-bootstrap interval")
    ece = summary["metrics"]["all"]["ece"]
    top.set(xlim=(0.45, 1), ylim=(0, 1), ylabel="accuracy")
    top.set_title(f"{title}\nECE {ece['value']:.3f} [{ece['ci95'][0]:.3f}, {ece['ci95'][1]:.3f}]", fontsize=10)
    top.legend(loc="upper left", fontsize=8)
    counts = np.array(reliability["count"])
    bottom.bar(left, counts, width=width, align="edge", color="gray", edgecolor="white")
    for x, w, count in zip(left, width, counts):
        if count:
            bottom.annotate(str(count), (x + w / 2, count), ha="center", va="bottom", fontsize=7)
    bottom.set(xlim=(0.45, 1), xlabel="confidence (top-label, two-way)", ylabel="questions")
    return _render(figure, stem)


def reliability_overlay(summaries: Sequence[dict], labels: Sequence[str], title: str, stem: str) -> dict[str, bytes]:
    """Several runs' reliability curves in one plot, each bin's question count beneath."""
    figure, axes = _figure(2, 1, size=(6.4, 6.4), ratios=(3, 1))
    top, bottom = axes[0, 0], axes[1, 0]
    top.plot([0, 1], [0, 1], color="black", linestyle="--", linewidth=1, label="perfect calibration")
    for position, (summary, label) in enumerate(zip(summaries, labels)):
        reliability = summary["reliability"]
        counts = np.array(reliability["count"])
        shown = counts > 0
        ece = summary["metrics"]["all"]["ece"]["value"]
        confidence = np.array(reliability["confidence"], dtype=float)[shown]
        accuracy = np.array(reliability["accuracy"], dtype=float)[shown]
        line = top.plot(confidence, accuracy, marker="o", label=f"{label} (ECE {ece:.3f})")[0]
        # bins side by side: each run takes its share of the bin's width
        left, width = _bin_layout(reliability)
        share = width / len(summaries)
        bottom.bar(left + position * share, counts, width=share, align="edge", color=line.get_color(), label=label)
    top.set(xlim=(0.45, 1.0), ylim=(0, 1), ylabel="accuracy", title=title)
    top.legend(loc="upper left", fontsize=8)
    bottom.set(xlim=(0.45, 1.0), xlabel="mean confidence in bin", ylabel="questions per bin")
    return _render(figure, stem)


def confidence_histogram(summary: dict, title: str, stem: str) -> dict[str, bytes]:
    """Confidence of correct and of incorrect answers; log count axis, so a handful of errors stays visible."""
    histogram = summary["confidence_histogram"]
    edges = np.array(histogram["edges"])
    figure, axes = _figure(size=(6.0, 4.0))
    axis = axes[0, 0]
    for name, color in (("correct", "tab:green"), ("incorrect", "tab:red")):
        counts = np.array(histogram[name])
        # the baseline sits below 1 on the log axis, so a bin of one question still shows as a step
        axis.stairs(counts, edges, baseline=0.5, fill=True, alpha=0.35, color=color, label=f"{name} ({counts.sum()})")
        axis.stairs(counts, edges, baseline=0.5, color=color)
    from matplotlib.ticker import FuncFormatter

    axis.set_yscale("log")
    axis.set_ylim(bottom=0.5)
    axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))  # 1, 10, 100, not 10^0
    auroc = summary["metrics"]["all"]["auroc"]["value"]
    axis.set(xlabel="confidence (top-label, two-way)", ylabel="questions (log scale)", title=f"{title}\nAUROC {auroc:.3f}")
    axis.title.set_fontsize(10)
    axis.legend(fontsize=8)
    return _render(figure, stem)


def _interval_line(axis: Any, x: np.ndarray, values: Sequence[dict], **style: Any) -> Any:
    """Point estimates with their 95% intervals as error bars; returns the line."""
    centre = np.array([value["value"] for value in values], dtype=float)
    low = np.array([value["ci95"][0] for value in values], dtype=float)
    high = np.array([value["ci95"][1] for value in values], dtype=float)
    error = [np.nan_to_num(centre - low), np.nan_to_num(high - centre)]
    return axis.errorbar(x, centre, yerr=error, marker="o", capsize=3, **style).lines[0]


def retention_figure(
    summaries: Sequence[dict], labels: Sequence[str], title: str, stem: str, reference: str | None = None
) -> dict[str, bytes]:
    """Accuracy and mean confidence on "yes" questions by object fate: lost, then retention bins.

    One solid line per pruned run; with a reference run (labelled ``reference``), a dashed line of the
    same colour shows the reference on exactly those questions (the questions the pruned run lost, ...).
    """
    figure, axes = _figure(1, 2, size=(10.0, 4.2))
    for summary, label in zip(summaries, labels):
        groups = ["lost", *(name for name in summary["survival"] if name.startswith("retention "))]
        x = np.arange(len(groups))
        for axis, metric in zip(axes[0], ("accuracy", "confidence")):
            line = _interval_line(axis, x, [summary["survival"][name][metric] for name in groups], label=label)
            reference = [summary["survival"][name].get(f"reference_{metric}") for name in groups]
            if all(reference):
                style = {"linestyle": "--", "color": line.get_color(), "markerfacecolor": "white"}
                _interval_line(axis, x + 0.08, reference, label=f"{reference} on {label}'s questions", **style)
            ticks = ["lost", *(name.removeprefix("retention ") for name in groups[1:])]
            axis.set_xticks(x, ticks)
    for axis, metric in zip(axes[0], ("accuracy", "mean confidence")):
        axis.set(xlabel="queried object: lost, or area retention of the kept tokens", ylabel=metric, ylim=(0, 1.02))
        axis.legend(fontsize=8)
    figure.suptitle(f"{title}: 'yes' questions by object fate (95% image-bootstrap intervals)", fontsize=10)
    return _render(figure, stem)


def cascade_figures(cascades: Sequence[dict], title: str, reference: str) -> dict[str, bytes]:
    """Cost against epsilon and held-out disagreement against epsilon, one line per cascade; ``reference``
    labels the run escalated to (``dense``, or a pruned run's selector@budget)."""
    return {**_cost_figure(cascades, title, reference), **_validity_figure(cascades, title, reference)}


def _series(cascade: dict, *keys: str) -> np.ndarray:
    """One value per target of a cascade, read through ``keys`` in each result."""
    values = []
    for result in cascade["results"]:
        for key in keys:
            result = result[key]
        values.append(result)
    return np.array(values, dtype=float)


def _cost_figure(cascades: Sequence[dict], title: str, reference: str) -> dict[str, bytes]:
    figure, axes = _figure(size=(6.4, 4.4))
    axis = axes[0, 0]
    for cascade in cascades:
        epsilon, label = _series(cascade, "epsilon"), cascade["label"]
        mean_cost = _series(cascade, "validity", "mean_relative_cost")
        line = axis.plot(epsilon, mean_cost, marker="o", label=f"{label} (mean over splits)")[0]
        seeded_cost = _series(cascade, "relative_cost")
        style = {"marker": "x", "linestyle": ":", "color": line.get_color()}
        axis.plot(epsilon, seeded_cost, label=f"{label} (seeded split)", **style)
    axis.axhline(1.0, color="black", linestyle="--", linewidth=1, label=f"{reference} on every question")
    axis.set(xlabel="target disagreement epsilon", ylabel=f"prefill tokens relative to {reference}", title=f"{title}: cost")
    axis.legend(fontsize=8)
    return _render(figure, "cascade_cost_vs_epsilon")


def _validity_figure(cascades: Sequence[dict], title: str, reference: str) -> dict[str, bytes]:
    figure, axes = _figure(size=(6.4, 4.4))
    axis = axes[0, 0]
    largest = max(_series(cascade, "epsilon").max() for cascade in cascades)
    axis.plot([0, largest], [0, largest], color="black", linestyle="--", linewidth=1, label="disagreement = epsilon")
    for cascade in cascades:
        epsilon, label = _series(cascade, "epsilon"), cascade["label"]
        mean = _series(cascade, "validity", "mean_disagreement")
        spread = _series(cascade, "validity", "std_disagreement")
        bars = axis.errorbar(epsilon, mean, yerr=spread, marker="o", capsize=3, label=f"{label} mean +- sd")
        worst = _series(cascade, "validity", "worst_disagreement")
        color = bars.lines[0].get_color()
        axis.plot(epsilon, worst, marker="v", linestyle="none", color=color, label=f"{label} worst split")
    axis.set(xlabel="target disagreement epsilon", ylabel=f"held-out disagreement with {reference}")
    axis.set_title(f"{title}: validity over random image splits")
    axis.legend(fontsize=8)
    return _render(figure, "cascade_validity")
