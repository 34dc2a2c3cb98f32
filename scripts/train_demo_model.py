"""Retrain the bundled demo model: ``python scripts/train_demo_model.py --out DIR [--seed 1 --steps 1000]``.

The same as ``prune-audit demo train``; see prune_audit/assets/demo/MODEL_CARD.md for the recipe.
"""

import sys

from prune_audit.cli.demo import app

if __name__ == "__main__":
    app(["train", *sys.argv[1:]], prog_name="train_demo_model.py")
