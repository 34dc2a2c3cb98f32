"""PruneVid on a Qwen2.5-VL clip end to end (tiny fp32 model): with ``merge=false`` it keeps its selection of the
adapter's signals and the pruned prefill equals the stock forward with the other video tokens masked out, keep-all
is dense, and the merging default is refused in one line (Qwen2.5-VL keeps original positions), as a still image."""

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

from prune_audit.pruners import get_selector

TOL = 1e-5


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    return tiny_video_vlm(tmp_path_factory)


@pytest.fixture(scope="module")
def item(vlm):
    return eight_frame_item(vlm)


@pytest.mark.parametrize("options", [{}, {"cluster_ratio": 0.5}])
def test_prunevid_without_merging_keeps_its_selection_and_keep_all_is_dense(vlm, item, options):
    selector, calls = spied(get_selector("prunevid", merge=False, **options))
    prefill, selections = vlm.prefill([item], selector, 24, generator=torch.Generator().manual_seed(0))
    assert calls[0].video_grid == (4, 4, 5)
    expected = get_selector("prunevid", merge=False, **options).select(calls[0], 24, torch.Generator().manual_seed(0))
    assert torch.equal(selections[0].kept, expected.kept) and 1 <= selections[0].kept.numel() <= 24
    reference = masked_reference_logits(vlm, item, [0], [selections[0].kept.tolist()])
    assert (prefill.logits[0] - reference).abs().max() <= TOL
    assert_keep_all_is_dense(vlm, item, get_selector("prunevid", merge=False))


def test_merging_prunevid_and_still_images_are_refused_in_one_line(vlm, item):
    assert_merging_and_still_images_refused(vlm, item, "prunevid")
