"""Where each selector can run inside a serving engine, read off its declared stage and signals."""

import pytest

from prune_audit.pruners import list_selectors, selector_class
from prune_audit.pruners.base import InputSelector
from prune_audit.pruners.serving import SERVING_NEEDS, serving_need


@pytest.mark.parametrize("name", list_selectors())
def test_every_registered_selector_has_a_serving_need_in_words(name):
    need = serving_need(selector_class(name))
    assert need in SERVING_NEEDS and need != "undeclared"  # a built-in reads only signals classified here


@pytest.mark.parametrize(
    ("name", "need"),
    [
        ("divprune", "encoder"),  # projector outputs alone
        ("pool", "encoder"),
        ("visionzip", "encoder_attention"),  # CLS attention and keys of the tower
        ("hiprune", "encoder_attention"),
        ("cdpruner", "prompt"),  # CLIP text relevance of the question
        ("coverage", "prompt"),  # a first-layer probe of the prompt
        ("v2drop", "llm_hidden"),  # hidden-state variation, any attention kernel
        ("dart", "llm_hidden"),  # key norms and normed hidden states
        ("fastv", "llm_attention"),  # the last text row's attention
        ("vscan", "llm_attention"),  # tower CLS attention, then the LLM's: the harder need wins
    ],
)
def test_serving_need_of_known_selectors(name, need):
    assert serving_need(selector_class(name)) == need


def test_a_plugin_signal_is_undeclared_not_guessed():
    class PluginSelector(InputSelector):
        name = "plugin_serving_probe"
        requires = frozenset({"features", "saliency_map"})

    assert serving_need(PluginSelector) == "undeclared"
