"""Issue 41: MustDrop (liuting20/MustDrop 909afa53), its key set and prefill stages.

The official code re-derived here from its text, independently of the module: the key set of ``clip_encoder.py``
(``attn[:, :, 0, 1:].mean(dim=1)``, ``torch.topk`` of ``ceil(0.08 (N - 1))``) and the prefill stages of
``modelling_sparse_llama.py`` (``dual_attention_filter`` on each pruning layer's attention, joined with the key set
by ``torch.unique``), on random fp32 attention at LLaVA-1.5 shapes; then the count rule, the schedules, and runs on
the demo and a tiny LLaVA whose per-stage records are checked against the filter on the signals each stage saw.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from tiny_models import QUESTIONS, WORDS, random_image

from prune_audit.api import pruned
from prune_audit.demo.assets import DEMO_MODELS
from prune_audit.demo.evaluate import load_demo
from prune_audit.errors import PruneAuditError
from prune_audit.models import load_vlm
from prune_audit.models.llava import LlavaModel
from prune_audit.pruners.arithmetic import SelectorWork
from prune_audit.pruners.base import Stage
from prune_audit.pruners.composed import composed_from_strings, selector_parts
from prune_audit.pruners.mustdrop import MustDropSelector, MustDropVision, WindowMerging
from prune_audit.pruners.registry import get_selector
from prune_audit.pruners.schedule import average_visual_tokens
from prune_audit.pruners.signals import InputSignals, LayerSignals

HEADS, PATCHES, SYSTEM, VISION_HEADS, VISION_WIDTH = 32, 576, 35, 16, 1024
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


def signals(
    alive: torch.Tensor, text_probs: torch.Tensor, cls_attention: torch.Tensor, layer: int, tower_row: bool = True
) -> LayerSignals:
    """The stage's signals; ``tower_row``: with the feature layer's CLS row (``vision=off`` ranks the key set on it)."""
    return LayerSignals(
        alive=alive, grid=(24, 24), layer=layer, num_layers=32, text_probs=text_probs,
        layer_cls_attention=cls_attention[None, alive] if tower_row else None,
    )  # fmt: skip


@pytest.mark.parametrize("vision", ["merge", "off"])
@pytest.mark.parametrize("text", [20, 45, 80])
@pytest.mark.parametrize("seed", range(10))
def test_official_rule_reproduces_the_dual_attention_filter(seed, text, vision):
    """Four prefill stages (layers 2/6/10/14) as the official loop runs them, against the selector's stages; the
    key set handed over by the vision stage (``key_positions``), or ranked on the feature layer (``vision=off``)."""
    generator = torch.Generator().manual_seed(seed)
    vision_probs = vision_probabilities(generator)
    keys = official_key_set(vision_probs)
    selector = get_selector("mustdrop", budget_rule="paper", vision=vision)
    stages = selector.schedule(32, PATCHES, 64)
    assert [stage.layer for stage in stages] == [3, 7, 11, 15]
    official_alive, key_positions = torch.arange(PATCHES), torch.tensor(sorted(keys))
    state: dict = {"key_positions": key_positions} if vision == "merge" else {}
    for stage in stages:
        img_seq = official_alive.numel()
        attn = causal_probabilities(SYSTEM + img_seq + text, generator, sharpness=3.0 + seed % 3)
        vis = torch.unique(torch.cat((official_filter(attn, SYSTEM, img_seq), key_positions)))
        key_positions = torch.nonzero(torch.isin(vis, key_positions)).flatten()
        text_probs = attn[0, :, SYSTEM + img_seq :, SYSTEM : SYSTEM + img_seq]
        cls_row = vision_probs[0, :, 0, 1:].mean(dim=0)
        kept = selector.prune(stage, signals(official_alive, text_probs, cls_row, 0, vision == "off"), state)
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
    selector = get_selector("mustdrop", vision="off")
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
    """MustDrop that keeps the signals each stage saw and the positions it kept."""

    def __init__(self, **options):
        super().__init__(**options)
        self.seen: list[LayerSignals] = []
        self.chosen: list[torch.Tensor] = []

    def prune(self, stage, signals, state):
        self.seen.append(signals)
        self.chosen.append(super().prune(stage, signals, state))
        return self.chosen[-1]


@pytest.fixture(scope="module")
def tiny_llava(tmp_path_factory):
    path = LlavaModel.build_tiny(tmp_path_factory.mktemp("mustdrop") / "llava", words=WORDS, text_layers=8, seed=3)
    vlm = load_vlm(path, device="cpu")
    return vlm, vlm.prepare(random_image(4), QUESTIONS[1])


@pytest.mark.parametrize("rule", ["average", "paper"])
def test_tiny_llava_stages_are_the_filter_on_what_each_stage_saw(tiny_llava, rule):
    vlm, item = tiny_llava
    selector = Recording(budget_rule=rule, vision="off")
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


@pytest.mark.parametrize("merge_thr", [0.8, 0.3])
def test_demo_run_records_the_vision_stage_then_one_stage_per_pruning_layer(merge_thr):
    """The tokens fed at the input (stage 0: the unmerged cells and the merged windows), then the four prefill
    stages on the tokens fed; 0.3 merges some of the demo's windows. Each stage's objects: never lost then found."""
    vlm = load_demo(DEMO_MODELS["demo"])
    image = random_image(5, (96, 96))
    with pruned(vlm, "mustdrop", 24, merge_thr=merge_thr) as model:
        result = model.answer(image, QUESTIONS[0])
    item = vlm.prepare(image, QUESTIONS[0])
    fed = len(result.kept_stages[0]) + len(result.merged_stages[0])
    stages = vlm.schedule(get_selector("mustdrop"), fed, 24)
    assert result.stage_layers == [0] + [stage.layer for stage in stages]
    merged = result.merged_stages[0]
    assert all(len(window) == 9 for window in merged) and (merge_thr == 0.8 or merged)
    assert sorted(result.kept_stages[0] + [cell for window in merged for cell in window]) == list(
        range(item.num_visual)
    )  # every cell fed once: alone or in its window
    alive = [len(k) + len(m) for k, m in zip(result.kept_stages[1:], result.merged_stages[1:], strict=True)]
    assert alive == [stage.keep for stage in stages]
    covered = [set(k) | {c for group in m for c in group} for k, m in zip(result.kept_stages, result.merged_stages)]
    for earlier, later in zip(covered, covered[1:]):  # a cell is never dropped then carried again
        assert later <= earlier


# --- the vision stage: ``local_merge.py`` (``conditional_pooling``, ``merge_wavg``) after CLIP layer 0 ---------------


def official_pooling(x: torch.Tensor, threshold: float = 0.8, ws: int = 3):
    """``conditional_pooling(x, threshold, (ws, ws))`` then ``merge_wavg``, re-derived from the official text on
    (1, 1 + N, D) states of a square grid: (1, 1 + M, D) merged states, (r, ws^2) the merged windows' cells in
    ``topk`` order, (N - r ws^2,) the unmerged cells ascending."""
    feat = x[:, 1:]
    batch, n, dim = feat.shape
    side = math.isqrt(n)
    grid = feat.transpose(1, 2).reshape(batch, dim, side, side)  # "b (h w) c -> b c h w"
    grid = grid.reshape(batch, dim, side // ws, ws, side // ws, ws).permute(0, 2, 4, 1, 3, 5)  # b gh gw c ps ps
    flat = grid.reshape(batch, side // ws, side // ws, dim, ws * ws)
    sims = F.cosine_similarity(flat.unsqueeze(-1), flat.unsqueeze(-2), dim=3) * (1 - torch.eye(ws * ws))
    similarity = (sims.sum(-1).sum(-1) / (ws * ws * (ws * ws - 1))).reshape(batch, -1)
    r = int(torch.ge(similarity, threshold).sum(dim=1).min())
    _, chosen = similarity.topk(r, dim=-1)
    cells = torch.arange(n).reshape(side, side)[None].repeat(batch, 1, 1)
    windows = cells.unfold(1, ws, ws).unfold(2, ws, ws).reshape(batch, -1, ws * ws)
    gathered = torch.gather(windows, 1, chosen.unsqueeze(-1).expand(-1, -1, ws * ws))
    mask = torch.ones(batch, windows.shape[1], dtype=torch.bool)
    mask.scatter_(1, chosen, torch.zeros_like(chosen, dtype=torch.bool))
    unm = windows[mask.unsqueeze(-1).expand(-1, -1, ws * ws)].reshape(batch, -1).sort(dim=-1).values
    src, dst = gathered[:, :, :-1].reshape(batch, -1), gathered[:, :, -1]
    merge_idx = torch.arange(r).repeat_interleave(ws * ws - 1)[None]

    def merge(t: torch.Tensor) -> torch.Tensor:
        cls, patches = t[:, :1], t[:, 1:]
        c = patches.shape[-1]
        target = patches.gather(1, dst[..., None].expand(-1, -1, c))
        target = target.scatter_reduce(
            1, merge_idx[..., None].expand(-1, -1, c), patches.gather(1, src[..., None].expand(-1, -1, c)), "sum"
        )
        return torch.cat([cls, target, patches.gather(1, unm[..., None].expand(-1, -1, c))], dim=1)

    size = torch.ones_like(x[..., :1])
    merged, size = merge(x * size), merge(size)
    return merged / size, gathered[0], unm[0]


def window_states(generator: torch.Generator, side: int = 24, width: int = VISION_WIDTH) -> torch.Tensor:
    """(1 + side^2, width) CLS and patches whose 3 x 3 windows share a direction, each window its own noise scale
    (0.2 .. 1.5: mean cosines from about 0.96 down to 0.3), so the 0.8 threshold merges some windows and not others."""
    states = torch.empty(side, side, width)
    for top in range(0, side, 3):
        for left in range(0, side, 3):
            scale = 0.2 + 1.3 * torch.rand(1, generator=generator)
            base = torch.randn(width, generator=generator)
            states[top : top + 3, left : left + 3] = base + scale * torch.randn(3, 3, width, generator=generator)
    return torch.cat([torch.randn(1, width, generator=generator), states.reshape(side * side, width)])


def synthetic_tower(hidden: torch.Tensor, layers: int, next_row: torch.Tensor | None):
    """A ``merging_tower`` over ``layers`` identity layers of (1 + N, D) states, calling the step after each; then
    the next layer's CLS row ``next_row(M)`` (H, 1 + M) when given (the adapter's reads_next_layer)."""

    def run(step):
        size = torch.ones(hidden.shape[0])
        sources = [torch.zeros(0, dtype=torch.long)] + [torch.tensor([c]) for c in range(hidden.shape[0] - 1)]
        states = hidden
        for layer in range(layers):
            metric = step.metric(torch.softmax(torch.randn(VISION_HEADS, states.shape[0]), dim=-1), None, None)
            states, size, sources = step(layer, layers, states, metric, size, sources)
        if next_row is not None:
            step.next_layer_cls(next_row)
        return states, sources

    return run


@pytest.mark.parametrize("seed", range(30))
def test_vision_merge_reproduces_the_official_conditional_pooling(seed):
    """LLaVA-1.5 shapes (24 x 24 patches, width 1024, fp32): the step's merged states, their order and sources, and
    the selection's key set (the next layer's CLS row, ``ceil(0.08 M)``) against the official text."""
    generator = torch.Generator().manual_seed(seed)
    hidden = window_states(generator)
    official, windows, unmerged = official_pooling(hidden[None])
    assert 0 < windows.shape[0] < 64  # the case is not trivial: some windows merge, some not
    step = WindowMerging((24, 24))
    states, _, sources = step(0, 23, hidden, torch.zeros(0), torch.ones(hidden.shape[0]), single_sources())
    torch.testing.assert_close(states, official[0], atol=1e-5, rtol=1e-5)
    expected = [sorted(window.tolist()) for window in windows] + [[cell] for cell in unmerged.tolist()]
    assert [group.tolist() for group in sources[1:]] == expected
    assert step.unmerged.tolist() == unmerged.tolist()

    tokens = 1 + len(expected)
    logits = torch.randn(1, VISION_HEADS, tokens, tokens, generator=generator) * 2
    next_row = torch.softmax(logits, dim=-1)  # the official layer 23 with output_attentions, on the merged states
    signals = InputSignals(grid=(24, 24))
    signals.merging_tower = synthetic_tower(hidden, 23, next_row[0, :, 0])
    selection = MustDropVision().select(signals, 64)
    assert set(selection.llm_state["key_positions"].tolist()) == official_key_set(next_row)
    assert selection.kept.tolist() == unmerged.tolist()
    assert selection.tower_stages == [] and selection.num_output_tokens == tokens - 1  # recorded at the input
    torch.testing.assert_close(selection.vision_tokens, official[0, 1:], atol=1e-5, rtol=1e-5)


def single_sources() -> list[torch.Tensor]:
    """The merging tower's opening sources: CLS (no cell), then one cell per patch."""
    return [torch.zeros(0, dtype=torch.long)] + [torch.tensor([c]) for c in range(PATCHES)]


