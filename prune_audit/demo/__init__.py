"""The bundled demo models, trained on synthetic shape scenes, and their question set.

``demo`` (LLaVA architecture) ships in ``prune_audit/assets/demo`` (see its MODEL_CARD.md);
``demo-qwen`` (Qwen2.5-VL architecture) in ``prune_audit/assets/demo-qwen`` (its own MODEL_CARD.md).
The POPE-style question set is generated deterministically into a cache folder on first use.
"""

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "demo"
DEMO_QWEN_MODEL_DIR = DEMO_MODEL_DIR.parent / "demo-qwen"
# names accepted by `--model` for the bundled checkpoints
DEMO_MODELS: dict[str, Path] = {"demo": DEMO_MODEL_DIR, "demo-qwen": DEMO_QWEN_MODEL_DIR}
