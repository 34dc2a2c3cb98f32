"""Issue 29, items 1-6: figures that misled a newcomer.

Figures are checked as matplotlib objects before saving (``captured``: the renderer is replaced by
one that keeps the Figure): legend labels, texts, axis limits, marker sizes. ``visualize`` is checked
on a real COCO image of the shared data (the demo model crops its 4:3 images to the centre square)
and through the CLI for its messages.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

import prune_audit.analysis.cascade_plots as cascade_plots
import prune_audit.analysis.figures as figures
import prune_audit.analysis.study_figures as study_figures
import prune_audit.runner.visualize as visualize_module
from prune_audit.analysis.overlay import (
    OUTSIDE_BASE,
    OUTSIDE_CONTRAST,
    Panel,
    dim_pruned,
    kept_pixels,
    legend_entries,
    merged_hatch,
    outside_view,
)
from prune_audit.analysis.report_html import _signed
from prune_audit.cli.main import app
from prune_audit.data.geometry import clip_geometry

runner = CliRunner()
COCO = Path(__file__).resolve().parents[2] / "shared" / "data" / "coco" / "tiny_coco_val2017"
KITCHEN = COCO / "val2017" / "000000037777.jpg"  # 352 x 230: the refrigerator is at x = 302-352
INSTANCES = COCO / "instances_val2017.json"
needs_coco = pytest.mark.skipif(not KITCHEN.is_file(), reason="shared COCO images not present")


def demo_view(size: tuple[int, int]):
    """The demo model's geometry (hf_crop: shortest edge 96, centre crop 96, 8-px patches)."""
    return clip_geometry(size, mode="hf_crop", shortest_edge=96, crop_size=(96, 96), patch_size=8)


@pytest.fixture
def captured(monkeypatch) -> dict:
    """{stem: matplotlib Figure} of every picture drawn while the test runs (nothing is rendered)."""
    drawn: dict = {}

    def keep(figure, stem):
        drawn[stem] = figure
        return {}

    monkeypatch.setattr(figures, "_render", keep)
    monkeypatch.setattr(study_figures, "_render", keep)
    monkeypatch.setattr(cascade_plots, "_render", keep)
    return drawn


def legend_labels(figure) -> list[str]:
    legends = [axis.get_legend() for axis in figure.axes if axis.get_legend()] + list(figure.legends)
    return [text.get_text() for legend in legends for text in legend.get_texts()]


def markers(axis) -> list:
    """The scatter collections with points (not the legend's empty proxy, not error bars)."""
    return [c for c in axis.collections if c.__class__.__name__ == "PathCollection" and len(c.get_offsets())]


def all_texts(figure) -> str:
    texts = [text.get_text() for text in figure.texts]
    for axis in figure.axes:
        texts += [axis.get_title(), axis.get_xlabel(), axis.get_ylabel(), *(t.get_text() for t in axis.texts)]
        texts += [label.get_text() for label in axis.get_xticklabels()]
    if figure._suptitle is not None:
        texts.append(figure._suptitle.get_text())
    return "\n".join(texts)


# ----- item 1: visualize on a real COCO image ---------------------------------------------------


@needs_coco
def test_the_default_object_is_one_the_model_sees_not_one_its_crop_removes():
    from prune_audit.data.coco import CocoInstances

    coco = CocoInstances.load(INSTANCES)
    geometry = demo_view((352, 230))
    assert visualize_module.most_visible_object(coco, KITCHEN.name) == "refrigerator"  # the whole image's largest
    chosen = visualize_module.most_visible_object(coco, KITCHEN.name, ~outside_view(geometry))
    assert chosen != "refrigerator"
    mask = coco.category_mask(coco.image_id(KITCHEN.name), chosen)
    assert (mask & ~outside_view(geometry)).any()
    fridge = coco.category_mask(coco.image_id(KITCHEN.name), "refrigerator")
    assert "outside the model's view" in visualize_module.view_warning(fridge, geometry, "refrigerator")
    assert visualize_module.view_warning(mask & ~outside_view(geometry), geometry, chosen) == ""


