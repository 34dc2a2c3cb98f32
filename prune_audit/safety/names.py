"""File-name parts given on the command line (prefixes, names) must stay inside their folder."""

from __future__ import annotations

import os

from prune_audit.errors import PruneAuditError


def check_plain_name(value: str, option: str) -> str:
    """``value`` unchanged when it is a plain name part: no path separator, no ``..``, not empty."""
    separators = {"/", "\\", os.sep, *([os.altsep] if os.altsep else [])}
    if not value or "\0" in value or ".." in value or any(sep in value for sep in separators):
        raise PruneAuditError(
            f"{option} {value!r} must be a plain name (no path separators, no '..'); "
            f"choose the folder with --out instead"
        )
    return value
