"""MustDrop: multi-stage vision token dropping; similar 3x3 windows merge in the vision tower, a key token set by
CLS attention survives every prefill stage, the rest drops by the text's global and individual attention."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, get_args

import torch
from torch import Tensor

from prune_audit.pruners.arithmetic import SelectorWork, matmul
from prune_audit.pruners.base import (
    InputSelector,
    PositionMode,
    Reference,
    Selection,
    Stage,
    as_float32,
    top_k_indices,
)
from prune_audit.pruners.fidelity import Fidelity, random_agreement
from prune_audit.pruners.options import Choice, Real, option
from prune_audit.pruners.ranking import ranked_indices
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import (
    REFERENCE_DEPTH,
    ScheduledSelector,
    merge_stages,
    scale_layers,
    solve_schedule,
)
from prune_audit.pruners.serving import TOWER_HOOK_SIGNALS
from prune_audit.pruners.signals import InputSignals, LayerSignals
from prune_audit.pruners.similarity import unit_rows

#: the decoder layers whose attention scores (``pruning_layers``); their outputs are pruned: stages at layer + 1
MUSTDROP_LAYERS = (2, 6, 10, 14)
KEY_SHARE = 0.08  # ``keep_rate``: the key set is ceil(0.08 N) patches by CLS attention
GLOBAL_THRESHOLD = 0.011  # ``--global_thr`` of the 64-token scripts (textvqa_64.sh, vizwiz_64.sh)
INDIVIDUAL_THRESHOLD = 0.01  # ``--individual_thr`` of the same scripts
#: ``average``: counts solved to the budget; ``paper`` (the in-LLM selectors' name for the reference rule): the script thresholds, the count they give
MUSTDROP_RULES = ("average", "paper")
#: ``merge``: the official vision stage in the tower; ``off``: the 576 patches unmerged, the key set by the feature layer
MUSTDROP_VISION = ("merge", "off")
MERGE_THRESHOLD = 0.8  # ``conditional_pooling(hidden_states, 0.8, (3, 3))`` in ``clip_encoder.py``
WINDOW = 3  # the 3 x 3 windows of that call
MERGE_LAYER = 0  # ``idx == 0``: the merge follows CLIP layer 0 (after its MLP)


def window_cells(grid: tuple[int, int], window: int = WINDOW) -> Tensor:
    """(W, window^2) the grid cells of each full ``window x window`` block tiling ``grid`` (rows, cols) from the
    top left, blocks in raster order, cells in raster order inside (the official ``unfold`` windows); cells past the
    last full block of a row or column are in none (the official code asserts the 24 x 24 grid divides)."""
    rows, cols = grid
    cells = torch.arange(rows * cols).view(rows, cols)[: rows - rows % window, : cols - cols % window]
    return cells.unfold(0, window, window).unfold(1, window, window).reshape(-1, window * window)


def window_similarity(patches: Tensor, windows: Tensor) -> Tensor:
    """(W,) float32 mean pairwise cosine of each window's tokens, self pairs left out (``similarity_map``).

    Args:
        patches: (N, D) the patch states (CLS excluded); windows: (W, k) cells of each window.
    """
    units = unit_rows(patches)[windows]  # (W, k, D)
    k = windows.shape[1]
    cosines = (units @ units.transpose(1, 2)) * (1 - torch.eye(k))  # (W, k, k), the diagonal zeroed
    return cosines.sum(dim=(1, 2)) / (k * (k - 1))


def merge_plan(patches: Tensor, grid: tuple[int, int], threshold: float, window: int = WINDOW) -> tuple[Tensor, Tensor]:
    """Which windows merge (``conditional_pooling``): every window whose mean pairwise cosine is ``>= threshold``.

    Args:
        patches: (N, D) patch states after CLIP layer 0; grid: (rows, cols) of the N patches.

    Returns:
        ``(merged, unmerged)``: (r, k) the cells of each merged window, by decreasing similarity (the official
        ``topk(r)`` order; exact ties to the lower window), and (N - r k,) the other cells, ascending.
    """
    windows = window_cells(grid, window)
    similarity = window_similarity(patches, windows)
    merged = windows[ranked_indices(similarity, int((similarity >= threshold).sum()))]
    rest = torch.ones(patches.shape[0], dtype=torch.bool)
    rest[merged.flatten()] = False
    return merged, torch.nonzero(rest).flatten()


def dual_attention_score(text_probs: Tensor, global_thr: float, individual_thr: float) -> Tensor:
    """(n,) float32 score whose ``>= 1`` is the official keep rule (``dual_attention_filter``).

    The official filter drops a token when its global attention (head-mean probabilities summed over the text
    rows, ``g``) is below ``global_thr * sum(g)`` *and* its individual attention (their maximum over the text
    rows, ``m``) is below ``individual_thr``; so a token survives iff ``max(g / (global_thr sum g), m /
    individual_thr) >= 1``, which this returns. Ranking by it keeps the official survivors first under a count.

    Args:
        text_probs: (H, T, n) attention probabilities of the text rows after the image to the alive visual tokens.
    """
    attention = text_probs.detach().float().mean(dim=0)  # (T, n)
    total = attention.sum(dim=0)  # (n,) global attention
    return torch.maximum(total / (total.sum() * global_thr), attention.max(dim=0).values / individual_thr)


def key_set(cls_attention: Tensor, share: float = KEY_SHARE) -> Tensor:
    """(ceil(share N),) ascending patch indices of the largest CLS attention (``cls_attention`` (N,) float32,
    head-mean probabilities of the CLS row); exact ties to the lower index."""
    return top_k_indices(cls_attention.float(), math.ceil(share * cls_attention.numel()), "lower")


@dataclass
class WindowMerging:
    """MustDrop's step in the adapter's tower rerun (``InputSignals.merging_tower``, after each layer's MLP).

    After layer 0 it merges every 3 x 3 window of ``grid`` whose mean pairwise cosine is ``>= threshold`` into the
    mean of its states (``merge_wavg``: each window sum over its size 9), laid out as the official ``merge``: CLS,
    the merged windows (:func:`merge_plan`'s order), then the other patches ascending. It keeps the (H, 1 + M) CLS
    row the key set ranks: the next layer's (``reads_next_layer``: the official layer 23 on the feature layer's
    output), else the last layer's run. ``unmerged``: the (N - 9r,) ascending cells no window merged.
    """

    grid: tuple[int, int]
    threshold: float = MERGE_THRESHOLD
    proportional: ClassVar[bool] = False  # the official later layers run plain attention (its ``size`` unused)
    after_mlp: ClassVar[bool] = True
    reads_next_layer: ClassVar[bool] = True
    cls_probs: Tensor | None = None
    unmerged: Tensor | None = None

    @staticmethod
    def metric(cls_probs: Tensor, keys: Tensor, values: Tensor) -> Tensor:
        """(H, L) float32 the layer's CLS row (the key set's, where no layer follows the feature layer)."""
        return cls_probs.float()

    def __call__(
        self, layer: int, layers: int, hidden: Tensor, metric: Tensor, size: Tensor, sources: list[Tensor]
    ) -> tuple[Tensor, Tensor, list[Tensor]]:
        self.cls_probs = metric
        if layer != MERGE_LAYER:
            return hidden, size, sources
        merged, unmerged = merge_plan(hidden[1:].float().cpu(), self.grid, self.threshold)  # the plan on the CPU
        rows, alone = merged.to(hidden.device) + 1, unmerged.to(hidden.device) + 1
        states = torch.cat([hidden[:1], hidden[rows].sum(dim=1) / merged.shape[1], hidden[alone]])
        kept_sources = (
            [sources[0]] + [torch.sort(cells).values for cells in merged] + [sources[1 + c] for c in unmerged.tolist()]
        )
        counts = torch.tensor([1.0] + [float(merged.shape[1])] * merged.shape[0] + [1.0] * unmerged.numel())
        self.unmerged = unmerged
        return states, counts, kept_sources

    def next_layer_cls(self, cls_probs: Tensor) -> None:
        """Keep the (H, 1 + M) CLS row of the layer after the feature layer on the final states."""
        self.cls_probs = cls_probs.float()


@dataclass
class MustDropVision(InputSelector):
    """MustDrop's vision stage, the input part :meth:`MustDropSelector.tower_stage` runs before its prefill stages
    (not registered: its name and facts are MustDrop's). It ignores the budget: the threshold decides.

    Returns ``Selection(kept, sources, vision_tokens)``: the M output tokens at the feature layer of the merged
    tower (``vision_tokens`` (M, Dv)) in the official order, ``kept`` the unmerged cells (``sources``: the merged
    windows too, the record's stage 0), and the key set's positions among the M tokens in ``llm_state``
    (``key_positions``: the ``ceil(0.08 M)`` largest head-mean CLS attention of the step's CLS row). The merge is
    recorded at the input (stage 0), as ToMe's tower merges are, not as a tower stage: a tower stage records kept
    cells only, so the merged windows would read as lost there and found again at the input.
    """

    name: ClassVar[str] = "mustdrop"
    summary: ClassVar[str] = "MustDrop's vision stage: 3x3 windows of mean cosine >= 0.8 merged after CLIP layer 0"
    requires: ClassVar[frozenset[str]] = frozenset({"merging_tower"})
    merges: ClassVar[bool] = True
    fills_budget: ClassVar[bool] = False
    flops_exact: ClassVar[bool] = True
    merges_after_mlp: ClassVar[bool] = WindowMerging.after_mlp  # the accounting's copy of the step's traits
    reads_next_layer: ClassVar[bool] = WindowMerging.reads_next_layer

    merge_thr: float = option(MERGE_THRESHOLD, Real(low=-1.0, high=1.0), "mean window cosine that merges a window")

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """The cosines inside every full 3 x 3 window: one (9, Dv) @ (Dv, 9) product per window."""
        windows = (work.grid[0] // WINDOW) * (work.grid[1] // WINDOW)
        return windows * matmul(WINDOW * WINDOW, work.vision_width, WINDOW * WINDOW)

    @staticmethod
    def tower_merges(tokens: int, budget: int, layers: int, stages: Sequence[tuple[int, int]]) -> tuple[int, ...]:
        """Tokens each of the ``layers`` tower layers removes, from the recorded input stage ``(0, unmerged
        cells)`` (the first at layer 0): 8 of every merged window's 9 after layer 0 (the tower always runs)."""
        unmerged = next(kept for layer, kept in stages if layer == 0)
        merges = [0] * layers
        merges[MERGE_LAYER] = (tokens - unmerged) // (WINDOW * WINDOW) * (WINDOW * WINDOW - 1)
        return tuple(merges)

    def select(self, signals: InputSignals, budget: int, generator: torch.Generator | None = None) -> Selection:
        self._check_signals(signals)
        step = WindowMerging(signals.grid, self.merge_thr)
        states, sources = signals.merging_tower(step)
        if step.cls_probs is None or step.cls_probs.shape[-1] != states.shape[0]:
            raise ValueError("MustDrop's key set needs a vision-tower layer after its merge (layer 0)")
        keys = key_set(step.cls_probs.mean(dim=0)[1:])
        unmerged = step.unmerged if step.unmerged is not None else torch.arange(signals.num_tokens)
        return Selection(
            kept=unmerged,
            sources=sources[1:],
            vision_tokens=as_float32(states[1:]),
            llm_state={"key_positions": keys},
        )


@register
@dataclass
class MustDropSelector(ScheduledSelector):
    """MustDrop (Liu et al., "Multi-Stage Vision Token Dropping", arXiv 2411.10803; liuting20/MustDrop).

    Vision stage (``vision="merge"``, official; :meth:`tower_stage`, run as a composed selector's input part):
    the adapter's tower rerun with :class:`WindowMerging` after CLIP layer 0's MLP merges every 3 x 3 window of
    mean pairwise cosine ``>= merge_thr`` (0.8) into its mean; the M tokens fed are the merged windows (by
    decreasing similarity) then the other patches ascending, as the official tower outputs them, recorded at the
    input (stage 0: the unmerged cells kept, each merged window a merged token). Key set: the ``ceil(0.08 M)`` tokens with the largest
    head-mean CLS attention of the layer after the feature layer on the merged states (the official layer 23),
    fixed at the first prefill stage; its tokens survive every stage. ``vision="off"``: the N unmerged patches
    (the stock tower) and the key set on the feature layer's CLS row (``layer_cls_attention``, the last row).

    Prefill stages: the attention of decoder layers 2, 6, 10 and 14 (``signal_layer`` previous: each layer's own
    probabilities, as the official code reads ``output_attentions``) prunes their outputs (stages at the inputs of
    layers 3, 7, 11, 15, scaled to the model's depth), head-mean over the text rows after the image, scored by
    :func:`dual_attention_score` (the official dual-attention filter as a score). Positions are compacted after
    every stage (the official code narrows ``position_ids`` to ``0..L'-1``).

    Decode stage (``decode_keeps_final``): the official prefill returns the KV cache of the pruning layers (2..14)
    sliced to the tokens the last stage keeps, so decoding attends there to the final survivors only (layers 0..1
    keep every token). Here the executor masks those layers' cache columns of the visual tokens the last stage
    dropped (:func:`~prune_audit.models.executor.final_cache_keys`), from the first stage's scoring layer on:
    the same attention as the sliced cache, and under ``compact`` positions each decoded token's position counts
    the layer's valid keys, as the official per-layer cache length gives it. The first answer token (the yes/no
    and option tasks) comes from the prefill and is unchanged; longer answers differ from the second token on.

    ``budget_rule="average"`` (default): one count at the four stages (nudged by single tokens), solved on the
    tokens the vision stage feeds so the layer average is the budget: the official thresholds drop almost
    everything they drop at the first stage and little after (realised 19.5 / 19.5 / 19.5 / 19.5 on the demo).
    Each stage keeps the key set's alive tokens first (by score; all of them when the count allows), then the
    highest scores. ``budget_rule="paper"``: the official thresholds (``global_thr`` 0.011, ``individual_thr``
    0.01, the 64-token scripts) keep every token scoring at least 1 plus the key set, whatever the budget; the
    realised counts are recorded per stage (``kept_stages``).

    Follows liuting20/MustDrop (commit 909afa53): ``local_merge.py`` (``conditional_pooling`` with threshold 0.8
    and 3 x 3 windows, ``merge_wavg``), ``clip_encoder.py`` (the merge at ``idx == 0``, the key set of ``keep_rate``
    0.08 at ``idx == 23``), ``llava_arch.py`` (the tower's tokens fed in its order, the key set as indices among
    them), ``modelling_sparse_llama.py`` (``pruning_layers``, ``dual_attention_filter``, the key set joined by
    ``torch.unique``). Differences: docs/fidelity.md.
    """

    name: ClassVar[str] = "mustdrop"
    summary: ClassVar[str] = (
        "3x3 windows merged in the CLIP tower; key set by CLS attention kept; text attention drops at layers 2/6/10/14"
    )
    requires: ClassVar[frozenset[str]] = frozenset({"text_probs", "merging_tower"})
    reference: ClassVar[Reference] = Reference(
        "Multi-Stage Vision Token Dropping: Towards Efficient Multimodal Large Language Model (arXiv 2411.10803)",
        "liuting20/MustDrop",
        "vision stage (3x3 windows of mean cosine >= 0.8 merged after CLIP layer 0), key set (top 8% CLS attention "
        "of layer 23) + dual-attention thresholds at layers 2/6/10/14 (global 0.011, individual 0.01); decoding "
        "attends in layers 2.. to the last stage's survivors (the KV-cache slicing)",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "909afa53",
        "3x3 windows of mean cosine >= 0.8 merged after CLIP layer 0 in the tower; key set of the top 8% CLS "
        "attention of the layer after the feature layer on the merged tokens kept; the dual-attention score of "
        "layers 2/6/10/14 prunes their outputs to one count solved to the budget average; positions compacted; "
        "decoding attends in layers 2.. to the last stage's survivors only",
        ("budget_rule=paper",),
        (
            "the decode stage masks the cache columns of the tokens the last stage dropped in layers 2.. (from the "
            "first stage's scoring layer, scaled) instead of slicing them: the same attention (within 1e-5 over "
            "three greedy steps, test_decode_stage_attends_to_the_last_stage_survivors_from_layer_2); positions "
            "count the valid keys as the official cache length does; the decode FLOPs and KV bytes reported are "
            "those of the unsliced caches the implementation runs",
            "merge ties between windows of equal similarity go to the lower window (torch.topk leaves them "
            "unspecified); a grid that 3x3 windows do not tile merges its full windows only (the official asserts "
            "24x24); the merged state is the window mean in the tower's dtype (the official sums in scatter order)",
            "budget_rule=average replaces the thresholds by one count at the four stages solved to the budget "
            "average on the tokens fed (derived, not official: the thresholds' realised counts fall at the first "
            "stage and stay), the key set first (all of it where the count allows), ranking the rest by the "
            "threshold rule as a score (max(g / (0.011 sum g), m / 0.01)); "
            "budget_rule=paper runs the official thresholds and ignores the budget (realised counts recorded per stage)",
            "exact ties to the lower index (ties=lower); the official threshold rule has no ranking",
            "fp32 scores and cosines (the official tower and attention are fp16); no half-precision agreement measured",
            "vision=off (not official) feeds the unmerged patches and ranks the key set on the feature layer's (22) "
            "CLS attention; it needs no tower rerun (LLaVA-NeXT runs it)",
        ),
        random_agreement(
            30,
            "tests/pruners/test_mustdrop.py::test_official_rule_reproduces_the_dual_attention_filter",
            "kept sets of each prefill stage and the key set against the official filter re-derived on LLaVA shapes "
            "(32 heads, 576 tokens), the key set handed over by the vision stage and ranked on the feature layer; "
            "vision stage: 30 of 30 random cases identical (merged windows, their order and sources, the layer-23 "
            "key set; merged states within 1e-5) against conditional_pooling / merge_wavg re-derived at 24x24 x 1024 "
            "fp32 (test_vision_merge_reproduces_the_official_conditional_pooling); tiny LLaVA: the adapter's "
            "tower equal to the official forward on the same modules (test_tiny_llava_vision_stage_is_the_official_tower)",
        ),
        30,
    )
    flops_exact: ClassVar[bool] = (
        True  # no products of its own in the prefill stages; the vision stage counts its cosines
    )

    budget_rule: str = option(
        "average", Choice(MUSTDROP_RULES), "average (counts solved to the budget) or paper (the official thresholds)"
    )
    positions: PositionMode = option(
        "compact", Choice(get_args(PositionMode)), "position ids after pruning (reference compacts)"
    )
    global_thr: float = option(GLOBAL_THRESHOLD, Real(low=0.0), "global attention threshold (share of the sum)")
    individual_thr: float = option(INDIVIDUAL_THRESHOLD, Real(low=0.0), "individual attention threshold")
    vision: str = option(
        "merge", Choice(MUSTDROP_VISION), "merge (the official 3x3 window merge in the tower) or off (576 patches)"
    )
    merge_thr: float = option(MERGE_THRESHOLD, Real(low=-1.0, high=1.0), "mean window cosine that merges a window")
    signal_layer = "previous"  # each scoring layer prunes its own output (not an option)
    decode_keeps_final: ClassVar[bool] = True  # the decode stage: layers 2.. attend to the last stage's survivors
    tower_stage_off: ClassVar[str] = "vision=off"

    @property
    def averages_budget(self) -> bool:
        return self.budget_rule == "average"  # paper: the official thresholds, whatever the budget

    @property
    def schedule_follows_tower(self) -> bool:
        return self.vision == "merge"  # the stages act on the merged windows, whose count each image decides

    def __post_init__(self) -> None:
        super().__post_init__()
        self._tower = MustDropVision(merge_thr=self.merge_thr) if self.vision == "merge" else None
        if self._tower is None:  # the key set from the stock tower's feature layer
            self.requires = frozenset({"text_probs", "layer_cls_attention"})  # type: ignore[misc]  # an instance's own (Selector.requires_on)

    def tower_stage(self) -> MustDropVision | None:
        """The vision stage (``vision="merge"``), one instance per selector: the merged tokens and key set."""
        return self._tower

    def _layers(self, num_layers: int) -> list[int]:
        return sorted(set(scale_layers([layer + 1 for layer in MUSTDROP_LAYERS], REFERENCE_DEPTH, num_layers)))

    def schedule(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        """Official rule: the four stages with no count limit (the thresholds decide); else the solved counts."""
        if self.budget_rule == "paper":
            layers, counts = merge_stages(self._layers(num_layers), [num_visual] * len(MUSTDROP_LAYERS))
            return [Stage(layer, count) for layer, count in zip(layers, counts, strict=True)]
        return super().schedule(num_layers, num_visual, budget)

    def solved_stages(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        layers = self._layers(num_layers)
        return solve_schedule(layers, [1.0] * len(layers), num_layers, num_visual, budget)

    def prune(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        """(k,) ascending alive positions that survive: the key set's and the best scores (or the thresholds')."""
        self._check_signals(signals, self.requires - TOWER_HOOK_SIGNALS)  # the tower stage checked its own
        if "key_set" not in state:  # fixed at the first stage, over every token fed, as their kinds
            positions = state.get("key_positions")  # the vision stage's, among the merged tokens
            if positions is None:
                positions = key_set(signals.layer_cls_attention.float().cpu()[-1])
            state["key_set"] = signals.alive.cpu()[positions]
        keys = torch.isin(signals.alive.cpu(), state["key_set"])
        scores = self.model_precision(
            dual_attention_score(self.inputs(signals).text_probs, self.global_thr, self.individual_thr), signals
        ).cpu()
        if self.budget_rule == "paper":
            return torch.nonzero((scores >= 1) | keys).flatten()
        keep = min(stage.keep, signals.num_alive)
        if keep <= 0:  # nothing left to rank (a tiny model's solved count can reach 0)
            return torch.zeros(0, dtype=torch.long)
        priority = torch.where(keys, scores + scores.max() + 1, scores)  # key tokens first, in score order
        return top_k_indices(priority, keep, self.ties)
