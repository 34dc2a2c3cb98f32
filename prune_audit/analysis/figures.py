"""Pictures of the calibration reports, drawn from their JSON-ready dicts (the cascade's: ``cascade_plots``).

With ``cascade_plots`` and ``study_figures``, the analysis modules that import matplotlib (inside the functions, through
``matplotlib.figure.Figure`` only: no pyplot state, no display needed). Every function
returns {file name: bytes} with a PNG and an SVG of each picture, so a command can write
them after everything else succeeded.
"""

from __future__ import annotations

import io
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from prune_audit.tasks import Task

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


MIN_BIN_QUESTIONS = 10
"""Reliability bins with fewer questions are drawn grey, without interval and outside the curve:
one or two questions give an accuracy of 0 or 1 that says nothing about calibration."""

MARKER_AREA = 240.0
"""Marker area (points^2) of the fullest bin of a reliability plot; every other bin's is proportional to its count."""

RELIABILITY_LIMITS = {"xlim": (0.45, 1.03), "ylim": (-0.05, 1.05)}
"""Axes a little wider than [0.45, 1] x [0, 1], so points at confidence or accuracy 1 stay off the frame."""


def confidence_floor(summaries: Sequence[dict]) -> float:
    """The lowest confidence the runs' answers can have: 0.5 for yes/no, 0 for a task without a yes/no answer (the
    first edge of each run's confidence histogram; a summary without one is a yes/no run's)."""
    return min(summary.get("confidence_histogram", {}).get("edges", [0.5])[0] for summary in summaries)


def reliability_xlim(summaries: Sequence[dict]) -> tuple[float, float]:
    """``RELIABILITY_LIMITS``' confidence range, from 0.05 below the runs' :func:`confidence_floor`."""
    return (confidence_floor(summaries) - 0.05, RELIABILITY_LIMITS["xlim"][1])


SPARSE_LABEL = f"open marker: bin of < {MIN_BIN_QUESTIONS} questions (not joined, no interval)"
SPARSE_STYLE = {"facecolors": "none", "linewidths": 0.9, "zorder": 2}

RUN_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")
"""Run colours, given in a report's run order. Red is left out (the figures flag with it: over-confidence, costs
above the reference), and grey and black (the reference, perfect calibration)."""
RUN_MARKERS = ("o", "^", "D", "v", "P", "X", "*", "h")
"""Run markers beside the colours, so runs stay apart where their points coincide or colour is not seen."""


@dataclass(frozen=True)
class RunStyle:
    """How one run is drawn in every figure of a report."""

    colour: str
    marker: str


REFERENCE_STYLE = RunStyle("black", "s")


def run_styles(labels: Sequence[str], reference: str | None = None) -> dict[str, RunStyle]:
    """One colour and marker per run label, by its place among ``labels`` (a report's runs, in the report's
    order; ``reference``: black squares). Every figure of a report styles its runs through this one function
    with the same labels, so a run looks the same in all of them; after 8 runs the styles repeat."""
    pruned = [label for label in dict.fromkeys(labels) if label != reference]
    styles = {
        label: RunStyle(RUN_COLOURS[index % len(RUN_COLOURS)], RUN_MARKERS[index % len(RUN_MARKERS)])
        for index, label in enumerate(pruned)
    }
    return styles if reference is None else {**styles, reference: REFERENCE_STYLE}


@dataclass(frozen=True)
class ReliabilityBins:
    """One run's non-empty reliability bins: questions, mean confidence, accuracy and its 95% interval."""

    count: np.ndarray
    confidence: np.ndarray
    accuracy: np.ndarray
    low: np.ndarray
    high: np.ndarray

    @classmethod
    def of(cls, reliability: dict) -> ReliabilityBins:
        count = np.array(reliability["count"], dtype=float)
        shown = count > 0
        interval = np.array(reliability.get("accuracy_ci95") or [[None, None]] * len(count), dtype=float)
        accuracy = np.array(reliability["accuracy"], dtype=float)
        return cls(
            count[shown],
            np.array(reliability["confidence"], dtype=float)[shown],
            accuracy[shown],
            interval[shown, 0],
            interval[shown, 1],
        )

    @property
    def dense(self) -> np.ndarray:
        """Bins with at least ``MIN_BIN_QUESTIONS`` questions."""
        return self.count >= MIN_BIN_QUESTIONS

    def areas(self, largest: float) -> np.ndarray:
        """Marker areas proportional to the counts, ``MARKER_AREA`` for a bin of ``largest`` questions."""
        return np.maximum(MARKER_AREA * self.count / max(largest, 1.0), 12.0)


