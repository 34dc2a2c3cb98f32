"""The bundled demo models, trained on synthetic shape scenes, and their question set.

``demo`` (LLaVA architecture) ships in ``prune_audit/assets/demo`` (see its MODEL_CARD.md);
``demo-qwen`` (Qwen2.5-VL architecture) in ``prune_audit/assets/demo-qwen`` (its own MODEL_CARD.md);
``demo-video`` is ``demo-qwen`` continued on synthetic clips, the default model of the clip tasks.
Both answer the yes/no questions only. ``demo-tasks`` and ``demo-qwen-tasks`` are the same two
architectures trained on the task mix (yes/no, short answers, multiple choice, captions; ``demo-tasks`` then
also on reading and grounding): the default model of every task but POPE. The question set is generated deterministically into a cache folder on
first use.
"""

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "demo"
DEMO_QWEN_MODEL_DIR = DEMO_MODEL_DIR.parent / "demo-qwen"
# names accepted by `--model` for the bundled checkpoints
DEMO_MODELS: dict[str, Path] = {
    "demo": DEMO_MODEL_DIR,
    "demo-qwen": DEMO_QWEN_MODEL_DIR,
    "demo-tasks": DEMO_MODEL_DIR.parent / "demo-tasks",
    "demo-qwen-tasks": DEMO_MODEL_DIR.parent / "demo-qwen-tasks",
    "demo-video": DEMO_MODEL_DIR.parent / "demo-video",
}
# the default model of a task's runs (`run --task T` without --model): the yes/no demo for POPE, which in-LLM
# pruning hurts as the calibration study describes, and the task demo for every task it was trained on
TASK_DEMO = "demo-tasks"
# the default model of the clip tasks (``Task.reads_clips``): the Qwen2.5-VL demo continued on clips
VIDEO_DEMO = "demo-video"


def default_demo(tasks) -> str:
    """The bundled demo that answers ``tasks`` (task names) when no ``--model`` is given; clip tasks and still-image
    tasks have no demo in common (a one-line PruneAuditError)."""
    from prune_audit.errors import PruneAuditError
    from prune_audit.tasks.registry import task_classes

    clips = {cls.name for cls in task_classes() if cls.reads_clips}
    if any(task in clips for task in tasks):
        if not all(task in clips for task in tasks):
            raise PruneAuditError(
                f"no bundled demo answers both clips ({', '.join(sorted(clips))}) and still images; name the clip "
                "tasks alone, or pass --model"
            )
        return VIDEO_DEMO
    return "demo" if all(task == "pope" for task in tasks) else TASK_DEMO
