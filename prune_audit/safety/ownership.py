"""Which command owns an output directory, so no command writes into another's outputs.

A command may create its output folder or adopt an empty one; a folder it does not own
is refused when it holds anything (another command's outputs, a user's files, ``/``).
It writes only there, and never through a symbolic link it did not make (``safety.links``):
a link inside its folder is refused wherever it sits (``check_output_dir``), and each path
about to be written is checked part by part (``check_owned_paths``). A file written beside
the user's files (``shared``: a figure, an exported kept-set file) never goes into, or
below, another command's folder.
``check_output_dir`` says so while planning, writing nothing. ``hold_output_dir`` is
taken right before the first byte is written and held until the command ends: it takes
the folder's write lock, checks again under the lock (so two commands that both passed
their planning check cannot both write), records the owner marker
(``.prune-audit-owner.json``: the command and its settings) and removes only the
temporary names this project writes that a killed run of the command left there. A
command that fails before writing anything removes the folder it created. Directories
written before markers existed are recognised by their files.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prune_audit.errors import PruneAuditError
from prune_audit.safety.atomic import remove_partial_files, remove_staging_folders, temporary_target, write_text_atomic
from prune_audit.safety.links import check_no_links, check_not_dangling, link_refusal
from prune_audit.safety.lock import DirectoryLock, lock_file_names

OWNER_FILE = ".prune-audit-owner.json"

# files that identify a command's outputs in a directory without a marker (checked in order)
SIGNATURE_FILES = (
    ("intervention.json", "intervene"),
    ("calibration.json", "calibrate"),
    ("cascade.json", "cascade"),
    ("manifest.json", "run"),
    ("records.parquet", "run"),
    ("summary.parquet", "study"),
    ("training.json", "demo train"),
)
# a study folder before markers, or one only its --plan commands wrote: runs/ holding run folders
STUDY_RUNS_FOLDER = "runs"
# a reproduction whose studies ran as separate `study` commands (reproduce --dry-run prints them): both study
# folders and nothing else (a folder holding one study folder is a user's, where `study` wrote its default out)
REPRODUCE_STUDY_FOLDERS = ("study", "timing-b32")


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
    if _holds_study_runs(directory):
        return Owner("study")
    if _holds_reproduce_studies(directory):
        return Owner("reproduce")
    return None


def _holds_study_runs(directory: Path) -> bool:
    runs = directory / STUDY_RUNS_FOLDER
    if _visible_names(directory) != [STUDY_RUNS_FOLDER] or not runs.is_dir() or runs.is_symlink():
        return False
    folders = list(runs.iterdir())
    return bool(folders) and all(
        folder.is_dir() and not folder.is_symlink() and getattr(read_owner(folder), "command", None) == "run"
        for folder in folders
    )


def _holds_reproduce_studies(directory: Path) -> bool:
    names = _visible_names(directory)
    return names == sorted(REPRODUCE_STUDY_FOLDERS) and all(
        not (directory / name).is_symlink() and getattr(read_owner(directory / name), "command", None) == "study"
        for name in names
    )


def _visible_names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))


def _held_files(directory: Path) -> str:
    """The first names in ``directory``: visible ones, else hidden ones (lock files aside)."""
    names = _visible_names(directory) or sorted(p.name for p in directory.iterdir() if not _is_lock_file(p.name))
    return ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")


def _is_lock_file(name: str) -> bool:
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in lock_file_names())


def _is_empty(directory: Path) -> bool:
    """Nothing in ``directory`` but lock files (left by a command killed before it claimed the folder) and
    the owner marker's temporary file (another shard of the same run writing the marker right now)."""
    return all(_is_lock_file(path.name) or temporary_target(path.name) == OWNER_FILE for path in directory.iterdir())


