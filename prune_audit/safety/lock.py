"""Write locks on output directories: one live writer at a time, stale locks taken over.

A lock is an ``flock`` on a file in the directory that also names its holder (pid, host,
command). The kernel releases it when the holder dies, however it dies, so a lock file
whose holder is gone is stale: the next writer takes it over and says so. Sharded runs
(``--shard I/N``) take the directory lock shared and their shard's lock exclusive, so
shards of one run write together but never twice the same shard, and an unsharded
writer excludes them all.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from prune_audit.errors import PruneAuditError
from prune_audit.safety.links import link_refusal

LOCK_FILE = ".prune-audit.lock"


def _holder() -> dict[str, Any]:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "since": time.strftime("%Y-%m-%d %H:%M:%S"),
        "command": " ".join(Path(sys.argv[0]).name.split() + sys.argv[1:3]),
    }


def _describe(info: dict[str, Any]) -> str:
    if not info:
        return "another prune-audit process"
    return f"pid {info.get('pid')} on {info.get('host')} (since {info.get('since')})"


class DirectoryLock:
    """Context manager holding the write lock of ``directory`` (created if needed).

    Args:
        directory: the output directory.
        shard: None for an exclusive lock; a shard name (e.g. ``0001of0004``) to share the
            directory with other shards while holding that shard exclusively.
        option: the option naming the directory, for the refusal message.
        wait: block until the lock is free instead of refusing (for shared caches).
        name: the lock file's name inside ``directory``.
    """

    def __init__(
        self,
        directory: str | Path,
        shard: str | None = None,
        option: str = "--out",
        wait: bool = False,
        name: str = LOCK_FILE,
    ) -> None:
        self.directory = Path(directory)
        self.shard = shard
        self.option = option
        self.wait = wait
        self.name = name
        self.handles: list[tuple[Any, bool]] = []

    def __enter__(self) -> DirectoryLock:
        self.directory.mkdir(parents=True, exist_ok=True)
        try:
            if self.shard is None:
                self._take(self.directory / self.name, exclusive=True)
            else:
                self._take(self.directory / self.name, exclusive=False)
                self._take(self.directory / f"{self.name}.shard-{self.shard}", exclusive=True)
        except BaseException:
            self.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _take(self, path: Path, exclusive: bool) -> None:
        while True:
            handle = _open_lock_file(path, self.option)
            try:
                mode = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
                fcntl.flock(handle.fileno(), mode if self.wait else mode | fcntl.LOCK_NB)
            except BlockingIOError:
                info = _read_info(handle)
                handle.close()
                what = "this shard of " if self.shard is not None and path.name != self.name else ""
                raise PruneAuditError(
                    f"{what}{self.directory} is being written by {_describe(info)}; wait for it to finish "
                    f"or pass another {self.option}"
                ) from None
            if _still_named(handle, path):
                break
            # the previous holder removed the lock file (and the folder it created) before unlocking
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
            handle.close()
            self.directory.mkdir(parents=True, exist_ok=True)
        self.handles.append((handle, exclusive))
        if not exclusive:
            return
        previous = _read_info(handle)
        if previous:
            print(
                f"notice: took over the stale lock of {self.directory} left by {_describe(previous)}, "
                f"which is no longer running",
                file=sys.stderr,
            )
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(_holder()))
        handle.flush()

    def release(self) -> None:
        """Clear the holder information (so it is not taken for stale) and unlock."""
        for handle, exclusive in reversed(self.handles):
            try:
                if exclusive:
                    handle.seek(0)
                    handle.truncate()
                    handle.flush()
            except OSError:
                pass
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
                handle.close()
        self.handles = []


def _open_lock_file(path: Path, option: str) -> Any:
    """The lock file opened for appending, never through a symbolic link (whose target is someone else's file)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o666)
    except OSError as error:
        if not path.is_symlink():
            raise
        raise link_refusal(path, option) from error
    return os.fdopen(fd, "a+", encoding="utf-8")


def lock_file_names(name: str = LOCK_FILE) -> tuple[str, str]:
    """Shell patterns of the lock files ``DirectoryLock`` creates: the directory's and its shards'."""
    return name, f"{name}.shard-*"


def _still_named(handle: Any, path: Path) -> bool:
    """Whether ``path`` still names the file ``handle`` locked."""
    try:
        return os.stat(path).st_ino == os.fstat(handle.fileno()).st_ino
    except FileNotFoundError:
        return False


def _read_info(handle: Any) -> dict[str, Any]:
    try:
        handle.seek(0)
        text = handle.read().strip()
        return json.loads(text) if text else {}
    except (OSError, ValueError):
        return {}