def _largest_bin(reliabilities: Sequence[dict]) -> float:
    return float(max((max(r["count"], default=0) for r in reliabilities), default=1))


def reliability_points(
    axis: Any, reliability: dict, largest: float, label: str, style: RunStyle, marker_scale: float = 1.0
) -> Any:
    """One run's reliability curve on ``axis`` in its ``style``; returns its line (the legend's handle).

    Marker area is proportional to the bin's question count (``largest`` questions: ``MARKER_AREA``);
    bins of at least ``MIN_BIN_QUESTIONS`` are filled, carry their 95% interval and are joined by the
    line; the others are open markers of the run's colour and shape, neither joined nor given an interval.
    """
    bins = ReliabilityBins.of(reliability)
    dense = bins.dense
    axis.plot(bins.confidence[dense], bins.accuracy[dense], color=style.colour, linewidth=1.2)
    # the legend's entry: the run's line with its marker (the scatters below draw the bins, sized by count)
    line = axis.plot([], [], color=style.colour, marker=style.marker, linewidth=1.2, label=label)[0]
    error = [
        np.clip(np.nan_to_num(bins.accuracy - bins.low), 0, None),
        np.clip(np.nan_to_num(bins.high - bins.accuracy), 0, None),
    ]
    axis.errorbar(
        bins.confidence[dense],
        bins.accuracy[dense],
        yerr=[e[dense] for e in error],
        fmt="none",
        ecolor=style.colour,
        capsize=2,
        linewidth=0.8,
    )
    areas = bins.areas(largest) * marker_scale
    from matplotlib.colors import to_rgba

    # tinted face, solid edge: where the big markers of several runs overlap (the top bin), each outline stays seen
    axis.scatter(
        bins.confidence[dense],
        bins.accuracy[dense],
        s=areas[dense],
        facecolors=to_rgba(style.colour, 0.3),
        edgecolors=style.colour,
        linewidths=1.5,
        marker=style.marker,
        zorder=3,
    )
    axis.scatter(
        bins.confidence[~dense],
        bins.accuracy[~dense],
        s=areas[~dense],
        marker=style.marker,
        edgecolors=style.colour,
        **SPARSE_STYLE,
    )
    return line


def _sparse_legend_entry(axis: Any) -> None:
    """A legend entry for the open markers of bins under ``MIN_BIN_QUESTIONS`` questions."""
    axis.scatter([], [], s=40, label=SPARSE_LABEL, edgecolors="0.3", **SPARSE_STYLE)


def _log_count_axis(axis: Any) -> None:
    """A log count axis labelled 1, 10, 100 (not 10^0), bottom below 1 so a bin of one question shows."""
    from matplotlib.ticker import FuncFormatter

    axis.set_yscale("log")
    axis.set_ylim(bottom=0.5)
    axis.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))


