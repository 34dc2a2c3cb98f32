"""The vision tower runs once per image for every selector (issue 18, item 5).

A second vision pass (e.g. recomputing features for a selector's signals) would make
input-level selectors slower than dense; this counts the images the tower encodes.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import QUESTIONS, WORDS, random_image

from prune_audit.errors import PruneAuditError
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
    selectors = [None, *map(get_selector, vlm.supported_selectors())]
    if "merging_tower" in vlm.input_signals:  # ToMe's tower option reruns the tower too
        selectors.append(get_selector("tome", location="tower"))
    for selector in selectors:
        name = None if selector is None else selector.name
        budget = None if selector is None else prepared[0].num_visual // 2
        prompts = prepared
        if getattr(selector, "resizes_image", False):  # downsample on Qwen: the resized image is the one encoded
            try:
                prompts = [vlm.prepare_for(random_image(seed), q, selector, budget) for seed, q in enumerate(QUESTIONS)]
            except PruneAuditError:  # a fixed-resolution processor has no smaller image: refused in one line
                continue
        encoded = images_encoded(
            vlm, lambda: vlm.answer(prompts, selector, budget, generator=torch.Generator().manual_seed(0))
        )
        # a selector that prunes inside the tower (merging_tower) runs it once, with its step, in place of the stock
        assert encoded == len(prepared), f"{name}: {encoded} images encoded for {len(prepared)} questions"


@pytest.mark.parametrize("options", [{"name": "flowcut"}, {"name": "tome", "location": "tower"}])
def test_a_tower_selector_keeping_every_token_runs_the_stock_tower_once(models, options):
    """At a budget of every token the tower selector runs no rerun: the deferred stock pass runs, once, and the
    answer is the unpruned one."""
    vlm = models["llava"]
    prepared = [vlm.prepare(random_image(seed), question) for seed, question in enumerate(QUESTIONS)]
    selector = get_selector(**options)
    answers = []
    encoded = images_encoded(vlm, lambda: answers.extend(vlm.answer(prepared, selector, prepared[0].num_visual)))
    unpruned = vlm.answer(prepared)
    assert encoded == len(prepared)
    assert [a.p_yes for a in answers] == [a.p_yes for a in unpruned]
    assert [a.cost.flops for a in answers] == [a.cost.flops_dense for a in unpruned]
