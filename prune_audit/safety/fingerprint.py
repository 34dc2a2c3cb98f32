"""Content fingerprints: sha256 of files, and of the images a run uses (cached by file state).

Records depend on the pixels of the images, not on their paths; size and mtime differ
across machines and copies, so the manifest pins the sha256 of each used image. Hashes
are cached in a JSON file keyed by the real path and the file's state (``file_state``):
an unchanged file is not read again, a changed one is. The state includes the ctime,
which the kernel sets on every write and which no user call can set back, so an in-place
edit that restores size and mtime (``touch -r``, ``os.utime``) and keeps the inode is
still seen. A hash taken within ``SETTLE_NS`` of the file's last change is not trusted
later (the file may have changed again within one timestamp tick); it is taken anew.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prune_audit.errors import PruneAuditError
from prune_audit.safety.atomic import write_text_atomic
from prune_audit.safety.inputs import check_input_file

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


def weight_files(source: str | Path) -> list[Path]:
    """The weight files directly in a checkpoint folder (none for a hub id, or a processor folder)."""
    folder = Path(source)
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in WEIGHT_SUFFIXES)


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


SETTLE_NS = 2_000_000_000
"""A cached hash counts only if taken this long after the file's last change (coarse filesystem clocks)."""


def file_state(state: os.stat_result) -> list[int]:
    """What changes whenever a file's bytes may have: size, mtime, ctime, inode and device."""
    return [state.st_size, state.st_mtime_ns, state.st_ctime_ns, state.st_ino, state.st_dev]


def _trusted(entry: Any, state: list[int]) -> bool:
    """A cache entry ``[*state, hashed_at_ns, sha256]`` of this very state, hashed after it settled."""
    return (
        isinstance(entry, list)
        and len(entry) == len(state) + 2
        and entry[: len(state)] == state
        and isinstance(entry[-2], int)
        and entry[-2] - state[2] > SETTLE_NS
    )


class HashCache:
    """sha256 per file, remembered across processes in ``cache_file`` (None: this process only)."""

    def __init__(self, cache_file: str | Path | None) -> None:
        self.cache_file = Path(cache_file) if cache_file is not None else None
        self.entries: dict[str, list[Any]] = {}
        self.changed = False
        if self.cache_file is not None and self.cache_file.is_file():
            try:
                self.entries = dict(json.loads(self.cache_file.read_text(encoding="utf-8")))
            except (ValueError, OSError, TypeError):
                self.entries = {}  # a damaged cache only costs re-hashing

    def sha256(self, path: str | Path) -> str:
        real = os.path.realpath(path)
        state = file_state(os.stat(real))
        cached = self.entries.get(real)
        if _trusted(cached, state):
            return str(cached[-1])
        hashed_at = time.time_ns()  # before reading: a change during the read shows as a later ctime
        digest = file_sha256(real)
        self.entries[real] = [*state, hashed_at, digest]
        self.changed = True
        return digest

    def save(self) -> None:
        """Write the cache (best effort: an unwritable cache folder only costs re-hashing)."""
        if self.cache_file is None or not self.changed:
            return
        try:
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomic(json.dumps(self.entries), self.cache_file)
        except OSError:
            pass


def check_pinned_file(
    path: str | Path, sha256: str | None, source: str, fix: str, cache_file: str | Path | None = None
) -> Path:
    """``path``, an input pinned by ``source`` (e.g. a run's manifest), if it still holds the pinned bytes.

    Raises:
        PruneAuditError: the file is gone or has other content, ending with ``fix``.
    """
    check_input_file(path, f"the file named in {source}", fix, limit_size=False)
    cache = HashCache(cache_file)
    digest = cache.sha256(path)
    cache.save()
    if digest != sha256:
        raise PruneAuditError(f"{path} has other content than when {source} pinned it (sha256 differs); {fix}")
    return Path(path)


def images_fingerprint(paths: Mapping[str, Path], cache_file: str | Path | None = None) -> dict[str, Any]:
    """``{"sha256": digest of every (name, file sha256), "count": n, "files": {name: sha256}}``.

    Args:
        paths: image name as the questions give it -> file; names in first-use order.
        cache_file: where hashes are remembered between runs.
    """
    cache = HashCache(cache_file)
    files = {name: cache.sha256(path) for name, path in paths.items()}
    cache.save()
    return {"sha256": combined_sha256(files), "count": len(files), "files": files}


def embedded_fingerprint(images: Mapping[str, bytes]) -> dict[str, Any]:
    """``images_fingerprint`` of images embedded in the question files (name -> bytes), hashed from the bytes."""
    files = {name: hashlib.sha256(data).hexdigest() for name, data in images.items()}
    return {"sha256": combined_sha256(files), "count": len(files), "files": files}


def combined_sha256(files: Mapping[str, str]) -> str:
    """One sha256 over ``name -> file sha256`` pairs, independent of their order."""
    digest = hashlib.sha256()
    for name in sorted(files):
        digest.update(f"{name}\0{files[name]}\n".encode())
    return digest.hexdigest()


def first_differing_image(old: Mapping[str, Any], new: Mapping[str, Any]) -> str | None:
    """The first image name (in ``new``'s order) whose content differs from ``old``'s; None if equal."""
    old_files, new_files = old.get("files") or {}, new.get("files") or {}
    for name, digest in new_files.items():
        if old_files.get(name) != digest:
            return name
    for name in old_files:
        if name not in new_files:
            return name
    return None
