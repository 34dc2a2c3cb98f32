"""`prune-audit visualize IMAGE` on the bundled demo: grid of every runnable selector, captions, output folder."""

from pathlib import Path

import pytest
from PIL import Image
from typer.testing import CliRunner

import prune_audit.runner.visualize as visualize_module
from prune_audit.analysis.overlay import MAX_COLUMNS
from prune_audit.cli.main import app
from prune_audit.demo.assets import demo_assets
from prune_audit.runner.visualize import DEFAULT_SELECTORS


@pytest.mark.slow
def test_demo_figure_is_a_captioned_grid_of_the_default_selectors(tmp_path, monkeypatch):
    image = next(iter(sorted(demo_assets().images_dir.glob("*.png"))))
    drawn = {}
    real_draw = visualize_module.draw_panels

    def spy(pixels, panels, path, suptitle="", note=""):
        drawn.update(panels=panels, suptitle=suptitle, note=note)
        return real_draw(pixels, panels, path, suptitle=suptitle, note=note)

    monkeypatch.setattr(visualize_module, "draw_panels", spy)
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["visualize", str(image), "--budget", "64"])
    assert result.exit_code == 0, result.output
    picture = tmp_path / "figures" / image.stem / "tokens-demo-model-64.png"  # default folder; model and budget named
    assert f"wrote figures/{image.stem}/tokens-demo-model-64.png" in result.output
    panels = drawn["panels"]
    names = [panel.title.split(",")[0].split(" ")[0] for panel in panels]
    assert names == ["none", *(name for name in DEFAULT_SELECTORS if name != "cdpruner")]  # a readable default set
    assert "cdpruner (needs --clip-text PATH)" in drawn["note"]  # listed with the reason
    assert "also available: cls_attn" in drawn["note"] and "--selector all" in drawn["note"]
    for panel in panels[1:]:
        assert "budget 64" in panel.title and all("kept" in label for label in panel.stage_labels)
        assert "retention" in panel.under(0) and "answer" in panel.under(len(panel.stages) - 1)  # demo annotations
    assert drawn["suptitle"].startswith("demo model | Is there a") and "/" not in drawn["suptitle"]
    cells = sum(len(panel.stages) for panel in panels)
    with Image.open(picture) as png:
        width, height = png.size
    assert width <= MAX_COLUMNS * 340 + 60 and height > (cells // MAX_COLUMNS) * 300


def test_a_question_is_required_without_annotations_or_object(tmp_path):
    image = tmp_path / "photo.png"
    Image.new("RGB", (32, 32)).save(image)
    result = CliRunner().invoke(app, ["visualize", str(image), "--model", str(tmp_path / "model")])
    assert result.exit_code == 2
    assert "pass --object NAME" in result.stderr and not (Path.cwd() / "figures" / "photo").exists()
