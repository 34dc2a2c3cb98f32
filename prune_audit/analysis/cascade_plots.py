"""The cascade's figures: prefill cost and held-out disagreement against the target epsilon.

Drawn with the renderer of ``figures`` (one look for every report); ``cascade`` and ``study`` use them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from prune_audit.analysis.figures import _figure, _render


def cascade_figures(cascades: Sequence[dict], title: str, reference: str, cost: str = "prefill tokens") -> dict[str, bytes]:
    """Cost against epsilon and held-out disagreement against epsilon, one line per cascade; ``reference``
    labels the run escalated to (``dense``, or a pruned run's selector@budget), ``cost`` the cost unit."""
    return {**_cost_figure(cascades, title, reference, cost), **_validity_figure(cascades, title, reference)}


def _series(cascade: dict, *keys: str) -> np.ndarray:
    """One value per target of a cascade, read through ``keys`` in each result."""
    values = []
    for result in cascade["results"]:
        for key in keys:
            result = result[key]
        values.append(result)
    return np.array(values, dtype=float)


def _chosen_epsilons(axis: Any, cascades: Sequence[dict]) -> None:
    """A dotted vertical line at each cascade's chosen target (--epsilon), labelled once."""
    for epsilon in sorted({cascade["epsilon"] for cascade in cascades}):
        axis.axvline(epsilon, color="0.4", linestyle=":", linewidth=1.2, label=f"chosen target epsilon {epsilon:g}")


def _legend_below(figure: Any, axis: Any) -> None:
    """The legend under the axes, where it covers no line."""
    handles, labels = axis.get_legend_handles_labels()
    figure.legend(handles, labels, loc="outside lower center", ncols=2, fontsize=7)


def _splits(cascades: Sequence[dict]) -> int:
    return int(cascades[0]["results"][0]["validity"]["splits"])


def _cost_figure(cascades: Sequence[dict], title: str, reference: str, cost: str) -> dict[str, bytes]:
    """Relative prefill cost against epsilon: mean over the validity splits and the one reported split;
    costs above the reference's are flagged (shaded band, red ring)."""
    figure, axes = _figure(size=(6.8, 5.4))
    axis = axes[0, 0]
    above: list[tuple[np.ndarray, np.ndarray]] = []
    for cascade in cascades:
        epsilon, label = _series(cascade, "epsilon"), cascade["label"]
        mean_cost = _series(cascade, "validity", "mean_relative_cost")
        mean_label = f"{label}: mean over {_splits(cascades)} random splits"
        line = axis.plot(epsilon, mean_cost, marker="o", label=mean_label)[0]
        seeded_cost = _series(cascade, "relative_cost")
        style = {"marker": "x", "linestyle": ":", "color": line.get_color()}
        axis.plot(epsilon, seeded_cost, label=f"{label}: the seeded split (the numbers of cascade.json)", **style)
        above += [(epsilon[cost > 1], cost[cost > 1]) for cost in (mean_cost, seeded_cost)]
    axis.axhline(1.0, color="black", linestyle="--", linewidth=1, label=f"{reference} on every question")
    points = [np.concatenate(part) for part in zip(*above)] if above else []
    if len(points) and len(points[0]):
        axis.scatter(*points, s=110, facecolors="none", edgecolors="tab:red", linewidths=1.2, zorder=3,
                     label=f"costs more than {reference} (red ring, shaded band)")
        bottom, top = axis.get_ylim()
        axis.axhspan(1.0, top, color="tab:red", alpha=0.08)
        axis.set_ylim(bottom, top)
    _chosen_epsilons(axis, cascades)
    axis.set(xlabel="target disagreement epsilon", ylabel=f"{cost} relative to {reference}")
    axis.set_title(f"{title}: cost\nseeded split: the --seed calibration/test split whose threshold cascade.json "
                   "reports", fontsize=9)
    _legend_below(figure, axis)
    return _render(figure, "cascade_cost_vs_epsilon")


def _validity_figure(cascades: Sequence[dict], title: str, reference: str) -> dict[str, bytes]:
    """Held-out disagreement against epsilon: mean +- sd and worst over the random splits."""
    figure, axes = _figure(size=(6.8, 5.4))
    axis = axes[0, 0]
    largest = max(_series(cascade, "epsilon").max() for cascade in cascades)
    axis.plot([0, largest], [0, largest], color="black", linestyle="--", linewidth=1,
              label="disagreement = epsilon (bound on the mean)")
    for cascade in cascades:
        epsilon, label = _series(cascade, "epsilon"), cascade["label"]
        mean = _series(cascade, "validity", "mean_disagreement")
        spread = _series(cascade, "validity", "std_disagreement")
        bars = axis.errorbar(epsilon, mean, yerr=spread, marker="o", capsize=3, label=f"{label} mean +- sd")
        worst = _series(cascade, "validity", "worst_disagreement")
        color = bars.lines[0].get_color()
        axis.plot(epsilon, worst, marker="v", linestyle="none", color=color, label=f"{label} worst split")
    _chosen_epsilons(axis, cascades)
    axis.set(xlabel="target disagreement epsilon", ylabel=f"held-out disagreement with {reference}")
    axis.set_title(f"{title}: validity over {_splits(cascades)} random image splits\nthe guarantee is on average: "
                   "the mean stays at or below epsilon; single splits may exceed it", fontsize=9)
    _legend_below(figure, axis)
    return _render(figure, "cascade_validity")
