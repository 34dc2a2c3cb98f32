"""HoliTom on a Qwen2.5-VL clip end to end (tiny fp32 model): with ``merge=false`` it keeps its selection of the
adapter's signals and the pruned prefill equals the stock forward with the other video tokens masked out, keep-all
is dense, the merging default is refused in one line (Qwen2.5-VL keeps original positions), and the clip's counted
FLOPs are the accounting's."""

from __future__ import annotations

import pytest
import torch
from eight_frame_clips import (
    assert_keep_all_is_dense,
    assert_merging_and_still_images_refused,
    eight_frame_item,
    spied,
    tiny_video_vlm,
)
from tiny_models import masked_reference_logits

from prune_audit.models import load_vlm
from prune_audit.pruners import get_selector

TOL = 1e-5


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return tiny_video_vlm(tmp_path_factory)


@pytest.fixture(scope="module")
def item(vlm):
    return eight_frame_item(vlm, repeat=4)


def test_holitom_without_merging_keeps_its_selection_and_keep_all_is_dense(vlm, item):
    selector, calls = spied(get_selector("holitom", merge=False))
    prefill, selections = vlm.prefill([item], selector, 16, generator=torch.Generator().manual_seed(0))
    assert calls[0].video_grid == (4, 4, 5)
    expected = get_selector("holitom", merge=False).select(calls[0], 16, torch.Generator().manual_seed(0))
    assert torch.equal(selections[0].kept, expected.kept) and 1 <= selections[0].kept.numel() <= 16
    assert get_selector("holitom").select(calls[0], 16, torch.Generator().manual_seed(0)).sources is not None
    reference = masked_reference_logits(vlm, item, [0], [selections[0].kept.tolist()])
    assert (prefill.logits[0] - reference).abs().max() <= TOL
    assert_keep_all_is_dense(vlm, item, get_selector("holitom", merge=False))


def test_merging_holitom_and_still_images_are_refused_in_one_line(vlm, item):
    assert_merging_and_still_images_refused(vlm, item, "holitom")


def test_clip_flops_equal_the_counted_flops(vlm, item):
    """``FlopCounterMode`` over the eager forward counts what the accounting says: the tower per step, the step
    attention HoliTom reads, and none of its own (no matrix product: ``flops_exact`` with zero)."""
    from test_compute import counted, eager

    eager_vlm = eager(load_vlm(vlm.model_id, device="cpu"))
    outside, inside, answer = counted(eager_vlm, item, get_selector("holitom", merge=False), item.num_visual // 2)
    assert outside == answer.cost.flops_vision + answer.cost.flops_llm
    assert inside == answer.cost.flops_selector == 0
    assert "vision_step_attention" in answer.cost.signal_sources
