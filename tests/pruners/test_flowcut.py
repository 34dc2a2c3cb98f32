"""FlowCut (issue 41): the tower cuts against an independent re-derivation of the official layers, the cut sizes
by hand, and runs on a tiny LLaVA and the demo with every tower stage recorded.

The reference is TungChintao/FlowCut as shipped on PyPI (``flowcut`` 1.0.2): ``modeling_clip_flowcut.py``
(``CLIPEncoderLayer_forward``: after the layer, while more than ``target = budget + 1`` tokens remain, the score
``compute_score`` of the layer's head-mean CLS attention, head-mean CLS-value softmax and head-mean values folded
into ``0.5 * cumulative + 0.5 * score``; where ``rpl = select_layer - idx - 1`` is even, a cut of
``adaptive_prune_ratio`` tokens by ``topk`` of the cumulative scores, sorted, CLS kept) and ``main.py``
(``select_layer = len(layers) - 2``). The re-derivation below writes those layers in their batched form over all
24 CLIP-L layers; the selector's step runs the 23 the feature layer needs.
"""

from __future__ import annotations

import math

import pyarrow.parquet as pq
import pytest
import torch
from tiny_models import WORDS, random_image
from typer.testing import CliRunner

from prune_audit.cli.main import app
from prune_audit.pruners import get_selector
from prune_audit.pruners.base import LayerSignals, Stage
from prune_audit.pruners.flowcut import (
    CropTowerCuts,
    TowerCuts,
    crop_budget,
    cut_size,
    decoder_flow_scores,
    flow_scores,
)

SEEDS, BUDGETS = range(10), (64, 128, 192)
TOKENS, HEADS, HEAD_DIM, ALL_LAYERS = 577, 16, 64, 24  # CLIP ViT-L/14-336; LLaVA reads layer -2
RUN_LAYERS = ALL_LAYERS - 1  # the layers up to the feature layer


