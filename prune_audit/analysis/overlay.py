"""Kept-token overlays on the original image, with the model's exact token geometry.

Every original pixel belongs to the token whose footprint contains its centre
(``prune_audit.data.geometry.token_index_map``), so padding, centre crops and Qwen's
resizing are drawn exactly as the model saw them: pixels of pruned tokens, and
pixels the preprocessing cropped away, are dimmed; pixels of kept tokens keep their
colour; pixels of cells that only a merged token carries (VisionZip's contextual
tokens, SparseVLM's recycled ones: the records' ``merged_stages``) are half-dimmed
and hatched.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prune_audit.data.geometry import TokenGeometry, token_index_map

KEPT_OUTLINE = (255, 221, 0)
MASK_OUTLINE = (0, 200, 255)
MERGED_HATCH = (255, 40, 200)
PRUNED_DIM = 0.25
MERGED_DIM = 0.6
HATCH_OPACITY = 0.7
MERGED_NOTE = (
    "Bright, yellow outline: kept cells. Half-dimmed, magenta hatching: cells carried only by merged tokens "
    "(they count towards retention). Dimmed: dropped."
)


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
    out = image.astype(np.float32)
    out[~keep & ~carried] *= dim
    out[carried] *= merged_dim
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


def hatching(shape: tuple[int, int]) -> np.ndarray:
    """(H, W) bool diagonal stripes, one pixel in four, spaced for a picture shown about 330 px wide."""
    height, width = shape
    period = max(8, round(max(height, width) / 40))
    rows, columns = np.indices((height, width))
    return (rows + columns) % period < period // 4


def merged_hatch(geometry: TokenGeometry, merged: Sequence[int] | np.ndarray, kept: Sequence[int] | np.ndarray) -> np.ndarray:
    """(H, W) bool: the hatch pixels of the cells carried only by merged tokens (``merged`` not in ``kept``)."""
    carried = kept_pixels(geometry, merged) & ~kept_pixels(geometry, kept)
    return carried & hatching(carried.shape)


def outline(mask: np.ndarray) -> np.ndarray:
    """(H, W) bool: pixels of ``mask`` with a 4-neighbour outside it (the mask's boundary)."""
    mask = mask.astype(bool)
    padded = np.pad(mask, 1, constant_values=False)
    interior = padded[:-2, 1:-1] & padded[2:, 1:-1] & padded[1:-1, :-2] & padded[1:-1, 2:]
    return mask & ~interior


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

    def merged_cells(self, stage: int) -> list[int]:
        return self.merged[stage] if stage < len(self.merged) else []

    def has_merged_only_cells(self) -> bool:
        """Whether some stage draws a cell that only a merged token carries."""
        return any(set(self.merged_cells(stage)) - set(kept) for stage, kept in enumerate(self.stages))


def compose(image: np.ndarray, panel: Panel, stage: int) -> np.ndarray:
    """(H, W, 3) uint8 picture of ``panel``'s ``stage``: dimmed pruned area, hatched merged-only cells,
    kept borders, mask outline."""
    kept, merged = panel.stages[stage], panel.merged_cells(stage)
    picture = dim_pruned(image, panel.geometry, kept, merged)
    hatch = merged_hatch(panel.geometry, merged, kept)
    picture[hatch] = np.rint(HATCH_OPACITY * np.array(MERGED_HATCH) + (1 - HATCH_OPACITY) * picture[hatch])
    picture[kept_token_borders(panel.geometry, kept)] = KEPT_OUTLINE
    if panel.mask is not None:
        picture[outline(panel.mask)] = MASK_OUTLINE
    return picture


MAX_COLUMNS = 4
"""Pictures per row of a figure: each stays about 330 px wide, readable at 100 % zoom."""

CELL_INCHES = 3.0
DPI = 110
NOTE_CHARS_PER_INCH = 15
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


def draw_panels(image: np.ndarray, panels: Sequence[Panel], path: Path, suptitle: str = "", note: str = "") -> Path:
    """Save every stage of every panel as one cell of a grid (row-major, <= 4 per row) to ``path``.

    Progressive selectors take one cell per stage, in order; each cell is titled with its
    panel's title and stage label; the panel's caption sits under its last stage; ``note``
    goes under the grid (e.g. the selectors that could not run, and why), after the legend of the
    merged-only cells when any panel draws some. PNG or SVG by suffix.
    """
    from matplotlib.figure import Figure

    note = figure_note(panels, note)
    cells = [(panel, stage) for panel in panels for stage in range(len(panel.stages))]
    rows, columns = grid_shape(len(cells))
    height, width = image.shape[:2]
    cell_height = CELL_INCHES * height / width + 1.1  # room for two-line titles and captions
    figure_width = columns * CELL_INCHES + 0.3
    note_lines = wrapped(note, int(figure_width * NOTE_CHARS_PER_INCH))
    note_height = len(note_lines) * NOTE_LINE_INCHES + 0.1 if note_lines else 0.0
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
        label = panel.stage_labels[stage] if stage < len(panel.stage_labels) else ""
        axis.set_title(panel.title + (f"\n{label}" if label else ""), fontsize=8)
        if stage == len(panel.stages) - 1 and panel.caption:
            axis.set_xlabel(panel.caption, fontsize=8)
    if suptitle:
        figure.suptitle(suptitle, fontsize=10)
    if note_lines:
        figure.text(0.01, 0.005, "\n".join(note_lines), fontsize=8, ha="left", va="bottom")
    figure.tight_layout(rect=(0, note_height / figure_height, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=DPI)
    return path
