"""Qwen2.5-VL vision-tower pieces that the Qwen signal tests and VScan's Qwen tests share: a tiny Qwen2.5-VL and
demo-qwen loaded once per module, and the tower's window order re-derived."""

from __future__ import annotations

import pytest
import torch
from tiny_models import WORDS

from prune_audit.demo.assets import DEMO_MODELS
from prune_audit.demo.evaluate import load_demo
from prune_audit.models import load_vlm
from prune_audit.models.qwen import QwenModel


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    tiny = QwenModel.build_tiny(tmp_path_factory.mktemp("qwenm") / "qwen", words=WORDS, image_size=168, seed=4)
    return {"tiny": load_vlm(tiny, device="cpu"), "demo-qwen": load_demo(DEMO_MODELS["demo-qwen"])}


def raster_to_window_order(rows: int, cols: int, side: int) -> torch.Tensor:
    """(N,) merged-token raster index at each window slot: ``side x side`` windows tiled from the top left
    (partial ones at the bottom and right edges), windows in raster order, tokens raster inside each."""
    order = []
    for top in range(0, rows, side):
        for left in range(0, cols, side):
            order += [
                r * cols + c for r in range(top, min(top + side, rows)) for c in range(left, min(left + side, cols))
            ]
    return torch.tensor(order)