def check_output_dir(
    directory: str | Path,
    command: str,
    settings: Mapping[str, Any] | None = None,
    option: str = "--out",
    shared: bool = False,
) -> Path:
    """Refuse ``directory`` as ``command``'s output unless it is new, empty, or this command's own.

    Writes nothing. ``settings`` (JSON-ready) are compared with the ones recorded by an
    earlier run of the same command; a difference, or outputs whose settings were never
    recorded, is refused, naming the first keys. ``shared``: a folder that may also hold
    the user's files (a figure's folder, a cache); only another command's outputs are refused.
    """
    directory = Path(directory)
    check_not_dangling(directory, option)
    if directory.exists() and not directory.is_dir():
        raise PruneAuditError(f"{option} {directory} is an existing file; pass a directory path")
    for parent in directory.parents:
        if parent.exists():
            if not parent.is_dir():
                raise PruneAuditError(
                    f"{option} {directory} is not writable: {parent} is a file, not a folder; pass another {option}"
                )
            break
    resolved = Path(os.path.realpath(directory))
    if resolved == Path(resolved.anchor):
        raise PruneAuditError(f"{option} {directory} is the filesystem root; pass a folder of its own")
    if shared:
        _check_not_inside_outputs(directory, command, option)
    if not directory.is_dir():
        return directory
    owner = read_owner(directory)
    if owner is None:
        if shared or _is_empty(directory):
            return directory
        # another shard of the same run may have written its marker since it was read: read it once more
        owner = read_owner(directory)
    if owner is None:
        raise PruneAuditError(
            f"{option} {directory} already holds files that no prune-audit {command} wrote ({_held_files(directory)}); "
            f"pass a new or empty folder"
        )
    if owner.command != command:
        raise PruneAuditError(
            f"{directory} holds the outputs of prune-audit {owner.command} ({_held_files(directory)}"
            f"{_settings_text(owner.settings, list(owner.settings or {})[:3], '; settings ')}); "
            f"{command} never writes there: pass another {option}"
        )
    if settings is not None:
        if owner.settings is None:
            raise PruneAuditError(
                f"{directory} holds prune-audit {command} outputs whose settings were not recorded; "
                f"pass another {option}"
            )
        changed = differing_settings(owner.settings, dict(settings))
        if changed:
            raise PruneAuditError(
                f"{directory} holds prune-audit {command} outputs of other settings ({', '.join(changed[:3])})"
                f"{_settings_text(owner.settings, changed[:3], ', written with ')}; "
                f"pass another {option}, or the same settings to resume"
            )
    check_no_links(directory, option)
    return directory


def _check_not_inside_outputs(directory: Path, command: str, option: str) -> None:
    """A folder that also holds the user's files (``shared``) lies in no command's folder: neither the folder
    itself (checked by the caller) nor any folder above it carries an owner marker."""
    for folder in Path(os.path.realpath(directory)).parents:
        if (folder / OWNER_FILE).is_file():
            owner = read_owner(folder)
            raise PruneAuditError(
                f"{option} {directory} lies inside {folder}, the outputs of prune-audit "
                f"{owner.command if owner else 'another command'}; {command} never writes there: "
                f"pass another {option}"
            )


def check_owned_paths(directory: Path, paths: Iterable[Path], option: str = "--out") -> None:
    """Each of ``paths`` (files below ``directory``, the command's own folder) can be written without leaving
    the folder: no part below ``directory`` is a symbolic link, a file where a folder is needed or a folder
    where the file goes. Writes nothing; the writer checks again right before it writes."""
    for path in paths:
        current = directory
        parts = Path(path).relative_to(directory).parts
        for index, part in enumerate(parts):
            current = current / part
            if current.is_symlink():
                raise link_refusal(current, option)
            if not current.exists():
                break
            last = index == len(parts) - 1
            if current.is_dir() == last:
                kind = "a folder, where a file" if last else "a file, where a folder"
                raise PruneAuditError(f"{current} is {kind} is written; remove it, or pass another {option}")