def test_cropped_away_pixels_are_grey_and_unlike_pruned_ones():
    geometry = clip_geometry((84, 56), mode="hf_crop", shortest_edge=56, crop_size=(56, 56))
    image = np.zeros((56, 84, 3), dtype=np.uint8)
    image[..., 0] = 200  # a red image
    out = dim_pruned(image, geometry, kept=[0])
    outside, pruned = outside_view(geometry), ~kept_pixels(geometry, [0]) & ~outside_view(geometry)
    assert outside[:, :14].all() and outside[:, -14:].all() and not outside[:, 14:-14].any()
    grey = round(OUTSIDE_BASE + OUTSIDE_CONTRAST * 200 / 3)
    assert (out[outside] == grey).all()  # colourless
    assert out[outside].min() > out[pruned].max()  # light grey, never the dark of a dropped cell
    labels = [label for label, _ in legend_entries([Panel("crop", geometry, [[0]])])]
    assert any("cropped away" in label for label in labels)
    full = clip_geometry((56, 56), mode="hf_crop", shortest_edge=None, crop_size=None)
    assert not any("cropped away" in label for label, _ in legend_entries([Panel("full", full, [[0]])]))


def spy_on_panels(monkeypatch) -> dict:
    drawn: dict = {}
    real_draw = visualize_module.draw_panels

    def spy(pixels, panels, path, suptitle="", note=""):
        drawn.update(panels=panels, suptitle=suptitle, note=note)
        return real_draw(pixels, panels, path, suptitle=suptitle, note=note)

    monkeypatch.setattr(visualize_module, "draw_panels", spy)
    return drawn


def visualize(*args: str):
    return runner.invoke(app, ["visualize", *map(str, args), "--threads", "1", "--selector", "none"])


@needs_coco
def test_visualize_warns_when_the_object_is_cropped_away_and_the_image_is_not_a_demo_scene(tmp_path, monkeypatch):
    drawn = spy_on_panels(monkeypatch)
    out = tmp_path / "kitchen.png"
    result = visualize(KITCHEN, "--annotations", INSTANCES, "--object", "refrigerator", "--out", out)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output and out.is_file()
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning: ")]
    assert len(warnings) == 2, result.stderr
    assert "not one of the demo model's scenes" in warnings[0] and "--model MODEL" in warnings[0]
    assert "refrigerator lies outside the model's view" in warnings[1] and "--object NAME" in warnings[1]
    (panel,) = drawn["panels"]
    assert "the object is outside the model's view" in panel.under(0)
    assert re.search(r"confidence \d\.\d{3}\)", panel.caption)  # three decimals
    assert "not one of the demo model's scenes" in drawn["note"]  # said under the figure as well


@needs_coco
def test_visualize_asks_by_default_about_an_object_the_model_sees(tmp_path, monkeypatch):
    drawn = spy_on_panels(monkeypatch)
    result = visualize(KITCHEN, "--annotations", INSTANCES, "--out", tmp_path / "kitchen.png")
    assert result.exit_code == 0, result.output
    assert "refrigerator" not in drawn["suptitle"]
    assert "outside the model's view" not in result.stderr
    (panel,) = drawn["panels"]
    assert re.match(r"retention 1\.00 \(\d+ object tokens\)", panel.under(0))


def test_a_demo_scene_draws_without_warning(tmp_path):
    from prune_audit.demo.assets import demo_assets

    image = next(iter(sorted(demo_assets().images_dir.glob("*.png"))))
    result = visualize(image, "--out", tmp_path / "scene.png")
    assert result.exit_code == 0, result.output
    assert "warning" not in result.stderr


# ----- item 4: tokens.png -------------------------------------------------------------------------


def test_the_legend_names_every_look_drawn_including_the_object_outline():
    geometry = clip_geometry((56, 56), mode="hf_crop", shortest_edge=None, crop_size=None)
    mask = np.zeros((56, 56), dtype=bool)
    mask[10:20, 10:20] = True
    plain = [label for label, _ in legend_entries([Panel("random", geometry, [[0, 1]])])]
    assert plain == ["kept (yellow outline)", "dropped (dimmed)"]
    rich = [label for label, _ in legend_entries([Panel("vz", geometry, [[0]], mask=mask, merged=[[0, 1, 2]])])]
    assert "queried object (cyan outline)" in rich and any("merged" in label for label in rich)


def test_retention_sits_under_the_stage_it_was_measured_at_and_the_answer_under_the_last():
    geometry = clip_geometry((56, 56), mode="hf_crop", shortest_edge=None, crop_size=None)
    panel = Panel(
        "e2s",
        geometry,
        [[0, 1, 2], [0, 1], [0]],
        caption="answer yes (confidence 0.987)",
        stage_notes={0: "retention 0.50 (2 object tokens)"},
    )
    assert panel.under(0) == "retention 0.50 (2 object tokens)"
    assert panel.under(1) == ""
    assert panel.under(2) == "answer yes (confidence 0.987)"
    single = Panel("random", geometry, [[0]], caption="answer no", stage_notes={0: "retention 0.00"})
    assert single.under(0) == "retention 0.00\nanswer no"


