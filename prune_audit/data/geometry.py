"""Image-to-token geometry: which original pixels each visual token sees.

Every supported preprocessing is an axis-aligned affine map from original pixel
coordinates to the processed image the vision encoder reads, followed by a regular
grid of square tokens:

    processed_x = x * scale_x + offset_x,   token column = floor(processed_x / token_pixels)

(and the same for y). Padding shows up as a positive offset, cropping as a negative
one. Original pixel (x, y) belongs to the token whose footprint contains its centre
(x + 0.5, y + 0.5); pixels whose centre falls outside the grid (cropped away) belong
to no token. Tokens are numbered row-major, as the models order them.

Modes (evaluation spec, section D):

- ``llava_pad``: original LLaVA-1.5 ``expand2square`` (paste at ((S-W)//2, (S-H)//2) on
  an S = max(W, H) square of the mean colour), then CLIP resize + centre crop.
- ``hf_pad``: ``LlavaImageProcessor(do_pad=True)``; the same pad offsets as ``llava_pad``.
- ``hf_crop``: the llava-hf default ``CLIPImageProcessor``: resize the shortest edge
  (long edge ``int(edge * long / short)``), then centre crop at ``(resized - crop) // 2``.
- ``qwen_smart_resize``: ``Qwen2VLImageProcessor`` (Qwen2-VL and Qwen2.5-VL):
  ``smart_resize`` to multiples of ``patch_size * merge_size``; one LLM token per
  28 x 28 processed pixels, no padding, no crop.
- ``anyres_tiles``: LLaVA-NeXT's unpadded tile grid; with its base view, one of an image's several
  grids (``data.multigrid``, whose geometries the functions below also take).

Image sizes are ``(width, height)`` as in ``PIL.Image.size``; arrays are ``(H, W)``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from prune_audit.errors import PruneAuditError

MODES = ("llava_pad", "hf_crop", "hf_pad", "qwen_smart_resize", "anyres_tiles")

CLIP_PATCH_SIZE = 14
LLAVA_SIDE = 336
QWEN_MIN_PIXELS = 3136
QWEN_MAX_PIXELS = 12845056


@dataclass(frozen=True)
class TokenGeometry:
    """The token grid of one image under one preprocessing.

    Attributes:
        mode: one of ``MODES``.
        image_width, image_height: original image size in pixels.
        processed_width, processed_height: size of the image the vision encoder reads.
        grid_rows, grid_cols: visual token grid; N = rows * cols, row-major.
        token_pixels: side of one token in processed pixels (14 for a CLIP patch,
            28 for a merged Qwen token).
        scale_x, scale_y: processed pixels per original pixel.
        offset_x, offset_y: processed coordinate of the original image's top-left corner.
        min_pixels, max_pixels: Qwen ``smart_resize`` limits (None for LLaVA modes).
    """

    mode: str
    image_width: int
    image_height: int
    processed_width: int
    processed_height: int
    grid_rows: int
    grid_cols: int
    token_pixels: int
    scale_x: float
    scale_y: float
    offset_x: float = 0.0
    offset_y: float = 0.0
    min_pixels: int | None = None
    max_pixels: int | None = None

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise PruneAuditError(f"unknown geometry mode {self.mode!r}; expected one of {', '.join(MODES)}")
        if min(self.image_width, self.image_height, self.grid_rows, self.grid_cols, self.token_pixels) <= 0:
            raise PruneAuditError(f"geometry sizes must be positive: {self}")
        if self.processed_width != self.grid_cols * self.token_pixels or (
            self.processed_height != self.grid_rows * self.token_pixels
        ):
            raise PruneAuditError(
                f"processed size {self.processed_width}x{self.processed_height} is not the token grid "
                f"{self.grid_cols}x{self.grid_rows} of {self.token_pixels}-pixel tokens"
            )

    @property
    def grid(self) -> tuple[int, int]:
        """(rows, cols) of the token grid."""
        return (self.grid_rows, self.grid_cols)

    @property
    def num_tokens(self) -> int:
        return self.grid_rows * self.grid_cols

    @property
    def image_size(self) -> tuple[int, int]:
        """(width, height) of the original image."""
        return (self.image_width, self.image_height)

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable fields (plain ints, floats, strings and None)."""
        return asdict(self)


