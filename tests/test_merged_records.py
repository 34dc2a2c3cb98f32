"""Merged tokens of input-level selectors (VisionZip's contextual tokens) in the records and the figures.

A contextual token carries the grid cells merged into it; the records list them in
``merged_stages`` (as SparseVLM's recycled tokens), so retention and ``lost`` count their
footprint, and ``visualize --run`` hatches the cells only they carry.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from test_run_cli import read_records
from typer.testing import CliRunner

import prune_audit.runner.visualize as visualize_module
import prune_audit.runner.visualize_record as visualize_record_module
from prune_audit.analysis.overlay import MERGED_NOTE, figure_note
from prune_audit.cli.main import app
from prune_audit.data.coco import CocoInstances
from prune_audit.data.geometry import TokenGeometry
from prune_audit.data.retention import object_area, retention
from prune_audit.demo.assets import demo_assets
from prune_audit.pruners.base import Selection
from prune_audit.pruners.visionzip import VisionZipSelector
from prune_audit.records.schema import SCHEMA_VERSION

BUDGET = 16


def test_merged_sources_are_the_tokens_that_are_not_a_kept_cell():
    # CLS (no cell), two dominant cells, a contextual token with members, one without members
    sources = [
        torch.tensor([], dtype=torch.long),
        torch.tensor([2]),
        torch.tensor([7]),
        torch.tensor([9, 1, 4]),
        torch.tensor([5]),
    ]
    selection = Selection(kept=torch.tensor([2, 7]), sources=sources, vision_tokens=torch.zeros(5, 3))
    assert selection.merged_sources() == [[1, 4, 9], [5]]  # ascending, in feed order
    assert Selection(kept=torch.tensor([2, 7])).merged_sources() == []


@pytest.fixture(scope="module")
def visionzip_run(tmp_path_factory):
    """The bundled demo under VisionZip at 16 tokens, first 6 questions (2 of whose objects lie only in
    contextual tokens), through the real CLI."""
    out = tmp_path_factory.mktemp("visionzip") / "run"
    args = [
        "run",
        "--model",
        "demo",
        "--selector",
        "visionzip",
        "--budget",
        str(BUDGET),
        "--limit",
        "6",
        "--threads",
        "1",
        "--out",
        str(out),
        "--quiet",
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    # the summary names the objects only a contextual token carries (2 of the 3 yes-questions with a mask)
    assert "diluted objects, stage first (decoder layer 0)" in result.output
    assert " 2 of 3 " in result.output.split("diluted objects")[1].splitlines()[0]
    return out


def test_visionzip_records_its_contextual_tokens_and_retention_counts_them(visionzip_run):
    manifest = json.loads((visionzip_run / "manifest.json").read_text())
    assert manifest["records_schema"] == SCHEMA_VERSION
    dominant, contextual = VisionZipSelector().split(BUDGET)
    coco = CocoInstances.load(demo_assets().annotations)
    rescued = 0
    for row in read_records(visionzip_run).itertuples():
        kept = list(row.kept_stages[0])
        assert len(row.kept_stages) == len(row.merged_stages) == 1 and kept == list(row.kept)
        merged = [list(sources) for sources in row.merged_stages[0]]
        assert len(kept) == dominant - 1 and len(merged) == contextual  # CLS is fed, but has no cell
        assert row.visual_tokens_avg == 1 + len(kept) + len(merged) == BUDGET
        assert all(sources == sorted(sources) for sources in merged)
        carried = [cell for sources in merged for cell in sources]
        assert len(set(carried)) == len(carried) and not set(carried) & set(kept)  # a partition of the rest
        geometry = TokenGeometry(**json.loads(row.geometry))
        assert sorted(carried + kept) == list(range(geometry.num_tokens))  # VisionZip drops no cell
        if row.lost is None:
            assert row.diluted is None and list(row.diluted_stages) == [None]
            continue
        area = object_area(coco.category_mask(row.image_id, row.object), geometry)
        retained, tokens, lost = retention(area.area_per_token, area.total_area, sorted(carried + kept))
        assert (row.retention, row.object_tokens_kept, row.lost) == (pytest.approx(retained), tokens, lost)
        assert row.retention == 1.0 and not row.lost
        alone_lost = retention(area.area_per_token, area.total_area, kept)[2]  # lost on the dominant cells alone
        assert row.diluted is alone_lost and list(row.diluted_stages) == [alone_lost]
        rescued += alone_lost
    assert rescued >= 1


def spy_on_panels(monkeypatch) -> dict:
    """Record the panels and note ``visualize`` draws (the figure is still written)."""
    drawn = {}
    real_draw = visualize_module.draw_panels

    def spy(pixels, panels, path, suptitle="", note=""):
        drawn.update(panels=panels, note=note)
        return real_draw(pixels, panels, path, suptitle=suptitle, note=note)

    monkeypatch.setattr(visualize_module, "draw_panels", spy)
    monkeypatch.setattr(visualize_record_module, "draw_panels", spy)
    return drawn


def test_visualize_run_hatches_the_contextual_cells(visionzip_run, tmp_path, monkeypatch):
    drawn = spy_on_panels(monkeypatch)
    record = read_records(visionzip_run).iloc[2]
    out = tmp_path / "tokens.png"
    args = [
        "visualize",
        "--run",
        str(visionzip_run),
        "--question-id",
        str(record["question_id"]),
        "--split",
        record["split"],
        "--out",
        str(out),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    (panel,) = drawn["panels"]
    carried = sorted(cell for sources in record["merged_stages"][0] for cell in sources)
    assert panel.merged == [carried] and panel.has_merged_only_cells()
    assert panel.stage_labels == [f"input: kept {len(record['kept'])} of 144 + 2 merged"]
    assert "retention 1.00" in panel.under(0) and out.is_file()
    assert figure_note(drawn["panels"], drawn["note"]) == MERGED_NOTE  # the legend under the figure


def test_visualize_live_draws_sparsevlm_recycled_cells_with_its_option(tmp_path, monkeypatch):
    drawn = spy_on_panels(monkeypatch)
    image = next(iter(sorted(demo_assets().images_dir.glob("*.png"))))
    out = tmp_path / "tokens.png"
    args = [
        "visualize",
        str(image),
        "--budget",
        str(BUDGET),
        "--threads",
        "1",
        "--selector",
        "none",
        "--selector",
        "sparsevlm",
        "--option",
        "recycle=true",
        "--out",
        str(out),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    unpruned, recycled = drawn["panels"]
    assert not unpruned.has_merged_only_cells()
    assert (
        recycled.title == f"sparsevlm (recycle=true), budget {BUDGET} (layer average)"
        and recycled.has_merged_only_cells()
    )
    assert len(recycled.merged) == len(recycled.stages) == len(recycled.stage_labels) > 1
    for cells, label in zip(recycled.merged, recycled.stage_labels):
        assert label.startswith("layer ") and (" merged" in label) == bool(cells)
    assert figure_note(drawn["panels"], drawn["note"]) == MERGED_NOTE and out.is_file()


@pytest.mark.parametrize(
    "selectors", [(), ("--selector", "none"), ("--selector", "visionzip", "--selector", "sparsevlm")]
)
def test_visualize_option_needs_exactly_one_selector(tmp_path, selectors):
    image = next(iter(sorted(demo_assets().images_dir.glob("*.png"))))
    out = tmp_path / "tokens.png"
    result = CliRunner().invoke(
        app, ["visualize", str(image), *selectors, "--option", "recycle=true", "--out", str(out)]
    )
    assert result.exit_code == 2 and "--option applies to one selector" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not out.exists()


def test_a_visionzip_run_of_schema_3_is_refused_by_resume_and_readers(visionzip_run, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(visionzip_run, old)
    manifest = json.loads((old / "manifest.json").read_text())
    (old / "manifest.json").write_text(json.dumps({**manifest, "records_schema": 3}))  # contextual cells not counted
    before = sorted(p.name for p in old.iterdir())
    resume = [
        "run",
        "--model",
        "demo",
        "--selector",
        "visionzip",
        "--budget",
        str(BUDGET),
        "--limit",
        "8",
        "--threads",
        "1",
        "--out",
        str(old),
        "--quiet",
    ]
    redraw = [
        "visualize",
        "--run",
        str(old),
        "--question-id",
        "1",
        "--split",
        "random",
        "--out",
        str(tmp_path / "x.png"),
    ]
    for args in (resume, redraw):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2 and "re-run with this version" in result.stderr, result.output
        assert len(result.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in old.iterdir()) == before and not (tmp_path / "x.png").exists()
