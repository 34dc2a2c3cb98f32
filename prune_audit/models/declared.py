"""The JSON files a checkpoint folder declares beside its weights for prune-audit (``task_instructions.json``,
``video_sampling.json``): read before the weights, so that a bad file fails fast, in one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from prune_audit.errors import PruneAuditError
from prune_audit.safety.inputs import loads_json, read_input


def declared_json(source: str | Path, file_name: str, what: str, fix: str) -> Any | None:
    """The parsed ``file_name`` of the checkpoint folder ``source``; None for a hub id or a folder without it.

    Raises:
        PruneAuditError: one line naming the file and ``fix`` when it cannot be read or is not JSON.
    """
    path = Path(source) / file_name
    if not path.is_file():
        return None
    try:
        return loads_json(read_input(path, what, fix), str(path))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise PruneAuditError(f"{path} is not JSON ({error}); {fix}") from None


__all__ = ["declared_json"]