def reliability_diagram(summary: dict, title: str, stem: str) -> dict[str, bytes]:
    """Accuracy per confidence bin against the diagonal, with the count of every bin below (log axis).

    The gap between accuracy and mean confidence is red where the model is over-confident and
    green where accuracy is above confidence; bins of fewer than ``MIN_BIN_QUESTIONS`` questions
    are grey, without interval.
    """
    reliability = summary["reliability"]
    figure, axes = _figure(2, 1, size=(6.0, 6.4), ratios=(3, 1))
    top, bottom = axes[0, 0], axes[1, 0]
    left, width = _bin_layout(reliability)
    counts = np.array(reliability["count"])
    dense = counts >= MIN_BIN_QUESTIONS
    accuracy = np.nan_to_num(np.array(reliability["accuracy"], dtype=float))
    confidence = np.nan_to_num(np.array(reliability["confidence"], dtype=float))
    sparse = ~dense & (counts > 0)
    gap = confidence - accuracy
    hatched = {"alpha": 0.3, "hatch": "//"}
    layers = (  # (bins, height, bottom, style, label); a layer without bins is neither drawn nor in the legend
        (dense, accuracy, 0, {"color": "tab:blue"}, "accuracy"),
        (sparse, accuracy, 0, {"color": "0.8"}, f"accuracy, bin of < {MIN_BIN_QUESTIONS} questions (no interval)"),
        (
            dense & (gap > 0),
            gap,
            accuracy,
            {"color": "tab:red", "edgecolor": "tab:red", **hatched},
            "confidence above accuracy (over-confident)",
        ),
        (
            dense & (gap < 0),
            gap,
            accuracy,
            {"color": "tab:green", "edgecolor": "tab:green", **hatched},
            "accuracy above confidence (under-confident)",
        ),
    )
    for chosen, height, base, style, label in layers:
        if chosen.any():
            top.bar(
                left[chosen],
                height[chosen],
                bottom=np.broadcast_to(base, height.shape)[chosen],
                width=width[chosen],
                align="edge",
                label=label,
                **{"edgecolor": "white", **style},
            )
    # a sparse bin of accuracy 0 has no bar: its grey marker still shows where it is
    top.scatter((left + width / 2)[sparse], accuracy[sparse], s=30, edgecolors="0.55", **SPARSE_STYLE)
    top.plot([0, 1], [0, 1], color="black", linestyle="--", linewidth=1, label="perfect calibration")
    if "accuracy_ci95" in reliability and dense.any():
        interval = np.clip(np.array(reliability["accuracy_ci95"], dtype=float)[dense], 0.0, 1.0)
        error = np.clip(np.abs(interval - accuracy[dense, None]).T, 0, None)
        top.errorbar(
            (left + width / 2)[dense],
            accuracy[dense],
            yerr=np.nan_to_num(error),
            fmt="none",
            ecolor="black",
            capsize=2,
            linewidth=0.8,
            label="95% image-bootstrap interval",
        )
    ece = summary["metrics"]["all"]["ece"]
    top.set(
        xlim=(confidence_floor([summary]) - 0.05, 1), ylim=(-0.04, 1.08), ylabel="accuracy"
    )  # points and intervals at 0 or 1 stay inside
    top.set_title(f"{title}\nECE {ece['value']:.3f} [{ece['ci95'][0]:.3f}, {ece['ci95'][1]:.3f}]", fontsize=10)
    top.legend(loc="upper left", fontsize=7)
    bottom.bar(left, np.where(counts > 0, counts, np.nan), width=width, align="edge", edgecolor="white", color="gray")
    for x, w, count in zip(left, width, counts):
        if count:
            bottom.annotate(str(count), (x + w / 2, count), ha="center", va="bottom", fontsize=7)
    _log_count_axis(bottom)
    bottom.set_ylim(top=max(counts.max(initial=1), 1) * 3)  # room for the count above the tallest bar
    bottom.set(xlim=(confidence_floor([summary]) - 0.05, 1), xlabel="confidence (top-label)", ylabel="questions (log)")
    return _render(figure, stem)


def reliability_overlay(
    summaries: Sequence[dict], labels: Sequence[str], title: str, stem: str, reference: str | None = None
) -> dict[str, bytes]:
    """Several runs' reliability curves in one plot (``reliability_points``, each run in its ``run_styles``; the
    ``reference`` run black), each bin's question count beneath. Where most answers share the top bin, every
    run's curve shrinks to one filled marker there, told apart by colour and shape."""
    figure, axes = _figure(2, 1, size=(6.4, 6.8), ratios=(3, 1))
    top, bottom = axes[0, 0], axes[1, 0]
    top.plot([0, 1], [0, 1], color="0.5", linestyle="--", linewidth=1, label="perfect calibration")
    largest = _largest_bin([summary["reliability"] for summary in summaries])
    styles = run_styles(labels, reference)
    for position, (summary, label) in enumerate(zip(summaries, labels)):
        reliability = summary["reliability"]
        ece = summary["metrics"]["all"]["ece"]["value"]
        reliability_points(top, reliability, largest, f"{label} (ECE {ece:.3f})", styles[label])
        # bins side by side: each run takes its share of the bin's width
        left, width = _bin_layout(reliability)
        share = width / len(summaries)
        counts = np.array(reliability["count"], dtype=float)
        bottom.bar(
            left + position * share,
            np.where(counts > 0, counts, np.nan),
            width=share,
            align="edge",
            color=styles[label].colour,
            label=label,
        )
    _sparse_legend_entry(top)
    top.set(xlim=reliability_xlim(summaries), ylim=RELIABILITY_LIMITS["ylim"], ylabel="accuracy")
    top.set_title(
        f"{title}\nmarker area: questions in the bin (tinted: >= {MIN_BIN_QUESTIONS}, joined); bars: 95% "
        "image-bootstrap interval",
        fontsize=10,
    )
    figure.legend(*top.get_legend_handles_labels(), loc="outside lower center", ncols=2, fontsize=7)  # covers no bin
    _log_count_axis(bottom)
    bottom.set(xlim=reliability_xlim(summaries), xlabel="mean confidence in bin", ylabel="questions per bin (log)")
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
    _log_count_axis(axis)
    auroc = summary["metrics"]["all"]["auroc"]["value"]
    axis.set(xlabel="confidence (top-label)", ylabel="questions (log scale)", title=f"{title}\nAUROC {auroc:.3f}")
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


LOST_GROUP = "lost"
LOST_TICK = "lost\n(retention 0)"
"""A lost object is one with retention exactly 0: the "retention 0" bin holds the same questions, so it is
not drawn twice."""


