"""Kept-token overlays: the dimmed area is exactly the pruned cells, the hatched one exactly the cells only merged
tokens carry (pixel checks on a known grid)."""

import numpy as np
from PIL import Image

from prune_audit.analysis.overlay import (
    ANSWER_OUTLINE,
    CAPTION_CHARS,
    CELL_INCHES,
    DPI,
    HATCH_OPACITY,
    KEPT_OUTLINE,
    MASK_OUTLINE,
    MERGED_HATCH,
    MERGED_NOTE,
    Panel,
    box_labels,
    box_line_width,
    box_outline,
    compose,
    dim_pruned,
    draw_panels,
    figure_note,
    grid_shape,
    kept_pixels,
    kept_token_borders,
    legend_entries,
    merged_hatch,
    outline,
    wrapped,
)
from prune_audit.data.boxes import Box
from prune_audit.data.geometry import clip_geometry


def test_overlay_covers_exactly_the_kept_cells():
    # 56 x 56 image, no resize, 14-px patches: a 4 x 4 grid whose cells are known blocks
    geometry = clip_geometry((56, 56), mode="hf_crop", shortest_edge=None, crop_size=None)
    assert geometry.grid == (4, 4)
    image = np.full((56, 56, 3), 200, dtype=np.uint8)
    kept = [0, 5, 15]
    out = dim_pruned(image, geometry, kept, dim=0.5)
    expected_kept = np.zeros((56, 56), dtype=bool)
    for token in kept:
        row, col = divmod(token, 4)
        expected_kept[row * 14 : (row + 1) * 14, col * 14 : (col + 1) * 14] = True
    assert np.array_equal(kept_pixels(geometry, kept), expected_kept)
    assert (out[expected_kept] == 200).all()
    assert (out[~expected_kept] == 100).all()


def test_cropped_pixels_belong_to_no_token_and_padding_is_not_drawn():
    # 84 x 56 landscape, centre crop to 56 x 56: 14 columns on each side are cropped away
    geometry = clip_geometry((84, 56), mode="hf_crop", shortest_edge=56, crop_size=(56, 56))
    everything = list(range(geometry.num_tokens))
    keep = kept_pixels(geometry, everything)
    assert not keep[:, :14].any() and not keep[:, -14:].any() and keep[:, 14:-14].all()
    # pad mode: a 56 x 28 image padded to 56 x 56 keeps all its own pixels on the grid
    padded = clip_geometry((56, 28), mode="hf_pad", shortest_edge=56, crop_size=(56, 56))
    assert kept_pixels(padded, range(padded.num_tokens)).all()


def test_outline_is_the_mask_boundary():
    mask = np.zeros((7, 7), dtype=bool)
    mask[2:5, 2:5] = True
    border = outline(mask)
    assert border.sum() == 8 and not border[3, 3]


def test_draw_panels_writes_png_and_svg(tmp_path):
    geometry = clip_geometry((56, 56), mode="hf_crop", shortest_edge=None, crop_size=None)
    image = (np.random.default_rng(0).random((56, 56, 3)) * 255).astype(np.uint8)
    panels = [
        Panel("a", geometry, [[0, 1, 2]], caption="yes 0.91"),
        Panel("b", geometry, [[0, 1, 2, 3], [1, 2]], stage_labels=["layer 2", "layer 8"]),
    ]
    png = draw_panels(image, panels, tmp_path / "x.png", suptitle="demo")
    svg = draw_panels(image, panels, tmp_path / "x.svg")
    with Image.open(png) as picture:
        width, height = picture.size
        assert width > 200 and height > 200
        assert np.asarray(picture.convert("L")).std() > 5  # not blank
    assert svg.read_text().lstrip().startswith("<?xml")


