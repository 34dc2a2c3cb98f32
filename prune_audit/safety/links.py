"""No command writes through a symbolic link it did not make.

No command makes one, so a link inside a command's folder (its ``images/`` pointing at a user's folder, its
lock file pointing at a user's file) is someone else's, and writing through it would write outside the folder.
"""

from __future__ import annotations

import os
from pathlib import Path

from prune_audit.errors import PruneAuditError


def link_refusal(path: Path, option: str) -> PruneAuditError:
    """The one-line refusal of the link ``path`` found where a command was about to write."""
    return PruneAuditError(
        f"{path} is a symbolic link that prune-audit did not make (to {os.readlink(path)}); "
        f"commands never write through one: remove the link, or pass another {option}"
    )


def check_no_links(directory: Path, option: str) -> None:
    """No symbolic link anywhere inside ``directory``, a command's own folder."""
    for root, folders, files in os.walk(directory):  # os.walk does not descend into linked folders
        for name in (*folders, *files):
            if (Path(root) / name).is_symlink():
                raise link_refusal(Path(root) / name, option)


def check_not_dangling(directory: Path, option: str) -> None:
    """No link on the way to ``directory`` points nowhere (the first ``mkdir`` would fail as 'File exists')."""
    for path in (directory, *directory.parents):
        if path.is_symlink() and not path.exists():
            raise PruneAuditError(
                f"{option} {directory}: {path} is a symbolic link to {os.readlink(path)}, which does "
                f"not exist; create that folder, or pass another {option}"
            )
