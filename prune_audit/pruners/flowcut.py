"""FlowCut: progressive pruning inside the CLIP tower by an information-flow score, to the budget."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from prune_audit.pruners.arithmetic import SelectorWork, matmul
from prune_audit.pruners.base import InputSelector, Reference, Selection, as_float32
from prune_audit.pruners.fidelity import Fidelity, random_agreement
from prune_audit.pruners.layout import ANYRES_LLM_CUT
from prune_audit.pruners.ranking import top_k_indices
from prune_audit.pruners.registry import register
from prune_audit.pruners.signals import InputSignals

#: the weight of the running score against the layer's own (the official cumulative_scores update)
EMA_WEIGHT = 0.5


@register
@dataclass
class FlowCutSelector(InputSelector):
    """FlowCut: inside the vision tower, every other layer, the patches with the lowest information-flow score
    leave, fewer at first and more where the CLS attention concentrates, until the budget at the last cut.

    Each tower layer ``l`` (0-based, ``Lv`` layers run to the feature layer) that still sees more patches than the
    budget scores them (:func:`flow_scores`: the CLS attention and the CLS-value attention, each normalised over
    the patches, summed, times the L1 norm of the head-mean value) and folds the score into a running one
    (``0.5 * running + 0.5 * layer``). With ``s = Lv - 2 - l`` layers left to the last cut, a layer with ``s``
    even and ``s >= 0`` cuts (:func:`cut_size`): ``r = round((n - budget) / sqrt(s) * (1 - (H / log n)^2))``
    patches (``H`` the entropy of the normalised CLS attention over the ``n`` patches; ``s = 0``: down to the
    budget), keeping the ``max(n - r, budget)`` with the highest running score, CLS always kept. LLaVA-1.5's
    23 layers cut after layers 1, 3, ..., 21; the feature layer's input holds the budget (a one-layer tower, as
    tiny test models have, cuts to the budget in its only layer).

    Follows TungChintao/FlowCut as shipped on PyPI (``flowcut`` 1.0.2, ``modeling_clip_flowcut.py``:
    ``CLIPEncoderLayer_forward``, ``CLIPEncoder_forward``; ``utils_flowcut.py``: ``compute_score``,
    ``adaptive_prune_ratio``; ``main.py``: ``target + 1`` with the CLS token, last cut at ``select_layer - 1``
    with ``select_layer = layers - 2``, here generalised as one layer before the feature layer). Differences:
    the cut falls between the attention and the MLP of the layer whose attention scored it, not after the MLP
    (the MLP is per token, so the kept states are the same; the cut patches' MLP is not run); exact score ties
    go to the lower index (``torch.topk`` leaves them unspecified); the entropy's ``0 log 0`` is 0 (NaN in the
    official code).

    LLaVA-NeXT (the official anyres path, TungChintao/FlowCut a2ecd24 ``main.py``, ``llava_arch.py``): the tower
    stage is ported (:meth:`_select_per_crop` on ``InputSignals.crop_merging_tower``): the crops run as one
    batch, each keeping ``budget // 2`` patches (:func:`crop_budget`) by its own running score, every cut the
    largest of the crops' cut sizes (:class:`CropTowerCuts`); the kept patches that unpadding leaves are laid out
    base view first, then the tile grid row-major, without newlines (``restore_image_features_sorted``,
    ``unpad_mask``). Not ported, so FlowCut stays refused there (``layout.ANYRES_LLM_CUT``): the cut that follows
    at decoder layer 1 (``prune_layer = 1``), to the budget by the last prompt token's attention to the visual
    tokens (the same flow score on the language model's queries, keys and values) with the positions renumbered
    after it. A budget over every visual token keeps them all with the newlines (the dense input); the official
    path then still drops the newlines and, where half the budget is below a crop's patches, still cuts.

    Each cut is a stage: ``Selection.tower_stages`` holds ``(l - Lv, kept cells)`` for the cut after layer
    ``l`` (negative: before the language model), the last one repeated at the input (stage 0). Returns
    ``Selection(kept, sources, vision_tokens)``: ``vision_tokens`` (budget, Dv) the kept patches' states at the
    feature layer of the pruned tower (they differ from the unpruned tower's), one cell each.
    """

    name: ClassVar[str] = "flowcut"
    summary: ClassVar[str] = "prunes in the CLIP tower every other layer by an information-flow score (FlowCut)"
    requires: ClassVar[frozenset[str]] = frozenset({"merging_tower"})
    substitutes: ClassVar[dict[str, str]] = {"merging_tower": "crop_merging_tower"}  # anyres: the crops' tower
    layout_need: ClassVar[str] = ANYRES_LLM_CUT  # the official anyres path's decoder layer-1 cut, not ported
    reference: ClassVar[Reference] = Reference(
        "FlowCut: Rethinking Redundancy via Information Flow for Efficient Vision-Language Models (NeurIPS 2025, "
        "arXiv 2505.19536)",
        "TungChintao/FlowCut",
        "PyPI flowcut 1.0.2: CLS + value-norm flow score with a running average, entropy-adaptive cuts every other "
        "tower layer to the budget",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "PyPI flowcut 1.0.2",
        "in the CLIP tower, every other layer, entropy-adaptive cuts by the running flow score; the budget at the "
        "last cut, one layer before the feature layer",
        (),
        (
            "the cut falls between a layer's attention and its MLP, not after the MLP (per-token MLP: the kept "
            "states are the same, the cut patches' MLP is skipped)",
            "last cut one layer before the feature layer (the official select_layer - 1 with the feature layer "
            "-2 hard-coded)",
            "exact ties go to the lower index (torch.topk leaves them unspecified); 0 log 0 = 0 in the entropy",
            "LLaVA-NeXT's anyres path: its per-crop tower stage (half the budget per crop, one batch, each cut the "
            "largest of the crops' sizes, base view then unpadded tile grid without newlines) is ported, its decoder "
            "layer-1 cut to the budget by the last prompt token's attention (positions renumbered after it) is not: "
            "refused there",
            "each tower cut is recorded as a stage at layer (cut layer - tower layers), the last also at 0",
        ),
        random_agreement(
            30,
            "test_flowcut.py::test_tower_cuts_reproduce_the_official_layers",
            "CLIP-L shapes: 577 tokens, 16 heads, 23 layers, float32; the anyres tower stage: crop patches and cut "
            "stages identical in 30 of 30 random cases of 3 crops "
            "(test_flowcut.py::test_crop_tower_cuts_reproduce_the_official_anyres_batch) and kept tokens, features "
            "and stages in 3 of 3 images of a tiny LLaVA-NeXT against the official code on the stock tower "
            "(test_llava_next.py::test_flowcut_tower_stage_runs_per_crop_on_llava_next_as_its_official_anyres_code)",
        ),
        30,
    )

    flops_exact: ClassVar[bool] = True

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """The CLS value against every token's value in each head (the semantic attention) in every tower layer
        that still sees more patches than the budget; ``tower_merges`` holds the patches each layer cuts."""
        total, patches = 0, work.tokens
        for cut in work.tower_merges:
            total += matmul(1, work.vision_width, 1 + patches) if patches > work.kept else 0
            patches -= cut
        return total

    @staticmethod
    def tower_merges(tokens: int, budget: int, layers: int, stages: Sequence[tuple[int, int]]) -> tuple[int, ...]:
        """Patches each of the ``layers`` tower layers cut, from the recorded ``(stage layer, kept count)``
        stages (the tower's are negative: ``l - layers``); none without a rerun (the budget keeps every token)."""
        if budget >= tokens:
            return ()
        cuts, alive = [0] * layers, tokens
        for layer, kept in stages:
            if layer < 0:
                cuts[layers + layer], alive = alive - kept, kept
        return tuple(cuts)

    def _select(self, signals: InputSignals, budget: int, generator: torch.Generator | None) -> Selection:
        if signals.crop_merging_tower is not None:
            return self._select_per_crop(signals, budget)
        step = TowerCuts(budget)
        states, sources = signals.merging_tower(step)
        cells = [int(group[0]) for group in sources[1:]]
        return Selection(
            kept=torch.tensor(cells, dtype=torch.long),
            sources=sources[1:],
            vision_tokens=as_float32(states[1:]),
            tower_stages=[(layer - step.layers, kept) for layer, kept in step.stages],
        )

    def _select_per_crop(self, signals: InputSignals, budget: int) -> Selection:
        """The anyres tower stage: every crop cut to half the budget (:class:`CropTowerCuts`), the kept patches
        that unpadding leaves laid out as the official ``restore_image_features_sorted`` and ``unpad_mask`` do:
        the base view's, then the tile grid's row-major (ascending visual token), no newlines."""
        step = CropTowerCuts(crop_budget(budget))
        states, tokens = signals.crop_merging_tower(step)  # (K, 1 + M, Dv), (K, M)
        tokens = tokens.flatten()
        visible = torch.nonzero(tokens >= 0).flatten()
        order = visible[torch.argsort(tokens[visible])]
        cells = tokens[order]
        return Selection(
            kept=cells,
            sources=[cell.reshape(1) for cell in cells],
            vision_tokens=as_float32(states[:, 1:].flatten(0, 1)[order.to(states.device)]),
            in_output_order=True,
            tower_stages=[(layer - step.layers, kept) for layer, kept in step.stages],
        )


def flow_scores(cls_probs: Tensor, values: Tensor) -> tuple[Tensor, Tensor]:
    """One layer's information-flow score of its patches (the official ``compute_score``).

    Args:
        cls_probs: (H, 1 + n) float32 the CLS query's attention over every token, CLS first.
        values: (H, 1 + n, d) float32 the layer's values.

    Returns:
        ``(relation, scores)``: (n,) the head-mean CLS attention to the patches, and (n,) the score
        ``(relation / sum + semantic / sum) * |mean_h v|_1``, ``semantic`` the head-mean softmax over every token
        of the CLS value's unscaled dot products with the values.
    """
    relation = cls_probs.mean(dim=0)[1:]
    semantic = torch.softmax(values[:, :1] @ values.transpose(1, 2), dim=-1)[:, 0].mean(dim=0)[1:]
    magnitude = values.mean(dim=0)[1:].abs().sum(dim=-1)
    return relation, (relation / relation.sum() + semantic / semantic.sum()) * magnitude


def cut_size(relation: Tensor, steps_left: int, budget: int) -> int:
    """Patches a cut removes (the official ``adaptive_prune_ratio``): all of them with no step left, else
    ``round((n - budget) / sqrt(steps_left) * (1 - (H / log n)^2))``, ``H`` the entropy of ``relation`` (n,)
    normalised (an all-zero attention, never a softmax's, counts as uniform: no cut); the caller keeps at least
    the budget."""
    n = relation.numel()
    if steps_left == 0:
        return n
    prob = relation / relation.sum()
    ratio = torch.nan_to_num(-torch.xlogy(prob, prob).sum() / math.log(n), nan=1.0)  # no attention: no cut
    return int(((n - budget) / steps_left**0.5 * (1 - ratio**2)).round())


@dataclass
class TowerCuts:
    """The cut step the adapter's vision tower runs between attention and MLP of each layer (``merging_tower``).

    Called with the layer index of the ``layers`` run, the (1 + n, Dv) states (CLS first), the metric
    :meth:`metric` formed of the layer's heads, sizes and sources; returns the kept ones. ``stages``: the
    ``(layer, kept cells)`` of each cut made.
    """

    budget: int
    proportional: ClassVar[bool] = False  # plain attention: the kept tokens stand for themselves
    layers: int = 0
    running: Tensor | None = None
    stages: list[tuple[int, Tensor]] = field(default_factory=list)

    @staticmethod
    def metric(cls_probs: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        """(H, L, 1 + d) float32: each head's CLS attention to every token beside its values."""
        return torch.cat([cls_probs.float()[..., None], values.float()], dim=-1)

    def __call__(
        self, layer: int, layers: int, hidden: Tensor, metric: Tensor, size: Tensor, sources: list[Tensor]
    ) -> tuple[Tensor, Tensor, list[Tensor]]:
        self.layers, patches = layers, hidden.shape[0] - 1
        if patches <= self.budget:
            return hidden, size, sources
        relation, scores = flow_scores(metric[..., 0], metric[..., 1:])
        self.running = folded(self.running, scores)
        keep = kept_count([relation], layer, layers, self.budget)
        if keep is None:
            return hidden, size, sources
        chosen = top_k_indices(self.running, keep)  # ascending, as the official sort after topk
        self.running = self.running[chosen]
        rows = torch.cat([torch.zeros(1, dtype=torch.long), chosen + 1])
        kept_sources = [sources[i] for i in rows.tolist()]
        if keep < patches:
            self.stages.append((layer, torch.cat(kept_sources[1:])))
        return hidden[rows.to(hidden.device)], size[rows], kept_sources


@dataclass
class CropTowerCuts:
    """The cut step of the per-crop tower rerun on the K crops of an anyres image
    (``InputSignals.crop_merging_tower``), as the official anyres path runs them: the crops as one batch, each
    with its own running score and its own top-k, the cut size the largest over the crops (``adaptive_prune_ratio``
    takes ``r.max(0)`` over the batch), so every crop keeps as many patches.

    Called with the layer index of the ``layers`` run, the (K, 1 + n, Dv) states (each crop's CLS first), the
    (K, H, 1 + n, 1 + d) metric (:meth:`TowerCuts.metric` of each crop) and the (K, n) visual token of each crop
    patch (-1: a tile patch that unpadding drops); returns the kept states and tokens. ``budget``: the patches
    each crop keeps (:func:`crop_budget`). ``stages``: ``(layer, kept visual tokens)`` of each cut, ascending over
    every crop.
    """

    budget: int
    layers: int = 0
    running: Tensor | None = None
    stages: list[tuple[int, Tensor]] = field(default_factory=list)
    metric = staticmethod(TowerCuts.metric)

    def __call__(
        self, layer: int, layers: int, hidden: Tensor, metric: Tensor, tokens: Tensor
    ) -> tuple[Tensor, Tensor]:
        self.layers, patches = layers, hidden.shape[1] - 1
        if patches <= self.budget:
            return hidden, tokens
        relations, scores = zip(*(flow_scores(crop[..., 0], crop[..., 1:]) for crop in metric))
        self.running = folded(self.running, torch.stack(scores))
        keep = kept_count(list(relations), layer, layers, self.budget)
        if keep is None:
            return hidden, tokens
        chosen = torch.stack([top_k_indices(row, keep) for row in self.running])  # (K, keep) ascending per crop
        self.running, tokens = self.running.gather(1, chosen), tokens.gather(1, chosen)
        if keep < patches:
            alive = tokens.flatten()
            self.stages.append((layer, alive[alive >= 0].sort().values))
        rows = torch.cat([torch.zeros_like(chosen[:, :1]), chosen + 1], dim=1).to(hidden.device)
        return hidden.gather(1, rows[..., None].expand(-1, -1, hidden.shape[-1])), tokens


def folded(running: Tensor | None, scores: Tensor) -> Tensor:
    """The running score after a layer's ``scores`` (same shape): ``0.5 * running + 0.5 * scores``, the layer's
    own at the first scoring layer (the official ``cumulative_scores``)."""
    return scores if running is None else EMA_WEIGHT * running + (1 - EMA_WEIGHT) * scores


def kept_count(relations: list[Tensor], layer: int, layers: int, budget: int) -> int | None:
    """Patches each crop keeps after tower layer ``layer`` of ``layers``, or None where that layer does not cut
    (``steps_left = layers - 2 - layer`` odd or negative; a one-layer tower cuts in its only layer): the
    ``n`` patches less the largest :func:`cut_size` of the crops' CLS attentions ``relations`` (each (n,)),
    at least ``budget``."""
    steps_left = max(layers - 2, 0) - layer
    if steps_left < 0 or steps_left % 2:
        return None
    patches = relations[0].numel()
    return max(patches - max(cut_size(relation, steps_left, budget) for relation in relations), budget)


def crop_budget(budget: int) -> int:
    """Patches each crop's tower keeps on an anyres image: half the image's ``budget``, rounded down (the official
    ``int(target_num / 2)``)."""
    return budget // 2
