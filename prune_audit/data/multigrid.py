"""Images whose visual tokens form several regular grids: LLaVA-NeXT's anyres tiling, InternVL's dynamic tiles.

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

InternVL (``GotOcr2ImageProcessor.crop_image_to_patches`` with ``crop_to_patches``) resizes the image,
aspect not kept, to the tile grid of ``data.tiles.tiled_canvas`` (``cols x rows`` square tiles), cuts it
into tiles row-major and appends a thumbnail (the whole image resized to one tile) when there is more
than one tile; each tile is a grid of pixel-shuffled tokens. The tiles together are one regular grid
over the canvas whose tokens are numbered tile by tile (``data.tiles.TiledGrid``); the thumbnail is a
second grid (``internvl_tiles``, :func:`internvl_geometry`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from prune_audit.data.geometry import TokenGeometry, clip_geometry, mask_area_per_token, token_footprints
from prune_audit.data.tiles import TiledGrid, tiled_canvas
from prune_audit.errors import PruneAuditError


@dataclass(frozen=True)
class MultiGridGeometry:
    """Several token grids over one image, their tokens numbered grid after grid.

    Attributes:
        mode: the preprocessing (``llava_next_anyres``, ``llava_onevision_anyres``, ``internvl_tiles``).
        grids: the grids in token order; grid ``g`` holds tokens ``offsets[g]`` to ``offsets[g] + its N - 1``.
    """

    mode: str
    grids: tuple[TokenGeometry | RectilinearGrid | TiledGrid, ...]

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

    def index_map(self) -> np.ndarray:
        """Refused: a pixel lies on one token of each grid (map the grids one by one: :func:`grid_pieces`)."""
        raise PruneAuditError(
            f"the {self.mode} geometry has {len(self.grids)} token grids per image, and this view "
            f"draws one; use the run's retention columns for this model family"
        )

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


def _interval_index(length: int, starts: Sequence[float], ends: Sequence[float]) -> np.ndarray:
    """(length,) int64 interval holding each pixel centre along one axis (ascending, disjoint intervals); -1: none."""
    centres = np.arange(length) + 0.5
    index = np.searchsorted(np.asarray(starts), centres, side="right") - 1
    inside = (index >= 0) & (centres < np.asarray(ends)[index.clip(0)])
    return np.where(inside, index, -1).astype(np.int64)


@dataclass(frozen=True)
class RectilinearGrid:
    """A row-major token grid whose columns and rows each cover their own interval of original pixels.

    For grids no single affine map describes: LLaVA-OneVision's tiles (a 384-px SigLIP tile holds 27 patches of
    14 px, so the joined grid skips the last 6 px of every tile) and their bilinearly downsampled grid.

    Attributes:
        mode: ``anyres_tiles`` or ``anyres_tiles_downsampled``.
        image_width, image_height: original image size.
        x0, x1: [x0[c], x1[c]) of column c in original pixels, ascending and disjoint; y0, y1 the same for rows.
    """

    mode: str
    image_width: int
    image_height: int
    x0: tuple[float, ...]
    x1: tuple[float, ...]
    y0: tuple[float, ...]
    y1: tuple[float, ...]

    @property
    def grid(self) -> tuple[int, int]:
        return (len(self.y0), len(self.x0))

    @property
    def num_tokens(self) -> int:
        return len(self.y0) * len(self.x0)

    @property
    def image_size(self) -> tuple[int, int]:
        return (self.image_width, self.image_height)

    def index_map(self) -> np.ndarray:
        """(H, W) int64 token of every original pixel (by its centre), -1 where no token covers it; read-only."""
        rows = _interval_index(self.image_height, self.y0, self.y1)
        cols = _interval_index(self.image_width, self.x0, self.x1)
        index = rows[:, None] * len(self.x0) + cols[None, :]
        index[(rows[:, None] < 0) | (cols[None, :] < 0)] = -1
        index.flags.writeable = False
        return index

    def footprints(self) -> np.ndarray:
        """(N, 4) float64 boxes (x0, y0, x1, y1), row-major."""
        row_of, col_of = np.divmod(np.arange(self.num_tokens), len(self.x0))
        x0, x1, y0, y1 = (np.asarray(edges, dtype=np.float64) for edges in (self.x0, self.x1, self.y0, self.y1))
        return np.stack([x0[col_of], y0[row_of], x1[col_of], y1[row_of]], axis=1)

    def mask_areas(self, mask: np.ndarray) -> np.ndarray:
        """(N,) int64 mask pixels whose centre lies in each token's footprint."""
        if mask.shape != (self.image_height, self.image_width):
            raise PruneAuditError(
                f"mask shape {mask.shape} does not match the image (H, W) = ({self.image_height}, {self.image_width})"
            )
        tokens = self.index_map()[mask.astype(bool, copy=False)]
        return np.bincount(tokens[tokens >= 0], minlength=self.num_tokens).astype(np.int64)

    def to_dict(self) -> dict[str, Any]:
        return {name: list(value) if isinstance(value, tuple) else value for name, value in asdict(self).items()}


