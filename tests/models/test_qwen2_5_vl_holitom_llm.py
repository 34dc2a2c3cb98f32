"""HoliTom with its inner-LLM merge (``holitom+holitom_llm``, the outer part with ``merge=false`` as Qwen2.5-VL
keeps original positions) on a tiny Qwen2.5-VL clip: the stage at the scaled layer keeps half the fed tokens and
folds every other one into a kept one in its place; the prefill equals the stock forward with the dropped keys
masked from that layer and each kept state replaced by its fold; keep-all equals dense; its FLOPs are counted."""

from __future__ import annotations

import pytest
import torch
from eight_frame_clips import eight_frame_item, tiny_video_vlm
from tiny_models import masked_reference_logits, stock_inputs, visual_columns

from prune_audit.models import load_vlm
from prune_audit.pruners.composed import parse_selector
from prune_audit.pruners.holitom_llm import HoliTomLLMSelector
from prune_audit.pruners.schedule import REFERENCE_DEPTH, scale_layers

TOL = 1e-5
LAYERS = 4
OPTIONS = ["holitom.merge=false"]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return tiny_video_vlm(tmp_path_factory, text_layers=LAYERS)


@pytest.fixture(scope="module")
def item(vlm):
    return eight_frame_item(vlm, repeat=4)


def folded_reference_logits(vlm, item, layer: int, fed: list[int], merged: list[list[int]], kept: list[int]):
    """The stock forward with the keys outside ``fed`` masked from layer 0 and outside ``kept`` from ``layer``,
    each merged token's kept cell (its one source in ``kept``) given, at ``layer``'s input, its members folded in
    ascending order as the official ``h <- (h + h_member) / 2``."""
    columns = visual_columns(item)

    def fold(module, args, kwargs):
        hidden = (args[0] if args else kwargs["hidden_states"]).clone()
        for group in merged:
            (target,) = set(group) & set(kept)
            state = hidden[0, columns[target]]
            for member in (cell for cell in group if cell != target):
                state = (state + hidden[0, columns[member]]) / 2
            hidden[0, columns[target]] = state
        return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

    handle = vlm.model.model.language_model.layers[layer].register_forward_pre_hook(fold, with_kwargs=True)
    try:
        return masked_reference_logits(vlm, item, [0, layer], [fed, kept])
    finally:
        handle.remove()


def test_the_inner_merge_folds_half_the_fed_tokens_in_place(vlm, item):
    selector = parse_selector("holitom+holitom_llm", OPTIONS)
    prefill, selections = vlm.prefill([item], selector, (40, 20), generator=torch.Generator().manual_seed(0))
    fed = selections[0].kept.tolist()
    (layer,) = prefill.stage_layers[0]
    assert layer == scale_layers([21], REFERENCE_DEPTH, LAYERS)[0] == 3
    plain, merged = prefill.kept_stages[0][0], prefill.merged_stages[0][0]
    assert merged and sorted([*plain, *(cell for group in merged for cell in group)]) == fed  # each fed token once
    options = [*OPTIONS, "holitom_llm.merge_pruned=false"]
    generator = torch.Generator().manual_seed(0)
    unmerged, _ = vlm.prefill([item], parse_selector("holitom+holitom_llm", options), (40, 20), generator=generator)
    survivors = unmerged.kept_stages[0][0]  # the same attention ranks both: the folds change no selection
    assert len(survivors) == round(len(fed) / 2) and set(survivors) <= set(fed) and not unmerged.merged_stages[0][0]
    assert (unmerged.logits[0] - masked_reference_logits(vlm, item, [0, layer], [fed, survivors])).abs().max() <= TOL
    targets = [set(group) & set(survivors) for group in merged]  # each merged token stands in one kept cell
    assert all(len(target) == 1 for target in targets)
    assert sorted(plain + [cell for target in targets for cell in target]) == survivors
    reference = folded_reference_logits(vlm, item, layer, fed, merged, survivors)
    assert (prefill.logits[0] - reference).abs().max() <= TOL
    assert (prefill.logits[0] - unmerged.logits[0]).abs().max() > TOL  # the folds change the answer's logits


def test_keep_all_is_dense(vlm, item):
    selector = parse_selector("holitom+holitom_llm", OPTIONS)
    full, _ = vlm.prefill([item], selector, (item.num_visual, item.num_visual))
    with torch.no_grad():
        stock = vlm.model(**stock_inputs(vlm, item)).logits[:, -1]
    assert (full.logits - stock).abs().max() <= TOL


def test_clip_flops_equal_the_counted_flops(vlm, item):
    """``FlopCounterMode`` over the eager forward counts what the accounting says, the inner merge's cosines
    (its own arithmetic: ``flops_exact``) included."""
    from test_compute import counted, eager

    eager_vlm = eager(load_vlm(vlm.model_id, device="cpu"))
    selector = parse_selector("holitom+holitom_llm", OPTIONS)
    outside, inside, answer = counted(eager_vlm, item, selector, (40, 20))
    assert outside == answer.cost.flops_vision + answer.cost.flops_llm
    assert inside == answer.cost.flops_selector > 0
    assert HoliTomLLMSelector.flops_exact