def remove_written(directory: Path, paths: Sequence[Path]) -> None:
    """Remove ``paths`` (files this command wrote below ``directory``), then the folders they leave empty, so a
    failed first attempt leaves nothing that blocks a corrected retry."""
    for path in reversed(paths):
        Path(path).unlink(missing_ok=True)
        folder = Path(path).parent
        while folder != directory and directory in folder.parents:
            try:
                folder.rmdir()
            except OSError:
                break  # not empty: holds something else
            folder = folder.parent


def _settings_text(settings: Mapping[str, Any] | None, keys: Sequence[str], lead: str) -> str:
    """``lead`` and ``key=value`` of the recorded ``settings`` named, each value cut at 80 characters; "" for none."""
    if not settings or not keys:
        return ""
    shown = [f"{key}={json.dumps(settings.get(key), default=str)}" for key in keys]
    return lead + ", ".join(text if len(text) <= 80 else text[:77] + "..." for text in shown)


def differing_settings(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Keys whose JSON values differ."""
    normalise = lambda value: json.loads(json.dumps(value, default=str))  # noqa: E731
    return [key for key in sorted(set(old) | set(new)) if normalise(old.get(key)) != normalise(new.get(key))]


@contextmanager
def hold_output_dir(
    directory: str | Path,
    command: str,
    settings: Mapping[str, Any] | None = None,
    *,
    option: str = "--out",
    shard: str | None = None,
    writes: Sequence[str] = (),
) -> Iterator[Path]:
    """Own ``directory`` as ``command``'s output while the block writes into it.

    Creates the folder if needed, takes its write lock (``shard``: see ``DirectoryLock``),
    checks it again under the lock (``check_output_dir``), records the owner marker with
    ``settings`` before anything else is written, and, under an exclusive lock, removes the
    staging folders and the temporary files of ``writes`` (shell patterns of the files the
    command writes there) that a killed run left. When the block fails before any output
    exists, the folders this call created are removed again.
    """
    directory = Path(directory)
    check_output_dir(directory, command, settings, option)
    created = _first_missing(directory)
    with DirectoryLock(directory, shard=shard, option=option):
        check_output_dir(directory, command, settings, option)  # a command that planned at the same time may own it now
        claimed = _write_marker(directory, command, settings)
        if shard is None:
            remove_partial_files(directory, [OWNER_FILE, *writes])
            remove_staging_folders(directory)
        try:
            yield directory
        except BaseException:
            if claimed and shard is None and _holds_no_output(directory):
                _unclaim(directory, created)
            raise


def _first_missing(directory: Path) -> Path | None:
    """The outermost folder of ``directory``'s path that does not exist yet (None: it exists)."""
    missing = None
    for folder in (directory, *directory.parents):
        if folder.exists():
            break
        missing = folder
    return missing


def _write_marker(directory: Path, command: str, settings: Mapping[str, Any] | None) -> bool:
    """Record ``command`` as the owner unless a marker exists; whether this call wrote it."""
    marker = directory / OWNER_FILE
    if marker.is_file():
        return False
    content = {"command": command, "settings": None if settings is None else dict(settings)}
    write_text_atomic(json.dumps(content, indent=2, default=str) + "\n", marker)
    return True


def _holds_no_output(directory: Path) -> bool:
    return all(path.name == OWNER_FILE or _is_lock_file(path.name) for path in directory.iterdir())


def _unclaim(directory: Path, created: Path | None) -> None:
    """Undo a claim that wrote nothing: remove the marker, and the folders this command created.

    A folder that existed before is left as it was (empty but for lock files), so a
    corrected command with other settings may adopt it.
    """
    (directory / OWNER_FILE).unlink(missing_ok=True)
    if created is None:
        return
    for path in directory.iterdir():
        if _is_lock_file(path.name):
            path.unlink(missing_ok=True)
    folder = directory
    while True:
        try:
            folder.rmdir()
        except OSError:
            return  # something else appeared meanwhile: keep it
        if folder == created:
            return
        folder = folder.parent
