"""What a selector needs to run inside a serving engine (vLLM, SGLang), read off its stage and signals.

Serving engines run the vision encoder and the language model with fused attention kernels and no hooks by
default; vLLM's EVS prunes on the encoder output alone. A selector's need follows from what it already
declares (``stage`` and ``requires``), so a new selector, a plugin included, is classified with no table to
edit. The levels, from the easiest to deploy:

- ``encoder``: the encoder output alone (projector or pre-projector features): a post-processing step after
  the vision tower.
- ``encoder_attention``: also the vision tower's attention (CLS row, per-layer attention or keys): the tower
  must expose them, eager attention or a recomputed row.
- ``tower``: a step inside the vision tower between its layers (ToMe's tower merging): the tower's forward
  must be replaced.
- ``prompt``: also the question's text (CLIP text relevance, a first-layer probe of the prompt): the pruning
  needs the request's prompt before the language model.
- ``llm_hidden``: inside the language model, its hidden states, key norms or embeddings: a hook in the
  decoder forward, any attention kernel.
- ``llm_attention``: inside the language model, the text rows' attention to the visual tokens: eager
  attention, or the scores recomputed beside a fused kernel.
- ``undeclared``: an input selector reading a signal this module does not know (a plugin's own).
"""

from __future__ import annotations

from typing import Literal

from prune_audit.pruners.base import Selector
from prune_audit.pruners.signals import LAST_LAYER_CLS_SIGNALS, STEP_ATTENTION, VIDEO_GRID

ServingNeed = Literal["encoder", "encoder_attention", "tower", "prompt", "llm_hidden", "llm_attention", "undeclared"]

SERVING_NEEDS: dict[ServingNeed, str] = {
    "encoder": "the encoder output alone",
    "encoder_attention": "the encoder output and the vision tower's attention (eager tower or recomputed row)",
    "tower": "a step inside the vision tower between its layers (its forward replaced)",
    "prompt": "the encoder output and the prompt's text",
    "llm_hidden": "hooks inside the language model (hidden states, key norms); any attention kernel",
    "llm_attention": "the language model's attention to the visual tokens (eager attention or recomputed scores)",
    "undeclared": "signals of its own, not classified here",
}
"""Each need in words, for ``prune-audit selectors`` and the docs."""

#: the encoder output and its layout (a clip's temporal grid: what vLLM's EVS reads beside the video embeddings)
ENCODER_SIGNALS = frozenset({"features", "vision_features", "token_crops", "padded_crops", "crop_layout", VIDEO_GRID})
TOWER_ATTENTION_SIGNALS = (
    frozenset(
        {
            "cls_attention",
            "cls_logits",
            "vision_keys",
            "cls_feature",
            "layer_attention",
            "layer_cls_attention",
            "last_cls_logits",
            STEP_ATTENTION,
        }
    )
    | LAST_LAYER_CLS_SIGNALS
)
TOWER_HOOK_SIGNALS = frozenset({"merging_tower"})
PROMPT_SIGNALS = frozenset({"text_relevance", "model_text_relevance", "demand"})
LLM_ATTENTION_SIGNALS = frozenset({"text_logits", "text_probs", "visual_probs", "rope_ones_logits"})


def serving_need(selector: Selector | type[Selector]) -> ServingNeed:
    """The easiest place a serving engine can run ``selector``, from its ``stage`` and ``requires``."""
    requires = selector.requires
    if selector.stage == "llm":
        return "llm_attention" if requires & LLM_ATTENTION_SIGNALS else "llm_hidden"
    if requires - ENCODER_SIGNALS - TOWER_ATTENTION_SIGNALS - TOWER_HOOK_SIGNALS - PROMPT_SIGNALS:
        return "undeclared"
    if requires & PROMPT_SIGNALS:
        return "prompt"
    if requires & TOWER_HOOK_SIGNALS:
        return "tower"
    return "encoder_attention" if requires & TOWER_ATTENTION_SIGNALS else "encoder"


__all__ = [
    "ServingNeed", "SERVING_NEEDS", "serving_need", "ENCODER_SIGNALS", "TOWER_ATTENTION_SIGNALS", "TOWER_HOOK_SIGNALS",
    "PROMPT_SIGNALS",
    "LLM_ATTENTION_SIGNALS",
]  # fmt: skip
