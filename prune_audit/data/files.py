"""Generic reading of every task's input files: JSON Lines, and each file's content hash.

Every task reader (POPE, GQA, ScienceQA, captions, LLaVA answer files) reads its JSON Lines through
``read_json_lines`` and pins its files by ``file_sha256`` (``safety.fingerprint``); a task whose image ids are
names keys them by ``stable_image_id``; image names are checked by
``safety.inputs.check_image_name``. None of it knows a task.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from prune_audit.errors import PruneAuditError
from prune_audit.safety.fingerprint import file_sha256
from prune_audit.safety.inputs import loads_json, open_input


def read_json_lines(
    path: str | Path, role: str = "question file", fix: str = "pass the JSON Lines file itself"
) -> list[tuple[int, dict[str, Any]]]:
    """(line number, object) for every non-blank line; a malformed line names the file and line.

    ``role`` and ``fix`` word the refusal of a path that is no readable regular file (``safety.inputs``).
    """
    path = Path(path)
    rows = []
    with open_input(path, role, fix) as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                raise PruneAuditError(
                    f"{path}:{number}: not UTF-8 text (byte 0x{raw[error.start]:02x}); save the file as UTF-8"
                ) from None
            if not line.strip():
                continue
            try:
                row = loads_json(line, f"{path}:{number}")
            except json.JSONDecodeError as error:
                raise PruneAuditError(f"{path}:{number}: malformed JSON line ({error.msg})") from None
            if not isinstance(row, dict):
                raise PruneAuditError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
            rows.append((number, row))
    return rows


def stable_image_id(name: str) -> int:
    """A non-negative int64 image id for an image id that need not be a number (GQA, TextVQA) (testdev's ``n161313``):
    the image id itself when it is ASCII digits, else the first 63 bits of its sha256 (equal names, equal ids)."""
    if name.isascii() and name.isdigit() and int(name) < 2**63:
        return int(name)
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little") & (2**63 - 1)


__all__ = ["file_sha256", "read_json_lines", "stable_image_id"]
