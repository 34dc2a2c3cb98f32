"""Kept-token overlays on the original image, with the model's exact token geometry.

Every original pixel belongs to the token whose footprint contains its centre
(``prune_audit.data.geometry.token_index_map``), so padding, centre crops and Qwen's
resizing are drawn exactly as the model saw them: pixels of pruned tokens, and
pixels the preprocessing cropped away, are dimmed; pixels of kept tokens keep their
colour.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prune_audit.data.geometry import TokenGeometry, token_index_map

KEPT_OUTLINE = (255, 221, 0)
MASK_OUTLINE = (0, 200, 255)


def kept_pixels(geometry: TokenGeometry, kept: Sequence[int] | np.ndarray) -> np.ndarray:
    """(H, W) bool: pixels whose token is in ``kept``."""
    index = token_index_map(geometry)
    selected = np.zeros(geometry.num_tokens + 1, dtype=bool)  # last slot: pixels of no token (-1)
    selected[np.asarray(kept, dtype=np.int64)] = True
    return selected[index]


def dim_pruned(image: np.ndarray, geometry: TokenGeometry, kept: Sequence[int] | np.ndarray, dim: float = 0.25) -> np.ndarray:
    """(H, W, 3) uint8 copy of ``image`` with every pixel outside the kept tokens scaled by ``dim``."""
    if image.shape[:2] != (geometry.image_height, geometry.image_width):
        raise ValueError(f"image shape {image.shape[:2]} does not match the geometry's (H, W)")
    keep = kept_pixels(geometry, kept)
    out = image.astype(np.float32)
    out[~keep] *= dim
    return np.clip(np.rint(out), 0, 255).astype(np.uint8)


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


def compose(image: np.ndarray, panel: Panel, stage: int) -> np.ndarray:
    """(H, W, 3) uint8 picture of ``panel``'s ``stage``: dimmed pruned area, kept borders, mask outline."""
    picture = dim_pruned(image, panel.geometry, panel.stages[stage])
    picture[kept_token_borders(panel.geometry, panel.stages[stage])] = KEPT_OUTLINE
    if panel.mask is not None:
        picture[outline(panel.mask)] = MASK_OUTLINE
    return picture


MAX_COLUMNS = 4
"""Pictures per row of a figure: each stays about 330 px wide, readable at 100 % zoom."""

CELL_INCHES = 3.0
DPI = 110


def grid_shape(pictures: int, max_columns: int = MAX_COLUMNS) -> tuple[int, int]:
    """(rows, columns) of the grid holding ``pictures`` cells, at most ``max_columns`` per row."""
    columns = max(1, min(max_columns, pictures))
    return -(-pictures // columns), columns


def draw_panels(image: np.ndarray, panels: Sequence[Panel], path: Path, suptitle: str = "", note: str = "") -> Path:
    """Save every stage of every panel as one cell of a grid (row-major, <= 4 per row) to ``path``.

    Progressive selectors take one cell per stage, in order; each cell is titled with its
    panel's title and stage label; the panel's caption sits under its last stage; ``note``
    goes under the grid (e.g. the selectors that could not run, and why). PNG or SVG by suffix.
    """
    from matplotlib.figure import Figure

    cells = [(panel, stage) for panel in panels for stage in range(len(panel.stages))]
    rows, columns = grid_shape(len(cells))
    height, width = image.shape[:2]
    cell_height = CELL_INCHES * height / width + 1.1  # room for two-line titles and captions
    figure = Figure(figsize=(columns * CELL_INCHES + 0.3, rows * cell_height + 0.5 + 0.25 * bool(note)))
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
    if note:
        figure.text(0.01, 0.005, note, fontsize=8, ha="left", va="bottom", wrap=True)
    figure.tight_layout(rect=(0, 0.03 if note else 0, 1, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=DPI)
    return path