def geometry_from_dict(fields: dict[str, Any]) -> TokenGeometry | RectilinearGrid | TiledGrid | MultiGridGeometry:
    """The geometry whose ``to_dict()`` gave ``fields`` (a record's ``geometry`` column)."""
    if "grids" in fields:
        return MultiGridGeometry(fields["mode"], tuple(geometry_from_dict(grid) for grid in fields["grids"]))
    if "canvas" in fields:
        return TiledGrid(fields["mode"], TokenGeometry(**fields["canvas"]), fields["tile_rows"], fields["tile_cols"])
    if "x0" in fields:
        return RectilinearGrid(
            **{name: tuple(value) if isinstance(value, list) else value for name, value in fields.items()}
        )
    return TokenGeometry(**fields)


def grid_pieces(geometry: Any) -> list[tuple[int, Any]]:
    """``(first token index, grid)`` of each regular grid of ``geometry`` (one for a :class:`TokenGeometry`)."""
    if isinstance(geometry, MultiGridGeometry):
        return list(zip(geometry.offsets, geometry.grids))
    return [(0, geometry)]


def grid_names(geometry: Any) -> list[str]:
    """A reader's name for each grid of :func:`grid_pieces` (``base view``, ``tiles``; InternVL's ``tiles``,
    ``thumbnail``; one grid: ``tokens``)."""
    if not isinstance(geometry, MultiGridGeometry):
        return ["tokens"]
    if geometry.mode == "internvl_tiles":
        return ["tiles", "thumbnail"]
    return [
        "base view",
        *("tiles (downsampled)" if grid.mode == "anyres_tiles_downsampled" else "tiles" for grid in geometry.grids[1:]),
    ]


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


