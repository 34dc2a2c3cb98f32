"""Issue 46, item 7: figures a newcomer could not read, checked as matplotlib objects before saving.

One run, one colour and marker in every figure of a report (``figures.run_styles``); the overlay's runs stay apart
in their small bins; the cascade's cost legend has one entry per run and no red rings; the validity bars are the
standard error the cascade table prints; the lost-object plot shows the diagonal; report.html's table fits the page.
"""

from __future__ import annotations

import numpy as np
import pytest
from matplotlib.colors import to_rgba
from test_figure_clarity import calibrated, captured, cascade, legend_labels, lost_row, markers  # noqa: F401

import prune_audit.analysis.figures as figures
import prune_audit.analysis.study_figures as study_figures
from prune_audit.analysis.cascade_plots import cascade_figures
from prune_audit.analysis.report_html import table_columns, table_html
from prune_audit.tasks.registry import get_task, task_classes

RED = to_rgba("tab:red")


def test_run_styles_give_each_run_its_own_colour_and_marker_and_the_reference_black_squares():
    labels = [f"run{index}" for index in range(8)]
    styles = figures.run_styles([*labels, "dense"], reference="dense")
    assert (
        len({style.colour for style in styles.values()}) == 9 and len({style.marker for style in styles.values()}) == 9
    )
    assert styles["dense"] == figures.REFERENCE_STYLE == figures.RunStyle("black", "s")
    assert "tab:red" not in figures.RUN_COLOURS  # red flags over-confidence and costs above the reference
    assert figures.run_styles(labels) == {label: styles[label] for label in labels}  # the reference takes no slot


def test_overlay_runs_differ_in_colour_and_shape_even_in_their_small_bins(captured):
    pruned = calibrated([0, 2, 0, 20, 300], [0.0, 0.0, 0.0, 0.8, 1.0], "fastv@16")
    dense = calibrated([0, 3, 0, 20, 300], [0.0, 1.0, 0.0, 0.8, 1.0], "dense")
    figures.reliability_overlay([pruned, dense], ["fastv@16", "dense"], "Reliability", "reliability_overlay", "dense")
    top = captured["reliability_overlay"].axes[0]
    small = [c for c in markers(top) if c.get_facecolors().size == 0]  # open markers: bins of < 10 questions
    assert len(small) == 2
    assert not np.allclose(small[0].get_edgecolors()[0], small[1].get_edgecolors()[0])
    assert len(small[0].get_paths()[0].vertices) != len(small[1].get_paths()[0].vertices)  # circle vs square
    entries = {line.get_label(): line for line in top.get_lines() if line.get_label().endswith(")")}
    assert {label.split(" ")[0] for label in entries} == {"fastv@16", "dense"}
    assert {line.get_marker() for line in entries.values()} == {"o", "s"}  # the legend shows each run's marker
    assert top.get_legend() is None and captured["reliability_overlay"].legends  # under the plot, over no bin


def study_rows():
    nan = float("nan")
    return [
        {"run": "dense", "selector": "dense"},
        lost_row("divprune@16", 0.0, nan, nan),
        lost_row("fastv@16", 0.52, 0.39, 0.973),
        lost_row("random@16", 0.37, 0.14, 0.998),
    ]


def drawn_lines(axis) -> list:
    """The axis' lines, an error bar's data line carrying its container's label."""
    containers = [container for container in axis.containers if container.get_label()]
    for container in containers:
        container.lines[0].set_label(container.get_label())
    return [*axis.get_lines(), *(container.lines[0] for container in containers)]


def test_a_run_has_one_colour_in_every_figure_of_a_study(captured):
    rows = study_rows()
    for row in rows:
        row.update({"visual_tokens": 16.0, "accuracy": 0.8, "accuracy_low": 0.7, "accuracy_high": 0.9})
    styles = study_figures.study_styles(rows)
    # divprune lost nothing: fastv keeps its own colour anyway
    study_figures.lost_objects(rows, "demo", "yes-questions")
    study_figures.metric_vs_budget(rows, [("accuracy", "accuracy")], "demo", "accuracy_vs_budget")
    cascade_figures(
        [cascade(label, [0.9, 0.6, 0.3]) for label in ("divprune@16", "fastv@16", "random@16")],
        "demo",
        "dense",
        styles=styles,
    )
    for stem in ("lost_objects", "accuracy_vs_budget", "cascade_cost_vs_epsilon", "cascade_validity"):
        (axis,) = captured[stem].axes
        for run in ("fastv@16", "random@16"):
            drawn = {to_rgba(line.get_color()) for line in drawn_lines(axis) if line.get_label().startswith(run)}
            assert drawn == {to_rgba(styles[run].colour)}, (stem, run, drawn)


