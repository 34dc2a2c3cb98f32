"""Where the demo lives: the shipped checkpoint and the (cached) demo question set.

``prune-audit run`` and ``prune-audit visualize`` fall back to these when no model and
no questions are given: POPE's files, or for ``--task gqa|scienceqa|caption`` the demo's
files of that task about the same images, for ``--task textvqa|refcoco`` about the same scenes
drawn with a word (``demo.task_files``), for ``--task video_presence|video_mc`` the demo clips
(``demo.clip_files``). A model that ``demo train`` wrote reads the same
question files by default.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from prune_audit.demo import DEMO_MODELS
from prune_audit.errors import PruneAuditError

if TYPE_CHECKING:
    from prune_audit.demo.questions import DemoQuestionSet

DEMO_TASKS = ("gqa", "scienceqa", "caption", "textvqa", "refcoco")
"""Tasks besides POPE with demo question files (``demo.task_files``)."""
CLIP_TASKS = ("video_presence", "video_mc")
"""The clip tasks with demo files (``demo.clip_files``: the demo clips' frame folders, questions and tracks)."""


@dataclass(frozen=True)
class DemoAssets:
    """The demo checkpoint folder and the demo question set's files.

    Attributes:
        model_dir: folder loadable with ``from_pretrained`` (the shipped checkpoint).
        pope_files: the POPE question files, random / popular / adversarial.
        images_dir: folder of the question set's images.
        annotations: COCO instances file with the exact object masks.
        question_set: the demo question set these files belong to.
    """

    model_dir: Path
    pope_files: tuple[Path, ...]
    images_dir: Path
    annotations: Path
    question_set: DemoQuestionSet

    def questions(self, task: str) -> tuple[tuple[Path, ...], Path, Path | None]:
        """(``--questions``, ``--images``, ``--annotations``) of ``task`` on the demo images.

        Raises:
            PruneAuditError: the demo has no questions of ``task`` (a plug-in task).
        """
        if task == "pope":
            return self.pope_files, self.images_dir, self.annotations
        if task in CLIP_TASKS:
            from prune_audit.demo.clip_files import demo_clip_files

            clips = demo_clip_files()  # written into the cache on the first such run
            return clips.questions(task), clips.videos, clips.evidence(task)
        if task not in DEMO_TASKS:
            raise PruneAuditError(
                f"the bundled demo has no {task} questions (it has {', '.join(('pope', *DEMO_TASKS, *CLIP_TASKS))}); "
                f"pass --questions FILE... with --images DIR"
            )
        from prune_audit.demo.questions import demo_task_files

        files = demo_task_files(self.question_set)  # written into the cache on the first such run
        return files.questions(task), files.images(task) or self.images_dir, files.evidence(task)


def is_demo_name(model: str | None) -> bool:
    """Whether ``--model`` names a bundled demo (``demo``, ``demo-qwen``) rather than a folder."""
    return model in DEMO_MODELS and not Path(model).exists()


def is_demo_trained(model: str | None) -> bool:
    """Whether ``--model`` is a folder ``prune-audit demo train`` wrote (its ``training.json`` names a recipe):
    such a model reads the demo question set by default, as the bundled demos do."""
    import json

    summary = Path(model) / "training.json" if model is not None else None
    if summary is None or not summary.is_file():
        return False
    try:
        return "recipe" in json.loads(summary.read_text())
    except (OSError, ValueError):
        return False


def demo_assets(cache_dir: str | Path | None = None, name: str = "demo") -> DemoAssets:
    """The shipped model ``name`` and the demo question set (generated into the cache on first use)."""
    from prune_audit.data.pope import POPE_SPLITS
    from prune_audit.demo.questions import demo_question_set

    if name not in DEMO_MODELS:
        raise PruneAuditError(f"no bundled demo model {name!r}; the demos are {', '.join(DEMO_MODELS)}")
    model_dir = DEMO_MODELS[name]
    if not (model_dir / "config.json").is_file():
        raise PruneAuditError(
            f"the bundled demo checkpoint is missing from {model_dir}; reinstall prune-audit, or train it with "
            f"`prune-audit demo train --model {name} --out DIR` and pass --model DIR"
        )
    question_set = demo_question_set(cache_dir)
    return DemoAssets(
        model_dir=model_dir,
        pope_files=tuple(question_set.question_file(split) for split in POPE_SPLITS),
        images_dir=question_set.image_dir,
        annotations=question_set.instances,
        question_set=question_set,
    )
