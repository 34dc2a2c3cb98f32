"""The demo trainer's checkpoint: written at every monitor step, removed with the final save.

Rerunning the same ``demo train`` command on its folder continues from it (``resume``). Batches are a
function of (seed, step) and nothing else draws random numbers, so a resumed run ends with the weights an
uninterrupted one would have (tests/test_demo_tasks.py).
"""

from __future__ import annotations

import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from prune_audit.safety.atomic import staging_folder

if TYPE_CHECKING:
    from torch import nn

    from prune_audit.demo.train import DemoRecipe
    from prune_audit.models.base import VisionLanguageModel

CHECKPOINT_FILE = "checkpoint.pt"


def save_checkpoint(
    out_dir: Path,
    recipe: DemoRecipe,
    step: int,
    minutes: float,
    history: list[dict],
    vlm: VisionLanguageModel,
    heads: nn.Module,
    optimizer: torch.optim.Optimizer,
) -> None:
    """Write everything a resumed run needs after ``step`` (float32 weights, heads, optimiser state) to
    ``out_dir/CHECKPOINT_FILE``, replacing the previous one only once complete."""
    out_dir.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(out_dir)
    try:
        state = {
            "recipe": asdict(recipe),
            "step": step,
            "minutes": minutes,
            "history": history,
            "model": vlm.model.state_dict(),
            "heads": heads.state_dict(),
            "optimizer": optimizer.state_dict(),
        }
        torch.save(state, staging / CHECKPOINT_FILE)
        os.replace(staging / CHECKPOINT_FILE, out_dir / CHECKPOINT_FILE)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def resume(
    out_dir: Path, recipe: DemoRecipe, vlm: VisionLanguageModel, heads: nn.Module, optimizer: torch.optim.Optimizer
) -> tuple[int, list[dict], float]:
    """Load ``out_dir``'s checkpoint into the model, heads and optimiser when there is one.

    Returns the first step still to train, the monitor history so far and the minutes already trained
    (0, [], 0.0 without a checkpoint). Batches are a function of (seed, step) and nothing else draws
    random numbers, so a resumed run ends with the weights an uninterrupted one would have.
    """
    path = out_dir / CHECKPOINT_FILE
    if not path.is_file():
        return 0, [], 0.0
    state = torch.load(path, weights_only=True)
    if state["recipe"] != asdict(recipe):
        raise ValueError(f"{path} was written by another recipe; use another --out, or delete it to start again")
    vlm.model.load_state_dict(state["model"])
    heads.load_state_dict(state["heads"])
    optimizer.load_state_dict(state["optimizer"])
    return state["step"], state["history"], state["minutes"]