def test_merged_hatching_leaves_the_image_visible():
    geometry = clip_geometry((336, 336), mode="hf_crop", shortest_edge=None, crop_size=None)
    everything = range(geometry.num_tokens)
    hatch = merged_hatch(geometry, list(everything), [0])  # VisionZip: every dropped cell is merged
    assert hatch.mean() < 0.12


class _Model:
    """Stands in for a model that cannot run cdpruner (no CLIP text tower)."""

    def check_selector(self, selector):
        from prune_audit.errors import PruneAuditError

        if selector.name == "cdpruner":
            raise PruneAuditError("cdpruner needs --clip-text PATH")


def test_without_selector_a_readable_set_is_drawn_and_the_others_are_listed():
    from prune_audit.pruners import list_selectors

    names, note = visualize_module.drawn_selectors(_Model(), [])
    assert names == ["none", *(n for n in visualize_module.DEFAULT_SELECTORS if n != "cdpruner")]
    assert len(names) <= 8 and "cdpruner (needs --clip-text PATH)" in note
    assert "also available: cls_attn" in note and "--selector all" in note
    everything, note = visualize_module.drawn_selectors(_Model(), ["all"])
    assert everything == ["none", *(n for n in list_selectors() if n != "cdpruner")] and "also available" not in note
    assert visualize_module.drawn_selectors(_Model(), ["fastv"]) == (["fastv"], "")


# ----- item 2: reliability pictures ---------------------------------------------------------------


def calibrated(counts, accuracy, label="run", ece=0.013) -> dict:
    """A calibrate entry with equal-width bins over [0.5, 1] (the given counts and accuracies)."""
    edges = np.linspace(0.5, 1.0, len(counts) + 1)
    centres = (edges[:-1] + edges[1:]) / 2
    shown = [count > 0 for count in counts]
    return {
        "label": label,
        "metrics": {"all": {"ece": {"value": ece, "ci95": [0.0, 0.03]}}},
        "reliability": {
            "lower": edges[:-1].tolist(),
            "upper": edges[1:].tolist(),
            "count": list(counts),
            "confidence": [float(c) if s else None for c, s in zip(centres, shown)],
            "accuracy": [float(a) if s else None for a, s in zip(accuracy, shown)],
            "accuracy_ci95": [
                [max(0.0, a - 0.1), min(1.0, a + 0.1)] if s else [None, None] for a, s in zip(accuracy, shown)
            ],
        },
    }


SPARSE_RUN = calibrated([0, 2, 0, 20, 300], [0.0, 0.0, 0.0, 0.8, 1.0], "dense")


def test_the_overlay_sizes_markers_by_count_greys_sparse_bins_and_keeps_points_off_the_frame(captured):
    figures.reliability_overlay([SPARSE_RUN], ["dense"], "Reliability", "reliability_overlay")
    figure = captured["reliability_overlay"]
    top, bottom = figure.axes
    dense, sparse = markers(top)  # the bins of >= MIN_BIN_QUESTIONS, then the others
    assert np.allclose(dense.get_sizes() / dense.get_sizes().max(), [20 / 300, 1.0])  # area proportional to count
    assert np.allclose(sparse.get_offsets(), [[0.65, 0.0]]) and sparse.get_facecolors().size == 0  # open, grey
    [line] = [line for line in top.get_lines() if len(line.get_xdata()) and line.get_linestyle() == "-"]
    assert np.allclose(line.get_xdata(), [0.85, 0.95])  # the sparse bin is not joined
    assert figures.SPARSE_LABEL in legend_labels(figure)
    assert top.get_xlim()[1] > 1.0 and top.get_ylim()[0] < 0 and top.get_ylim()[1] > 1.0
    assert bottom.get_yscale() == "log" and "marker area" in top.get_title()