def retention_groups(summary: dict) -> list[str]:
    """The survival groups of the retention figure: lost, then every retention bin above 0."""
    bins = [name for name in summary["survival"] if name.startswith("retention ") and name != "retention 0"]
    return [LOST_GROUP, *bins]


def zoomed_limits(values: Sequence[float], floor: float, ceiling: float) -> tuple[float, float]:
    """Axis limits around the finite ``values`` (points and interval ends) with a margin, within [floor, ceiling]."""
    finite = np.array([v for v in values if v is not None and np.isfinite(v)], dtype=float)
    if not len(finite):
        return floor, ceiling
    low, high = finite.min(), finite.max()
    margin = max(0.01, 0.08 * (high - low))
    return max(floor, low - margin), min(ceiling, high + margin)


def _count_labels(
    axis: Any, x: np.ndarray, counts: Sequence[float], measured: Sequence[dict], color: Any, run: int
) -> None:
    """ "n=COUNT" left of each point; a group without questions gets "n=0" near the bottom (one row per run)."""
    from matplotlib.transforms import blended_transform_factory

    bottom = blended_transform_factory(axis.transData, axis.transAxes)
    for position, count, value in zip(x, counts, measured):
        if value["value"] is None:
            axis.text(
                position, 0.03 + 0.05 * run, f"n={count:.0f}", transform=bottom, ha="center", fontsize=7, color=color
            )
        else:
            axis.annotate(
                f"n={count:.0f}",
                (position, value["value"]),
                xytext=(-6, 0),
                textcoords="offset points",
                ha="right",
                va="center",
                fontsize=7,
                color=color,
            )


def retention_figure(
    summaries: Sequence[dict],
    labels: Sequence[str],
    title: str,
    stem: str,
    reference: str | None = None,
    task: Task | None = None,
) -> dict[str, bytes]:
    """Accuracy and mean confidence on the questions of ``task`` (default POPE) that name evidence, by the fate of
    their evidence (``Task.evidence_fate``): lost (= retention 0), then retention bins.

    One solid line per pruned run, each point labelled with its question count n; with a reference
    run (labelled ``reference``: dense, or a pruned run's selector@budget), a dashed line of the same
    colour shows the reference on exactly those questions. The
    confidence panel zooms to the data (confidence is rarely far from 1).
    """
    figure, axes = _figure(1, 2, size=(10.0, 4.4))
    confidence_values: list[float] = []
    styles = run_styles(labels)  # the colours of the same runs in reliability_overlay
    for run, (summary, label) in enumerate(zip(summaries, labels)):
        groups = retention_groups(summary)
        survival = summary["survival"]
        x = np.arange(len(groups))
        counts = [survival[name]["count"]["value"] for name in groups]
        for axis, metric in zip(axes[0], ("accuracy", "confidence")):
            measured = [survival[name][metric] for name in groups]
            line = _interval_line(axis, x, measured, label=label, color=styles[label].colour)
            _count_labels(axis, x, counts, measured, line.get_color(), run)
            on_reference = [survival[name].get(f"reference_{metric}") for name in groups]
            if all(on_reference):
                style = {"linestyle": "--", "color": line.get_color(), "markerfacecolor": "white"}
                _interval_line(axis, x + 0.08, on_reference, label=f"{reference} on {label}'s questions", **style)
                measured = [*measured, *on_reference]
            if metric == "confidence":
                confidence_values += [v for m in measured for v in (m["value"], *m["ci95"])]
            ticks = [LOST_TICK, *(name.removeprefix("retention ") for name in groups[1:])]
            axis.set_xticks(x, ticks)
    accuracy_axis, confidence_axis = axes[0]
    accuracy_axis.set(ylabel="accuracy", ylim=(-0.03, 1.05))
    confidence_axis.set(
        ylabel="mean confidence (axis zoomed to the data)",
        ylim=zoomed_limits(confidence_values, confidence_floor(summaries), 1.0 + 0.005),
    )
    for axis in axes[0]:
        axis.set_xlim(-0.5, axis.get_xlim()[1] + 0.1)  # room for the n labels left of the first group
        axis.legend(fontsize=7)
    from prune_audit.tasks import DEFAULT_TASK, get_task

    task = task or get_task(DEFAULT_TASK)
    figure.supxlabel(
        f"{task.evidence_noun}: lost (no kept token holds any of their pixels), or area retention of the kept tokens",
        fontsize=9,
    )
    figure.suptitle(f"{title}: {task.evidence_fate} (95% image-bootstrap intervals; n: questions)", fontsize=10)
    return _render(figure, stem)
