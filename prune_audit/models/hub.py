"""Model sources: a local folder, or a hub id answered from the local cache when the hub is unreachable.

Without this check a hub id on an offline machine costs about half a minute of
retries before a multi-line error; here it is one line within a few seconds.
"""

from __future__ import annotations

import os
import re
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

from prune_audit.errors import PruneAuditError

HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
REACH_TIMEOUT_S = 3.0


def hub_reachable(timeout: float = REACH_TIMEOUT_S) -> bool:
    """Whether the hub endpoint accepts a TCP connection within ``timeout`` seconds (DNS included)."""
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    address = (endpoint.hostname or "huggingface.co", endpoint.port or (80 if endpoint.scheme == "http" else 443))
    result: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection(address, timeout=timeout).close()
            result.append(True)
        except OSError:
            result.append(False)

    worker = threading.Thread(target=connect, daemon=True)  # getaddrinfo ignores socket timeouts
    worker.start()
    worker.join(timeout)
    return bool(result and result[0])


def _offline_requested() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in {"1", "true", "yes", "on"}


def resolve_model_source(source: str, option: str = "--model") -> str:
    """``source`` when it is a local folder or a reachable hub id; a cached snapshot folder
    when the hub is unreachable; otherwise a one-line PruneAuditError."""
    path = Path(source).expanduser()
    if path.exists():
        if not path.is_dir():
            raise PruneAuditError(f"{option} {source} is a file; pass the checkpoint folder (with config.json)")
        return str(path)
    if not HUB_ID.match(source):
        raise PruneAuditError(f"model folder not found: {source}; pass an existing folder with {option}")
    if not _offline_requested() and hub_reachable():
        return source
    cached = cached_snapshot(source)
    if cached is not None:
        return str(cached)
    raise PruneAuditError(
        f"model {source!r} is not a local folder nor in the hub cache, and the hub is unreachable; "
        f"pass a local checkpoint folder with {option}"
    )


def cached_snapshot(hub_id: str) -> Path | None:
    """The folder of ``hub_id``'s snapshot in the local hub cache (the one holding its config.json), else None."""
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(hub_id, "config.json")
    return Path(cached).parent if isinstance(cached, str) else None


WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


def local_weights(source: str) -> Path | None:
    """The local folder holding ``source``'s config.json and weight files (a folder path, or a hub id's cached
    snapshot), without touching the network; None when either is missing."""
    path = Path(source).expanduser()
    folder = path if path.is_dir() else cached_snapshot(source) if HUB_ID.match(source) else None
    if folder is None or not (folder / "config.json").is_file():
        return None
    return folder if any(next(folder.glob(pattern), None) for pattern in WEIGHT_PATTERNS) else None
