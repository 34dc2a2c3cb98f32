"""FlowCut: progressive pruning inside the CLIP tower by an information-flow score, to the budget; on an anyres
image half the budget per crop, then a cut to the budget after decoder layer 1."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, get_args

import torch
from torch import Tensor

from prune_audit.pruners.arithmetic import SelectorWork, matmul
from prune_audit.pruners.base import (
    InputSelector,
    LayerSelector,
    PositionMode,
    Reference,
    Selection,
    Stage,
    as_float32,
    validate_budget,
)
from prune_audit.pruners.fidelity import Fidelity, random_agreement
from prune_audit.pruners.options import Choice, option
from prune_audit.pruners.ranking import top_k_indices
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import solve_schedule
from prune_audit.pruners.serving import TOWER_HOOK_SIGNALS
from prune_audit.pruners.signals import InputSignals, LayerSignals

#: the weight of the running score against the layer's own (the official cumulative_scores update)
EMA_WEIGHT = 0.5
#: the decoder layer whose attention scores the anyres cut of its own output (the official ``prune_layer = 1``)
DECODER_CUT_LAYER = 1
#: ``average``: the decoder cut's count solved so the layer average is the budget; ``paper``: the budget (official)
FLOWCUT_RULES = ("average", "paper")


@dataclass
class FlowCutTower(InputSelector):
    """FlowCut's tower stage, the input part :meth:`FlowCutSelector.tower_stage` runs before its decoder cut (not
    registered: its name and facts are FlowCut's): inside the vision tower, every other layer, the patches with
    the lowest information-flow score leave, fewer at first and more where the CLS attention concentrates, until
    the budget at the last cut.

    Each tower layer ``l`` (0-based, ``Lv`` layers run to the feature layer) that still sees more patches than the
    budget scores them (:func:`flow_scores`: the CLS attention and the CLS-value attention, each normalised over
    the patches, summed, times the L1 norm of the head-mean value) and folds the score into a running one
    (``0.5 * running + 0.5 * layer``). With ``s = Lv - 2 - l`` layers left to the last cut, a layer with ``s``
    even and ``s >= 0`` cuts (:func:`cut_size`): ``r = round((n - budget) / sqrt(s) * (1 - (H / log n)^2))``
    patches (``H`` the entropy of the normalised CLS attention over the ``n`` patches; ``s = 0``: down to the
    budget), keeping the ``max(n - r, budget)`` with the highest running score, CLS always kept. LLaVA-1.5's
    23 layers cut after layers 1, 3, ..., 21; the feature layer's input holds the budget (a one-layer tower, as
    tiny test models have, cuts to the budget in its only layer).

    On an anyres image (``InputSignals.crop_merging_tower``, :meth:`_select_per_crop`) the crops run as one
    batch, each keeping ``budget // 2`` patches (:func:`crop_budget`) by its own running score, every cut the
    largest of the crops' cut sizes (:class:`CropTowerCuts`); the kept patches that unpadding leaves are laid out
    base view first, then the tile grid row-major, without newlines.

    Each cut is a stage: ``Selection.tower_stages`` holds ``(l - Lv, kept cells)`` for the cut after layer
    ``l`` (negative: before the language model), the last one repeated at the input (stage 0). Returns
    ``Selection(kept, sources, vision_tokens)``: ``vision_tokens`` (M, Dv) the kept patches' states at the
    feature layer of the pruned tower (they differ from the unpruned tower's), one cell each.
    """

    name: ClassVar[str] = "flowcut"
    summary: ClassVar[str] = "FlowCut's tower stage: cuts every other CLIP layer by an information-flow score"
    requires: ClassVar[frozenset[str]] = frozenset({"merging_tower"})
    substitutes: ClassVar[dict[str, str]] = {"merging_tower": "crop_merging_tower"}  # anyres: the crops' tower
    fills_budget: ClassVar[bool] = False  # anyres: half the budget per crop, less the patches unpadding drops
    flops_exact: ClassVar[bool] = True

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """The CLS value against every token's value in each head (the semantic attention) in every tower layer
        that still sees more patches than the budget; ``tower_merges`` holds the patches each layer cuts (on an
        anyres image each crop's, ``crop_stages`` its ``(patches, kept)`` in every crop)."""
        total = 0
        for tokens, kept in work.crop_stages or ((work.tokens, work.kept),):
            patches = tokens
            for cut in work.tower_merges:
                total += matmul(1, work.vision_width, 1 + patches) if patches > kept else 0
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
            tower_crop_merges=tuple(step.merges),
        )


@register
@dataclass
class FlowCutSelector(LayerSelector):
    """FlowCut (Tong et al., NeurIPS 2025, arXiv 2505.19536; TungChintao/FlowCut a2ecd24, PyPI ``flowcut`` 1.0.2):
    pruning by information flow, in the vision tower and, on an anyres image, once more at decoder layer 1.

    Tower stage (:class:`FlowCutTower`, :meth:`tower_stage`, run as a composed selector's input part): the
    entropy-adaptive cuts every other CLIP layer by the running flow score, to the budget (LLaVA-1.5) or, on
    LLaVA-NeXT's anyres image, to half the budget in every crop (the official ``int(target_num / 2)``).

    Decoder stage (the official anyres path only, ``main.py``: ``prune_layer = 1``): where the tower stage fed
    more visual tokens than the budget (LLaVA-NeXT: half the budget per crop over several crops), decoder layer 1
    runs on every token and its output keeps the visual tokens with the highest :func:`decoder_flow_scores`
    (the last prompt token's query against the visual keys of that layer, softmax over the visual tokens, head
    mean; the same with its value against the visual values; each normalised, summed, times the L1 norm of the
    head-mean visual value), ascending: a stage at the input of layer 2 (``signal_layer="previous"``). Positions
    are renumbered after it (``positions="compact"``: the official ``position_ids`` of ``0..L'-1`` from layer 2
    on; decoding counts each layer's cached keys, the official per-layer shift). Where the tower stage already
    holds the budget (LLaVA-1.5) there is no decoder stage, as the official pad path has none. How many it keeps:
    ``budget_rule="paper"`` the budget (the official ``target_num``); ``"average"`` (default, the project's rule
    for a stage inside the language model) the count that makes the layer average the budget, layers 0 and 1
    holding every token fed.

    Follows ``flowcut/main.py``, ``modeling_clip_flowcut.py`` (``CLIPEncoderLayer_forward``, ``CLIPEncoder_forward``),
    ``utils_flowcut.py`` (``compute_score``, ``adaptive_prune_ratio``), ``llava_arch.py``
    (``restore_image_features_sorted``, ``unpad_mask``, ``visual_token_pos``/``visual_token_num``,
    ``last_instruct_pos``) and ``modeling_llama_flowcut.py`` (``LlamaSdpaAttention_forward``'s scores at
    ``prune_layer``, ``LlamaModel_forward``'s cut and positions). Differences: docs/fidelity.md.
    """

    name: ClassVar[str] = "flowcut"
    summary: ClassVar[str] = (
        "prunes in the CLIP tower every other layer by an information-flow score; anyres: again after decoder layer 1"
    )
    requires: ClassVar[frozenset[str]] = frozenset({"merging_tower", "text_logits", "values", "text_values"})
    substitutes: ClassVar[dict[str, str]] = {"merging_tower": "crop_merging_tower"}  # anyres: the crops' tower
    reference: ClassVar[Reference] = Reference(
        "FlowCut: Rethinking Redundancy via Information Flow for Efficient Vision-Language Models (NeurIPS 2025, "
        "arXiv 2505.19536)",
        "TungChintao/FlowCut",
        "a2ecd24 / PyPI flowcut 1.0.2: CLS + value-norm flow score with a running average, entropy-adaptive cuts "
        "every other tower layer to the budget (anyres: half the budget per crop, then decoder layer 1's flow "
        "score of the last prompt token to the budget, target_num)",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "a2ecd24",
        "in the CLIP tower, every other layer, entropy-adaptive cuts by the running flow score; the budget at the "
        "last cut, one layer before the feature layer; anyres: half the budget per crop, then the output of "
        "decoder layer 1 cut by the last prompt token's flow score to the count whose layer average is the budget, "
        "positions renumbered",
        ("budget_rule=paper",),
        (
            "the tower cut falls between a layer's attention and its MLP, not after the MLP (per-token MLP: the kept "
            "states are the same, the cut patches' MLP is skipped)",
            "last tower cut one layer before the feature layer (the official select_layer - 1 with the feature "
            "layer -2 hard-coded)",
            "exact ties go to the lower index (torch.topk leaves them unspecified); 0 log 0 = 0 in the entropy",
            "LLaVA-NeXT's anyres path: the per-crop tower stage (half the budget per crop, one batch, each cut the "
            "largest of the crops' sizes, base view then unpadded tile grid without newlines), then decoder layer "
            "1's cut; its scores in float32 (the official forms them in the model's half dtype), the softmaxes over "
            "the visual tokens only, as official; a grouped-query decoder's values read once per key/value head "
            "(the official head means over repeat_kv's copies are the same)",
            "budget_rule=average (default) keeps after decoder layer 1 the count whose layer average over the "
            "decoder is the budget (the project's rule inside the language model; refused in one line where layers "
            "0 and 1 alone exceed it); budget_rule=paper keeps the budget there, as the official target_num",
            "a language model of fewer than 3 decoder layers has no layer-1 cut: refused in one line where one is due",
            "each tower cut is recorded as a stage at layer (cut layer - tower layers), the last also at 0; the "
            "decoder cut at layer 2 (the input after layer 1)",
        ),
        random_agreement(
            30,
            "test_flowcut.py::test_tower_cuts_reproduce_the_official_layers",
            "CLIP-L shapes: 577 tokens, 16 heads, 23 layers, float32; the anyres tower stage: crop patches and cut "
            "stages identical in 30 of 30 random cases of 3 crops "
            "(test_flowcut.py::test_crop_tower_cuts_reproduce_the_official_anyres_batch) and kept tokens, features "
            "and stages in 3 of 3 images of a tiny LLaVA-NeXT against the official code on the stock tower "
            "(test_llava_next.py::test_flowcut_tower_stage_runs_per_crop_on_llava_next_as_its_official_anyres_code); "
            "the decoder layer-1 cut: kept sets identical in 30 of 30 random cases at LLaVA-NeXT-7B shapes (32 "
            "heads of 128, 1500 to 2900 visual tokens, float32; "
            "test_flowcut.py::test_decoder_cut_reproduces_the_official_layer_1_scores) and the tiny LLaVA-NeXT's "
            "kept tokens per stage and logits equal to a reference forward cutting the same tokens after layer 1 "
            "(budget_rule=paper; test_llava_next.py::test_flowcut_cuts_after_decoder_layer_1_on_llava_next_as_its_official_"
            "anyres_code)",
        ),
        30,
    )
    flops_exact: ClassVar[bool] = True  # the tower stage counts its semantic attention, the decoder stage its own

    budget_rule: str = option(
        "average", Choice(FLOWCUT_RULES), "average (decoder count solved to the budget) or paper (the budget, official)"
    )
    positions: PositionMode = option(
        "compact", Choice(get_args(PositionMode)), "position ids after the decoder cut (reference compacts)"
    )
    signal_layer = "previous"  # layer 1's queries, keys and values cut its own output (not an option)

    @property
    def schedule_follows_tower(self) -> bool:
        return True  # solved on what the tower stage feeds each image

    @property
    def averages_budget(self) -> bool:
        return self.budget_rule == "average"  # paper: exactly the budget after layer 1

    def __post_init__(self) -> None:
        super().__post_init__()
        self._tower = FlowCutTower()

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """The decoder cut: the last prompt token's value against every alive visual value in each key/value
        head (its semantic attention), at each stage that cuts."""
        return sum(matmul(1, work.kv_width, before) for before, after in work.stages if after < before)

    def tower_stage(self) -> FlowCutTower:
        """The tower stage, one instance per selector."""
        return self._tower

    def schedule(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        """One stage at the input of the layer after ``DECODER_CUT_LAYER`` where the tower stage fed more than
        ``budget`` (``num_visual``), none otherwise: down to ``budget`` (``paper``) or to the count whose layer
        average is ``budget`` (``average``)."""
        budget = validate_budget(budget)
        if num_visual <= budget:
            return []
        layer = DECODER_CUT_LAYER + 1
        if num_layers <= layer:
            raise ValueError(
                f"FlowCut cuts the output of decoder layer {DECODER_CUT_LAYER}; a language model of {num_layers} "
                f"layers has no layer after it"
            )
        if self.budget_rule == "paper":
            return [Stage(layer, budget)]
        if budget * num_layers < layer * num_visual:  # layers 0 and 1 hold every token fed
            raise ValueError(
                f"layers 0 and 1 hold the {num_visual} visual tokens the tower stage feeds, a layer average of "
                f"{layer * num_visual / num_layers:.1f} already; raise the budget or use budget_rule=paper"
            )
        return solve_schedule([layer], [1.0], num_layers, num_visual, budget)

    def prune(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        """(keep,) ascending alive positions with the highest :func:`decoder_flow_scores` (ties: lower index)."""
        self._check_signals(signals, self.requires - TOWER_HOOK_SIGNALS)  # the tower stage checked its own
        keep = min(stage.keep, signals.num_alive)
        if keep >= signals.num_alive:
            return torch.arange(signals.num_alive, dtype=torch.long)
        scores = decoder_flow_scores(signals.text_logits[:, -1], signals.text_values[:, -1], signals.values)
        return top_k_indices(scores, keep)


def decoder_flow_scores(last_logits: Tensor, last_value: Tensor, values: Tensor) -> Tensor:
    """(n,) float32 the decoder cut's flow score of the alive visual tokens (the official layer-1
    ``relation_attn``, ``semantic_attn`` and ``compute_score``).

    Args:
        last_logits: (H, n) the last prompt token's logits ``q . k / sqrt(d)`` to the visual keys (RoPE applied).
        last_value: (Hkv, d) its value; values: (Hkv, n, d) the visual tokens' (a query head's key/value head is
            shared, so head means over the key/value heads equal the official ones over ``repeat_kv``'s heads).

    Returns:
        ``(relation / sum + semantic / sum) * |mean_h v|_1``: ``relation`` the head-mean softmax of
        ``last_logits`` over the visual tokens, ``semantic`` the head-mean softmax of ``v_last . v / sqrt(d)``.
    """
    relation = torch.softmax(last_logits.float(), dim=-1).mean(dim=0)
    values, last_value = values.float(), last_value.float()
    dots = (last_value[:, None] @ values.transpose(1, 2))[:, 0] / math.sqrt(values.shape[-1])  # (Hkv, n)
    return combined_flow(relation, torch.softmax(dots, dim=-1).mean(dim=0), values)


def combined_flow(relation: Tensor, semantic: Tensor, values: Tensor) -> Tensor:
    """(n,) the official ``compute_score`` of n tokens from their (n,) ``relation`` and ``semantic`` attention and
    their (H, n, d) ``values``: ``(relation / sum + semantic / sum) * |mean_h v|_1``."""
    return (relation / relation.sum() + semantic / semantic.sum()) * values.mean(dim=0).abs().sum(dim=-1)


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
    return relation, combined_flow(relation, semantic, values[:, 1:])


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
    every crop; ``merges``: the patches each crop cuts in each of the ``layers`` layers.
    """

    budget: int
    layers: int = 0
    running: Tensor | None = None
    stages: list[tuple[int, Tensor]] = field(default_factory=list)
    merges: list[int] = field(default_factory=list)
    metric = staticmethod(TowerCuts.metric)

    def __call__(
        self, layer: int, layers: int, hidden: Tensor, metric: Tensor, tokens: Tensor
    ) -> tuple[Tensor, Tensor]:
        self.layers, patches = layers, hidden.shape[1] - 1
        self.merges += [0] * (layers - len(self.merges))
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
            self.merges[layer] = patches - keep
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