def test_panels_are_laid_out_at_most_four_per_row(tmp_path):
    assert grid_shape(1) == (1, 1) and grid_shape(4) == (1, 4) and grid_shape(5) == (2, 4) and grid_shape(17) == (5, 4)
    geometry = clip_geometry((56, 56), mode="hf_crop", shortest_edge=None, crop_size=None)
    image = np.full((56, 56, 3), 128, dtype=np.uint8)
    panels = [Panel(f"s{i}, budget 3", geometry, [[0, 1, 2]], ["input: kept 3 of 16"]) for i in range(9)]
    with Image.open(draw_panels(image, panels, tmp_path / "grid.png", note="not drawn: x (needs y)")) as picture:
        width, height = picture.size
    cell = CELL_INCHES * DPI
    assert 4 * cell <= width <= 4 * cell + 60  # four columns, each about 330 px: readable at 100 %
    assert 3 * cell < height < 3 * (cell + 1.4 * DPI) + 160  # three rows of square images, legend and note


def test_cells_only_merged_tokens_carry_are_half_dimmed_and_hatched():
    # 4 x 4 grid of 14-px cells; kept 0 and 5; merged tokens carry {1, 2} and {5, 6}: 1, 2, 6 only merged
    geometry = clip_geometry((56, 56), mode="hf_crop", shortest_edge=None, crop_size=None)
    image = np.full((56, 56, 3), 200, dtype=np.uint8)
    kept, merged = [0, 5], [1, 2, 5, 6]
    shaded = dim_pruned(image, geometry, kept, merged, dim=0.25, merged_dim=0.6)
    kept_area, merged_only = kept_pixels(geometry, kept), kept_pixels(geometry, [1, 2, 6])
    dropped = ~kept_area & ~merged_only
    assert (shaded[kept_area] == 200).all() and (shaded[merged_only] == 120).all() and (shaded[dropped] == 50).all()

    picture = compose(image, Panel("visionzip", geometry, [kept], merged=[merged]), 0)
    hatch = merged_hatch(geometry, merged, kept)
    assert np.array_equal(hatch & merged_only, hatch)  # hatching only on the merged-only cells
    assert 0.05 < hatch[merged_only].mean() < 0.2  # thin stripes: the image stays visible between them
    tinted = np.rint(HATCH_OPACITY * np.array(MERGED_HATCH) + (1 - HATCH_OPACITY) * 120)
    assert (picture[hatch] == tinted).all()
    assert (picture[merged_only & ~hatch] == 120).all() and (picture[dropped] == 50).all()
    border = kept_token_borders(geometry, kept)
    assert (picture[border] == KEPT_OUTLINE).all() and (picture[kept_area & ~border] == 200).all()
    # three looks, told apart by a plain grey reading: kept > merged-only (even on a stripe) > dropped
    grey = picture.mean(axis=2)
    assert grey[kept_area & ~border].min() > grey[merged_only].max() and grey[merged_only].min() > grey[dropped].max()


def test_the_legend_of_merged_cells_is_added_only_when_a_panel_draws_some():
    geometry = clip_geometry((56, 56), mode="hf_crop", shortest_edge=None, crop_size=None)
    plain = Panel("random", geometry, [[0, 1]])
    inside = Panel("recycled into kept cells", geometry, [[0, 1], [0]], merged=[[0, 1], []])
    merging = Panel("sparsevlm", geometry, [[0, 1], [0]], merged=[[], [3, 4]])
    assert figure_note([plain, inside], "not drawn: x") == "not drawn: x"
    assert figure_note([plain, merging], "not drawn: x") == MERGED_NOTE + "\nnot drawn: x"
    assert figure_note([merging]) == MERGED_NOTE and "merged" in MERGED_NOTE and "retention" in MERGED_NOTE


