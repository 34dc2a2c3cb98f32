"""HoliTom on a LLaVA-OneVision clip (tiny fp32 model): refused in one line, as the family computes no step attention
on clips (HoliTom's official salience, SigLIP's last-layer attention averaged over its queries, is not computed)."""

from __future__ import annotations

import pytest
from tiny_models import QUESTIONS, WORDS, random_image

from prune_audit.errors import PruneAuditError
from prune_audit.models import load_vlm
from prune_audit.models.llava_onevision import LlavaOnevisionModel
from prune_audit.models.video_sampling import write_video_sampling
from prune_audit.pruners import get_selector


def test_holitom_is_refused_on_a_onevision_clip_in_one_line(tmp_path):
    path = LlavaOnevisionModel.build_tiny(tmp_path / "model", words=WORDS, image_size=186, text_layers=2, seed=5)
    write_video_sampling(path, {"frames": 4})
    vlm = load_vlm(path, device="cpu")
    item = vlm.prepare_video(vlm.read_clip([random_image(seed, (90, 70)) for seed in range(6)], 2.0), QUESTIONS[0])
    for selector in (get_selector("holitom"), get_selector("holitom", merge=False)):
        with pytest.raises(PruneAuditError, match="needs step_attention") as error:
            vlm.prefill([item], selector, 50)
        assert "\n" not in str(error.value)
