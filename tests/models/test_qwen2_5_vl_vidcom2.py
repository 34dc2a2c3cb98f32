"""VidCom2 on a Qwen2.5-VL clip end to end (tiny fp32 model): the kept tokens are the selector's on the clip's
merged video features, the pruned prefill equals the stock forward with the other video tokens masked out (original
M-RoPE ids kept), keep-all is dense, and still images are refused in one line."""

from __future__ import annotations

import pytest
import torch
from tiny_models import QUESTIONS, WORDS, masked_reference_logits, random_image, stock_inputs

from prune_audit.data.video import sample_clip
from prune_audit.errors import PruneAuditError
from prune_audit.models import load_vlm
from prune_audit.models.families import adapter_for, family_names
from prune_audit.models.qwen import QwenModel
from prune_audit.pruners import get_selector
from prune_audit.pruners.signals import InputSignals

TOL = 1e-5
SMALL = {"min_pixels": 4 * 28 * 28, "total_pixels": 8 * 168 * 168}  # 8 frames of 130 x 100: a 4 x 4 x 5 token grid


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = QwenModel.build_tiny(
        tmp_path_factory.mktemp("qwen") / "qwen", words=WORDS, image_size=168, text_layers=3, seed=5
    )
    return load_vlm(path, device="cpu")


@pytest.fixture(scope="module")
def item(vlm):
    clip = sample_clip([random_image(seed, (130, 100)) for seed in range(8)], 2.0, **SMALL)  # 4 s: 8 frames
    return vlm.prepare_video(clip, QUESTIONS[0])


def test_vidcom2_keeps_its_selection_of_the_clip_features_and_keep_all_is_dense(vlm, item):
    assert item.video_grid == (4, 4, 5)
    selector = get_selector("vidcom2")
    prefill, selections = vlm.prefill([item], selector, 30)
    features = vlm.model.model.get_video_features(
        item.pixel_values, item.extras["video_grid_thw"], return_dict=True
    ).pooler_output[0]
    expected = selector.select(InputSignals(grid=item.grid, features=features.float(), video_grid=item.video_grid), 30)
    assert torch.equal(selections[0].kept, expected.kept) and selections[0].kept.numel() == 30
    reference = masked_reference_logits(vlm, item, [0], [selections[0].kept.tolist()])
    assert (prefill.logits[0] - reference).abs().max() <= TOL
    full, _ = vlm.prefill([item], selector, item.num_visual)
    with torch.no_grad():
        stock = vlm.model(**stock_inputs(vlm, item)).logits[:, -1]
    assert (full.logits - stock).abs().max() <= TOL


def test_vidcom2_is_refused_on_still_images_in_one_line(vlm):
    image = vlm.prepare(random_image(0, (130, 100)), QUESTIONS[0])
    with pytest.raises(PruneAuditError, match="still image") as refusal:
        vlm.prefill([image], get_selector("vidcom2"), 10)
    assert "\n" not in str(refusal.value)
    for family in family_names():
        assert "still image" in adapter_for(family, "test").selector_support()["vidcom2"]
