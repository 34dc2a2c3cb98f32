"""The cascade's figures: prefill cost and held-out disagreement against the target epsilon.

Drawn with the renderer of ``figures`` (one look for every report); ``cascade`` and ``study`` use them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from prune_audit.analysis.figures import RunStyle, _figure, _render, run_styles


def cascade_figures(
    cascades: Sequence[dict],
    title: str,
    reference: str,
    cost: str = "prefill tokens",
    styles: dict[str, RunStyle] | None = None,
) -> dict[str, bytes]:
    """Cost against epsilon and held-out disagreement against epsilon, one line per cascade; ``reference``
    labels the run escalated to (``dense``, or a pruned run's selector@budget), ``cost`` the cost unit, ``styles``
    the runs' colours and markers (``run_styles``; default: the cascades' own order)."""
    styles = styles or run_styles([cascade["label"] for cascade in cascades])
    return {
        **_cost_figure(cascades, title, reference, cost, styles),
        **_validity_figure(cascades, title, reference, styles),
    }


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


def _cost_figure(
    cascades: Sequence[dict], title: str, reference: str, cost: str, styles: dict[str, RunStyle]
) -> dict[str, bytes]:
    """Relative prefill cost against epsilon: mean over the validity splits (solid, filled) and the one reported
    split (dotted, x), one legend entry per run; costs above the reference's fall in a shaded band."""
    figure, axes = _figure(size=(6.8, 5.4))
    axis = axes[0, 0]
    highest = 1.0
    for cascade in cascades:
        epsilon, label, style = _series(cascade, "epsilon"), cascade["label"], styles[cascade["label"]]
        mean_cost = _series(cascade, "validity", "mean_relative_cost")
        axis.plot(epsilon, mean_cost, marker=style.marker, color=style.colour, label=label)
        seeded_cost = _series(cascade, "relative_cost")
        axis.plot(epsilon, seeded_cost, marker="x", linestyle=":", color=style.colour)
        highest = max(highest, float(np.nanmax([*mean_cost, *seeded_cost])))
    reference_label = f"{reference} on every question"
    if highest > 1.0:
        bottom, top = axis.get_ylim()
        axis.axhspan(1.0, top, color="0.5", alpha=0.12)
        axis.set_ylim(bottom, top)
        reference_label += f"; shaded above: costs more than {reference}"
    axis.axhline(1.0, color="black", linestyle="--", linewidth=1, label=reference_label)
    _chosen_epsilons(axis, cascades)
    axis.set(xlabel="target disagreement epsilon", ylabel=f"{cost} relative to {reference}")
    axis.set_title(
        f"{title}: cost\nsolid, filled: mean over {_splits(cascades)} random splits; dotted, x: the seeded "
        "split: the --seed calibration/test split whose threshold cascade.json reports",
        fontsize=9,
        wrap=True,
    )
    _legend_below(figure, axis)
    return _render(figure, "cascade_cost_vs_epsilon")


def _validity_figure(
    cascades: Sequence[dict], title: str, reference: str, styles: dict[str, RunStyle]
) -> dict[str, bytes]:
    """Held-out disagreement against epsilon: mean +- its standard error (as ``cascade``'s table) and worst over
    the random splits."""
    figure, axes = _figure(size=(6.8, 5.4))
    axis = axes[0, 0]
    largest = max(_series(cascade, "epsilon").max() for cascade in cascades)
    axis.plot(
        [0, largest],
        [0, largest],
        color="black",
        linestyle="--",
        linewidth=1,
        label="disagreement = epsilon (bound on the mean)",
    )
    for cascade in cascades:
        epsilon, label, style = _series(cascade, "epsilon"), cascade["label"], styles[cascade["label"]]
        mean = _series(cascade, "validity", "mean_disagreement")
        error = _series(cascade, "validity", "sem_disagreement")
        axis.errorbar(epsilon, mean, yerr=error, marker=style.marker, color=style.colour, capsize=3, label=label)
        worst = _series(cascade, "validity", "worst_disagreement")
        axis.plot(epsilon, worst, marker="_", markersize=12, markeredgewidth=2, linestyle="none", color=style.colour)
    axis.plot(
        [],
        [],
        marker="_",
        markersize=12,
        markeredgewidth=2,
        linestyle="none",
        color="0.3",
        label="dash: the worst split",
    )
    _chosen_epsilons(axis, cascades)
    axis.set(xlabel="target disagreement epsilon", ylabel=f"held-out disagreement with {reference}")
    axis.set_title(
        f"{title}: validity over {_splits(cascades)} random image splits (mean ± standard error, as "
        "cascade's table)\nthe guarantee is on average: the mean stays at or below epsilon; single splits "
        "may exceed it",
        fontsize=9,
    )
    _legend_below(figure, axis)
    return _render(figure, "cascade_validity")