def layer_draws(seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer: (H, 577) CLS logits (a sharpness that varies by layer, so the entropy-adaptive cuts vary) and
    (H, 577, 64) values; a layer seeing T tokens reads the first T of each."""
    generator = torch.Generator().manual_seed(seed)
    draws = []
    for _ in range(ALL_LAYERS):
        sharpness = 0.5 + 4 * torch.rand(1, generator=generator)
        logits = torch.randn(HEADS, TOKENS, generator=generator) * sharpness
        draws.append((logits, torch.randn(HEADS, TOKENS, HEAD_DIM, generator=generator)))
    return draws


def official_compute_score(cls_attn, semantic_attn, value):
    relation = cls_attn / cls_attn.sum(dim=-1, keepdim=True)
    semantic = semantic_attn / semantic_attn.sum(dim=-1, keepdim=True)
    return (relation + semantic) * torch.norm(value, p=1, dim=-1)


def official_prune_number(attn, rpl, target_num):
    n = attn.shape[-1]
    prob = attn / attn.sum(dim=-1, keepdim=True)
    entropy = -torch.sum(prob * torch.log(prob), dim=-1)
    ratio = entropy / torch.log(torch.tensor(n))
    r = (n - target_num) / rpl**0.5 * (1 - ratio**2)
    return int(r.max(0).values.round()) if r.shape[0] > 1 else int(r.round())


def official_tower(draws, budget):
    """The official encoder's FlowCut over all 24 layers, batch of one: the patches (original indices) of the
    hidden state LLaVA reads (after layer 22) and the patches kept after each cut, by layer."""
    target, select_layer = budget + 1, ALL_LAYERS - 2
    alive = torch.arange(TOKENS - 1)[None]  # original patch of each hidden_states[:, 1:] row
    cumulative, cuts, features = None, {}, None
    length = TOKENS
    for idx, (logits, values) in enumerate(draws):
        rpl = select_layer - idx - 1
        if idx == select_layer + 1:
            features = alive[0].clone()  # hidden_states[-2] is the input of the last layer
        attn_weights = torch.softmax(logits[:, :length], dim=-1)[None, :, None, :]  # (B, H, CLS row, T)
        value_states = values[:, :length][None]  # (B, H, T, d)
        semantic = torch.softmax(torch.bmm(value_states[0, :, :1], value_states[0].transpose(1, 2)), dim=-1)
        semantic_attn, value_metric = semantic.view(1, HEADS, length).mean(1), value_states.mean(1)
        if length > target:
            cls_attention = attn_weights[:, :, 0, 1:].mean(dim=1)
            scores = official_compute_score(cls_attention, semantic_attn[:, 1:], value_metric[:, 1:])
            cumulative = scores.clone() if cumulative is None else 0.5 * cumulative + 0.5 * scores
            if not rpl % 2:
                prune_num = official_prune_number(cls_attention, rpl, target - 1) if rpl else length
                target_num = max(length - prune_num, target)
                _, keep = torch.topk(cumulative, target_num - 1, dim=1)
                keep = keep.sort(dim=1).values
                cumulative = torch.gather(cumulative, dim=1, index=keep)
                alive = torch.gather(alive, dim=1, index=keep)
                if target_num < length:
                    cuts[idx] = alive[0].tolist()
                length = target_num
    return features.tolist(), cuts


def selector_tower(draws, budget):
    """TowerCuts through the 23 layers to the feature layer, as the adapter's merging tower calls it."""
    step = TowerCuts(budget)
    hidden, size = torch.zeros(TOKENS, 1), torch.ones(TOKENS)
    sources = [torch.zeros(0, dtype=torch.long)] + [torch.tensor([cell]) for cell in range(TOKENS - 1)]
    for layer, (logits, values) in enumerate(draws[:RUN_LAYERS]):
        length = hidden.shape[0]
        metric = step.metric(torch.softmax(logits[:, :length], dim=-1), None, values[:, :length])
        hidden, size, sources = step(layer, RUN_LAYERS, hidden, metric, size, sources)
    return [int(group[0]) for group in sources[1:]], {layer: cells.tolist() for layer, cells in step.stages}


def test_tower_cuts_reproduce_the_official_layers():
    """30 cases: 10 seeds x budgets 64/128/192, CLIP-L shapes, float32: the same cuts after the same layers and
    the same patches at the feature layer."""
    identical = 0
    for seed in SEEDS:
        draws = layer_draws(seed)
        for budget in BUDGETS:
            features, cuts = official_tower(draws, budget)
            kept, stages = selector_tower(draws, budget)
            identical += kept == features and stages == cuts and len(kept) == budget
            assert max(stages) == RUN_LAYERS - 2 and all(layer % 2 for layer in stages)  # after 1, 3, ..., 21
    assert identical == len(SEEDS) * len(BUDGETS)


CROPS = 3  # an anyres image of a base view and two tiles, as one tower batch


def official_crop_tower(crop_draws, budget):
    """The official encoder's FlowCut on the crops of an anyres image as one batch (``main.py``: ``target =
    int(budget / 2) + 1``): the crop patches (``crop * 576 + patch``) of the features LLaVA reads, each cut's kept
    crop patches by layer, and how many cuts had crops whose own ``adaptive_prune_ratio`` differed (the batch
    takes the largest)."""
    target, select_layer = budget // 2 + 1, ALL_LAYERS - 2
    alive = torch.arange(TOKENS - 1)[None].repeat(CROPS, 1)
    offsets = torch.arange(CROPS)[:, None] * (TOKENS - 1)
    cumulative, cuts, features, spread, length = None, {}, None, 0, TOKENS
    for idx in range(ALL_LAYERS):
        rpl = select_layer - idx - 1
        if idx == select_layer + 1:
            features = (alive + offsets).flatten().tolist()
        attn_weights = torch.stack([torch.softmax(draws[idx][0][:, :length], dim=-1) for draws in crop_draws])
        value_states = torch.stack([draws[idx][1][:, :length] for draws in crop_draws])  # (B, H, T, d)
        semantic = torch.softmax(value_states[:, :, :1] @ value_states.transpose(2, 3), dim=-1)[:, :, 0].mean(1)
        if length > target:
            cls_attention = attn_weights[:, :, 1:].mean(dim=1)
            scores = official_compute_score(cls_attention, semantic[:, 1:], value_states.mean(1)[:, 1:])
            cumulative = scores.clone() if cumulative is None else 0.5 * cumulative + 0.5 * scores
            if not rpl % 2:
                prune_num = official_prune_number(cls_attention, rpl, target - 1) if rpl else length
                if rpl:
                    spread += len({official_prune_number(row[None], rpl, target - 1) for row in cls_attention}) > 1
                target_num = max(length - prune_num, target)
                keep = torch.topk(cumulative, target_num - 1, dim=1).indices.sort(dim=1).values
                cumulative, alive = torch.gather(cumulative, 1, keep), torch.gather(alive, 1, keep)
                if target_num < length:
                    cuts[idx] = sorted((alive + offsets).flatten().tolist())
                length = target_num
    return features, cuts, spread


def selector_crop_tower(crop_draws, budget):
    """CropTowerCuts through the 23 layers to the feature layer, as the LLaVA-NeXT adapter's crop tower calls it."""
    step = CropTowerCuts(crop_budget(budget))
    hidden, tokens = torch.zeros(CROPS, TOKENS, 1), torch.arange(CROPS * (TOKENS - 1)).view(CROPS, -1)
    for layer in range(RUN_LAYERS):
        length = hidden.shape[1]
        metric = torch.stack(
            [
                step.metric(torch.softmax(d[layer][0][:, :length], dim=-1), None, d[layer][1][:, :length])
                for d in crop_draws
            ]
        )
        hidden, tokens = step(layer, RUN_LAYERS, hidden, metric, tokens)
    return tokens.flatten().tolist(), {layer: cells.tolist() for layer, cells in step.stages}


def test_crop_tower_cuts_reproduce_the_official_anyres_batch():
    """30 cases: 10 seeds x budgets 64/128/192 over 3 crops (each its own CLIP-L draws), float32: half the budget
    in every crop, the same cuts after the same layers (the cut size the largest over the crops, where theirs
    differ) and the same crop patches at the feature layer."""
    identical, spread = 0, 0
    for seed in SEEDS:
        crop_draws = [layer_draws(100 + CROPS * seed + crop) for crop in range(CROPS)]
        for budget in BUDGETS:
            features, cuts, differing = official_crop_tower(crop_draws, budget)
            kept, stages = selector_crop_tower(crop_draws, budget)
            identical += kept == features and stages == cuts and len(kept) == CROPS * (budget // 2)
            spread += differing
    assert identical == len(SEEDS) * len(BUDGETS) and spread > 0


def test_cut_sizes_by_hand():
    """n = 8 patches, budget 2: uniform attention (entropy ratio 1) cuts none; four equal patches (ratio
    log 4 / log 8 = 2/3) cut round(6 / sqrt(4) * (1 - 4/9)) = round(1.67) = 2 with 4 steps left, round(6 * 5/9)
    = round(3.33) = 3 with 1; no step left cuts all (the caller keeps the budget)."""
    uniform, four = torch.full((8,), 0.125), torch.tensor([0.25] * 4 + [0.0] * 4)
    assert cut_size(uniform, 4, 2) == 0
    assert cut_size(four, 4, 2) == 2 and cut_size(four, 1, 2) == 3
    assert cut_size(four, 0, 2) == 8
    assert math.isclose(-(torch.xlogy(four, four).sum()) / math.log(8), 2 / 3, rel_tol=1e-6)


def test_flow_score_by_hand():
    """One head, CLS + 2 patches: relation (0.2, 0.6) -> (0.25, 0.75); values CLS (1, 0), patches (2, 0) and
    (0, 3): CLS-value products (1, 2, 0), softmax over all three, patches renormalised; times |v|_1 = (2, 3)."""
    cls_probs = torch.tensor([[0.2, 0.2, 0.6]])
    values = torch.tensor([[[1.0, 0.0], [2.0, 0.0], [0.0, 3.0]]])
    relation, scores = flow_scores(cls_probs, values)
    semantic = torch.tensor([math.e**2, 1.0]) / (math.e**2 + 1)
    expected = (torch.tensor([0.25, 0.75]) + semantic) * torch.tensor([2.0, 3.0])
    assert torch.allclose(relation, torch.tensor([0.2, 0.6])) and torch.allclose(scores, expected)


def test_keep_counts_shrink_every_other_layer_to_the_budget():
    """The realised schedule on CLIP-L draws: counts non-increasing, cuts only after odd layers, the budget after
    layer 21 and never below it."""
    kept, stages = selector_tower(layer_draws(3), 64)
    counts = [len(cells) for _, cells in sorted(stages.items())]
    assert counts == sorted(counts, reverse=True) and counts[-1] == 64 == len(kept) and min(counts) == 64
    assert len(set(counts)) == len(counts)


def test_tiny_llava_records_each_tower_cut(tmp_path):
    """A tiny LLaVA with a 4-layer tower (3 run): one cut after layer 1, recorded at stage layer -2 and at the
    input, and the cost counts the rerun."""
    from prune_audit.models import load_vlm
    from prune_audit.models.llava import LlavaModel

    path = LlavaModel.build_tiny(tmp_path / "llava", words=WORDS, vision_layers=4, seed=1)
    vlm = load_vlm(path, device="cpu")
    item = vlm.prepare(random_image(2), "is there a red dog in the image?")
    selector = get_selector("flowcut")
    [answer] = vlm.answer([item], selector, 12, generator=torch.Generator().manual_seed(0))
    assert answer.stage_layers == [-2, 0] and answer.kept_stages[0] == answer.kept_stages[1] == answer.kept
    assert len(answer.kept) == 12 and answer.visual_tokens_avg == 12
    assert answer.cost.flops_selector > 0 and answer.cost.signal_sources  # the rerun's semantic products counted


def test_demo_run_records_stages_and_qwen_refuses(tmp_path):
    out = tmp_path / "demo"
    result = CliRunner().invoke(app, ["run", "--selector", "flowcut", "--budget", "32", "--limit", "3",
                                      "--out", str(out)])  # fmt: skip
    assert result.exit_code == 0, result.output
    assert "layer average" not in result.output.splitlines()[0]
    for record in pq.read_table(out / "records.parquet").to_pylist():
        assert record["stage_layers"] == [-2, 0] and [len(k) for k in record["kept_stages"]] == [32, 32]
        assert record["kept"] == record["kept_stages"][-1] and record["merged_stages"] == [[], []]
    result = CliRunner().invoke(app, ["run", "--model", "demo-qwen", "--selector", "flowcut", "--budget", "16",
                                      "--limit", "1", "--out", str(tmp_path / "q")])  # fmt: skip
    assert result.exit_code != 0 and "selector 'flowcut' needs" in result.output and "Traceback" not in result.output
    assert len(result.output.strip().splitlines()) == 1


# LLaVA-NeXT-7B's decoder (vicuna-7b: 32 heads of 128, no grouped-query heads) and a prompt around the image
LLM_HEADS, LLM_HEAD_DIM, BEFORE, AFTER = 32, 128, 35, 20
DECODER_BUDGETS = (160, 320, 640)


def official_decoder_cut(query_states, key_states, value_states, start, visual, last, target):
    """``LlamaSdpaAttention_forward``'s prune block of TungChintao/FlowCut a2ecd24 (``modeling_llama_flowcut.py``)
    for batch row 0, re-typed: the (1, H, L, d) post-RoPE queries and keys and the values of the layer (after
    ``repeat_kv``), the visual span ``start:start + visual``, ``last_instruct_pos`` ``last``; the ``target``
    kept positions in the span, ascending."""
    end, head_dim = start + visual, query_states.shape[-1]  # the attention's self.head_dim
    vis_k, vis_v = key_states[0, :, start:end], value_states[0, :, start:end]
    text_q, text_v = query_states[0, :, last - 1 : last], value_states[0, :, last - 1 : last]
    relation_weight = torch.bmm(text_q, vis_k.transpose(1, 2)) / math.sqrt(head_dim)
    relation_attn = torch.softmax(relation_weight, dim=-1, dtype=torch.float32).mean(0)
    semantic_weight = torch.bmm(text_v, vis_v.transpose(1, 2)) / math.sqrt(head_dim)
    semantic_attn = torch.softmax(semantic_weight, dim=-1, dtype=torch.float32).mean(0)
    score = official_compute_score(relation_attn, semantic_attn, vis_v.mean(0))
    return torch.topk(score, target, dim=1).indices.sort().values[0]


def decoder_states(seed: int, kv_heads: int = LLM_HEADS):
    """(1, H, L, d) queries, keys and values of one prompt (``BEFORE`` text, 1500 to 2900 visual tokens as
    LLaVA-NeXT's anyres tower stage feeds, ``AFTER`` text) with the keys and values of ``kv_heads`` heads each
    read by ``H / kv_heads`` query heads (``repeat_kv``), and the visual count; queries and values scaled per
    seed so the softmaxes range from flat to peaked."""
    generator = torch.Generator().manual_seed(seed)
    visual = int(torch.randint(1500, 2900, (1,), generator=generator))
    length = BEFORE + visual + AFTER
    scale = 0.5 + 2 * torch.rand(2, generator=generator)
    draw = lambda heads: torch.randn(1, heads, length, LLM_HEAD_DIM, generator=generator)  # noqa: E731
    queries, keys, values = draw(LLM_HEADS) * scale[0], draw(kv_heads), draw(kv_heads) * scale[1]
    groups = LLM_HEADS // kv_heads
    return queries, keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1), visual, groups


def selector_decoder_cut(queries, keys, values, visual, budget, groups=1):
    """FlowCut's decoder stage on the signals the adapter gives at layer 2 (``signal_layer="previous"``): the
    text rows' logits to the visual keys, and the values of the visual and text tokens per key/value head."""
    visual_span = slice(BEFORE, BEFORE + visual)
    text = slice(BEFORE + visual, None)
    signals = LayerSignals(
        alive=torch.arange(visual), grid=(1, visual), layer=2, num_layers=32,
        text_logits=queries[0, :, text] @ keys[0, :, visual_span].transpose(1, 2) / math.sqrt(LLM_HEAD_DIM),
        values=values[0, ::groups, visual_span], text_values=values[0, ::groups, text],
    )  # fmt: skip
    return get_selector("flowcut", budget_rule="paper").prune(Stage(2, budget), signals, {})


def test_decoder_cut_reproduces_the_official_layer_1_scores():
    """30 cases: 10 seeds x budgets 160/320/640 at LLaVA-NeXT-7B's decoder shapes (32 heads of 128, 1500 to 2900
    visual tokens between 35 and 20 text tokens), float32: the kept positions equal the official prune block's
    (``topk`` of ``compute_score`` over the last prompt token's relation and semantic attention, sorted)."""
    identical = 0
    for seed in SEEDS:
        queries, keys, values, visual, _ = decoder_states(seed)
        for budget in DECODER_BUDGETS:
            official = official_decoder_cut(queries, keys, values, BEFORE, visual, keys.shape[2], budget)
            kept = selector_decoder_cut(queries, keys, values, visual, budget)
            identical += torch.equal(kept, official)
    assert identical == len(SEEDS) * len(DECODER_BUDGETS)


def test_decoder_cut_reads_grouped_values_as_the_official_repeat_kv():
    """A grouped-query decoder (8 key/value heads for 32 query heads): the selector reads each key/value head's
    values once, the official code every query head's ``repeat_kv`` copy; the head means and the kept positions
    agree."""
    for seed in range(3):
        queries, keys, values, visual, groups = decoder_states(50 + seed, kv_heads=8)
        official = official_decoder_cut(queries, keys, values, BEFORE, visual, keys.shape[2], 320)
        assert groups == 4 and torch.equal(selector_decoder_cut(queries, keys, values, visual, 320, groups), official)


def test_decoder_flow_score_by_hand():
    """One head of width 4, two visual tokens: the last token's logits (0, log 3) give relation (1/4, 3/4); its
    value (2, 0, 0, 0) against values (1, 0, 0, 0) and (0, 1, 0, 0) gives products (2, 0) / sqrt(4) = (1, 0),
    semantic (e, 1) / (e + 1); times the values' L1 norms (1, 1)."""
    logits = torch.tensor([[0.0, math.log(3)]])
    values = torch.tensor([[[1.0, 0, 0, 0], [0, 1.0, 0, 0]]])
    scores = decoder_flow_scores(logits, torch.tensor([[2.0, 0, 0, 0]]), values)
    semantic = torch.tensor([math.e, 1.0]) / (math.e + 1)
    assert torch.allclose(scores, torch.tensor([0.25, 0.75]) + semantic)


def test_schedule_cuts_after_decoder_layer_1_only_where_the_tower_fed_more_than_the_budget():
    """One stage at the input of layer 2: down to the budget (``budget_rule=paper``, the official target_num), or
    to the count whose layer average is the budget (default): (32 x 640 - 2 x 1500) / 30 = 582.7 -> 583; none
    where the tower stage already holds the budget (LLaVA-1.5); a language model of 2 layers has no layer after
    layer 1, and a budget below what layers 0 and 1 hold is refused (one-line errors)."""
    paper, average = get_selector("flowcut", budget_rule="paper"), get_selector("flowcut")
    assert paper.schedule(32, 1500, 640) == [Stage(2, 640)] and average.schedule(32, 1500, 640) == [Stage(2, 583)]
    assert paper.schedule(32, 576, 576) == average.schedule(32, 576, 576) == average.schedule(2, 64, 64) == []
    with pytest.raises(ValueError, match="decoder layer 1"):
        paper.schedule(2, 65, 64)
    with pytest.raises(ValueError, match="budget_rule=paper"):
        average.schedule(32, 1500, 90)


def test_composition_is_refused_in_one_line():
    """FlowCut is an in-LLM selector with its own tower stage and no switch for it: an input part would replace
    that stage, and another in-LLM part would be a second decoder stage; both refused in one line."""
    from prune_audit.errors import PruneAuditError
    from prune_audit.pruners.composed import parse_selector

    for name, words in (("random+flowcut", "run 'flowcut' alone"), ("flowcut+fastv", "both parts")):
        with pytest.raises(PruneAuditError, match=words) as error:
            parse_selector(name, [])
        assert "\n" not in str(error.value)
