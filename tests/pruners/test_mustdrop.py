"""Issue 41: MustDrop (liuting20/MustDrop 909afa53), its key set and prefill stages.

The official code re-derived here from its text, independently of the module: the key set of ``clip_encoder.py``
(``attn[:, :, 0, 1:].mean(dim=1)``, ``torch.topk`` of ``ceil(0.08 (N - 1))``) and the prefill stages of
``modelling_sparse_llama.py`` (``dual_attention_filter`` on each pruning layer's attention, joined with the key set
by ``torch.unique``), on random fp32 attention at LLaVA-1.5 shapes; then the count rule, the schedules, and runs on
the demo and a tiny LLaVA whose per-stage records are checked against the filter on the signals each stage saw.
"""

from __future__ import annotations

import math

import pytest
import torch
from tiny_models import QUESTIONS, WORDS, random_image

from prune_audit.api import pruned
from prune_audit.demo.assets import DEMO_MODELS
from prune_audit.demo.evaluate import load_demo
from prune_audit.models import load_vlm
from prune_audit.models.llava import LlavaModel
from prune_audit.pruners.base import Stage
from prune_audit.pruners.mustdrop import MustDropSelector
from prune_audit.pruners.registry import get_selector
from prune_audit.pruners.schedule import average_visual_tokens
from prune_audit.pruners.signals import LayerSignals

HEADS, PATCHES, SYSTEM, VISION_HEADS = 32, 576, 35, 16
THRESHOLDS = {"global_thr": 0.011, "individual_thr": 0.01}


def official_key_set(vision_attention: torch.Tensor) -> set[int]:
    """``clip_encoder.py`` at layer 23: (1, Hv, 1 + N, 1 + N) probabilities -> the key set's patch indices."""
    left = math.ceil(0.08 * (vision_attention.shape[-1] - 1))
    cls_attn = vision_attention[:, :, 0, 1:].mean(dim=1)
    return set(torch.topk(cls_attn, left, dim=1, largest=True).indices[0].tolist())


def official_filter(attn: torch.Tensor, v_token_start: int, img_seq: int) -> torch.Tensor:
    """``dual_attention_filter``: (1, H, L, L) probabilities -> the kept positions in the image span."""
    attn = attn[0]
    text_seq = attn.shape[1] - img_seq - v_token_start
    attn = attn.narrow(1, v_token_start + img_seq, text_seq).narrow(2, v_token_start, img_seq).mean(dim=0)
    attn_sum = attn.sum(dim=0)
    candidate = (attn_sum < attn_sum.sum(dim=0) * THRESHOLDS["global_thr"]) & (
        attn.max(dim=0)[0] < THRESHOLDS["individual_thr"]
    )
    return torch.arange(img_seq)[~candidate]


def causal_probabilities(length: int, generator: torch.Generator, sharpness: float) -> torch.Tensor:
    """(1, H, L, L) causal softmax of random logits (a sharper scale leaves more tokens above the thresholds)."""
    logits = torch.randn(1, HEADS, length, length, generator=generator) * sharpness
    mask = torch.ones(length, length, dtype=torch.bool).triu(1)
    return torch.softmax(logits.masked_fill(mask, float("-inf")), dim=-1)


def vision_probabilities(generator: torch.Generator) -> torch.Tensor:
    logits = torch.randn(1, VISION_HEADS, 1 + PATCHES, 1 + PATCHES, generator=generator) * 2
    return torch.softmax(logits, dim=-1)


def signals(alive: torch.Tensor, text_probs: torch.Tensor, cls_attention: torch.Tensor, layer: int) -> LayerSignals:
    return LayerSignals(
        alive=alive, grid=(24, 24), layer=layer, num_layers=32, text_probs=text_probs,
        layer_cls_attention=cls_attention[None, alive],
    )  # fmt: skip


@pytest.mark.parametrize("text", [20, 45, 80])
@pytest.mark.parametrize("seed", range(10))
def test_official_rule_reproduces_the_dual_attention_filter(seed, text):
    """Four prefill stages (layers 2/6/10/14) as the official loop runs them, against the selector's stages."""
    generator = torch.Generator().manual_seed(seed)
    vision = vision_probabilities(generator)
    keys = official_key_set(vision)
    selector = get_selector("mustdrop", budget_rule="paper")
    stages = selector.schedule(32, PATCHES, 64)
    assert [stage.layer for stage in stages] == [3, 7, 11, 15]
    official_alive, key_positions = torch.arange(PATCHES), torch.tensor(sorted(keys))
    state: dict = {}
    for stage in stages:
        img_seq = official_alive.numel()
        attn = causal_probabilities(SYSTEM + img_seq + text, generator, sharpness=3.0 + seed % 3)
        vis = torch.unique(torch.cat((official_filter(attn, SYSTEM, img_seq), key_positions)))
        key_positions = torch.nonzero(torch.isin(vis, key_positions)).flatten()
        text_probs = attn[0, :, SYSTEM + img_seq :, SYSTEM : SYSTEM + img_seq]
        kept = selector.prune(stage, signals(official_alive, text_probs, vision[0, :, 0, 1:].mean(dim=0), 0), state)
        assert official_alive[kept].tolist() == official_alive[vis].tolist()
        assert keys <= set(official_alive[kept].tolist())
        official_alive = official_alive[vis]
    assert set(state["key_set"].tolist()) == keys


