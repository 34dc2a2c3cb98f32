"""V2Drop: progressive pruning of the visual tokens whose hidden states change least."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from prune_audit.pruners.base import Reference, Stage
from prune_audit.pruners.fidelity import Fidelity, random_agreement
from prune_audit.pruners.options import Choice, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import (
    OFFICIAL_RULES,
    REFERENCE_DEPTH,
    REFERENCE_VISUAL,
    ScheduledSelector,
    merge_stages,
    paper_schedule,
    scale_layers,
)
from prune_audit.pruners.signals import LayerSignals

V2DROP_LAYERS = (3, 17, 22)
# paper schedules (quoted in V2Drop issue #6): fraction of the current tokens kept at each stage
PAPER_KEEP_RATIOS = {64: (0.05, 0.05, 0.0), 128: (0.28, 0.25, 0.0), 192: (0.5, 0.3, 0.0)}
# the repository's LLaVA code: keep 0.5 / 0.5 / 0 of the current count, at least one token per stage
OFFICIAL_KEEP_RATIOS = (0.5, 0.5, 0.0)


def ratio_counts(ratios: Sequence[float], num_visual: int) -> list[int]:
    """Counts after each stage keeping ``int(current * ratio)`` tokens, as the reference does."""
    counts, current = [], num_visual
    for ratio in ratios:
        current = int(current * ratio)
        counts.append(current)
    return counts


# the paper counts on 576 tokens (576 -> 288 -> 86 -> 0 etc.) are the default rule's shapes
V2DROP_SHAPES = {budget: ratio_counts(ratios, REFERENCE_VISUAL) for budget, ratios in PAPER_KEEP_RATIOS.items()}


@register
@dataclass
class V2DropSelector(ScheduledSelector):
    """V2Drop ("Variation-aware Vision Token Dropping for Faster Large Vision-Language Models"; xuyang-liu16/V2Drop).

    Score: ``||h_l[j] - h_{l-1}[j]||_2``, the size of the update layer ``l - 1`` wrote
    into the alive visual token ``j`` (``hidden_states`` minus ``previous_hidden_states``,
    the inputs of layers ``l`` and ``l - 1``); keep the ``keep`` tokens with the
    **largest** variation. Stages at the inputs of layers 3, 17, 22; original positions kept.

    ``budget_rule="paper"``: the paper's keep ratios of the current count,
    192 -> 50% / 30% / 0 (576 -> 288 -> 86 -> 0), 128 -> 28% / 25% / 0 (161 -> 40 -> 0),
    64 -> 5% / 5% / 0 (28 -> 1 -> 0), realised averages ~193 / 131 / 67.
    ``budget_rule="average"`` (default): those counts as shapes, solved to the budget.
    ``budget_rule="official"``: the repository's LLaVA schedule, keep ratios 0.5 / 0.5 / 0
    with ``max(1, int(n * ratio))`` (576 -> 288 -> 144 -> 1), realised average 202.81 on
    32 x 576; any other budget is refused with that average.

    ``score_dtype="model"`` (a half model dtype): as the reference computes in it, the states
    rounded, their difference rounded, its norm rounded; ``ties="topk"`` ranks with ``torch.topk``.

    Deviations: under the paper and average rules the last stage keeps 0 tokens as the
    paper states (the repository keeps one); ties to the lower index by default.
    """

    name: ClassVar[str] = "v2drop"
    summary: ClassVar[str] = "largest hidden-state variation across one layer, layers 3/17/22"
    requires: ClassVar[frozenset[str]] = frozenset({"hidden_states", "previous_hidden_states"})
    reference: ClassVar[Reference] = Reference(
        "Variation-aware Vision Token Dropping for Faster Large Vision-Language Models (V2Drop), 2025",
        "xuyang-liu16/V2Drop",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "219e03ed",
        "largest hidden-state variation at layers 3/17/22, paper shapes solved to the budget average",
        ("budget_rule=official", "score_dtype=model", "ties=topk"),
        (
            "paper and average rules keep 0 tokens at the last stage as the paper states (the code keeps 1; "
            "budget_rule=official does)",
            "ties to the lower index by default; ties=topk ranks with torch.topk on the half variations as the "
            "official code (its order among exact ties is the kernel's: use it to reproduce a run on the same "
            "hardware, the default for deterministic audits)",
            "score_dtype=model computes as the official code in the model dtype: the states rounded, their "
            "difference rounded, its norm torch's half-precision reduction (float32 accumulation in the kernel's "
            "order, rounded once)",
        ),
        random_agreement(
            30,
            "test_fidelity.py::test_attention_and_variation_scorers_reproduce_the_official_top_k",
            "one stage; official schedule identical to the code's default (test_schedule.py)",
        ),
        30,
        "fp16 30 of 30, bf16 30 of 30 random cases and 10 of 10 each with duplicated rows, with score_dtype=model, "
        "ties=topk against the official torch.norm of the half difference on CPU "
        "(test_v2drop.py::test_v2drop_model_dtype_reproduces_the_official_half_precision_variation); "
        "lower-index ties 5 and 0 of 30, float32 5 and 0 of 30",
        {"fp16": 30, "bf16": 30},
    )

    flops_exact: ClassVar[bool] = True  # no matrix products of its own

    reference_layers: ClassVar[tuple[int, ...]] = V2DROP_LAYERS
    reference_counts: ClassVar[Mapping[int, Sequence[int]]] = V2DROP_SHAPES

    budget_rule: str = option(
        "average", Choice(OFFICIAL_RULES), "average (solved), paper (issue #6 ratios), official (code: 0.5/0.5/0, >= 1)"
    )

    def official_stages(self, num_layers: int, num_visual: int) -> list[Stage]:
        counts, current = [], num_visual
        for ratio in OFFICIAL_KEEP_RATIOS:
            current = max(1, int(current * ratio))
            counts.append(current)
        layers, counts = merge_stages(scale_layers(V2DROP_LAYERS, REFERENCE_DEPTH, num_layers), counts)
        return [Stage(layer, count) for layer, count in zip(layers, counts)]

    def paper_stages(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        return paper_schedule(
            V2DROP_LAYERS, PAPER_KEEP_RATIOS, num_layers, num_visual, budget, self.name, counts_for=ratio_counts
        )

    def score(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        update = signals.hidden_states.detach().float() - signals.previous_hidden_states.detach().float()
        half = self.ranking_dtype(signals.model_dtype)
        if half is None:
            return update.norm(dim=-1)
        # the reference subtracts and takes the norm in the model dtype: the difference is rounded, and the
        # norm is torch's half-precision reduction (its float32 accumulation order is the kernel's)
        return torch.linalg.vector_norm(update.to(half), dim=-1).float()
