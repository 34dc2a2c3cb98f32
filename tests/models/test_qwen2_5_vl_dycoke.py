"""DyCoke on a tiny Qwen2.5-VL clip (``QwenModel.prepare_video``): the temporal merging's kept tokens are the
selector's on the clip's merged features and the pruned prefill equals the stock forward with the dropped tokens
masked; keep-all equals dense; composed with its decode-time stage (``dycoke+dycoke_kv``) both stages are recorded,
nested, and the prefill equals the masked stock forward at each stage's layer."""

from __future__ import annotations

import pytest
import torch
from tiny_models import QUESTIONS, WORDS, masked_reference_logits, random_image, stock_inputs

from prune_audit.data.video import sample_clip
from prune_audit.models import load_vlm
from prune_audit.models.qwen import QwenModel
from prune_audit.pruners import get_selector
from prune_audit.pruners.composed import parse_selector
from prune_audit.pruners.signals import InputSignals

TOL = 1e-5
FRAMES = 10  # 5 s at 2 fps: 5 temporal steps of 4 x 5 tokens (an odd count: the official loops drop the last)


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = QwenModel.build_tiny(
        tmp_path_factory.mktemp("qwen") / "qwen", words=WORDS, image_size=168, text_layers=4, seed=4
    )
    return load_vlm(path, device="cpu")


@pytest.fixture(scope="module")
def item(vlm):
    frames = [random_image(seed, (130, 100)) for seed in range(FRAMES)]
    clip = sample_clip(frames, 2.0, min_pixels=4 * 28 * 28, total_pixels=FRAMES * 168 * 168)
    return vlm.prepare_video(clip, QUESTIONS[0])


def stock_logits(vlm, item) -> torch.Tensor:
    with torch.no_grad():
        return vlm.model(**stock_inputs(vlm, item)).logits[:, -1]


def test_dycoke_keeps_its_selection_of_the_clip_features(vlm, item):
    assert item.video_grid == (5, 4, 5)
    dycoke = get_selector("dycoke")
    prefill, selections = vlm.prefill([item], dycoke, 50)
    features = vlm.model.model.get_video_features(
        item.pixel_values, item.extras["video_grid_thw"], return_dict=True
    ).pooler_output[0]
    expected = dycoke.select(InputSignals(grid=item.grid, features=features.float(), video_grid=item.video_grid), 50)
    assert torch.equal(selections[0].kept, expected.kept) and expected.kept.numel() == 50
    assert set(range(20)) <= set(selections[0].kept.tolist())  # the first step whole
    reference = masked_reference_logits(vlm, item, [0], [selections[0].kept.tolist()])
    assert (prefill.logits[0] - reference).abs().max() <= TOL


def test_keep_all_is_dense(vlm, item):
    full, _ = vlm.prefill([item], get_selector("dycoke"), item.num_visual)
    assert (full.logits - stock_logits(vlm, item)).abs().max() <= TOL
    both, _ = vlm.prefill([item], parse_selector("dycoke+dycoke_kv", []), (item.num_visual, item.num_visual))
    assert (both.logits - stock_logits(vlm, item)).abs().max() <= TOL


def test_composed_with_its_decode_stage_records_both_stages(vlm, item):
    prefill, selections = vlm.prefill([item], parse_selector("dycoke+dycoke_kv", []), (50, 30))
    fed = selections[0].kept.tolist()  # the input stage (recorded at layer 0 by the run)
    layers, stages = prefill.stage_layers[0], [list(kept) for kept in prefill.kept_stages[0]]
    assert list(layers) == [1] and len(fed) == 50  # layer 3 of the 32-layer reference on 4 layers
    assert set(stages[0]) <= set(fed) and fed[-1] in stages[0]  # nested; the last visual token always kept
    reference = masked_reference_logits(vlm, item, [0, 1], [fed, stages[0]])
    assert (prefill.logits[0] - reference).abs().max() <= TOL
