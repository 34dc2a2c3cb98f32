"""The bundled demo models, trained on synthetic shape scenes, and their question set.

``demo`` (LLaVA architecture) ships in ``prune_audit/assets/demo`` (see its MODEL_CARD.md);
``demo-qwen`` (Qwen2.5-VL architecture) in ``prune_audit/assets/demo-qwen`` (its own MODEL_CARD.md).
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
}
# the default model of a task's runs (`run --task T` without --model): the yes/no demo for POPE, which in-LLM
# pruning hurts as the calibration study describes, and the task demo for every task it was trained on
TASK_DEMO = "demo-tasks"


def default_demo(tasks) -> str:
    """The bundled demo that answers ``tasks`` (task names) when no ``--model`` is given."""
    return "demo" if all(task == "pope" for task in tasks) else TASK_DEMO
