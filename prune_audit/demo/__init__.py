"""The bundled demo: a small LLaVA trained on synthetic shape scenes, and its question set.

The checkpoint ships in ``prune_audit/assets/demo`` (see its MODEL_CARD.md); the POPE-style
question set is generated deterministically into a cache folder on first use.
"""

from pathlib import Path

DEMO_MODEL_DIR = Path(__file__).resolve().parents[1] / "assets" / "demo"
