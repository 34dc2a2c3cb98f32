"""Opening image files: one-line errors for missing, corrupt, oversized and out-of-range images.

PIL refuses images of more than twice ``Image.MAX_IMAGE_PIXELS`` pixels as possible
decompression bombs; ``PRUNE_AUDIT_MAX_IMAGE_PIXELS`` raises (or lowers) that limit for
trusted, very large images.

Models see 8-bit RGB. Pixel formats whose range is fixed by their bit depth are converted
by that range: 16-bit greyscale (PIL modes ``I;16*``, e.g. a 16-bit PNG or TIFF) maps
0..65535 linearly onto 0..255 (``round(v / 257)``, the inverse of 8-to-16-bit expansion),
never by the image's own min and max, so one image's contrast does not depend on its
content and two images stay comparable. 32-bit integer (mode ``I``) and floating-point
(mode ``F``) pixels have no range of their own: PIL would clip them (a float image in
[0, 1] turns black, a 16-bit one white), so they are refused and the user converts them
with the scaling their data needs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO

from prune_audit.errors import PruneAuditError
from prune_audit.safety.inputs import open_input, positive_setting

MAX_PIXELS_VARIABLE = "PRUNE_AUDIT_MAX_IMAGE_PIXELS"
SIXTEEN_BIT_MODES = frozenset({"I;16", "I;16L", "I;16B", "I;16N"})
"""PIL modes of 16-bit greyscale pixels: converted by their fixed 0..65535 range."""
UNKNOWN_RANGE_MODES = {"I": "32-bit integer", "F": "32-bit floating-point"}
"""PIL modes whose values have no fixed range to map onto 8 bits: refused."""


def _pixel_limit(default: int | None) -> int | None:
    """PIL's ``MAX_IMAGE_PIXELS`` for this open: the environment's (a positive whole number), else PIL's own."""
    return positive_setting(MAX_PIXELS_VARIABLE, "pixels", 200_000_000, "PIL's default") or default


def to_rgb(image: Any, path: str | Path) -> Any:
    """``image`` (a decoded ``PIL.Image``) as 8-bit RGB, converted by its bit depth's range.

    Raises:
        PruneAuditError: an image without pixels (0 wide or high), or pixels without a fixed range (mode I or F),
            naming the file.
    """
    from PIL import Image

    if 0 in image.size:
        raise PruneAuditError(
            f"image {path} is {image.size[0]}x{image.size[1]} pixels, so there is nothing to see; "
            f"pass an image with pixels"
        )
    if image.mode in SIXTEEN_BIT_MODES:
        import numpy as np

        grey = (np.asarray(image, dtype=np.uint32) + 128) // 257  # round(v * 255 / 65535)
        return Image.fromarray(grey.astype(np.uint8)).convert("RGB")
    if image.mode in UNKNOWN_RANGE_MODES:
        raise PruneAuditError(
            f"image {path} has {UNKNOWN_RANGE_MODES[image.mode]} pixels (PIL mode {image.mode}), whose range is "
            f"unknown, so converting them to 8-bit RGB would guess; save it as an 8-bit (or 16-bit) RGB or "
            f"greyscale PNG, scaled as your data requires"
        )
    return image.convert("RGB")


def open_rgb(path: str | Path) -> Any:
    """The image at ``path`` decoded as an 8-bit RGB ``PIL.Image``; problems raise PruneAuditError.

    Only a regular file is opened (``safety.inputs``): a folder, FIFO or device is refused by kind.
    """
    with open_input(path, "image", "check --images", limit_size=False) as handle:
        return _decode_rgb(handle, path)


def decode_rgb(data: bytes, name: str) -> Any:
    """Image bytes embedded in a question file (``name`` for messages) decoded as ``open_rgb`` decodes a file."""
    import io

    return _decode_rgb(io.BytesIO(data), name)


def _decode_rgb(source: str | Path | BinaryIO, path: str | Path) -> Any:
    """``source`` (a file or its bytes, named ``path`` in messages) as 8-bit RGB, one-line errors."""
    from PIL import Image, UnidentifiedImageError

    default = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = _pixel_limit(default)
    try:
        with Image.open(source) as image:
            image.load()
            return to_rgb(image, path)
    except PruneAuditError:
        raise  # already one line (PruneAuditError is a ValueError: keep it out of the clause below)
    except Image.DecompressionBombError:
        raise PruneAuditError(
            f"image {path} has more pixels than PIL's decompression-bomb limit of {2 * (Image.MAX_IMAGE_PIXELS or 0)} "
            f"(2 x Image.MAX_IMAGE_PIXELS); if you trust it, raise the limit: "
            f"{MAX_PIXELS_VARIABLE}=<pixels> prune-audit ..."
        ) from None
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise PruneAuditError(f"image {path} cannot be decoded ({error}); replace or remove the file") from None
    finally:
        Image.MAX_IMAGE_PIXELS = default