def test_several_token_grids_are_drawn_one_picture_each_on_their_tokens_pixels():
    """LLaVA-NeXT's base view and tiles: each grid's picture leaves exactly its kept tokens' footprints undimmed
    (boxes from ``footprints``, not the pixel map the overlay reads), and the whole figure draws."""
    from prune_audit.analysis.overlay import grid_panels
    from prune_audit.data.multigrid import anyres_geometry

    geometry = anyres_geometry((130, 100), pinpoints=[[56, 112], [112, 56], [112, 112]], tile=56)
    base, tiles = geometry.grids
    base_token, tile_token = 5, base.num_tokens + 7  # one kept token in each grid, in the flat index space
    panel = Panel(
        "x",
        geometry,
        [[base_token, tile_token]],
        ["input: kept 2"],
        caption="answer yes",
        stage_notes={0: "retention 0.50"},
    )
    pieces = grid_panels(panel)
    assert [piece.stages for piece in pieces] == [[[base_token]], [[tile_token - base.num_tokens]]]
    assert [piece.geometry for piece in pieces] == [base, tiles]
    assert pieces[0].stage_labels == [f"input: kept 2\nbase view: 1 of {base.num_tokens} kept"]
    assert (pieces[0].under(0), pieces[1].under(0)) == ("retention 0.50", "answer yes")
    image = np.full((100, 130, 3), 200, dtype=np.uint8)
    centres_x, centres_y = np.meshgrid(np.arange(130) + 0.5, np.arange(100) + 0.5)
    for piece, token in zip(pieces, (base_token, tile_token)):
        x0, y0, x1, y1 = geometry.footprints()[token]
        box = (centres_x >= x0) & (centres_x < x1) & (centres_y >= y0) & (centres_y < y1)
        undimmed = dim_pruned(image, piece.geometry, piece.stages[0]).mean(axis=-1) == 200
        assert box.any() and np.array_equal(undimmed, box)
    assert grid_panels(Panel("x", base, [[1]])) == [Panel("x", base, [[1]])]


# ----- a task's boxes: evidence framed solid, the model's answer box dashed -------------------------------------------


def test_a_box_is_framed_just_inside_its_edge_on_the_pixels_whose_centre_it_holds():
    # x in [5, 15), y in [4, 10): columns 5..14, rows 4..9; a 2-px frame
    frame = box_outline((20, 30), Box(5.0, 4.0, 15.0, 10.0), width=2)
    expected = np.zeros((20, 30), dtype=bool)
    expected[4:10, 5:15] = True
    expected[6:8, 7:13] = False
    assert np.array_equal(frame, expected)
    assert np.array_equal(box_outline((20, 30), Box(4.6, 3.6, 14.6, 9.6), width=2), expected)  # centres at +0.5


def test_a_dashed_frame_alternates_runs_along_each_side_and_a_side_past_the_image_is_not_drawn():
    dashed = box_outline((12, 30), Box(0.0, 0.0, 24.0, 12.0), width=1, dash=4)
    assert dashed[0].tolist() == ([True] * 4 + [False] * 4) * 3 + [False] * 6  # top side: 4 on, 4 off
    assert dashed[:, 0].tolist() == [True] * 4 + [False] * 4 + [True] * 4  # left side, from the top corner
    partly_out = box_outline((10, 10), Box(-5.0, 2.0, 6.0, 20.0), width=1)
    assert not partly_out[:, 0][3:].any()  # no left side at the image border: the box goes on past it
    assert partly_out[2, :6].all() and partly_out[2:, 5].all() and not partly_out[:, 6:].any()
    assert not box_outline((10, 10), Box(12.0, 0.0, 20.0, 5.0)).any()  # outside the image
    assert not box_outline((10, 10), Box(6.0, 6.0, 2.0, 2.0)).any()  # inverted corners: no region


def test_compose_frames_evidence_boxes_in_the_evidence_colour_and_the_answer_box_dashed_in_its_own():
    geometry = clip_geometry((56, 56), mode="hf_crop", shortest_edge=None, crop_size=None)
    image = np.full((56, 56, 3), 200, dtype=np.uint8)
    panel = Panel(
        "refcoco",
        geometry,
        [[5]],
        evidence_boxes=[("bottle", Box(8.0, 8.0, 40.0, 30.0))],
        answer_boxes=[("IoU 0.14", Box(20.0, 34.0, 52.0, 50.0))],
    )
    picture = compose(image, panel, 0)
    assert box_line_width((56, 56)) == 1
    evidence = box_outline((56, 56), Box(8.0, 8.0, 40.0, 30.0))
    assert (picture[evidence] == MASK_OUTLINE).all()
    assert (picture[8, 8:40] == MASK_OUTLINE).all() and (picture[8:30, 39] == MASK_OUTLINE).all()
    assert (picture[34, 20:24] == ANSWER_OUTLINE).all() and not (picture[34, 24:28] == ANSWER_OUTLINE).all(
        axis=-1
    ).any()
    assert (picture[49, 20:24] == ANSWER_OUTLINE).all()  # bottom side: the same dashes
    assert not (picture[20, 20] == MASK_OUTLINE).all()  # inside the frame: the picture itself


