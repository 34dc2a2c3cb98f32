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
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from prune_audit.data.geometry import TokenGeometry, token_index_map
from prune_audit.data.multigrid import grid_names, grid_pieces
from prune_audit.safety.atomic import write_bytes_atomic

KEPT_OUTLINE = (255, 221, 0)
MASK_OUTLINE = (0, 200, 255)
MERGED_HATCH = (255, 40, 200)
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

    def merged_cells(self, stage: int) -> list[int]:
        return self.merged[stage] if stage < len(self.merged) else []

    def under(self, stage: int) -> str:
        """The text under ``stage``'s cell: its stage note, then the caption under the last stage."""
        lines = [self.stage_notes.get(stage, ""), self.caption if stage == len(self.stages) - 1 else ""]
        return "\n".join(line for line in lines if line)

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
            )
        )
    return panels


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


def legend_entries(panels: Sequence[Panel]) -> list[tuple[str, dict]]:
    """(label, patch style) of every look the figure draws: kept and dropped cells always; the object
    outline, cropped-away pixels and merged-only cells when some panel draws them."""
    colour = lambda rgb, scale=1.0: tuple(scale * c / 255 for c in rgb)  # noqa: E731
    entries = [
        ("kept (yellow outline)", {"facecolor": "0.85", "edgecolor": colour(KEPT_OUTLINE), "linewidth": 2}),
        ("dropped (dimmed)", {"facecolor": colour((200, 200, 200), PRUNED_DIM), "edgecolor": "none"}),
    ]
    if any(panel.mask is not None and panel.mask.any() for panel in panels):
        entries.append(
            ("queried object (cyan outline)", {"facecolor": "none", "edgecolor": colour(MASK_OUTLINE), "linewidth": 2})
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
    title_lines = max(
        1 + len(panel.stage_labels[stage].splitlines()) if stage < len(panel.stage_labels) else 1
        for panel, stage in cells
    )
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
        label = panel.stage_labels[stage] if stage < len(panel.stage_labels) else ""
        axis.set_title(panel.title + (f"\n{label}" if label else ""), fontsize=9)
        if panel.under(stage):
            axis.set_xlabel(panel.under(stage), fontsize=9)
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
