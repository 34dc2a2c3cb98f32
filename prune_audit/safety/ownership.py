"""Which command owns an output directory, so no command writes into another's outputs.

The command that creates an output directory leaves a marker (``.prune-audit-owner.json``:
the command and, for analysis commands, its settings). Before anything is written, every
command checks its ``--out``: an existing file, a directory owned by another command, or
one holding the same command's outputs for other settings is refused with one line
naming the directory and what it holds. Directories written before markers existed are
recognised by their files.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prune_audit.errors import PruneAuditError
from prune_audit.safety.atomic import write_text_atomic

OWNER_FILE = ".prune-audit-owner.json"

# files that identify a command's outputs in a directory without a marker (checked in order)
SIGNATURE_FILES = (
    ("intervention.json", "intervene"),
    ("calibration.json", "calibrate"),
    ("cascade.json", "cascade"),
    ("manifest.json", "run"),
    ("records.parquet", "run"),
)


@dataclass(frozen=True)
class Owner:
    """The command whose outputs a directory holds, and the settings it ran with (if recorded)."""

    command: str
    settings: dict[str, Any] | None = None


def read_owner(directory: Path) -> Owner | None:
    """The owner of ``directory`` from its marker, else from its files; None for a folder of no command."""
    marker = directory / OWNER_FILE
    if marker.is_file():
        try:
            data = json.loads(marker.read_text(encoding="utf-8"))
            return Owner(str(data["command"]), data.get("settings"))
        except (ValueError, KeyError, TypeError):
            raise PruneAuditError(f"{marker} is unreadable; remove it if {directory} holds nothing you need") from None
    for name, command in SIGNATURE_FILES:
        if (directory / name).exists():
            return Owner(command)
    return None


def _held_files(directory: Path) -> str:
    names = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
    shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
    return shown or "no visible files"


def check_output_dir(
    directory: str | Path, command: str, settings: Mapping[str, Any] | None = None, option: str = "--out"
) -> Path:
    """Refuse ``directory`` as ``command``'s output unless it is new, unowned, or this command's own.

    Writes nothing. ``settings`` (JSON-ready) are compared with the ones recorded by an
    earlier run of the same command; a difference is refused, naming the first keys.
    """
    directory = Path(directory)
    if directory.exists() and not directory.is_dir():
        raise PruneAuditError(f"{option} {directory} is an existing file; pass a directory path")
    for parent in directory.parents:
        if parent.exists():
            if not parent.is_dir():
                raise PruneAuditError(
                    f"{option} {directory} is not writable: {parent} is a file, not a folder; pass another {option}"
                )
            break
    if not directory.is_dir():
        return directory
    owner = read_owner(directory)
    if owner is None:
        return directory
    if owner.command != command:
        raise PruneAuditError(
            f"{directory} holds the outputs of prune-audit {owner.command} ({_held_files(directory)}); "
            f"{command} never writes there: pass another {option}"
        )
    if settings is not None and owner.settings is not None:
        changed = differing_settings(owner.settings, dict(settings))
        if changed:
            raise PruneAuditError(
                f"{directory} holds prune-audit {command} outputs of other settings ({', '.join(changed[:3])}); "
                f"pass another {option}"
            )
    return directory


def differing_settings(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Keys whose JSON values differ."""
    normalise = lambda value: json.loads(json.dumps(value, default=str))  # noqa: E731
    return [key for key in sorted(set(old) | set(new)) if normalise(old.get(key)) != normalise(new.get(key))]


def claim_output_dir(directory: str | Path, command: str, settings: Mapping[str, Any] | None = None) -> Path:
    """Create ``directory`` (after ``check_output_dir``) and record ``command`` as its owner."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    marker = directory / OWNER_FILE
    if not marker.is_file():
        content = {"command": command, "settings": None if settings is None else dict(settings)}
        write_text_atomic(json.dumps(content, indent=2, default=str) + "\n", marker)
    return directory
