"""A half-precision LLaVA passes HiPrune and VScan the vision-layer attention its official code forms in that dtype
(``model_layer_attention`` / ``model_layer_cls_attention``), so score_dtype=model ranks the official half means."""

from __future__ import annotations

import pytest
import torch
from transformers import LlavaForConditionalGeneration

from prune_audit.models import load_vlm
from prune_audit.pruners import get_selector


@pytest.fixture(scope="module")
def tiny_llava_path(tmp_path_factory):
    from tiny_models import WORDS

    from prune_audit.models.llava import LlavaModel

    return LlavaModel.build_tiny(tmp_path_factory.mktemp("half-adapter") / "llava", words=WORDS, text_layers=4, seed=3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_llava_passes_the_official_half_vision_layer_attention(tiny_llava_path, dtype):
    from tiny_models import QUESTIONS, random_image

    path = tiny_llava_path
    eager = LlavaForConditionalGeneration.from_pretrained(path, attn_implementation="eager", dtype=dtype).eval()
    vlm = load_vlm(path, device="cpu", dtype=dtype)
    item = vlm.prepare(random_image(0), QUESTIONS[0])
    [output] = vlm._vision([item], frozenset({"layer_attention", "layer_cls_attention"}))
    with torch.no_grad():
        tower = eager.model.vision_tower(item.pixel_values[None].to(dtype), output_attentions=True)
    layers = output.signals["model_layer_attention"].shape[0]
    official = torch.stack([probs.mean(dim=1).mean(dim=1)[0, 1:] for probs in tower.attentions[:layers]])
    official_cls = torch.stack([probs[0, :, 0, 1:].mean(dim=0) for probs in tower.attentions[:layers]])
    assert official.dtype == dtype  # HiPrune's attentions.mean(1).mean(1) and VScan's CLS head mean, in half
    assert torch.equal(output.signals["model_layer_attention"], official.float())
    assert torch.equal(output.signals["model_layer_cls_attention"], official_cls.float())
    assert not torch.equal(output.signals["layer_attention"], official.float())  # the float32 default differs
    # score_dtype=model ranks these: the official half kept set
    answer = vlm.answer([item], get_selector("hiprune", score_dtype="model", ties="topk"), 8)[0]
    assert len(answer.kept_stages[0]) == 8
    # VScan's in-LLM stage receives the twin through the layer plan, beside the float32 signal
    vscan = get_selector("vscan", score_dtype="model", ties="topk")
    assert vlm.answer([item], vscan, 8)[0].kept_stages
