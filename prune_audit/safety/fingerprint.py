"""Content fingerprints: sha256 of files, and of the images a run uses (cached by file state).

Records depend on the pixels of the images, not on their paths; size and mtime differ
across machines and copies, so the manifest pins the sha256 of each used image. Hashes
are cached in a JSON file keyed by (real path, size, mtime, inode): an unchanged file is
not read again, a changed one is.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prune_audit.safety.atomic import write_text_atomic


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    digest = hashlib.sha256()
    with Path(path).open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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
        state = os.stat(real)
        key = [state.st_size, state.st_mtime_ns, state.st_ino]
        cached = self.entries.get(real)
        if cached is not None and cached[:3] == key:
            return str(cached[3])
        digest = file_sha256(real)
        self.entries[real] = [*key, digest]
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
