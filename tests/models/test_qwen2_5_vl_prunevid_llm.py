"""PruneVid's two stages on a tiny Qwen2.5-VL clip (``prunevid+prunevid_llm``, ``merge=false``): the in-LLM stage
keeps the official selection (``int(m alpha)`` best of each group the input part formed) on the attention the
model probed, the prefill equals the stock forward with each stage's dropped tokens masked, decoding attends to
the survivors in every layer (the official sliced cache), and keep-all equals dense."""

from __future__ import annotations

import pytest
import torch
from eight_frame_clips import eight_frame_item, tiny_video_vlm
from tiny_models import masked_reference_logits, stock_inputs

from prune_audit.models import load_vlm
from prune_audit.pruners.composed import parse_selector
from prune_audit.pruners.prunevid import TOKEN_GROUPS

TOL = 1e-5
OFFICIAL = ["prunevid.merge=false", "prunevid.cluster_ratio=0.5"]


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return tiny_video_vlm(tmp_path_factory, text_layers=4)


@pytest.fixture(scope="module")
def item(vlm):
    return eight_frame_item(vlm)


def spied(composed):
    """``composed`` whose in-LLM part records each stage's signals, state and kept positions."""
    calls = []
    prune = composed.llm.prune

    def recording(stage, signals, state):
        kept = prune(stage, signals, state)
        calls.append((signals, dict(state), kept))
        return kept

    object.__setattr__(composed.llm, "prune", recording)
    return composed, calls


def official_selection(text_probs: torch.Tensor, groups: list[torch.Tensor], alpha: float) -> list[int]:
    """``process_attention`` on the probed (H, T, n) rows: max over heads then rows, ``int(m alpha)`` of each
    group by ``torch.topk`` (the probed scores have no exact ties), ascending."""
    scores = text_probs.float().max(dim=0)[0].max(dim=0)[0]
    picked = [group[torch.topk(scores[group], k=int(group.numel() * alpha)).indices] for group in groups]
    return sorted(torch.cat(picked).tolist())


def test_the_in_llm_stage_keeps_the_official_share_of_each_group(vlm, item):
    composed, calls = spied(parse_selector("prunevid+prunevid_llm", OFFICIAL))
    prefill, selections = vlm.prefill(
        [item], composed, (item.num_visual, 1), generator=torch.Generator().manual_seed(0)
    )
    fed = selections[0].kept.tolist()
    ((signals, state, kept),) = calls
    groups = state[TOKEN_GROUPS]
    assert signals.layer == 1 and sum(g.numel() for g in groups) == len(fed) < item.num_visual  # layer 11 of 32 on 4
    assert kept.tolist() == official_selection(signals.text_probs, groups, 0.4)
    assert prefill.stage_layers[0] == [1] and sorted(prefill.kept_stages[0][0]) == [fed[i] for i in kept.tolist()]
    reference = masked_reference_logits(vlm, item, [0, 1], [fed, prefill.kept_stages[0][0]])
    assert (prefill.logits[0] - reference).abs().max() <= TOL


@pytest.mark.parametrize("everywhere", [True, False])
def test_decoding_attends_to_the_survivors_in_every_layer(vlm, item, monkeypatch, everywhere):
    """The stage at layer 3 (``layer=24`` of 32 on 4), scored by layer 2: the official slices the cache of layers
    0 to 2 too; MustDrop's rule (``decode_keeps_final_everywhere`` off) would leave layers 0 and 1 every token."""
    composed = parse_selector("prunevid+prunevid_llm", [*OFFICIAL, "prunevid_llm.layer=24"])
    monkeypatch.setattr(type(composed.llm), "decode_keeps_final_everywhere", everywhere)
    prefill, selections = vlm.prefill([item], composed, (item.num_visual, 1), use_cache=True)
    fed, final = selections[0].num_output_tokens, len(prefill.kept_stages[0][-1])
    text = item.input_ids.numel() - item.num_visual
    assert prefill.stage_layers[0] == [3] and final < fed
    shallow = [text + final] * 2 if everywhere else [text + fed] * 2
    assert [int(keys.sum()) for keys in prefill.decode.key_valid] == [*shallow, text + final, text + final]


@pytest.mark.parametrize("options", [["prunevid_llm.alpha=1.0"], ["prunevid_llm.budget_rule=average"]])
def test_keep_all_is_dense(vlm, item, options):
    composed = parse_selector("prunevid+prunevid_llm", ["prunevid.merge=false", *options])
    full, _ = vlm.prefill([item], composed, (item.num_visual, item.num_visual))
    with torch.no_grad():
        stock = vlm.model(**stock_inputs(vlm, item)).logits[:, -1]
    assert (full.logits - stock).abs().max() <= TOL


@pytest.mark.parametrize("composed", [False, True])
def test_clip_flops_equal_the_counted_flops(vlm, item, composed):
    """``FlopCounterMode`` over the eager forward counts what the accounting says outside the selectors (the tower,
    the pruned prefill and its attention probe) and inside them: prunevid_llm's own work has no product (zero),
    prunevid's Grams are counted from the sizes its selection reports (both ``flops_exact``)."""
    from test_compute import counted, eager

    eager_vlm = eager(load_vlm(vlm.model_id, device="cpu"))
    if composed:
        selector, budget = parse_selector("prunevid+prunevid_llm", OFFICIAL), (item.num_visual, 1)
    else:
        selector, budget = parse_selector("prunevid_llm", []), item.num_visual // 2
    outside, inside, answer = counted(eager_vlm, item, selector, budget)
    assert outside == answer.cost.flops_vision + answer.cost.flops_llm
    assert answer.cost.flops < answer.cost.flops_dense
    assert inside == answer.cost.flops_selector  # prunevid's Grams, from the sizes its selection reports
    assert (answer.cost.flops_selector > 0) == composed