def test_the_diagram_names_both_gaps_keeps_intervals_inside_and_counts_on_a_log_axis(captured):
    # accuracy above confidence at 0.85, below it at 0.95; the sparse bin of accuracy 0 still gets a marker
    mixed = calibrated([0, 2, 0, 30, 300], [0.0, 0.0, 0.0, 0.95, 0.9])
    figures.reliability_diagram(mixed, "run", "reliability_run")
    figure = captured["reliability_run"]
    top, bottom = figure.axes
    labels = legend_labels(figure)
    assert "accuracy above confidence (under-confident)" in labels
    assert "confidence above accuracy (over-confident)" in labels
    assert f"accuracy, bin of < {figures.MIN_BIN_QUESTIONS} questions (no interval)" in labels
    (sparse,) = markers(top)
    assert np.allclose(sparse.get_offsets(), [[0.65, 0.0]]) and top.get_ylim()[0] < 0  # off the frame
    assert top.get_ylim()[1] > 1.0  # an interval ending at 1 is drawn inside the axes
    assert bottom.get_yscale() == "log"


def test_the_study_grid_draws_the_same_points(captured):
    study_figures.reliability_grid([SPARSE_RUN, calibrated([5, 0, 0, 40, 100], [0, 0, 0, 0.7, 0.9], "random")], "demo")
    figure = captured["reliability_grid"]
    for axis in figure.axes[:2]:
        assert axis.get_xlim()[1] > 1.0 and axis.get_ylim()[1] > 1.0
        assert len(markers(axis)) == 2  # dense bins and grey bins
    assert figures.SPARSE_LABEL in figure._suptitle.get_text()


# ----- item 3: retention and lost objects ---------------------------------------------------------


def measured(value, low, high, count=None) -> dict:
    entry = {"value": value, "ci95": [low, high]}
    return entry if count is None else {"count": {"value": count, "ci95": [count, count]}}


def group(count, accuracy, confidence) -> dict:
    return {
        "count": {"value": float(count), "ci95": [0.0, 0.0]},
        "accuracy": measured(accuracy, accuracy - 0.1, min(1.0, accuracy + 0.1)),
        "confidence": measured(confidence, confidence - 0.01, min(1.0, confidence + 0.01)),
        "reference_accuracy": measured(1.0, 0.9, 1.0),
        "reference_confidence": measured(0.999, 0.99, 1.0),
    }


def test_retention_draws_lost_once_with_counts_and_zooms_the_confidence_axis(captured):
    survival = {
        "lost": group(7, 0.4, 0.97),
        "survived": group(53, 0.9, 0.98),
        "retention 0": group(7, 0.4, 0.97),
        "retention (0, 0.25]": group(14, 0.8, 0.975),
        "retention (0.25, 0.5]": group(9, 0.9, 0.98),
        "retention (0.5, 1]": group(30, 0.95, 0.99),
    }
    figures.retention_figure([{"survival": survival}], ["fastv@16"], "demo", "retention", "dense")
    figure = captured["retention"]
    accuracy_axis, confidence_axis = figure.axes
    ticks = [label.get_text() for label in accuracy_axis.get_xticklabels()]
    assert ticks == ["lost\n(retention 0)", "(0, 0.25]", "(0.25, 0.5]", "(0.5, 1]"]  # no separate "0" bin
    texts = [text.get_text() for text in accuracy_axis.texts]
    assert {"n=7", "n=14", "n=9", "n=30"} <= set(texts)
    low, high = confidence_axis.get_ylim()
    assert 0.9 < low < 0.96 and 1.0 <= high < 1.02  # zoomed to 0.96-1.0, not 0-1


def lost_row(run, share, accuracy, confidence, reference=(1.0, 0.999)) -> dict:
    row = {"run": run, "selector": run.split("@")[0], "lost_share": share}
    values = {
        "lost_accuracy": accuracy,
        "lost_confidence": confidence,
        "lost_reference_accuracy": reference[0],
        "lost_reference_confidence": reference[1],
    }
    for name, value in values.items():
        row.update({name: value, f"{name}_low": value - 0.02, f"{name}_high": value + 0.01})
    return row


def test_lost_objects_has_intervals_shows_the_diagonal_and_lists_runs_that_lost_nothing(captured):
    nan = float("nan")
    rows = [
        {"run": "dense", "selector": "dense"},
        lost_row("fastv@16", 0.52, 0.39, 0.973),
        lost_row("random@16", 0.37, 0.14, 0.998),
        lost_row("divprune@16", 0.0, nan, nan),
    ]
    study_figures.lost_objects(rows, "demo", "yes-questions")
    figure = captured["lost_objects"]
    (axis,) = figure.axes
    assert axis.get_xlim() == axis.get_ylim() and axis.get_xlim()[0] < 0.14  # one range: the diagonal shows (issue 46)
    assert "divprune@16 (lost no object)" in all_texts(figure)
    assert not [text for text in axis.texts if getattr(text, "arrow_patch", None)]  # no arrows
    bars = [c for c in axis.collections if c.__class__.__name__ == "LineCollection"]
    assert len(bars) == 8  # x and y intervals of pruned and dense, for each of the two runs drawn
    assert any("open square: dense" in label for label in legend_labels(figure))


