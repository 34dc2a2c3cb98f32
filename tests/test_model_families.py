"""The family registry: config model_type -> adapter, one-line refusals before weights are read."""

from __future__ import annotations

import json

import pytest

from prune_audit.errors import PruneAuditError
from prune_audit.models import family_names, load_vlm, register_family
from prune_audit.models import families
from prune_audit.models.llava import LlavaModel
from prune_audit.models.qwen import QwenModel
from tiny_models import WORDS


def test_registered_families_in_registration_order():
    assert family_names() == ["llava", "qwen2_5_vl", "qwen2_vl", "internvl", "qwen3_vl", "llava_next", "llava_onevision"]
    assert families.adapter_for("llava", "x") is LlavaModel
    assert families.adapter_for("qwen2_5_vl", "x") is QwenModel


def test_an_unregistered_model_type_is_refused_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    with pytest.raises(PruneAuditError) as error:
        load_vlm(tmp_path, device="cpu")
    assert str(error.value) == f"{tmp_path} is a 'bert' model; supported families: llava, qwen2_5_vl, qwen2_vl, internvl, qwen3_vl, llava_next, llava_onevision"


def test_a_model_type_cannot_be_served_by_two_adapters():
    register_family("llava", LlavaModel)  # the same registration again is harmless
    with pytest.raises(ValueError, match="already served by LlavaModel"):
        register_family("llava", QwenModel)


def test_load_vlm_uses_the_registered_adapter(tmp_path, monkeypatch):
    class CustomLlava(LlavaModel):
        pass

    path = LlavaModel.build_tiny(tmp_path / "llava", words=WORDS, text_layers=2, seed=1)
    monkeypatch.setitem(families._ADAPTERS, "llava", CustomLlava)
    assert type(load_vlm(path, device="cpu")) is CustomLlava


@pytest.mark.parametrize(
    ("adapter", "template", "clip_text", "message"),
    [
        (LlavaModel, "chatml", None, "unknown LLaVA prompt template 'chatml'; choose llava_hf or vicuna_v1"),
        (QwenModel, "vicuna_v1", None, "unknown Qwen2.5-VL prompt template 'vicuna_v1'; choose qwen2_5_vl"),
        (QwenModel, None, "clip", "clip_text applies to LLaVA's CLIP vision tower; Qwen2.5-VL has no CLIP space"),
    ],
)
def test_options_are_checked_by_the_adapter_class(adapter, template, clip_text, message):
    with pytest.raises(PruneAuditError) as error:
        adapter.resolve_template(template)
        adapter.check_clip_text(clip_text)
    assert str(error.value) == message