def test_box_labels_sit_outside_their_box_unless_it_touches_the_edge_and_never_for_a_box_off_the_image():
    geometry = clip_geometry((100, 100), mode="hf_crop", shortest_edge=None, crop_size=None, patch_size=10)
    panel = Panel(
        "x",
        geometry,
        [[0]],
        evidence_boxes=[
            ("STOP", Box(10.0, 40.0, 30.0, 50.0)),
            ("top", Box(10.0, 2.0, 30.0, 9.0)),
            ("", Box(0, 0, 5, 5)),
        ],
        answer_boxes=[("IoU 0.50", Box(80.0, 20.0, 95.0, 60.0)), ("gone", Box(200.0, 0.0, 300.0, 50.0))],
    )
    labels = box_labels(panel, (100, 100))
    assert [(label.text, label.x, label.y, label.ha, label.va) for label in labels] == [
        ("STOP", 10.0, 40.0, "left", "bottom"),  # above the box's top-left corner
        ("top", 10.0, 2.0, "left", "top"),  # at the image's top: inside the box
        ("IoU 0.50", 95.0, 60.0, "right", "top"),  # below the bottom edge, from the right corner in the right third
    ]
    assert labels[0].colour == MASK_OUTLINE and labels[2].colour == ANSWER_OUTLINE


def test_the_legend_names_the_evidence_in_the_panels_words_and_the_answer_box_when_drawn():
    geometry = clip_geometry((56, 56), mode="hf_crop", shortest_edge=None, crop_size=None)
    boxes_only = Panel(
        "x", geometry, [[0]], evidence_label="answer's OCR text", evidence_boxes=[("Coca", Box(1.0, 1.0, 9.0, 9.0))]
    )
    labels = [label for label, _ in legend_entries([boxes_only])]
    assert "answer's OCR text (cyan outline)" in labels and not any("dashed" in label for label in labels)
    answered = Panel("x", geometry, [[0]], answer_boxes=[("IoU 0.10", Box(1.0, 1.0, 9.0, 9.0))])
    styles = dict(legend_entries([answered]))
    assert styles["the model's box (green, dashed)"]["linestyle"] == "--"
    assert not any("cyan" in label for label in styles)  # no evidence drawn: no evidence entry
    masked = Panel("x", geometry, [[0]], mask=np.ones((56, 56), dtype=bool))
    assert "queried object (cyan outline)" in [label for label, _ in legend_entries([masked])]  # the live default


def test_a_figure_with_boxes_titles_a_note_on_its_own_line_and_wraps_a_long_caption(tmp_path):
    geometry = clip_geometry((56, 56), mode="hf_crop", shortest_edge=None, crop_size=None)
    image = np.full((56, 56, 3), 128, dtype=np.uint8)
    panel = Panel(
        "random, budget 3\nno box parsed",
        geometry,
        [[0, 1, 2]],
        ["input: kept 3 of 16"],
        caption="answer " + "word " * 30,
        evidence_boxes=[("person", Box(5.0, 20.0, 30.0, 50.0))],
    )
    assert panel.title_lines(0) == 3
    with Image.open(draw_panels(image, [panel], tmp_path / "boxes.png")) as picture:
        pixels = np.asarray(picture.convert("RGB"))
    assert (np.abs(pixels.astype(int) - MASK_OUTLINE).sum(axis=-1) < 30).any()  # the cyan frame is on the page
    assert wrapped(panel.under(0), CAPTION_CHARS) and all(
        len(line) <= CAPTION_CHARS for line in wrapped(panel.under(0), CAPTION_CHARS)
    )
