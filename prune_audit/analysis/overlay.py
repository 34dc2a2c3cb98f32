"""Kept-token overlays on the original image, with the model's exact token geometry.

Every original pixel belongs to the token whose footprint contains its centre
(``prune_audit.data.geometry.token_index_map``), so padding, centre crops and Qwen's
resizing are drawn exactly as the model saw them: pixels of pruned tokens are dimmed;
pixels the preprocessing cropped away (no token sees them) are washed-out grey, so they
never read as pruned; pixels of kept tokens keep their colour; pixels of cells that only
a merged token carries (VisionZip's contextual tokens, SparseVLM's recycled ones: the
records' ``merged_stages``) are half-dimmed and sparsely hatched.

An image seen through several token grids (LLaVA-NeXT's and LLaVA-OneVision's base view and
tiles, ``data.multigrid``) is drawn once per grid (:func:`grid_panels`): each picture shows the
original image with that grid's kept tokens on the pixels they were computed from, so a reader
sees whether the queried object survived in the coarse base view, in the fine tiles, or in both.
Newline tokens have no pixels and are drawn nowhere.

A task's boxes are drawn over every picture in image pixels (``Panel.evidence_boxes``, ``Panel.answer_boxes``):
evidence boxes (TextVQA's OCR tokens, RefCOCO's target) framed solid in the evidence colour, the model's answer box
(RefCOCO's prediction) framed dashed in its own colour, each labelled (an OCR word, an IoU). The legend names the
evidence outline in the task's words (``Panel.evidence_label``).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from prune_audit.data.boxes import Box
from prune_audit.data.geometry import TokenGeometry, token_index_map
from prune_audit.data.multigrid import grid_names, grid_pieces
from prune_audit.safety.atomic import write_bytes_atomic

KEPT_OUTLINE = (255, 221, 0)
MASK_OUTLINE = (0, 200, 255)
MERGED_HATCH = (255, 40, 200)
ANSWER_OUTLINE = (40, 255, 40)
"""The model's answer box (dashed): green, unlike the yellow kept cells, the cyan evidence and the magenta hatch."""
PRUNED_DIM = 0.25
MERGED_DIM = 0.6
HATCH_OPACITY = 0.55
OUTSIDE_BASE = 150.0
OUTSIDE_CONTRAST = 0.3
"""Cropped-away pixels become grey OUTSIDE_BASE + OUTSIDE_CONTRAST * brightness: light and colourless,
unlike the dark pruned cells, with just enough contrast to recognise the scene."""
MERGED_NOTE = "Cells carried only by merged tokens (hatched) count towards retention: the model still sees them, mixed."


def kept_pixels(geometry: TokenGeometry, kept: Sequence[int] | np.ndarray) -> np.ndarray:
    """(H, W) bool: pixels whose token is in ``kept``."""
    index = token_index_map(geometry)
    selected = np.zeros(geometry.num_tokens + 1, dtype=bool)  # last slot: pixels of no token (-1)
    selected[np.asarray(kept, dtype=np.int64)] = True
    return selected[index]


def dim_pruned(
    image: np.ndarray,
    geometry: TokenGeometry,
    kept: Sequence[int] | np.ndarray,
    merged: Sequence[int] | np.ndarray = (),
    dim: float = PRUNED_DIM,
    merged_dim: float = MERGED_DIM,
) -> np.ndarray:
    """(H, W, 3) uint8 copy of ``image``: pixels of the ``kept`` tokens as they are, those of the
    ``merged`` cells (carried only by merged tokens) scaled by ``merged_dim``, all others by ``dim``."""
    if image.shape[:2] != (geometry.image_height, geometry.image_width):
        raise ValueError(f"image shape {image.shape[:2]} does not match the geometry's (H, W)")
    keep = kept_pixels(geometry, kept)
    carried = kept_pixels(geometry, merged) & ~keep
    outside = outside_view(geometry)
    out = image.astype(np.float32)
    out[~keep & ~carried & ~outside] *= dim
    out[carried] *= merged_dim
    out[outside] = OUTSIDE_BASE + OUTSIDE_CONTRAST * out[outside].mean(axis=-1, keepdims=True)
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def outside_view(geometry: TokenGeometry) -> np.ndarray:
    """(H, W) bool: pixels no token sees (cropped away by the model's preprocessing); with several
    token grids, pixels no grid sees."""
    return np.logical_and.reduce([token_index_map(grid) < 0 for _, grid in grid_pieces(geometry)])