def test_window_flops_count_one_product_per_full_window():
    work = SelectorWork(tokens=PATCHES, vision_width=VISION_WIDTH, grid=(24, 24))
    assert MustDropVision.flops(work) == 64 * 2 * 9 * VISION_WIDTH * 9
    assert MustDropVision.tower_merges(PATCHES, 64, 23, [(0, 576 - 9 * 5), (3, 40), (7, 30)])[:2] == (40, 0)


@pytest.fixture(scope="module")
def merging_llava(tmp_path_factory):
    """A tiny LLaVA with a 6 x 6 grid (four 3 x 3 windows) and 3 tower layers: layer 0, the merge, layer 1 (the
    feature layer's), and layer 2 whose CLS row ranks the key set (the official layer 23 of 24)."""
    root = tmp_path_factory.mktemp("mustdrop_merge") / "llava"
    path = LlavaModel.build_tiny(root, words=WORDS, text_layers=16, seed=4, image_size=84, vision_layers=3)
    vlm = load_vlm(path, device="cpu")
    return vlm, vlm.prepare(random_image(6, (84, 84)), QUESTIONS[1])


@torch.no_grad()
def official_tower(vlm, item, threshold: float):
    """``CLIPVisionModelAcc.custom_forward`` on the tiny tower's modules: layer 0, the pooling, the layers up to the
    feature layer, and the key set of the next layer's attention: (M, Dv) features, windows, unmerged, key set."""
    tower = vlm.vision_tower
    hidden = tower.pre_layrnorm(tower.embeddings(item.pixel_values[None].float()))
    layers = tower.encoder.layers
    hidden, windows, unmerged = official_pooling(layers[0](hidden, None), threshold)
    for layer in layers[1 : vlm.feature_index]:
        hidden = layer(hidden, None)
    key_layer = layers[vlm.feature_index]  # its attention probabilities (``output_attentions``), CLS row
    attention = key_layer.self_attn
    normed = key_layer.layer_norm1(hidden)
    heads = [
        p(normed).view(1, hidden.shape[1], -1, attention.head_dim).transpose(1, 2)
        for p in (attention.q_proj, attention.k_proj)
    ]
    probs = torch.softmax(heads[0] @ heads[1].transpose(2, 3) * attention.scale, dim=-1)
    return hidden[0, 1:], windows, unmerged, official_key_set(probs)


