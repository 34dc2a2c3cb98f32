"""Opening image files: one-line errors for missing, corrupt and oversized images.

PIL refuses images of more than twice ``Image.MAX_IMAGE_PIXELS`` pixels as possible
decompression bombs; ``PRUNE_AUDIT_MAX_IMAGE_PIXELS`` raises (or lowers) that limit for
trusted, very large images.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from prune_audit.errors import PruneAuditError

MAX_PIXELS_VARIABLE = "PRUNE_AUDIT_MAX_IMAGE_PIXELS"


def _pixel_limit(default: int | None) -> int | None:
    """PIL's ``MAX_IMAGE_PIXELS`` for this open: the environment's, else PIL's own."""
    text = os.environ.get(MAX_PIXELS_VARIABLE)
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise PruneAuditError(f"{MAX_PIXELS_VARIABLE} must be a whole number of pixels, got {text!r}") from None


def open_rgb(path: str | Path) -> Any:
    """The image at ``path`` decoded as an RGB ``PIL.Image``; problems raise PruneAuditError."""
    from PIL import Image, UnidentifiedImageError

    default = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = _pixel_limit(default)
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except Image.DecompressionBombError:
        raise PruneAuditError(
            f"image {path} has more pixels than PIL's decompression-bomb limit of {2 * (Image.MAX_IMAGE_PIXELS or 0)} "
            f"(2 x Image.MAX_IMAGE_PIXELS); if you trust it, raise the limit: "
            f"{MAX_PIXELS_VARIABLE}=<pixels> prune-audit ..."
        ) from None
    except FileNotFoundError:
        raise PruneAuditError(f"image not found: {path}; check --images") from None
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise PruneAuditError(f"image {path} cannot be decoded ({error}); replace or remove the file") from None
    finally:
        Image.MAX_IMAGE_PIXELS = default
