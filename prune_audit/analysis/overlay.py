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


def draw_panels(image: np.ndarray, panels: Sequence[Panel], path: Path, suptitle: str = "") -> Path:
    """Save one column per panel and one row per stage to ``path`` (PNG or SVG by suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = max(len(p.stages) for p in panels)
    height, width = image.shape[:2]
    scale = 3.2 / max(height, width)
    figure, axes = plt.subplots(
        rows, len(panels), figsize=(len(panels) * width * scale + 0.4, rows * (height * scale + 0.9)), squeeze=False
    )
    for column, panel in enumerate(panels):
        for row in range(rows):
            axis = axes[row][column]
            axis.set_xticks([])
            axis.set_yticks([])
            if row >= len(panel.stages):
                axis.axis("off")
                continue
            axis.imshow(compose(image, panel, row), interpolation="nearest")
            label = panel.stage_labels[row] if row < len(panel.stage_labels) else ""
            axis.set_title(panel.title + (f"\n{label}" if label else ""), fontsize=8)
            if row == len(panel.stages) - 1 and panel.caption:
                axis.set_xlabel(panel.caption, fontsize=8)
    if suptitle:
        figure.suptitle(suptitle, fontsize=9)
    figure.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=150)
    plt.close(figure)
    return path
