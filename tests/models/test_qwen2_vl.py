"""Qwen2-VL (``models/qwen2_vl.py``): what the adapter declares beside Qwen2.5-VL's, each refusal in one line.

The suites over every family (``test_families_registry.py``) check its prompts, prefill, geometry and selectors;
these are the facts Qwen2-VL alone declares: no HiPrune / CLS / CLIP-text signals, no box convention, no video path.
"""

from __future__ import annotations

import pytest
from tiny_models import QUESTIONS, WORDS, random_image

from prune_audit.data.boxes import box_convention
from prune_audit.data.video import sample_clip
from prune_audit.errors import PruneAuditError
from prune_audit.models import load_vlm
from prune_audit.models.qwen2_vl import Qwen2VLModel
from prune_audit.pruners import get_selector

SMALL = {"min_pixels": 4 * 28 * 28, "total_pixels": 4 * 168 * 168}


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    path = Qwen2VLModel.build_tiny(tmp_path_factory.mktemp("qwen2vl") / "model", words=WORDS, text_layers=2, seed=5)
    return load_vlm(path, device="cpu")


def test_it_reads_the_merged_features_and_the_text_demand_only(vlm):
    assert vlm.family == "qwen2_vl" and vlm.input_signals >= {"features", "demand"}
    supported = vlm.supported_selectors()
    assert {"divprune", "fastv", "random"} <= set(supported)
    assert not {"hiprune", "visionzip", "cdpruner"} & set(supported)  # Qwen2.5-VL's tower gives HiPrune its signal
    with pytest.raises(PruneAuditError) as refused:
        vlm.check_selector(get_selector("visionzip"))
    assert "\n" not in str(refused.value) and "no CLS token" in str(refused.value)


def test_grounding_is_refused_in_one_line_naming_the_families_that_have_a_convention(vlm):
    assert vlm.grounding is None
    with pytest.raises(PruneAuditError) as refused:
        box_convention(vlm.grounding, vlm.display_name)
    message = str(refused.value)
    assert "\n" not in message and "Qwen2-VL declares no box convention" in message and "Qwen2.5-VL" in message


def test_a_clip_is_refused_in_one_line(vlm):
    clip = sample_clip([random_image(seed, (130, 100)) for seed in range(4)], 2.0, **SMALL)
    with pytest.raises(PruneAuditError, match="Qwen2-VL has no video path here"):
        vlm.prepare_video(clip, QUESTIONS[0])
    assert vlm.prepare(random_image(0, (130, 100)), QUESTIONS[0]).num_visual > 0  # still images are its input