def test_the_cost_legend_names_each_run_once_and_draws_no_red(captured):
    cascades = [cascade(label, [1.1, 0.7, 0.3]) for label in ("divprune@16", "fastv@16", "random@16", "vscan@16")]
    cascade_figures(cascades, "demo", "dense")
    figure = captured["cascade_cost_vs_epsilon"]
    labels = legend_labels(figure)
    assert len(labels) == len(cascades) + 2, labels  # the runs, the reference (and its shaded band), the chosen epsilon
    assert labels[: len(cascades)] == [entry["label"] for entry in cascades]
    assert "shaded above: costs more than dense" in labels[len(cascades)]
    (axis,) = figure.axes
    for collection in axis.collections:
        assert not any(np.allclose(colour, RED) for colour in collection.get_edgecolors()), "a red ring"


def test_validity_bars_are_the_standard_error_the_cascade_table_prints(captured):
    cascade_figures([cascade("fastv@16", [0.9, 0.6, 0.3])], "demo", "dense")
    (axis,) = captured["cascade_validity"].axes
    [bars] = [c for c in axis.collections if c.__class__.__name__ == "LineCollection"]
    lengths = [abs(segment[1][1] - segment[0][1]) for segment in bars.get_segments()]
    assert np.allclose(lengths, 2 * 0.0014)  # mean +- sem_disagreement, not +- std_disagreement (0.01)
    assert "standard error" in axis.get_title() and "sd" not in " ".join(legend_labels(captured["cascade_validity"]))


def test_lost_objects_axes_share_one_range_that_holds_the_diagonal(captured):
    study_figures.lost_objects(study_rows(), "demo", "yes-questions")
    (axis,) = captured["lost_objects"].axes
    low, high = axis.get_xlim()
    assert axis.get_ylim() == (low, high) and low <= 0.12 - 0.02 and high >= 1.0  # random's accuracy 0.14 - 0.02
    [diagonal] = [line for line in axis.get_lines() if line.get_label() == "accuracy = confidence"]
    assert list(diagonal.get_xdata()) == list(diagonal.get_ydata()) == [low, high]  # corner to corner


def text_width(text: str, pixels: float) -> float:
    """Width in pixels of ``text`` in DejaVu Sans (wider than the usual sans-serif fonts: an upper bound)."""
    from matplotlib import font_manager
    from PIL import ImageFont

    return ImageFont.truetype(font_manager.findfont("DejaVu Sans"), round(pixels)).getlength(text)


@pytest.mark.parametrize("task", [task.name for task in task_classes()])
def test_the_html_table_fits_the_page(task):
    """A study row with every column of the task's table at its widest (POPE: loyalty and F1; GQA and captions:
    both loyalties, no F1): at 0.9 x 16 px, each column as wide as its longest line (the interval line at 0.85 of
    that) or its header's longest word, plus 2 x 8 px padding and a border: under the page's 1100 px (a 1280-px
    screen)."""
    row = {
        "run": "divprune@64",
        "selector": "divprune",
        "lost_accuracy": 0.367,
        "lost_reference_accuracy": 1.0,
        "visual_tokens": 144.0,
        "latency_ms": 1234.5,
        "mean_kv_bytes": 942 * 1024.0,
        "lost_share": 0.2,
    }
    for name in ("accuracy", "loyalty", "loyalty_overlap", "f1", "ece", "ece_test_after", "auroc", "flops_relative"):
        row.update({name: 0.943, f"{name}_low": 0.920, f"{name}_high": 0.962})
    shown = get_task(task)
    page = table_html([row], table_columns(shown.report_metrics, shown.names_evidence))
    assert '0.943<br><span class="ci">[0.920, 0.962]</span>' in page  # the interval under its value
    body = 0.9 * 16
    cells = page.split("<tbody>")[1].split("<td>")[1:]
    headers = page.split("<th>")[1:]
    width = 0.0
    for header, cell in zip(headers, cells):
        value, _, interval = cell.split("</td>")[0].partition("<br>")
        interval = interval.replace('<span class="ci">', "").replace("</span>", "")
        words = header.split("</th>")[0].split()
        width += (
            max(
                text_width(value, body),
                text_width(interval, 0.85 * body),
                max(text_width(word, body) for word in words),
            )
            + 2 * 8
            + 1
        )
    assert width < 1100, width
