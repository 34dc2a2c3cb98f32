"""SparseVLM: progressive pruning by the attention of text "raters" chosen from the input embeddings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, get_args

import torch
from torch import Tensor

from prune_audit.pruners.base import LayerSignals, PositionMode, Reference, Stage
from prune_audit.pruners.registry import register
from prune_audit.pruners.options import Choice, option
from prune_audit.pruners.schedule import SIGNAL_LAYERS, ScheduledSelector

SPARSEVLM_LAYERS = (2, 6, 15)  # the layers whose attention scores; the reference prunes their outputs
# tokens kept after each stage, score.py of the reference (RETAIN_TOKN)
SPARSEVLM_COUNTS = {64: (66, 30, 17), 96: (238, 48, 26), 128: (303, 110, 36), 192: (300, 200, 110)}


def select_raters(embeddings: Tensor, text_embeddings: Tensor) -> Tensor:
    """(T,) bool: the text tokens whose relevance to the image is above the mean.

    ``P = softmax over text of V T^T`` (V: (n, D) visual, T: (T, D) text input
    embeddings), ``w = mean over visual tokens of P``; raters are ``w > mean(w)``.
    If no token is above the mean (all equally relevant) every text token rates.
    """
    relevance = torch.softmax(embeddings.detach().float() @ text_embeddings.detach().float().T, dim=-1).mean(dim=0)
    raters = relevance > relevance.mean()
    return raters if bool(raters.any()) else torch.ones_like(raters)


@register
@dataclass
class SparseVLMSelector(ScheduledSelector):
    """SparseVLM v1.5 without recycling (Zhang et al., ICML 2025; Gumpest/SparseVLMs, branch main).

    Raters: chosen once per question from the LLM input embeddings of the visual and
    the text tokens after the image (question and template suffix), see
    :func:`select_raters`; kept in ``state`` so later stages use the same raters.
    Score at each stage: attention probabilities of the rater rows, mean over heads
    and raters, to each alive visual token; keep the top ``keep``. Positions are
    compacted (v1.5 truncates ``position_ids``).

    Scoring layers 2, 6, 15. ``signal_layer="previous"`` (default, reference): layer
    ``l`` runs on all tokens, its own attention probabilities score, and its *output*
    is pruned (stages at the inputs of layers 3, 7, 16). ``"current"``: the stage is at
    the input of layer ``l``, scored by layer ``l``'s probe there (tokens leave one
    layer earlier). ``budget_rule="paper"``: the reference's counts 192 -> 300/200/110,
    128 -> 303/110/36, 96 -> 238/48/26, 64 -> 66/30/17, realising 202.75 / 140.81 / 79.19
    for 192 / 128 / 64 on 32 layers x 576 tokens with the reference semantics (188.19 /
    123.94 / 61.72 with ``"current"``). ``budget_rule="average"`` (default): the nearest
    of those as a shape, solved so the realised average matches the budget.
    ``score_dtype="model"``: probabilities and scores rounded to the model dtype.

    Deviations: (1) no recycling yet: the reference merges the best pruned tokens into
    DPC-kNN cluster tokens inserted after the kept ones; the executor only removes
    tokens. (2) Exactly ``keep`` tokens are kept (the reference caps at ``n - 1``);
    ties to the lower index.
    """

    name: ClassVar[str] = "sparsevlm"
    summary: ClassVar[str] = "attention of text raters chosen from input embeddings, layers 2/6/15 (no recycling)"
    requires: ClassVar[frozenset[str]] = frozenset({"text_probs", "embeddings", "text_embeddings"})
    reference: ClassVar[Reference] = Reference(
        "SparseVLM: Visual Token Sparsification for Efficient Vision-Language Model Inference, ICML 2025",
        "Gumpest/SparseVLMs",
    )

    reference_counts: ClassVar[Mapping[int, Sequence[int]]] = SPARSEVLM_COUNTS

    positions: str = option("compact", Choice(get_args(PositionMode)), "position ids after pruning (v1.5 compacts)")
    signal_layer: str = option(
        "previous", Choice(SIGNAL_LAYERS), "prune layer l's output by its attention (reference) or its input by a probe"
    )

    @property
    def reference_layers(self) -> tuple[int, ...]:  # type: ignore[override]
        """Stage layers (inputs) on the 32-layer reference: after the scoring layers, or at them."""
        shift = 1 if self.signal_layer == "previous" else 0
        return tuple(layer + shift for layer in SPARSEVLM_LAYERS)

    def score(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        if "raters" not in state:
            state["raters"] = select_raters(signals.embeddings, signals.text_embeddings)
        return signals.text_probs.detach().float()[:, state["raters"], :].mean(dim=(0, 1))