def anyres_layout(
    image_size: tuple[int, int], pinpoints: Sequence[Sequence[int]], tile: int, patch_size: int
) -> AnyresLayout:
    """The processor's resize and padding for patching, and the model's ``unpad_image``, of ``image_size``."""
    width, height = image_size
    canvas_h, canvas_w = best_resolution(image_size, pinpoints)
    if canvas_h % tile or canvas_w % tile:
        raise PruneAuditError(
            f"image_grid_pinpoints canvas {canvas_h}x{canvas_w} is not a multiple of the {tile}-px tile"
        )
    if canvas_w / width < canvas_h / height:  # the width reaches the canvas first
        resized_w, resized_h = canvas_w, min(math.ceil(height * canvas_w / width), canvas_h)
    else:
        resized_w, resized_h = min(math.ceil(width * canvas_h / height), canvas_w), canvas_h
    side = tile // patch_size  # patches per tile side (a 384-px SigLIP tile leaves its last 6 px unseen)
    rows, cols = canvas_h // tile * side, canvas_w // tile * side
    cut_rows = cut_cols = 0
    if width / height > cols / rows:
        cut_rows = (rows - int(round(height * (cols / width), 7))) // 2
    else:
        cut_cols = (cols - int(round(width * (rows / height), 7))) // 2
    return AnyresLayout(
        canvas=(canvas_h, canvas_w),
        resized=(resized_w, resized_h),
        paste=((canvas_w - resized_w) // 2, (canvas_h - resized_h) // 2),
        cut=(cut_rows, cut_cols),
        grid=(rows - 2 * cut_rows, cols - 2 * cut_cols),
    )


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
    base = clip_geometry(
        image_size, mode="hf_crop", shortest_edge=None, resize_to=(tile, tile), crop_size=None, patch_size=patch_size
    )
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


def anyres_crop_patches(
    image_size: tuple[int, int], *, pinpoints: Sequence[Sequence[int]], tile: int = 336, patch_size: int = 14
) -> np.ndarray:
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


def onevision_geometry(
    image_size: tuple[int, int],
    *,
    pinpoints: Sequence[Sequence[int]],
    tile: int = 384,
    patch_size: int = 14,
    max_tiles: int = 9,
) -> MultiGridGeometry:
    """LLaVA-OneVision's base view plus unpadded (and, past ``max_tiles`` tiles' worth, downsampled) tile grid.

    As :func:`anyres_geometry`, except that a ``tile``-px crop holds ``tile // patch_size`` patches from its top
    left (SigLIP's 384-px crop: 27 patches over 378 px), and that ``anyres_max_{max_tiles}`` bilinearly resizes an
    unpadded grid of ``h x w`` patches with ``r = sqrt(h * w / (max_tiles * side**2)) > 1.1`` to
    ``int(h // r) x int(w // r)`` tokens (``LlavaOnevisionModel.pack_image_features``). A downsampled token's
    footprint is its cell of the coarser grid (``anyres_tiles_downsampled``): the bilinear sample (no
    antialiasing) reads the 2 x 2 patches around the cell's centre, so it is a convention, not a partition of
    what each token read.
    """
    width, height = image_size
    side = tile // patch_size
    base = TokenGeometry(
        mode="hf_crop",
        image_width=width,
        image_height=height,
        processed_width=side * patch_size,
        processed_height=side * patch_size,
        grid_rows=side,
        grid_cols=side,
        token_pixels=patch_size,
        scale_x=tile / width,
        scale_y=tile / height,
    )
    layout = anyres_layout(image_size, pinpoints, tile, patch_size)
    rows, cols = layout.grid
    shrink = math.sqrt(rows * cols / (max_tiles * side**2))
    target = (int(rows // shrink), int(cols // shrink)) if shrink > 1.1 else (rows, cols)

    def edges(count: int, cut: int, paste: int, scale: float, cells: int) -> tuple[tuple[float, ...], ...]:
        """[start, end) of each of ``cells`` tokens along an axis of ``count`` unpadded patches, original pixels."""
        first = (np.arange(count) + cut) // side * tile + (np.arange(count) + cut) % side * patch_size
        bounds = np.arange(cells + 1) * count / cells  # cell borders in patch units
        patch = np.minimum(np.floor(bounds).astype(np.int64), count - 1)
        pixels = (first[patch] + (bounds - patch) * patch_size - paste) / scale
        return tuple(float(v) for v in pixels[:-1]), tuple(float(v) for v in pixels[1:])

    x0, x1 = edges(cols, layout.cut[1], layout.paste[0], layout.resized[0] / width, target[1])
    y0, y1 = edges(rows, layout.cut[0], layout.paste[1], layout.resized[1] / height, target[0])
    mode = "anyres_tiles_downsampled" if target != (rows, cols) else "anyres_tiles"
    return MultiGridGeometry("llava_onevision_anyres", (base, RectilinearGrid(mode, width, height, x0, x1, y0, y1)))


def internvl_geometry(
    image_size: tuple[int, int],
    *,
    tile: tuple[int, int] = (448, 448),
    token_pixels: int = 28,
    min_tiles: int = 1,
    max_tiles: int = 12,
) -> TokenGeometry | MultiGridGeometry:
    """InternVL's tokens of an image of ``image_size`` (width, height) under ``crop_to_patches``.

    The image resized (aspect not kept) to the ``data.tiles.tiled_canvas`` of ``cols x rows`` (height, width)
    ``tile``s, cut into tiles row-major, each tile one grid of ``token_pixels`` squares (28: 2 x 2 pixel-shuffled 14-px
    patches), then the thumbnail: the whole image resized to one tile. One tile (a 1 x 1 canvas, or
    ``max_tiles`` 1) gives that tile alone, no thumbnail: the plain resize of ``hf_crop`` without its crop.
    """

    def resized(height: int, width: int) -> TokenGeometry:
        return clip_geometry(
            image_size,
            mode="hf_crop",
            shortest_edge=None,
            resize_to=(height, width),
            crop_size=None,
            patch_size=token_pixels,
        )

    thumbnail = resized(*tile)
    cols, rows = tiled_canvas(image_size, tile, min_tiles, max_tiles)
    if cols * rows == 1:
        return thumbnail
    tiles = TiledGrid("internvl_tiles", resized(rows * tile[0], cols * tile[1]), rows, cols)
    return MultiGridGeometry("internvl_tiles", (tiles, thumbnail))


__all__ = [
    "MultiGridGeometry",
    "AnyresLayout",
    "geometry_from_dict",
    "grid_pieces",
    "grid_names",
    "best_resolution",
    "anyres_layout",
    "anyres_geometry",
    "anyres_crop_patches",
    "RectilinearGrid",
    "onevision_geometry",
    "internvl_geometry",
]
