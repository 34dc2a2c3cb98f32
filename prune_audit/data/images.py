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


def _apply_pixel_limit() -> int:
    """Set PIL's limit from the environment; returns the number of pixels refused above."""
    from PIL import Image

    text = os.environ.get(MAX_PIXELS_VARIABLE)
    if text:
        try:
            Image.MAX_IMAGE_PIXELS = int(text)
        except ValueError:
            raise PruneAuditError(f"{MAX_PIXELS_VARIABLE} must be a whole number of pixels, got {text!r}") from None
    return 2 * int(Image.MAX_IMAGE_PIXELS or 0)


def open_rgb(path: str | Path) -> Any:
    """The image at ``path`` decoded as an RGB ``PIL.Image``; problems raise PruneAuditError."""
    from PIL import Image, UnidentifiedImageError

    limit = _apply_pixel_limit()
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except Image.DecompressionBombError:
        raise PruneAuditError(
            f"image {path} has more pixels than PIL's decompression-bomb limit of {limit} "
            f"(2 x Image.MAX_IMAGE_PIXELS); if you trust it, raise the limit: "
            f"{MAX_PIXELS_VARIABLE}=<pixels> prune-audit ..."
        ) from None
    except FileNotFoundError:
        raise PruneAuditError(f"image not found: {path}; check --images") from None
    except (UnidentifiedImageError, OSError, ValueError) as error:
        raise PruneAuditError(f"image {path} cannot be decoded ({error}); replace or remove the file") from None