def _check_image_size(image_size: tuple[int, int]) -> tuple[int, int]:
    width, height = (int(v) for v in image_size)
    if width <= 0 or height <= 0:
        raise PruneAuditError(f"image size must be positive (width, height), got {image_size}")
    return width, height


def clip_geometry(
    image_size: tuple[int, int],
    *,
    mode: str = "hf_crop",
    shortest_edge: int | None = LLAVA_SIDE,
    resize_to: tuple[int, int] | None = None,
    crop_size: tuple[int, int] | None = (LLAVA_SIDE, LLAVA_SIDE),
    patch_size: int = CLIP_PATCH_SIZE,
) -> TokenGeometry:
    """Geometry of the CLIP-style pipeline: optional pad to square, resize, optional centre crop.

    Follows transformers 5.24 ``PilBackend`` (``get_resize_output_image_size`` with
    ``default_to_square=False`` and ``center_crop``); the torchvision backend uses the
    same offsets whenever the crop fits inside the resized image.

    Args:
        image_size: original (width, height).
        mode: ``llava_pad`` or ``hf_pad`` pad to a square first; ``hf_crop`` does not.
        shortest_edge: resize so the short side has this length (long side truncated
            to ``int(edge * long / short)``), as ``size={"shortest_edge": ...}``.
        resize_to: (height, width) for ``size={"height", "width"}``; overrides ``shortest_edge``.
            Both None means no resize.
        crop_size: (height, width) of the centre crop, or None for no crop.
        patch_size: vision-encoder patch side in processed pixels.
    """
    if mode not in ("llava_pad", "hf_pad", "hf_crop"):
        raise PruneAuditError(f"clip_geometry handles llava_pad, hf_pad and hf_crop, not {mode!r}")
    width, height = _check_image_size(image_size)
    pad_x = pad_y = 0
    if mode != "hf_crop":
        side = max(width, height)
        pad_x, pad_y = (side - width) // 2, (side - height) // 2
        canvas_w = canvas_h = side
    else:
        canvas_w, canvas_h = width, height
    if resize_to is not None:
        resized_h, resized_w = resize_to
    elif shortest_edge is not None:
        short, long = min(canvas_w, canvas_h), max(canvas_w, canvas_h)
        new_long = int(shortest_edge * long / short)
        resized_h, resized_w = (shortest_edge, new_long) if canvas_h <= canvas_w else (new_long, shortest_edge)
    else:
        resized_h, resized_w = canvas_h, canvas_w
    scale_x, scale_y = resized_w / canvas_w, resized_h / canvas_h
    crop_top = crop_left = 0
    processed_h, processed_w = resized_h, resized_w
    if crop_size is not None:
        processed_h, processed_w = crop_size
        crop_top, crop_left = (resized_h - processed_h) // 2, (resized_w - processed_w) // 2
    if processed_h % patch_size or processed_w % patch_size:
        raise PruneAuditError(
            f"processed image {processed_w}x{processed_h} is not a multiple of the {patch_size}-pixel patch"
        )
    return TokenGeometry(
        mode=mode,
        image_width=width,
        image_height=height,
        processed_width=processed_w,
        processed_height=processed_h,
        grid_rows=processed_h // patch_size,
        grid_cols=processed_w // patch_size,
        token_pixels=patch_size,
        scale_x=scale_x,
        scale_y=scale_y,
        offset_x=pad_x * scale_x - crop_left,
        offset_y=pad_y * scale_y - crop_top,
    )


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL ``smart_resize``: (height, width) rounded to multiples of ``factor`` within the pixel limits.

    Re-implemented from the rule in the evaluation spec (D3) and transformers'
    ``qwen2_vl`` image processor: round each side to the nearest multiple (Python
    ``round``, half to even); if the area exceeds ``max_pixels`` scale down with floor,
    if it is below ``min_pixels`` scale up with ceil. Aspect ratios above 200 are refused.
    """
    if max(height, width) / min(height, width) > 200:
        raise PruneAuditError(f"aspect ratio of {width}x{height} exceeds 200, which Qwen2-VL refuses")
    resized_h = round(height / factor) * factor
    resized_w = round(width / factor) * factor
    if resized_h * resized_w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        resized_h = max(factor, math.floor(height / beta / factor) * factor)
        resized_w = max(factor, math.floor(width / beta / factor) * factor)
    elif resized_h * resized_w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        resized_h = math.ceil(height * beta / factor) * factor
        resized_w = math.ceil(width * beta / factor) * factor
    return resized_h, resized_w


def qwen_geometry(
    image_size: tuple[int, int],
    *,
    min_pixels: int = QWEN_MIN_PIXELS,
    max_pixels: int = QWEN_MAX_PIXELS,
    patch_size: int = CLIP_PATCH_SIZE,
    merge_size: int = 2,
) -> TokenGeometry:
    """Geometry of ``Qwen2VLImageProcessor``: one LLM token per (patch_size * merge_size)^2 pixels.

    Defaults are the Qwen2.5-VL checkpoints' ``min_pixels 3136`` / ``max_pixels 12845056``;
    pass the values the processor actually uses (they change the token count).
    """
    width, height = _check_image_size(image_size)
    token = patch_size * merge_size
    resized_h, resized_w = smart_resize(height, width, token, min_pixels, max_pixels)
    return TokenGeometry(
        mode="qwen_smart_resize",
        image_width=width,
        image_height=height,
        processed_width=resized_w,
        processed_height=resized_h,
        grid_rows=resized_h // token,
        grid_cols=resized_w // token,
        token_pixels=token,
        scale_x=resized_w / width,
        scale_y=resized_h / height,
        min_pixels=min_pixels,
        max_pixels=max_pixels,
    )


def mapped_to_original(geometry: TokenGeometry, image_size: tuple[int, int]) -> TokenGeometry:
    """``geometry`` of an image that is the original of ``image_size`` (width, height) resized before the
    processor (the image-resizing selectors' ``prepare_for``), mapped back to the original's pixels: the same
    grid and processed size, scaled from original pixels. The two resizes compose into one because both align
    pixel centres without offset (PIL's resize and ``smart_resize``'s): original centre ``x + 0.5`` lands on
    processed ``(x + 0.5) * processed_width / width``."""
    if geometry.offset_x or geometry.offset_y:
        raise PruneAuditError(f"a {geometry.mode} geometry with an offset cannot be mapped through a resize")
    width, height = _check_image_size(image_size)
    return replace(
        geometry,
        image_width=width,
        image_height=height,
        scale_x=geometry.processed_width / width,
        scale_y=geometry.processed_height / height,
    )


def _pixel_tokens_1d(length: int, scale: float, offset: float, token_pixels: int, cells: int) -> np.ndarray:
    """(length,) int64 token row/column of each pixel centre along one axis; -1 outside the grid."""
    # A centre exactly on a token border belongs to the right/lower token ([x0, x1) footprints); the
    # nudge absorbs float error there and is far below the smallest non-tie distance (~1e-6).
    index = np.floor(((np.arange(length) + 0.5) * scale + offset) / token_pixels + 1e-9).astype(np.int64)
    index[(index < 0) | (index >= cells)] = -1
    return index


@functools.lru_cache(maxsize=64)
def token_index_map(geometry: TokenGeometry) -> np.ndarray:
    """(H, W) int64 token index of every original pixel (by its centre); -1 where cropped away.

    Cached per geometry (geometries are frozen); the returned array is read-only.
    """
    if not isinstance(geometry, TokenGeometry):  # data.multigrid's geometries map themselves
        return geometry.index_map()
    rows = _pixel_tokens_1d(
        geometry.image_height, geometry.scale_y, geometry.offset_y, geometry.token_pixels, geometry.grid_rows
    )
    cols = _pixel_tokens_1d(
        geometry.image_width, geometry.scale_x, geometry.offset_x, geometry.token_pixels, geometry.grid_cols
    )
    index = rows[:, None] * geometry.grid_cols + cols[None, :]
    index[(rows[:, None] < 0) | (cols[None, :] < 0)] = -1
    index.flags.writeable = False
    return index


def token_footprints(geometry: TokenGeometry) -> np.ndarray:
    """(N, 4) float64 boxes (x0, y0, x1, y1) of each token in original-pixel coordinates.

    Half-open boxes [x0, x1) x [y0, y1), not clipped to the image: padding tokens lie
    partly or wholly outside it.
    """
    if not isinstance(geometry, TokenGeometry):
        return geometry.footprints()
    t = geometry.token_pixels
    cols = np.arange(geometry.grid_cols, dtype=np.float64)
    rows = np.arange(geometry.grid_rows, dtype=np.float64)
    x0 = (cols * t - geometry.offset_x) / geometry.scale_x
    x1 = ((cols + 1) * t - geometry.offset_x) / geometry.scale_x
    y0 = (rows * t - geometry.offset_y) / geometry.scale_y
    y1 = ((rows + 1) * t - geometry.offset_y) / geometry.scale_y
    row_of, col_of = np.divmod(np.arange(geometry.num_tokens), geometry.grid_cols)
    return np.stack([x0[col_of], y0[row_of], x1[col_of], y1[row_of]], axis=1)


def mask_area_per_token(mask: np.ndarray, geometry: TokenGeometry) -> np.ndarray:
    """(N,) int64 number of mask pixels whose centre lies in each token's footprint.

    Args:
        mask: (H, W) boolean mask at the original resolution of ``geometry``.
    """
    if not isinstance(geometry, TokenGeometry):
        return geometry.mask_areas(mask)
    if mask.shape != (geometry.image_height, geometry.image_width):
        raise PruneAuditError(
            f"mask shape {mask.shape} does not match the geometry's image (H, W) = "
            f"({geometry.image_height}, {geometry.image_width})"
        )
    tokens = token_index_map(geometry)[mask.astype(bool, copy=False)]
    return np.bincount(tokens[tokens >= 0], minlength=geometry.num_tokens).astype(np.int64)


def _unwrap_image_processor(processor: Any) -> tuple[Any, int | None]:
    """The image processor inside a full processor, and the wrapper's ``patch_size`` if it has one."""
    image_processor = getattr(processor, "image_processor", None)
    if image_processor is None:
        return processor, None
    return image_processor, getattr(processor, "patch_size", None)


def _class_family(image_processor: Any) -> str:
    """Class name without the backend suffix: ``CLIPImageProcessorPil`` -> ``CLIPImageProcessor``."""
    name = type(image_processor).__name__
    for suffix in ("Pil", "Fast"):
        name = name.removesuffix(suffix)
    return name


def _size_value(size: Any, key: str) -> int | None:
    value = size.get(key) if isinstance(size, dict) else getattr(size, key, None)
    return int(value) if value is not None else None


def qwen_geometry_from_processor(image_processor: Any, image_size: tuple[int, int]) -> TokenGeometry:
    """:func:`qwen_geometry` as a ``Qwen2VLImageProcessor`` (any backend) is configured: pixel limits, patch, merge."""
    size = getattr(image_processor, "size", None) or {}
    min_pixels = _size_value(size, "shortest_edge") or getattr(image_processor, "min_pixels", None)
    max_pixels = _size_value(size, "longest_edge") or getattr(image_processor, "max_pixels", None)
    if min_pixels is None or max_pixels is None:
        raise PruneAuditError("Qwen2-VL image processor has no min/max pixels in its size configuration")
    return qwen_geometry(
        image_size,
        min_pixels=int(min_pixels),
        max_pixels=int(max_pixels),
        patch_size=int(image_processor.patch_size),
        merge_size=int(image_processor.merge_size),
    )


def clip_geometry_from_processor(
    image_processor: Any, image_size: tuple[int, int], *, patch_size: int, pads_to_square: bool = False
) -> TokenGeometry:
    """:func:`clip_geometry` as a LLaVA image processor (``CLIPImageProcessor``/``LlavaImageProcessor``, any
    backend; not its wrapper) is configured: resize, centre crop, and ``do_pad`` read as Llava's pad to square
    (``hf_pad``; the caller vouches for that reading). ``pads_to_square``: the original LLaVA
    ``image_aspect_ratio="pad"`` expansion before the processor (``llava_pad``)."""
    family = type(image_processor).__name__
    processor_pads = bool(getattr(image_processor, "do_pad", False))
    mode = "llava_pad" if pads_to_square else "hf_pad" if processor_pads else "hf_crop"
    size = getattr(image_processor, "size", None) or {}
    shortest_edge = resize_to = None
    if getattr(image_processor, "do_resize", True):
        shortest_edge = _size_value(size, "shortest_edge")
        height, width = _size_value(size, "height"), _size_value(size, "width")
        if _size_value(size, "longest_edge") is not None or (
            shortest_edge is None and (height is None or width is None)
        ):
            raise PruneAuditError(f"unsupported resize configuration {dict(size)} in {family}")
        if shortest_edge is None:
            resize_to = (height, width)
    crop_size = None
    if getattr(image_processor, "do_center_crop", False):
        crop = image_processor.crop_size
        crop_size = (_size_value(crop, "height"), _size_value(crop, "width"))
    return clip_geometry(
        image_size,
        mode=mode,
        shortest_edge=shortest_edge,
        resize_to=resize_to,
        crop_size=crop_size,
        patch_size=patch_size,
    )


def geometry_from_processor(
    processor: Any,
    image_size: tuple[int, int],
    *,
    patch_size: int | None = None,
    image_aspect_ratio: str | None = None,
) -> TokenGeometry:
    """Token geometry from a bare (image) processor, for library callers without a loaded model.

    Model families declare their geometry (``VisionLanguageModel.token_geometry``); this guesses the family
    from the processor's class and attributes because a caller holding only a processor (the README's
    ``ObjectAreaCache`` example) has no adapter to ask. Qwen2-VL processors (``merge_size`` and
    ``temporal_patch_size``) and CLIP/Llava ones only; LLaVA-NeXT/OneVision and InternVL: ask the adapter.

    Args:
        processor: an image processor, or a processor wrapping one in ``image_processor``.
        image_size: original (width, height).
        patch_size: vision patch side for CLIP-family processors; defaults to the wrapper's
            ``patch_size`` (``LlavaProcessor``) or 14.
        image_aspect_ratio: the original LLaVA model config's value; ``"pad"`` expands the image to a square
            before the processor (``llava_pad``), ``"square"`` or None leave it to the processor.
    """
    image_processor, wrapper_patch = _unwrap_image_processor(processor)
    if image_aspect_ratio not in (None, "pad", "square"):
        raise PruneAuditError(
            f"unsupported image_aspect_ratio {image_aspect_ratio!r} (expected 'pad', 'square' or none)"
        )
    if hasattr(image_processor, "merge_size") and hasattr(image_processor, "temporal_patch_size"):
        if image_aspect_ratio == "pad":
            raise PruneAuditError("image_aspect_ratio='pad' applies to LLaVA, not to a Qwen2-VL processor")
        return qwen_geometry_from_processor(image_processor, image_size)
    family = _class_family(image_processor)
    if family not in ("CLIPImageProcessor", "LlavaImageProcessor"):
        raise PruneAuditError(f"no token geometry for image processor {type(image_processor).__name__}")
    if getattr(image_processor, "do_pad", False) and family != "LlavaImageProcessor":
        raise PruneAuditError(f"{family} with do_pad=True pads to a fixed batch size, which is not supported")
    return clip_geometry_from_processor(
        image_processor,
        image_size,
        patch_size=int(patch_size or wrapper_patch or CLIP_PATCH_SIZE),
        pads_to_square=image_aspect_ratio == "pad",
    )
