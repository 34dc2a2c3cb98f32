"""The demo question set: held-out synthetic scenes as COCO, with POPE questions built from them.

The scenes come from the held-out stream (never seen in training), are exported with
exact RLE masks (``data.scenes.export_coco``), and the three POPE splits are built by
the same builder as for real COCO (``data.pope_build.build_pope``: images with at least
three objects, first three objects as positives, random / popular / adversarial
negatives). Everything is a function of the seeds below, so the set is generated once
into a cache folder and is identical on every machine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prune_audit.errors import PruneAuditError
from prune_audit.safety.lock import DirectoryLock
from prune_audit.safety.ownership import check_output_dir

if TYPE_CHECKING:
    from prune_audit.demo.task_files import DemoTaskFiles

DEMO_IMAGE_SIZE = 96
DEMO_SCENE_SEED = 2026
DEMO_SCENES = 1000  # 522 of them hold three or more objects
DEMO_POPE_IMAGES = 500  # as POPE: 500 images x 6 questions per split
DEMO_POPE_SEED = 0
QUESTION_PREFIX = "demo"
_COMPLETE_MARKER = ".complete"


@dataclass(frozen=True)
class DemoQuestionSet:
    """Paths of a generated demo question set."""

    root: Path

    @property
    def instances(self) -> Path:
        return self.root / "instances.json"

    @property
    def image_dir(self) -> Path:
        return self.root / "images"

    def question_file(self, split: str) -> Path:
        """POPE JSON Lines file of ``split`` (random, popular or adversarial)."""
        return self.root / f"{QUESTION_PREFIX}_pope_{split}.json"


def default_cache_dir() -> Path:
    """``$PRUNE_AUDIT_CACHE``, else ``$XDG_CACHE_HOME/prune-audit``, else ``~/.cache/prune-audit``."""
    if os.environ.get("PRUNE_AUDIT_CACHE"):
        return check_cache_dir(Path(os.environ["PRUNE_AUDIT_CACHE"]), "PRUNE_AUDIT_CACHE")
    if os.environ.get("XDG_CACHE_HOME"):
        return check_cache_dir(Path(os.environ["XDG_CACHE_HOME"]) / "prune-audit", "XDG_CACHE_HOME")
    return check_cache_dir(Path.home() / ".cache" / "prune-audit", "HOME", fix="set PRUNE_AUDIT_CACHE to a folder")


def check_cache_dir(path: Path, named_by: str, fix: str | None = None) -> Path:
    """``path`` unless it (or the nearest existing path above it) is not a folder; ``named_by`` chose it."""
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise PruneAuditError(
            f"the prune-audit cache folder {path} (from {named_by}) cannot be made: {existing} is a file, not a "
            f"folder; {fix or f'point {named_by} to a folder'}"
        )
    return path


def demo_question_set(
    cache_dir: str | Path | None = None,
    *,
    scenes: int = DEMO_SCENES,
    pope_images: int = DEMO_POPE_IMAGES,
    seed: int = DEMO_SCENE_SEED,
) -> DemoQuestionSet:
    """The demo question set in ``cache_dir``, generated on first use (a few seconds; see ``_cached_folder``)."""
    cache = _checked_cache(cache_dir)
    name = f"demo-questions-seed{seed}-scenes{scenes}-pope{pope_images}-{DEMO_IMAGE_SIZE}px"

    def build(staging: Path) -> None:
        from prune_audit.data.coco import CocoInstances
        from prune_audit.data.pope_build import build_pope, write_pope_files
        from prune_audit.data.scenes import export_coco

        instances = export_coco(staging, seed=seed, count=scenes, image_size=DEMO_IMAGE_SIZE, split="heldout")
        questions = build_pope(CocoInstances.load(instances), sample_images=pope_images, seed=DEMO_POPE_SEED)
        write_pope_files(questions, staging, prefix=QUESTION_PREFIX)

    return DemoQuestionSet(_cached_folder(cache, name, build))


def demo_task_files(question_set: DemoQuestionSet, *, scenes: int | None = None) -> DemoTaskFiles:
    """The GQA, ScienceQA and caption files about ``question_set``'s first scenes, in a cache folder beside it,
    written on first use (``demo.task_files``; under a second)."""
    from prune_audit.data.coco import read_json
    from prune_audit.demo.task_files import (
        DEMO_TASK_SCENES,
        TASK_FILES_VERSION,
        DemoTaskFiles,
        write_task_files,
    )

    coco = read_json(question_set.instances, "demo instances file", "remove the demo cache folder to rebuild it")
    info = coco["info"]
    scenes = min(scenes or DEMO_TASK_SCENES, len(coco["images"]))
    name = f"{question_set.root.name}-tasks{scenes}-v{TASK_FILES_VERSION}"

    def build(staging: Path) -> None:
        write_task_files(
            staging, question_set.instances, seed=info["seed"], scenes=scenes, image_size=info["image_size"]
        )

    return DemoTaskFiles(_cached_folder(question_set.root.parent, name, build))


def _checked_cache(cache_dir: str | Path | None) -> Path:
    cache = check_cache_dir(Path(cache_dir), "--cache-dir") if cache_dir is not None else default_cache_dir()
    check_output_dir(cache, "demo questions", option="--cache-dir", shared=True)  # a cache, never a command's outputs
    return cache


def _cached_folder(cache: Path, name: str, build: Callable[[Path], None]) -> Path:
    """``cache/name``, made by ``build(staging)`` on first use.

    Generation writes into a temporary sibling folder and renames it when complete, so
    an interrupted run never leaves a half-written folder behind; a lock in the cache folder
    lets one process build while the others wait for its result.
    """
    root = cache / name
    if (root / _COMPLETE_MARKER).is_file():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    # one builder at a time (processes of several users may share one cache); a complete
    # folder is never touched again, so readers need no lock
    with DirectoryLock(cache, wait=True, name=f".{name}.lock"):
        if (root / _COMPLETE_MARKER).is_file():
            return root  # built by another process while this one waited
        for leftover in cache.glob(f".{name}-*"):  # staging folders of killed builders
            shutil.rmtree(leftover, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=cache))
        try:
            build(staging)
            (staging / _COMPLETE_MARKER).write_text("")
            if root.exists():  # an incomplete leftover of an older version
                shutil.rmtree(root)
            staging.rename(root)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return root


def first_questions(question_files: Sequence[Path], per_split: int, out_dir: Path) -> list[Path]:
    """Copies of ``question_files`` holding their first ``per_split`` questions, in ``out_dir``.

    A file already there with the same content is left alone, so a finished run over the
    subset can be resumed or reused. The demo pruning table and its tests run on these.
    """
    if per_split <= 0:
        raise ValueError(f"per_split must be positive, got {per_split}")
    out_dir.mkdir(parents=True, exist_ok=True)
    subset = []
    for path in question_files:
        target = out_dir / Path(path).name
        text = "".join(Path(path).read_text().splitlines(keepends=True)[:per_split])
        if not target.is_file() or target.read_text() != text:
            target.write_text(text)
        subset.append(target)
    return subset