@torch.no_grad()
def window_threshold(vlm, item) -> float:
    """A threshold between the second and third largest window similarities after layer 0: two windows merge."""
    tower = vlm.vision_tower
    hidden = tower.encoder.layers[0](tower.pre_layrnorm(tower.embeddings(item.pixel_values[None].float())), None)
    cells = torch.arange(36).view(6, 6).unfold(0, 3, 3).unfold(1, 3, 3).reshape(4, 9)
    units = F.normalize(hidden[0, 1:][cells], dim=-1)
    similarity = ((units @ units.transpose(1, 2)) * (1 - torch.eye(9))).sum(dim=(1, 2)) / 72
    ranked = similarity.sort(descending=True).values
    return float((ranked[1] + ranked[2]) / 2)


@pytest.mark.parametrize("rule", ["average", "paper"])
def test_tiny_llava_vision_stage_is_the_official_tower(merging_llava, rule):
    """The adapter's hook after layer 0's MLP and the next layer's CLS row: the tokens fed, their order and sources
    and the key set equal the official tower's; the key set survives each prefill stage as the filter decides."""
    vlm, item = merging_llava
    threshold = window_threshold(vlm, item)
    features, windows, unmerged, keys = official_tower(vlm, item, threshold)
    selector = Recording(budget_rule=rule, merge_thr=threshold)
    prefill, selections = vlm.prefill([item], selector, 8)
    selection = selections[0]
    assert windows.shape[0] == 2
    assert [g.tolist() for g in selection.sources] == [sorted(w.tolist()) for w in windows] + [
        [c] for c in unmerged.tolist()
    ]
    torch.testing.assert_close(selection.vision_tokens, features.float(), atol=1e-5, rtol=1e-5)
    assert set(selection.llm_state["key_positions"].tolist()) == keys
    first = selector.seen[0]
    assert first.alive.numel() == features.shape[0]
    key_kinds = set(first.alive[sorted(keys)].tolist())  # the fed tokens' kinds (merged windows: negative)
    assert len(selector.seen) == len(prefill.kept_stages[0]) == 4
    for seen, chosen, kept in zip(selector.seen, selector.chosen, prefill.kept_stages[0], strict=True):
        survivors, alive_keys = set(seen.alive[chosen].tolist()), key_kinds & set(seen.alive.tolist())
        assert kept == sorted(kind for kind in survivors if kind >= 0)  # the record: the grid cells alone
        if rule == "paper":
            probs = seen.text_probs.float().mean(dim=0)
            total = probs.sum(dim=0)
            drop = (total < total.sum() * 0.011) & (probs.max(dim=0).values < 0.01)
            assert survivors == set(seen.alive[~drop].tolist()) | alive_keys
        else:
            assert alive_keys <= survivors or survivors <= alive_keys