def test_the_thresholds_drop_some_tokens_and_keep_others_in_these_cases():
    """The random cases above are not trivial: a stage keeps more than the key set and drops some tokens."""
    generator = torch.Generator().manual_seed(0)
    attn = causal_probabilities(SYSTEM + PATCHES + 45, generator, sharpness=3.0)
    kept = official_filter(attn, SYSTEM, PATCHES).numel()
    assert 0 < kept < PATCHES


@pytest.mark.parametrize("seed", range(5))
def test_count_rule_keeps_the_key_set_then_the_official_survivors_first(seed):
    generator = torch.Generator().manual_seed(seed)
    cls_attention = torch.rand(PATCHES, generator=generator)
    attn = causal_probabilities(SYSTEM + PATCHES + 40, generator, sharpness=4.0)
    text_probs = attn[0, :, SYSTEM + PATCHES :, SYSTEM : SYSTEM + PATCHES]
    alive = torch.arange(PATCHES)
    official = set(official_filter(attn, SYSTEM, PATCHES).tolist())
    keys = set(torch.topk(cls_attention, 47).indices.tolist())
    selector = get_selector("mustdrop")
    survivors = official | keys
    many = selector.prune(Stage(3, len(survivors) + 10), signals(alive, text_probs, cls_attention, 3), {})
    assert len(many) == len(survivors) + 10 and survivors <= set(many.tolist())
    few = selector.prune(Stage(3, 30), signals(alive, text_probs, cls_attention, 3), {})
    assert len(few) == 30 and set(few.tolist()) <= keys  # the key set comes first, best scores within it
    if len(official - keys) >= 10:
        some = set(selector.prune(Stage(3, 57), signals(alive, text_probs, cls_attention, 3), {}).tolist())
        assert keys <= some and some - keys <= official


@pytest.mark.parametrize("budget", [64, 128, 192])
def test_average_rule_solves_four_stages_to_the_budget(budget):
    stages = get_selector("mustdrop").schedule(32, PATCHES, budget)
    assert [stage.layer for stage in stages] == [3, 7, 11, 15]
    assert abs(average_visual_tokens(stages, 32, PATCHES) - budget) < 0.5
    if budget >= 128:  # the count then holds the whole key set (ceil(0.08 576) = 47) at every stage
        assert min(stage.keep for stage in stages) >= 47


def test_options_are_checked():
    with pytest.raises(ValueError):
        get_selector("mustdrop", budget_rule="official")
    with pytest.raises(ValueError):
        get_selector("mustdrop", global_thr=-1.0)
    assert isinstance(get_selector("mustdrop"), MustDropSelector)


class Recording(MustDropSelector):
    """MustDrop that keeps the signals each stage saw."""

    def __init__(self, **options):
        super().__init__(**options)
        self.seen: list[LayerSignals] = []

    def prune(self, stage, signals, state):
        self.seen.append(signals)
        return super().prune(stage, signals, state)


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory):
    path = LlavaModel.build_tiny(tmp_path_factory.mktemp("mustdrop") / "llava", words=WORDS, text_layers=8, seed=3)
    vlm = load_vlm(path, device="cpu")
    return vlm, vlm.prepare(random_image(4), QUESTIONS[1])


@pytest.mark.parametrize("rule", ["average", "paper"])
def test_tiny_llava_stages_are_the_filter_on_what_each_stage_saw(tiny_llava, rule):
    vlm, item = tiny_llava
    selector = Recording(budget_rule=rule)
    budget = item.num_visual // 4
    prefill, _ = vlm.prefill([item], selector, budget)
    kept_stages = prefill.kept_stages[0]
    stages = vlm.schedule(selector, item.num_visual, budget)
    assert len(kept_stages) == len(selector.seen) == len(stages) == 4
    keys = set(selector.seen[0].alive[official_key_order(selector.seen[0])].tolist())
    alive = list(range(item.num_visual))
    for seen, kept in zip(selector.seen, kept_stages, strict=True):
        assert seen.alive.tolist() == alive
        alive_keys = keys & set(alive)
        assert set(kept) <= set(alive)
        assert alive_keys <= set(kept) if len(kept) >= len(alive_keys) else set(kept) <= alive_keys
        if rule == "paper":
            probs = seen.text_probs.float().mean(dim=0)
            total = probs.sum(dim=0)
            drop = (total < total.sum() * 0.011) & (probs.max(dim=0).values < 0.01)
            assert sorted(kept) == sorted(set(seen.alive[~drop].tolist()) | alive_keys)
        alive = list(kept)
    if rule == "average":
        assert [len(k) for k in kept_stages] == [s.keep for s in stages]


def official_key_order(seen: LayerSignals) -> torch.Tensor:
    """The key set's positions: ``torch.topk`` of ``ceil(0.08 N)`` on the feature layer's CLS row."""
    cls_row = seen.layer_cls_attention.float()[-1]
    return torch.topk(cls_row, math.ceil(0.08 * cls_row.numel())).indices


def test_demo_run_records_one_stage_per_pruning_layer():
    vlm = load_demo(DEMO_MODELS["demo"])
    with pruned(vlm, "mustdrop", 24) as model:
        result = model.answer(random_image(5, (96, 96)), QUESTIONS[0])
    stages = vlm.schedule(get_selector("mustdrop"), vlm.prepare(random_image(5, (96, 96)), QUESTIONS[0]).num_visual, 24)
    assert [len(kept) for kept in result.kept_stages] == [stage.keep for stage in stages]
    for earlier, later in zip(result.kept_stages, result.kept_stages[1:]):
        assert set(later) <= set(earlier)
