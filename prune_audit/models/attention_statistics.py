"""Attention statistics of an unpruned prefill for fitting a pruning schedule (FitPrune's calibration).

A :class:`StatisticsProbe` rides the pruning loop as an in-LLM selector that prunes nothing: a stage at the
input of every layer from 1 on, each reading the attention the layer before computed on its input (the
``signal_layer="previous"`` probe of ``models.layer_signals``), so layer ``l``'s statistics are those of the
unpruned prompt. The last layer's attention is not read: a token removed after it leaves no later input.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor

from prune_audit.pruners.base import LayerSelector, Reference, Stage
from prune_audit.pruners.fitprune import AttentionStatistics, statistics_from_probs
from prune_audit.pruners.signals import LayerSignals

if TYPE_CHECKING:
    from prune_audit.models.base import VisionLanguageModel
    from prune_audit.models.prepared import Prepared


@dataclass
class StatisticsProbe(LayerSelector):
    """Records each layer's (cross, visual) head-max attention statistics and keeps every token (not registered)."""

    name: ClassVar[str] = "attention statistics"
    reference: ClassVar[Reference] = Reference("-", "-")
    requires: ClassVar[frozenset[str]] = frozenset({"text_probs", "visual_probs"})
    signal_layer = "previous"
    cross: list[Tensor] = field(default_factory=list)
    visual: list[Tensor] = field(default_factory=list)

    def schedule(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        return [Stage(layer, num_visual) for layer in range(1, num_layers)]

    def prune(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        self._check_signals(signals)
        cross, visual = statistics_from_probs(signals.text_probs, signals.visual_probs)  # type: ignore[arg-type]
        self.cross.append(cross)
        self.visual.append(visual)
        return torch.arange(signals.num_alive, dtype=torch.long)


def attention_statistics(vlm: VisionLanguageModel, item: Prepared) -> AttentionStatistics:
    """The statistics of ``item``'s unpruned prefill at layers 0..L-2 (``AttentionStatistics`` of L - 1 rows)."""
    probe = StatisticsProbe()
    vlm.prefill([item], probe, item.num_visual)
    return AttentionStatistics(torch.stack(probe.cross), torch.stack(probe.visual))