# --- the decode stage: ``modelling_sparse_llama.py``'s KV cache of layers 2..14 sliced to the last survivors -------


def sliced_decode(decode):
    """The official decode state: each layer's cache ``index_select``-ed to its valid columns (one row), every
    kept key valid; a copy, so the masked state decodes on the cache as prefill left it."""
    cache = copy.deepcopy(decode.cache)
    valid = []
    for layer, keys in zip(cache.layers, decode.key_valid, strict=True):
        columns = torch.nonzero(keys[0]).flatten()
        layer.keys, layer.values = layer.keys[:, :, columns], layer.values[:, :, columns]
        valid.append(torch.ones(1, columns.numel(), dtype=torch.bool))
    return dataclasses.replace(decode, cache=cache, key_valid=valid, next_position=decode.next_position.clone())


# the paper rule with thresholds that drop some of the tiny model's nearly flat attention (0.011 / 0.01 keep all)
DECODE_CASES = [{"budget_rule": "average"}, {"budget_rule": "paper", "global_thr": 0.06, "individual_thr": 0.2}]


@pytest.mark.parametrize("options", DECODE_CASES)
def test_decode_stage_attends_to_the_last_stage_survivors_from_layer_2(merging_llava, options):
    """After a cached prefill, layers from the first stage's scoring layer on (2 on the reference, 1 on this
    16-layer model) keep only the last stage's visual tokens valid, the layers before every token; three greedy
    steps on that masked cache give the logits of the official sliced cache, and differ from the unsliced one."""
    vlm, item = merging_llava
    options = {**options, "merge_thr": window_threshold(vlm, item)}
    selector = get_selector("mustdrop", **options)
    prefill, selections = vlm.prefill([item], selector, 8, use_cache=True)
    fed = selections[0].num_output_tokens
    first = vlm.schedule(selector, fed, 8)[0].layer
    final = len(prefill.kept_stages[0][-1]) + len(prefill.merged_stages[0][-1])
    text = item.input_ids.numel() - item.num_visual
    valid = [int(keys.sum()) for keys in prefill.decode.key_valid]
    assert first == 2 and valid == [text + fed] * (first - 1) + [text + final] * (vlm.num_layers - first + 1)
    assert final < fed  # the stages dropped tokens: the decode stage masks some
    official = sliced_decode(prefill.decode)
    unsliced, _ = vlm.prefill([item], Unsliced(**options), 8, use_cache=True)
    token = torch.tensor([5])
    for _ in range(3):
        masked_logits = vlm.loop.decode_step(prefill.decode, token)
        torch.testing.assert_close(masked_logits, vlm.loop.decode_step(official, token), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(masked_logits, vlm.loop.decode_step(unsliced.decode, token), atol=1e-5)
        token = masked_logits.argmax(dim=-1)


class Unsliced(MustDropSelector):
    """MustDrop without its decode stage: each layer's cache keeps the tokens it ran on at prefill."""

    decode_keeps_final = False


def test_a_composed_input_part_needs_the_vision_stage_off():
    """An input part before MustDrop would replace its vision stage (and its key set): refused in one line, naming
    the switch; with it, MustDrop ranks its key set on the feature layer as ``vision=off`` does."""
    with pytest.raises(PruneAuditError, match=r"mustdrop\.vision=off"):
        composed_from_strings("visionzip+mustdrop", [])
    composed = composed_from_strings("visionzip+mustdrop", ["mustdrop.vision=off"])
    assert selector_parts(composed) == (composed.input, composed.llm) and composed.llm.tower_stage() is None


def test_the_schedule_follows_the_merged_windows_only_where_the_tower_merges():
    """With the vision stage the prefill stages act on the windows it merged, a count each image decides: no
    schedule is planned ahead (the manifest's is null); unmerged patches (``vision=off``) plan it."""
    assert get_selector("mustdrop").schedule_follows_tower
    assert not get_selector("mustdrop", vision="off").schedule_follows_tower