def hatching(shape: tuple[int, int]) -> np.ndarray:
    """(H, W) bool thin diagonal stripes, about one pixel in ten, spaced for a picture shown about 330 px wide:
    sparse enough that a panel whose every dropped cell is merged (VisionZip) still shows its image."""
    height, width = shape
    period = max(10, round(max(height, width) / 30))
    rows, columns = np.indices((height, width))
    return (rows + columns) % period < max(1, period // 10)


def merged_hatch(
    geometry: TokenGeometry, merged: Sequence[int] | np.ndarray, kept: Sequence[int] | np.ndarray
) -> np.ndarray:
    """(H, W) bool: the hatch pixels of the cells carried only by merged tokens (``merged`` not in ``kept``)."""
    carried = kept_pixels(geometry, merged) & ~kept_pixels(geometry, kept)
    return carried & hatching(carried.shape)


def outline(mask: np.ndarray) -> np.ndarray:
    """(H, W) bool: pixels of ``mask`` with a 4-neighbour outside it (the mask's boundary)."""
    mask = mask.astype(bool)
    padded = np.pad(mask, 1, constant_values=False)
    interior = padded[:-2, 1:-1] & padded[2:, 1:-1] & padded[1:-1, :-2] & padded[1:-1, 2:]
    return mask & ~interior


def pixel_span(low: float, high: float) -> tuple[int, int]:
    """[start, stop) of the pixel rows or columns whose centre lies in [low, high), unclipped (the pixel-centre rule
    of ``data.geometry`` and ``data.textvqa.box_mask``)."""
    return math.ceil(low - 0.5), math.ceil(high - 0.5)


def box_line_width(shape: tuple[int, int]) -> int:
    """Frame width in image pixels: about 1.5 screen pixels once the picture is shown about 330 px wide."""
    return max(1, round(max(shape) / 250))


def box_outline(shape: tuple[int, int], box: Box, width: int = 1, dash: int = 0) -> np.ndarray:
    """(H, W) bool: a frame ``width`` pixels thick just inside ``box`` (image pixels), clipped to the image; a side
    past the image edge is not drawn (the frame never pretends the box ends at the border). ``dash`` > 0: runs of
    ``dash`` pixels on and off along each side. Empty for a box of no area or outside the image."""
    (top, bottom), (left, right) = pixel_span(box.y1, box.y2), pixel_span(box.x1, box.x2)
    if bottom <= top or right <= left:
        return np.zeros(shape, dtype=bool)
    rows, columns = np.indices(shape)
    inside = (rows >= top) & (rows < bottom) & (columns >= left) & (columns < right)
    horizontal = (rows < top + width) | (rows >= bottom - width)
    vertical = (columns < left + width) | (columns >= right - width)
    frame = inside & (horizontal | vertical)
    if dash > 0:
        along = np.where(horizontal, columns - left, rows - top)  # the position along the side the pixel is on
        frame &= (along // dash) % 2 == 0
    return frame


def kept_token_borders(geometry: TokenGeometry, kept: Sequence[int] | np.ndarray) -> np.ndarray:
    """(H, W) bool: boundary pixels of the kept region (for a crisp edge around kept cells)."""
    return outline(kept_pixels(geometry, kept))


@dataclass
class Panel:
    """One picture: an image with one or more kept sets (one row per stage)."""

    title: str
    geometry: TokenGeometry
    stages: list[list[int]]
    stage_labels: list[str] = field(default_factory=list)
    caption: str = ""
    mask: np.ndarray | None = None
    merged: list[list[int]] = field(default_factory=list)
    """Per stage, the grid cells its merged tokens carry (empty, or missing, without merging)."""
    stage_notes: dict[int, str] = field(default_factory=dict)
    """Text under one stage's cell (e.g. the retention of the stage it was measured at), above any caption."""
    evidence_label: str = "queried object"
    """What the evidence outline shows, in the legend's words (``visualize --run``: its task's ``evidence_label``)."""
    evidence_boxes: list[tuple[str, Box]] = field(default_factory=list)
    """(label, box in image pixels) of each evidence box, framed solid in MASK_OUTLINE (an empty label: none)."""
    answer_boxes: list[tuple[str, Box]] = field(default_factory=list)
    """(label, box in image pixels) of the model's answer boxes, framed dashed in ANSWER_OUTLINE."""
    image: np.ndarray | None = None
    """(H, W, 3) uint8 picture this panel draws over instead of the figure's image (a clip's frame; every panel's
    the same size as the figure's); None: the figure's image."""

    def merged_cells(self, stage: int) -> list[int]:
        return self.merged[stage] if stage < len(self.merged) else []

    def under(self, stage: int) -> str:
        """The text under ``stage``'s cell: its stage note, then the caption under the last stage."""
        lines = [self.stage_notes.get(stage, ""), self.caption if stage == len(self.stages) - 1 else ""]
        return "\n".join(line for line in lines if line)

    def title_lines(self, stage: int) -> int:
        """Lines of ``stage``'s cell title: the panel's title (a task's note included), then the stage label."""
        label = self.stage_labels[stage] if stage < len(self.stage_labels) else ""
        return len(self.wrapped_title.splitlines()) + len(label.splitlines())

    @property
    def wrapped_title(self) -> str:
        """The title wrapped to a cell's width (a composed selector's budget words run long)."""
        return "\n".join(wrapped(self.title, CAPTION_CHARS))

    def has_merged_only_cells(self) -> bool:
        """Whether some stage draws a cell that only a merged token carries."""
        return any(set(self.merged_cells(stage)) - set(kept) for stage, kept in enumerate(self.stages))


def grid_panels(panel: Panel) -> list[Panel]:
    """``panel`` itself when its geometry is one token grid; else one panel per grid, in token order.

    Each grid's panel holds that grid's kept and merged tokens renumbered from 0, its stage labels
    say how many of the grid's tokens each stage keeps, the stage notes (the image's retention)
    go under the first grid's pictures and the caption under the last grid's.
    """
    pieces = grid_pieces(panel.geometry)
    if len(pieces) == 1:
        return [panel]
    last = len(pieces) - 1
    panels = []
    for index, ((start, grid), name) in enumerate(zip(pieces, grid_names(panel.geometry))):

        def local(cells: Sequence[int], start: int = start, stop: int = start + grid.num_tokens) -> list[int]:
            return [cell - start for cell in cells if start <= cell < stop]

        stages = [local(kept) for kept in panel.stages]
        labels = [
            "\n".join(
                filter(
                    None,
                    [
                        panel.stage_labels[stage] if stage < len(panel.stage_labels) else "",
                        f"{name}: {len(kept)} of {grid.num_tokens} kept",
                    ],
                )
            )
            for stage, kept in enumerate(stages)
        ]
        panels.append(
            Panel(
                panel.title,
                grid,
                stages,
                labels,
                panel.caption if index == last else "",
                panel.mask,
                [local(cells) for cells in panel.merged],
                stage_notes=panel.stage_notes if index == 0 else {},
                evidence_label=panel.evidence_label,
                evidence_boxes=panel.evidence_boxes,
                answer_boxes=panel.answer_boxes,
                image=panel.image,
            )
        )
    return panels


def compose(image: np.ndarray, panel: Panel, stage: int) -> np.ndarray:
    """(H, W, 3) uint8 picture of ``panel``'s ``stage``: dimmed pruned area, hatched merged-only cells,
    kept borders, mask outline, evidence boxes (solid) and answer boxes (dashed); over ``panel.image`` when it has
    one, else over ``image``."""
    kept, merged = panel.stages[stage], panel.merged_cells(stage)
    picture = dim_pruned(image if panel.image is None else panel.image, panel.geometry, kept, merged)
    hatch = merged_hatch(panel.geometry, merged, kept)
    picture[hatch] = np.rint(HATCH_OPACITY * np.array(MERGED_HATCH) + (1 - HATCH_OPACITY) * picture[hatch])
    picture[kept_token_borders(panel.geometry, kept)] = KEPT_OUTLINE
    if panel.mask is not None:
        picture[outline(panel.mask)] = MASK_OUTLINE
    shape, width = picture.shape[:2], box_line_width(picture.shape[:2])
    for _, box in panel.evidence_boxes:
        picture[box_outline(shape, box, width)] = MASK_OUTLINE
    for _, box in panel.answer_boxes:
        picture[box_outline(shape, box, width, dash=4 * width)] = ANSWER_OUTLINE
    return picture


BOX_LABEL_MARGIN = 0.08
"""A box label goes outside its box (above an evidence box, below an answer box) unless the box lies within this
share of the image height of the edge; then it goes inside."""


class BoxLabel(NamedTuple):
    """Where ``label_boxes`` writes a box's label: the anchor in image pixels, its alignment, text and colour."""

    x: float
    y: float
    ha: str
    va: str
    text: str
    colour: tuple[int, int, int]


def box_labels(panel: Panel, shape: tuple[int, int]) -> list[BoxLabel]:
    """The label of every labelled box of ``panel`` that shows in an image of ``shape`` (H, W): an evidence box's
    on its top edge, an answer box's on its bottom edge (a target and a prediction that overlap keep their labels
    apart), each from the box's left corner, or its right one for a box starting in the image's right third."""
    height, width = shape
    margin = BOX_LABEL_MARGIN * height
    labels = []
    for boxes, colour, top in ((panel.evidence_boxes, MASK_OUTLINE, True), (panel.answer_boxes, ANSWER_OUTLINE, False)):
        for text, box in boxes:
            if not text or not box_outline(shape, box).any():
                continue
            left = box.x1 < 2 * width / 3
            x = min(max(box.x1 if left else box.x2, 0.0), float(width))
            y = min(max(box.y1 if top else box.y2, 0.0), float(height))
            outside = y > margin if top else y < height - margin
            va = "bottom" if outside == top else "top"
            labels.append(BoxLabel(x, y, "left" if left else "right", va, text, colour))
    return labels


MAX_COLUMNS = 4
"""Pictures per row of a figure: each stays about 330 px wide, readable at 100 % zoom."""

CELL_INCHES = 3.0
DPI = 110
NOTE_CHARS_PER_INCH = 15
CAPTION_CHARS = 45
"""About how many characters of the 9-pt text under a cell fit its width (a long caption wraps, never overflows)."""
"""About how many characters of the 8-pt note fit in an inch of figure width."""
NOTE_LINE_INCHES = 0.15


def grid_shape(pictures: int, max_columns: int = MAX_COLUMNS) -> tuple[int, int]:
    """(rows, columns) of the grid holding ``pictures`` cells, at most ``max_columns`` per row."""
    columns = max(1, min(max_columns, pictures))
    return -(-pictures // columns), columns


def wrapped(text: str, width: int) -> list[str]:
    """``text``'s lines wrapped at ``width`` characters (none for empty text)."""
    import textwrap

    return [line for paragraph in text.splitlines() for line in textwrap.wrap(paragraph, width) or [""]]


def figure_note(panels: Sequence[Panel], note: str = "") -> str:
    """``note``, after the legend of the merged-only cells when any panel draws some."""
    if not any(panel.has_merged_only_cells() for panel in panels):
        return note
    return MERGED_NOTE + (f"\n{note}" if note else "")


def legend_entries(panels: Sequence[Panel]) -> list[tuple[str, dict]]:
    """(label, patch style) of every look the figure draws: kept and dropped cells always; the evidence outline
    (named by the first such panel's ``evidence_label``), the answer box, cropped-away pixels and merged-only cells
    when some panel draws them."""
    colour = lambda rgb, scale=1.0: tuple(scale * c / 255 for c in rgb)  # noqa: E731
    entries = [
        ("kept (yellow outline)", {"facecolor": "0.85", "edgecolor": colour(KEPT_OUTLINE), "linewidth": 2}),
        ("dropped (dimmed)", {"facecolor": colour((200, 200, 200), PRUNED_DIM), "edgecolor": "none"}),
    ]
    evidence = [panel for panel in panels if (panel.mask is not None and panel.mask.any()) or panel.evidence_boxes]
    if evidence:
        entries.append(
            (
                f"{evidence[0].evidence_label} (cyan outline)",
                {"facecolor": "none", "edgecolor": colour(MASK_OUTLINE), "linewidth": 2},
            )
        )
    if any(panel.answer_boxes for panel in panels):
        entries.append(
            (
                "the model's box (green, dashed)",
                {"facecolor": "none", "edgecolor": colour(ANSWER_OUTLINE), "linewidth": 2, "linestyle": "--"},
            )
        )
    if any(outside_view(panel.geometry).any() for panel in panels):
        grey = (OUTSIDE_BASE + OUTSIDE_CONTRAST * 128) / 255
        entries.append(
            ("cropped away by the model's preprocessing (grey)", {"facecolor": (grey, grey, grey), "edgecolor": "none"})
        )
    if any(panel.has_merged_only_cells() for panel in panels):
        entries.append(
            (
                "only in merged tokens (half-dimmed, hatched)",
                {"facecolor": colour((200, 200, 200), MERGED_DIM), "edgecolor": colour(MERGED_HATCH), "hatch": "///"},
            )
        )
    return entries


def label_boxes(axis: Any, panel: Panel, shape: tuple[int, int]) -> None:
    """Write ``box_labels`` on ``axis`` (8 pt, black on the box's colour, clipped to the picture)."""
    for label in box_labels(panel, shape):
        bbox = {"facecolor": tuple(c / 255 for c in label.colour), "edgecolor": "none", "alpha": 0.85, "pad": 1.0}
        axis.text(
            label.x, label.y, label.text, fontsize=8, color="black", ha=label.ha, va=label.va, clip_on=True, bbox=bbox
        )


LEGEND_ROW_INCHES = 0.2


def legend_columns(grid_columns: int) -> int:
    """Legend entries per row: as many as the grid has columns, at most 3 (each label needs about 3 inches)."""
    return max(1, min(3, grid_columns))


def draw_panels(image: np.ndarray, panels: Sequence[Panel], path: Path, suptitle: str = "", note: str = "") -> Path:
    """Save every stage of every panel as one cell of a grid (row-major, <= 4 per row) to ``path``.

    Progressive selectors take one cell per stage, in order; each cell is titled with its
    panel's title and stage label; under it are its stage note and, under the last stage,
    the panel's caption; a legend of every look drawn (``legend_entries``) and ``note`` go under
    the grid (e.g. the selectors not drawn, and why), after the legend of the merged-only cells
    when any panel draws some. PNG or SVG by suffix.
    """
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    panels = [piece for panel in panels for piece in grid_panels(panel)]
    note = figure_note(panels, note)
    cells = [(panel, stage) for panel in panels for stage in range(len(panel.stages))]
    rows, columns = grid_shape(len(cells))
    height, width = image.shape[:2]
    title_lines = max(panel.title_lines(stage) for panel, stage in cells)
    cell_height = CELL_INCHES * height / width + 1.3 + 0.15 * max(0, title_lines - 2)  # titles, three-line captions
    figure_width = columns * CELL_INCHES + 0.3
    note_lines = wrapped(note, int(figure_width * NOTE_CHARS_PER_INCH))
    entries = legend_entries(panels)
    legend_height = -(-len(entries) // legend_columns(columns)) * LEGEND_ROW_INCHES + 0.15
    note_height = (len(note_lines) * NOTE_LINE_INCHES + 0.1 if note_lines else 0.0) + legend_height
    figure_height = rows * cell_height + 0.5 + note_height
    figure = Figure(figsize=(figure_width, figure_height))
    axes = figure.subplots(rows, columns, squeeze=False)
    for axis in axes.ravel():
        axis.axis("off")
    for axis, (panel, stage) in zip(axes.ravel(), cells):
        axis.axis("on")
        axis.set_xticks([])
        axis.set_yticks([])
        axis.imshow(compose(image, panel, stage), interpolation="nearest")
        label_boxes(axis, panel, image.shape[:2])
        label = panel.stage_labels[stage] if stage < len(panel.stage_labels) else ""
        axis.set_title(panel.wrapped_title + (f"\n{label}" if label else ""), fontsize=9)
        axis.set_xlabel("\n".join(wrapped(panel.under(stage), CAPTION_CHARS)), fontsize=9)
    if suptitle:
        figure.suptitle(suptitle, fontsize=10)
    handles = [Patch(label=label, **style) for label, style in entries]
    bottom = (note_height - legend_height + 0.05) / figure_height
    figure.legend(
        handles=handles,
        loc="lower center",
        bbox_to_anchor=(0.5, bottom),
        ncols=legend_columns(columns),
        fontsize=8,
        frameon=False,
    )
    if note_lines:
        figure.text(0.01, 0.005, "\n".join(note_lines), fontsize=8, ha="left", va="bottom")
    figure.tight_layout(rect=(0, note_height / figure_height, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    figure.savefig(buffer, dpi=DPI, format=path.suffix.lstrip(".").lower() or "png")
    return write_bytes_atomic(buffer.getvalue(), path)  # never a half-written figure under its name