# ----- item 5: cascade pictures -------------------------------------------------------------------


def cascade(label, costs, chosen=0.1) -> dict:
    epsilons = [0.05, 0.1, 0.2]
    validity = {
        "splits": 50,
        "mean_relative_cost": 0.0,
        "mean_disagreement": 0.03,
        "std_disagreement": 0.01,
        "sem_disagreement": 0.0014,
        "worst_disagreement": 0.08,
    }
    results = [
        {"epsilon": e, "relative_cost": c, "validity": {**validity, "mean_relative_cost": c - 0.02}}
        for e, c in zip(epsilons, costs)
    ]
    return {"label": label, "epsilon": chosen, "results": results}


def test_the_cost_figure_marks_the_chosen_epsilon_and_flags_costs_above_dense(captured):
    cascade_plots.cascade_figures(
        [cascade("divprune@16", [1.1, 0.7, 0.3]), cascade("fastv@16", [0.9, 0.6, 0.3])], "demo", "dense"
    )
    cost, validity = captured["cascade_cost_vs_epsilon"], captured["cascade_validity"]
    (axis,) = cost.axes
    chosen = [line for line in axis.get_lines() if line.get_label() == "chosen target epsilon 0.1"]
    assert len(chosen) == 1 and list(chosen[0].get_xdata()) == [0.1, 0.1]
    labels = legend_labels(cost)
    assert any("costs more than dense" in label for label in labels)
    assert "dotted, x: the seeded split" in axis.get_title() and "seeded split:" in axis.get_title()
    assert axis.get_legend() is None and cost.legends  # under the axes, covering no line
    assert "on average" in validity.axes[0].get_title()
    assert "chosen target epsilon 0.1" in legend_labels(validity)


def test_costs_at_or_below_dense_are_not_flagged(captured):
    cascade_plots.cascade_figures([cascade("fastv@16", [0.9, 0.6, 0.3])], "demo", "dense")
    assert not any("costs more" in label for label in legend_labels(captured["cascade_cost_vs_epsilon"]))


# ----- item 6: report.html ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def demo_study(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("study") / "study"
    args = [
        "study",
        "--selectors",
        "random",
        "--budgets",
        "16",
        "--limit",
        "60",
        "--epsilons",
        "0.2",
        "--bootstrap",
        "50",
        "--splits",
        "10",
        "--threads",
        "1",
        "--quiet",
        "--out",
        str(out),
    ]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return out


def test_the_report_has_a_header_the_validity_figure_no_wrapping_and_a_latency_caveat(demo_study):
    from prune_audit import __version__

    page = (demo_study / "report.html").read_text(encoding="utf-8")
    for needle in (
        "<dt>command</dt>",
        "prune-audit study --selectors random --budgets 16",
        f"<dd>{__version__}",
        "<dt>model</dt><dd>demo</dd>",
        "demo_pope_random.json",
        "60 questions",
        "<dt>report date</dt>",
        "td{white-space:nowrap}",
        "latency ms: mean wall-clock",
        "a pruned run can read slower than dense",
        'alt="Cascade validity',
    ):
        assert needle in page, needle
    assert (demo_study / "cascade_validity.png").is_file()
    markdown = (demo_study / "report.md").read_text(encoding="utf-8")
    assert "- command: `prune-audit study" in markdown and "(cascade_validity.png)" in markdown


def test_a_difference_that_is_zero_on_every_resample_reads_as_such():
    assert _signed({"d": 0.0, "d_low": 0.0, "d_high": 0.0}, "d") == "identical answers on every resample"
    assert _signed({"d": 0.02, "d_low": 0.02, "d_high": 0.02}, "d") == "+0.020 on every bootstrap resample"
    interval = _signed({"d": -0.05, "d_low": -0.09, "d_high": -0.01}, "d")
    assert interval == "-0.050, 95% interval [-0.090, -0.010] excludes 0"
