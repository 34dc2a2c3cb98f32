"""FastV: prune once inside the LLM by the last prompt token's attention."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from torch import Tensor

from prune_audit.pruners.base import Reference, Stage
from prune_audit.pruners.fidelity import (
    LAST_ROW_HALF,
    MODEL_DTYPE_ATTENTION,
    TIES_TOPK_HALF,
    Fidelity,
    random_agreement,
)
from prune_audit.pruners.options import Choice, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import SIGNAL_LAYERS, SingleStageSelector
from prune_audit.pruners.signals import LayerSignals


def last_row_attention(signals: LayerSignals) -> Tensor:
    """(n,) head-mean attention probability of the last prompt position to each alive visual token.

    ``signals.text_probs`` is (H, T, n), softmax over every key the row sees; the raw
    probabilities are used, not renormalised over the visual columns.
    """
    return signals.text_probs.detach().float()[:, -1, :].mean(dim=0)


@register
@dataclass
class FastVSelector(SingleStageSelector):
    """FastV (Chen et al., "An Image is Worth 1/2 Tokens After Layer 2", ECCV 2024; pkunlp-icler/FastV).

    Score: head-mean attention probability from the last prompt position (the last
    text row, ``:`` of ``ASSISTANT:`` on LLaVA-1.5) to each alive visual token, raw
    probabilities (softmax over every key); keep the top ``keep``, original positions
    kept (the in-place variant).

    Schedule: one stage at the input of decoder layer ``layer`` (K = 2 on the 32-layer
    LLaVA-1.5-7B, scaled proportionally on other depths).
    ``budget_rule="average"`` (default): the kept count is solved so that the layer
    average equals the budget, ``k ~ (L B - K N) / (L - K)`` = 166 / 98 / 30 for
    192 / 128 / 64 on LLaVA-1.5-7B (derived; spec section 2). ``budget_rule="paper"``:
    ``budget`` tokens are kept after layer K (the kept-after-K convention of FastV's
    ``fast_v_attention_rank``); its realised average is larger (156 for 128).

    ``signal_layer="previous"`` (default, reference): the probabilities layer K-1
    computed on its input (the reference's ``output_attentions`` of layer K-1), tokens
    leave from layer K. ``"current"``: layer K's own probabilities on its input.
    ``score_dtype="model"``: the probabilities formed in the model dtype as the reference's
    fp16 eager attention weights (the executor's probe, ``DecoderProbe.probabilities``) and
    the scores rounded to it.

    Deviations: ties to the lower index (``torch.topk`` leaves them unspecified);
    prefill-only pruning (the reference without KV cache re-ranks at every generated token).
    """

    name: ClassVar[str] = "fastv"
    summary: ClassVar[str] = "last prompt token's attention, one stage at layer K=2"
    requires: ClassVar[frozenset[str]] = frozenset({"text_probs"})
    reference: ClassVar[Reference] = Reference(
        "An Image is Worth 1/2 Tokens After Layer 2 (FastV), ECCV 2024", "pkunlp-icler/FastV"
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "d1659729",
        "attention of layer K-1 (signal_layer=previous), last prompt row, K=2, average-matched count",
        ("budget_rule=paper", "score_dtype=model", "ties=topk"),
        (
            TIES_TOPK_HALF,
            "prefill-only pruning (the official code without KV cache re-ranks at every generated token)",
            "ties to the lower index",
            MODEL_DTYPE_ATTENTION,
        ),
        random_agreement(
            30,
            "test_fidelity.py::test_attention_and_variation_scorers_reproduce_the_official_top_k",
            "and identical to the top-k of layer K-1's eager attention in 2 of 2 prompts on the tiny LLaVA "
            "(test_fastv.py::test_fastv_ranks_with_the_attention_of_the_layer_before_the_cut)",
        ),  # fmt: skip
        30,
        LAST_ROW_HALF,
        {"fp16": 30, "bf16": 30},
    )

    flops_exact: ClassVar[bool] = True  # no products of its own: it ranks the attention the model gives it

    signal_layer: str = option("previous", Choice(SIGNAL_LAYERS), "layer K-1's attention (reference) or layer K's")

    def score(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        return last_row_attention(signals)
