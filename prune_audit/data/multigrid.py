"""Images whose visual tokens form several regular grids: LLaVA-NeXT's anyres tiling.

LLaVA-NeXT (``LlavaNextImageProcessor`` + ``LlavaNextModel.pack_image_features`` in transformers
5.24, from the LLaVA-NeXT ``anyres`` / ``spatial_unpad`` design) turns one image into:

1. the **base view**: the whole image resized to the tower's square input (aspect not kept, no pad,
   no crop): one ``24 x 24`` grid of 14-px CLIP patches at 336 px (``hf_crop`` without its crop);
2. the **tiles**: the image resized, aspect kept (the side that reaches the canvas first sets the
   scale, the other side is ``ceil``-ed), into the best-resolution canvas of ``image_grid_pinpoints``
   (most effective pixels, then least waste), centred on zero padding, cut into 336-px tiles whose
   patch grids join row-major into one ``(rows * 24) x (cols * 24)`` grid; the model then unpads it,
   removing ``(grid - round(image side * grid / other image side)) // 2`` patch rows (or columns) at
   each end of the padded axis (the ``anyres_tiles`` mode).

Visual tokens are numbered base view first (576), then the unpadded tile grid row-major. The model
also puts one ``image_newline`` embedding after every row of the tile grid: those are not visual
tokens (no pixels) and have no index here. Every pixel of the image belongs to one token of each grid.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from prune_audit.data.geometry import TokenGeometry, clip_geometry, mask_area_per_token, token_footprints
from prune_audit.errors import PruneAuditError


@dataclass(frozen=True)
class MultiGridGeometry:
    """Several token grids over one image, their tokens numbered grid after grid.

    Attributes:
        mode: the preprocessing (``llava_next_anyres``).
        grids: the grids in token order; grid ``g`` holds tokens ``offsets[g]`` to ``offsets[g] + its N - 1``.
    """

    mode: str
    grids: tuple[TokenGeometry, ...]

    def __post_init__(self) -> None:
        if not self.grids or len({grid.image_size for grid in self.grids}) != 1:
            raise PruneAuditError(f"a multi-grid geometry needs one or more grids over one image: {self}")

    @property
    def grid(self) -> tuple[int, int]:
        """(1, N): tokens of several grids have no common (rows, cols) layout."""
        return (1, self.num_tokens)

    @property
    def num_tokens(self) -> int:
        return sum(grid.num_tokens for grid in self.grids)

    @property
    def image_size(self) -> tuple[int, int]:
        """(width, height) of the original image."""
        return self.grids[0].image_size

    @property
    def image_width(self) -> int:
        return self.grids[0].image_width

    @property
    def image_height(self) -> int:
        return self.grids[0].image_height

    @property
    def offsets(self) -> tuple[int, ...]:
        """Index of each grid's first token."""
        return tuple(int(start) for start in np.cumsum([0] + [grid.num_tokens for grid in self.grids[:-1]]))

    def footprints(self) -> np.ndarray:
        """(N, 4) boxes of every token (``token_footprints`` of each grid, in token order)."""
        return np.concatenate([token_footprints(grid) for grid in self.grids])

    def mask_areas(self, mask: np.ndarray) -> np.ndarray:
        """(N,) mask pixels per token (``mask_area_per_token`` of each grid, in token order): each grid
        alone sums back to the mask area it sees, so all tokens count a mask pixel once per grid."""
        return np.concatenate([mask_area_per_token(mask, grid) for grid in self.grids])

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable fields (``geometry_from_dict`` reads them back)."""
        return {"mode": self.mode, "grids": [grid.to_dict() for grid in self.grids]}


def geometry_from_dict(fields: dict[str, Any]) -> TokenGeometry | MultiGridGeometry:
    """The geometry whose ``to_dict()`` gave ``fields`` (a record's ``geometry`` column)."""
    if "grids" in fields:
        return MultiGridGeometry(fields["mode"], tuple(TokenGeometry(**grid) for grid in fields["grids"]))
    return TokenGeometry(**fields)


def grid_pieces(geometry: TokenGeometry | MultiGridGeometry) -> list[tuple[int, TokenGeometry]]:
    """``(first token index, grid)`` of each regular grid of ``geometry`` (one for a :class:`TokenGeometry`)."""
    if isinstance(geometry, MultiGridGeometry):
        return list(zip(geometry.offsets, geometry.grids))
    return [(0, geometry)]


def best_resolution(image_size: tuple[int, int], pinpoints: Sequence[Sequence[int]]) -> tuple[int, int]:
    """(height, width) of the canvas in ``pinpoints`` ((height, width) pairs) that shows ``image_size``
    ((width, height)) with the most pixels (capped at the original count), ties to the least padding;
    the first such canvas in order (transformers ``select_best_resolution``)."""
    width, height = image_size
    best, most, least_waste = None, 0, math.inf
    for canvas_h, canvas_w in pinpoints:
        scale = min(canvas_w / width, canvas_h / height)
        effective = min(int(width * scale) * int(height * scale), width * height)
        waste = canvas_w * canvas_h - effective
        if effective > most or (effective == most and waste < least_waste):
            best, most, least_waste = (int(canvas_h), int(canvas_w)), effective, waste
    if best is None:
        raise PruneAuditError("image_grid_pinpoints is empty; the LLaVA-NeXT processor needs candidate resolutions")
    return best


@dataclass(frozen=True)
class AnyresLayout:
    """Where an image lands in LLaVA-NeXT's tiles, in processed pixels and in patches.

    Attributes:
        canvas: (height, width) of the best-resolution canvas, a whole number of tiles.
        resized: (width, height) of the image resized into it, aspect kept.
        paste: (x, y) of the resized image's top-left corner on the zero-padded canvas.
        cut: (rows, cols) of patches unpadding removes at each end of the joined patch grid.
        grid: (rows, cols) of the unpadded patch grid.
    """

    canvas: tuple[int, int]
    resized: tuple[int, int]
    paste: tuple[int, int]
    cut: tuple[int, int]
    grid: tuple[int, int]


def anyres_layout(image_size: tuple[int, int], pinpoints: Sequence[Sequence[int]], tile: int,
                  patch_size: int) -> AnyresLayout:
    """The processor's resize and padding for patching, and the model's ``unpad_image``, of ``image_size``."""
    width, height = image_size
    canvas_h, canvas_w = best_resolution(image_size, pinpoints)
    if canvas_h % tile or canvas_w % tile:
        raise PruneAuditError(f"image_grid_pinpoints canvas {canvas_h}x{canvas_w} is not a multiple of the {tile}-px tile")
    if canvas_w / width < canvas_h / height:  # the width reaches the canvas first
        resized_w, resized_h = canvas_w, min(math.ceil(height * canvas_w / width), canvas_h)
    else:
        resized_w, resized_h = min(math.ceil(width * canvas_h / height), canvas_w), canvas_h
    rows, cols = canvas_h // patch_size, canvas_w // patch_size
    cut_rows = cut_cols = 0
    if width / height > cols / rows:
        cut_rows = (rows - int(round(height * (cols / width), 7))) // 2
    else:
        cut_cols = (cols - int(round(width * (rows / height), 7))) // 2
    return AnyresLayout(canvas=(canvas_h, canvas_w), resized=(resized_w, resized_h),
                        paste=((canvas_w - resized_w) // 2, (canvas_h - resized_h) // 2), cut=(cut_rows, cut_cols),
                        grid=(rows - 2 * cut_rows, cols - 2 * cut_cols))


def anyres_geometry(
    image_size: tuple[int, int],
    *,
    pinpoints: Sequence[Sequence[int]],
    tile: int = 336,
    patch_size: int = 14,
) -> MultiGridGeometry:
    """LLaVA-NeXT's base view plus unpadded tile grid of an image of ``image_size`` (width, height).

    Args:
        pinpoints: the processor's ``image_grid_pinpoints``, (height, width) canvases, multiples of ``tile``.
        tile: side of the tower's square input (the base view and each tile), in pixels.
        patch_size: CLIP patch side; one visual token per patch.
    """
    width, height = image_size
    base = clip_geometry(image_size, mode="hf_crop", shortest_edge=None, resize_to=(tile, tile), crop_size=None,
                         patch_size=patch_size)
    layout = anyres_layout(image_size, pinpoints, tile, patch_size)
    rows, cols = layout.grid
    tiles = TokenGeometry(
        mode="anyres_tiles",
        image_width=width,
        image_height=height,
        processed_width=cols * patch_size,
        processed_height=rows * patch_size,
        grid_rows=rows,
        grid_cols=cols,
        token_pixels=patch_size,
        scale_x=layout.resized[0] / width,
        scale_y=layout.resized[1] / height,
        offset_x=float(layout.paste[0] - layout.cut[1] * patch_size),
        offset_y=float(layout.paste[1] - layout.cut[0] * patch_size),
    )
    return MultiGridGeometry("llava_next_anyres", (base, tiles))


def anyres_crop_patches(image_size: tuple[int, int], *, pinpoints: Sequence[Sequence[int]], tile: int = 336,
                        patch_size: int = 14) -> np.ndarray:
    """(N,) int64 index of each visual token of :func:`anyres_geometry` among the crops' patches flattened
    crop-major (base view, then the tiles row-major over the canvas, each tile's patches row-major)."""
    layout = anyres_layout(image_size, pinpoints, tile, patch_size)
    side = tile // patch_size  # patches per tile side
    tile_cols = layout.canvas[1] // tile
    rows = np.arange(layout.grid[0])[:, None] + layout.cut[0]  # row of each unpadded token in the joined grid
    cols = np.arange(layout.grid[1])[None, :] + layout.cut[1]
    crop = 1 + (rows // side) * tile_cols + cols // side
    within = (rows % side) * side + cols % side
    return np.concatenate([np.arange(side * side), (crop * side * side + within).ravel()]).astype(np.int64)


__all__ = [
    "MultiGridGeometry", "AnyresLayout", "geometry_from_dict", "grid_pieces", "best_resolution", "anyres_layout",
    "anyres_geometry", "anyres_crop_patches",
]
