"""The vision tower runs once per image for every selector (issue 18, item 5).

A second vision pass (e.g. recomputing features for a selector's signals) would make
input-level selectors slower than dense; this counts the images the tower encodes.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import QUESTIONS, WORDS, random_image

from prune_audit.models import load_vlm
from prune_audit.models.build import build_clip
from prune_audit.models.llava import LlavaModel
from prune_audit.models.qwen import QwenModel
from prune_audit.pruners import get_selector


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("vision_once")
    llava = LlavaModel.build_tiny(root / "llava", words=WORDS, text_layers=3)
    clip = build_clip(root / "clip", words=WORDS, vision_hidden_size=64)
    qwen = QwenModel.build_tiny(root / "qwen", words=WORDS, image_size=224, text_layers=3)
    return {"llava": load_vlm(llava, device="cpu", clip_text=clip), "qwen": load_vlm(qwen, device="cpu")}


def tower(vlm) -> torch.nn.Module:
    """The module every vision pass enters once: CLIP's patch embedding (the adapter runs the
    CLIP layers itself), Qwen's whole vision tower."""
    return vlm.vision_tower.embeddings if vlm.family == "llava" else vlm.model.model.visual


def images_encoded(vlm, run) -> int:
    """Images passed through the vision tower while ``run()`` executes."""
    seen = []

    def count(module, args, kwargs):
        pixels = args[0] if args else next(iter(kwargs.values()))
        # LLaVA: (B, 3, H, W); Qwen: flattened patches of every image, grid_thw gives the image count
        grid = kwargs.get("grid_thw", args[1] if len(args) > 1 else None)
        seen.append(pixels.shape[0] if grid is None else grid.shape[0])

    handle = tower(vlm).register_forward_pre_hook(count, with_kwargs=True)
    try:
        run()
    finally:
        handle.remove()
    return sum(seen)


@pytest.mark.parametrize("family", ["llava", "qwen"])
def test_vision_tower_runs_once_per_image_under_every_selector(models, family):
    vlm = models[family]
    prepared = [vlm.prepare(random_image(seed), question) for seed, question in enumerate(QUESTIONS)]
    for name in [None, *vlm.supported_selectors()]:
        selector = None if name is None else get_selector(name)
        budget = None if name is None else prepared[0].num_visual // 2
        encoded = images_encoded(
            vlm, lambda: vlm.answer(prepared, selector, budget, generator=torch.Generator().manual_seed(0))
        )
        # the named exception: a selector that prunes inside the tower reruns it (merging_tower) beside the stock
        # pass the adapter makes for every selector; the cost columns count both passes
        passes = 2 if selector is not None and "merging_tower" in selector.requires else 1
        assert encoded == passes * len(prepared), f"{name}: {encoded} images encoded for {len(prepared)} questions"
