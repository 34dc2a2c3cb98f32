"""InternVL's dynamic tiles: which tile grid an image gets, and that grid's tokens numbered tile by tile.

``GotOcr2ImageProcessor.crop_image_to_patches`` (transformers 5.24, the InternVL processors with
``crop_to_patches``) resizes an image, aspect not kept, to ``cols x rows`` square tiles
(:func:`tiled_canvas`) and cuts them row-major; the model reads each tile's tokens row-major, tile after
tile (:class:`TiledGrid`). ``data.multigrid.internvl_geometry`` adds the thumbnail grid.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from prune_audit.data.geometry import TokenGeometry, mask_area_per_token, token_footprints, token_index_map
from prune_audit.errors import PruneAuditError


def tiled_canvas(image_size: tuple[int, int], tile: tuple[int, int], min_tiles: int, max_tiles: int) -> tuple[int, int]:
    """(cols, rows) of InternVL's tile grid for an image of ``image_size`` (width, height) and (height, width) tiles.

    Re-implemented from the rule of transformers 5.24 ``get_optimal_tiled_canvas`` (``models/got_ocr2``, what
    the InternVL ``-hf`` processors run) and of the official ``find_closest_aspect_ratio`` / ``dynamic_preprocess``
    (OpenGVLab/InternVL ``internvl_chat/internvl/train/dataset.py``, 1831ceb9; InternVL3 chats with
    ``max_dynamic_patch`` 12 and the thumbnail on): among the (cols, rows) with
    ``min_tiles <= cols * rows <= max_tiles``, ordered by tile count, the one whose aspect ratio ``cols / rows`` is
    closest to the image's; on a tie, a later (more tiles) grid wins while the image's area exceeds half of that
    grid's pixels. Grids of one tile count are visited with fewer columns first, as transformers does; the official
    code visits them in Python set order, which matters only on an exact tie between two grids of the same tile
    count (the image's ratio halfway between theirs). With ``min_tiles`` 1 (every released processor) another grid
    is always strictly closer there, so no image reaches such a tie (checked exactly for ``max_tiles`` up to 40);
    with a larger ``min_tiles`` one can (a 5:4 image at exactly 2 tiles), and this follows transformers.
    """
    width, height = image_size
    tile_h, tile_w = tile
    grids = sorted(
        (
            (cols, rows)
            for cols in range(1, max_tiles + 1)
            for rows in range(1, max_tiles + 1)
            if min_tiles <= cols * rows <= max_tiles
        ),
        key=lambda grid: grid[0] * grid[1],
    )
    best, best_diff = (1, 1), math.inf
    for cols, rows in grids:
        diff = abs(width / height - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and width * height > 0.5 * tile_h * tile_w * cols * rows:
            best = (cols, rows)
    return best


@dataclass(frozen=True)
class TiledGrid:
    """A regular token grid over an image cut into square tiles, its tokens numbered tile by tile.

    InternVL's tiles: the image resized to the canvas of ``tile_rows x tile_cols`` tiles is one row-major grid of
    tokens (``canvas``), but the language model reads tile 0's tokens row-major, then tile 1's, ..., tiles in
    row-major order over the canvas.

    Attributes:
        mode: ``internvl_tiles``.
        canvas: the whole canvas's row-major grid (``hf_crop`` without its crop: a plain resize).
        tile_rows, tile_cols: tiles down and across the canvas; each holds ``canvas.grid_rows // tile_rows`` x
            ``canvas.grid_cols // tile_cols`` tokens.
    """

    mode: str
    canvas: TokenGeometry
    tile_rows: int
    tile_cols: int

    def __post_init__(self) -> None:
        if (
            min(self.tile_rows, self.tile_cols) <= 0
            or self.canvas.grid_rows % self.tile_rows
            or (self.canvas.grid_cols % self.tile_cols)
        ):
            raise PruneAuditError(
                f"a {self.canvas.grid_rows}x{self.canvas.grid_cols} token canvas does not split "
                f"into {self.tile_rows}x{self.tile_cols} tiles"
            )

    @property
    def tile_grid(self) -> tuple[int, int]:
        """(rows, cols) of tokens in one tile."""
        return (self.canvas.grid_rows // self.tile_rows, self.canvas.grid_cols // self.tile_cols)

    @property
    def grid(self) -> tuple[int, int]:
        """(1, N): numbered tile by tile, the tokens have no row-major (rows, cols) layout."""
        return (1, self.num_tokens)

    @property
    def num_tokens(self) -> int:
        return self.canvas.num_tokens

    @property
    def image_size(self) -> tuple[int, int]:
        return self.canvas.image_size

    @property
    def image_width(self) -> int:
        return self.canvas.image_width

    @property
    def image_height(self) -> int:
        return self.canvas.image_height

    def canvas_order(self) -> np.ndarray:
        """(N,) int64 row-major canvas token of each token, in tile-by-tile order."""
        rows, cols = self.tile_grid
        tile, within = np.divmod(np.arange(self.num_tokens), rows * cols)
        tile_row, tile_col = np.divmod(tile, self.tile_cols)
        row, col = np.divmod(within, cols)
        return ((tile_row * rows + row) * self.canvas.grid_cols + tile_col * cols + col).astype(np.int64)

    def index_map(self) -> np.ndarray:
        """(H, W) int64 token of every original pixel (by its centre); read-only (every pixel has one)."""
        numbering = np.empty(self.num_tokens, dtype=np.int64)
        numbering[self.canvas_order()] = np.arange(self.num_tokens)
        canvas = token_index_map(self.canvas)
        index = np.where(canvas >= 0, numbering[canvas.clip(0)], -1)
        index.flags.writeable = False
        return index

    def footprints(self) -> np.ndarray:
        """(N, 4) float64 boxes (x0, y0, x1, y1), tile by tile."""
        return token_footprints(self.canvas)[self.canvas_order()]

    def mask_areas(self, mask: np.ndarray) -> np.ndarray:
        """(N,) int64 mask pixels whose centre lies in each token's footprint, tile by tile."""
        return mask_area_per_token(mask, self.canvas)[self.canvas_order()]

    def to_dict(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "canvas": self.canvas.to_dict(),
            "tile_rows": self.tile_rows,
            "tile_cols": self.tile_cols,
        }


__all__ = ["TiledGrid", "tiled_canvas"]
