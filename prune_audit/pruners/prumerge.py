"""LLaVA-PruMerge and PruMerge+: CLS-attention outliers (or the budget's top tokens), each merged with its
key-nearest neighbours weighted by their CLS attention, plus one token for everything pruned."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from prune_audit.pruners.arithmetic import SelectorWork, matmul
from prune_audit.pruners.base import TOP_K_TIES, InputSelector, Reference, Selection, as_float32, ranked_indices
from prune_audit.pruners.fidelity import Fidelity, random_agreement
from prune_audit.pruners.options import Choice, Integer, Real, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.signals import InputSignals
from prune_audit.pruners.similarity import unit_rows

COUNTS = ("budget", "adaptive")
#: where the CLS attention and the keys come from: the tower's last layer (official) or the feature layer
SIGNAL_LAYERS = ("last", "feature")
SIGNALS_OF_LAYER = {  # signal_layer -> the (H, 1 + N) CLS logits and (H, 1 + N, d) keys it reads
    "last": ("last_layer_cls_logits", "last_layer_vision_keys"),
    "feature": ("cls_logits", "vision_keys"),
}
REPOSITORY = "42Shawn/LLaVA-PruMerge"
COMMIT = "1ca8b2ba"
PAPER = "LLaVA-PruMerge: Adaptive Token Reduction for Efficient Large Multimodal Models (arXiv 2403.15388)"
#: what both selectors do differently from the official code, and why
DIFFERENCES = (
    "signal_layer=feature reads the CLS logits and keys of the feature layer (22, as VisionZip and cls_attn do) "
    "instead of the official last layer (23, hooked at its q_proj / k_proj on the layer-22 output); the default "
    "signal_layer=last recomputes layer 23's layer norm and q / k projections only (the rest of layer 23 does not "
    "run), equal to the stock tower's hooked projections within 1e-5 (tests/models/test_llava.py::"
    "test_last_layer_cls_row_equals_the_stock_towers_last_layer); LLaVA only, the other families refuse it; either "
    "way the single full-width head is formed exactly from the per-head logits (sum_h logit_h / sqrt(H))",
    "count=budget (default) replaces the IQR count so the budget is honoured; count=adaptive is the official count "
    "and ignores the budget (the realised tokens are recorded per question; the FLOP formula then counts the budget "
    "as the kept count: nominal)",
    "exact ties (attention rank, neighbour cosines) to the lower index with ties=lower; torch.topk's order with "
    "ties=topk",
    "the percentile is taken per image (the official code takes it over the whole batch; its evaluation runs one "
    "image per batch)",
    "every output token is a merged token (its centre and neighbours, or the pruned remainder) recorded in "
    "merged_stages; kept_stages is empty, as no cell reaches the model through its own token alone",
    "fp32 only: no model-dtype path",
)


def full_width_attention(cls_logits: Tensor) -> Tensor:
    """(N,) float32 CLS attention of one full-width head over the 1 + N tokens, patch columns.

    The official code forms ``softmax(q k^T / sqrt(H d))`` from the unsplit q_proj / k_proj outputs; with per-head
    logits ``l_h = q_h . k_h / sqrt(d)`` (``cls_logits``, (H, 1 + N)) that is ``softmax(sum_h l_h / sqrt(H))``.
    """
    logits = as_float32(cls_logits)
    return torch.softmax(logits.sum(dim=0) / math.sqrt(logits.shape[0]), dim=0)[1:]


def full_width_keys(vision_keys: Tensor) -> Tensor:
    """(N, H d) float32 patch keys with the heads concatenated (k_proj's output) from ``vision_keys`` (H, 1 + N, d)."""
    keys = as_float32(vision_keys)
    return keys.permute(1, 0, 2).reshape(keys.shape[1], -1)[1:]


def outlier_ratio(attention: Tensor) -> float:
    """The official adaptive ratio: the share of patches above ``Q3 + 1.5 IQR`` of ``attention`` ((N,) float32,
    quartiles linearly interpolated as numpy's percentile); the official count is ``int(N * ratio)``."""
    first, third = torch.quantile(attention, torch.tensor([0.25, 0.75]))
    return int((attention > third + 1.5 * (third - first)).sum()) / attention.numel()


def ranked(attention: Tensor, count: int, ties: str) -> Tensor:
    """(count,) the most attended patches, most attended first (the official ``torch.topk`` order)."""
    if ties == "topk":
        return torch.topk(attention, count).indices
    return ranked_indices(attention, count)


@dataclass
class _PruneMerge(InputSelector):
    """What PruMerge and PruMerge+ share: the centres' merge with their neighbours and the remainder token."""

    merges: ClassVar[bool] = True
    requires: ClassVar[frozenset[str]] = frozenset({*SIGNALS_OF_LAYER["last"], "vision_features"})
    flops_exact: ClassVar[bool] = True

    signal_layer: str = option(
        "last",
        Choice(SIGNAL_LAYERS),
        "CLS attention and keys of the tower's last layer (official) or the feature layer",
    )
    count: str = option("budget", Choice(COUNTS), "budget - 1 centres (default), or the official IQR outlier count")
    neighbours: int = option(32, Integer(low=1), "nearest neighbours (key cosine) each centre merges")
    ties: str = option("lower", Choice(TOP_K_TIES), "exact ties to the lower index, or torch.topk's order (official)")

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """Centre-to-token key cosines (C x N), each centre's weighted neighbour sum (k x Dv) and the remainder's
        weighted sum (1 x R x Dv), with C = budget - 1 centres (nominal under count=adaptive)."""
        if work.kept >= work.tokens:  # every token passes unchanged
            return 0
        centres = work.kept - 1
        neighbours = min(work.options.get("neighbours", 32), work.tokens - 1)
        rest = work.tokens - centres
        return (
            matmul(centres, work.vision_width, work.tokens)
            + centres * matmul(1, neighbours, work.vision_width)
            + matmul(1, rest, work.vision_width)
        )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.signal_layer != "last":  # the adapter computes the other layer's row (Selector.requires_on)
            self.requires = frozenset({*SIGNALS_OF_LAYER[self.signal_layer], "vision_features"})  # type: ignore[misc]  # an instance's own

    def centres(self, attention: Tensor, budget: int) -> Tensor:
        """(C,) the centres in output order; ``attention`` (N,) float32."""
        raise NotImplementedError

    def _select(self, signals: InputSignals, budget: int, generator: torch.Generator | None) -> Selection:
        logits, keys = (getattr(signals, name) for name in SIGNALS_OF_LAYER[self.signal_layer])
        attention = full_width_attention(logits)
        centres = self.centres(attention, budget)
        features = as_float32(signals.vision_features)
        unit_keys = unit_rows(full_width_keys(keys))
        sources, tokens = merge_centres(centres, attention, unit_keys, features, self.neighbours, self.ties)
        rest = torch.ones(signals.num_tokens, dtype=torch.bool)
        rest[centres] = False
        remainder = torch.nonzero(rest).flatten()
        sources.append(remainder)
        tokens.append((attention[remainder][None] @ features[remainder])[0])  # (1, R) @ (R, Dv)
        return Selection(kept=torch.zeros(0, dtype=torch.long), sources=sources, vision_tokens=torch.stack(tokens))


def merge_centres(
    centres: Tensor, attention: Tensor, unit_keys: Tensor, features: Tensor, neighbours: int, ties: str
) -> tuple[list[Tensor], list[Tensor]]:
    """Each centre plus the attention-weighted sum of its nearest neighbours among all other patches.

    Args:
        centres: (C,) patch indices, output order.
        attention: (N,) float32 full-width CLS attention (the weights, not normalised, as the official code).
        unit_keys: (N, Dk) unit patch keys; features: (N, Dv) float32 features at the feature layer.
        neighbours: how many each centre merges (at most N - 1); ties: ``"lower"`` or ``"topk"`` among equal cosines.

    Returns:
        ``([centre, neighbours by decreasing cosine] per centre, (Dv,) merged token per centre)``.
    """
    if centres.numel() == 0:
        return [], []
    count = min(neighbours, attention.numel() - 1)
    cosines = unit_keys[centres] @ unit_keys.T  # (C, N)
    cosines[torch.arange(centres.numel()), centres] = -math.inf  # a centre is not its own neighbour
    if ties == "topk":
        nearest = torch.topk(cosines, count, dim=1).indices
    else:
        nearest = torch.sort(-cosines, dim=1, stable=True).indices[:, :count]
    weighted = torch.bmm(attention[nearest][:, None, :], features[nearest])[:, 0]  # (C, 1, k) @ (C, k, Dv)
    merged = features[centres] + weighted
    sources = [torch.cat([centre.reshape(1), row]) for centre, row in zip(centres, nearest, strict=True)]
    return sources, list(merged)


@register
@dataclass
class PruMergeSelector(_PruneMerge):
    """LLaVA-PruMerge: the most CLS-attended patches, each merged with its key-nearest neighbours.

    Attention ``a`` (N,): the CLS row of one full-width head, ``softmax(sum_h l_h / sqrt(H))`` of the per-head CLS
    logits (H, 1 + N) of the tower's last layer (``last_layer_cls_logits``: CLIP layer 23 on the layer-22 output,
    as the official q_proj / k_proj hooks), patch columns, not renormalised. Centres: with ``count="budget"`` the
    ``budget - 1`` patches of largest ``a``; with ``count="adaptive"`` (official) the ``int(N * ratio)`` of them,
    ``ratio`` the share of patches above ``Q3 + 1.5 IQR`` of ``a``. Each centre ``i`` becomes
    ``x_i + sum_{r in nbr(i)} a_r x_r`` over its ``neighbours`` (32) most key-cosine-similar other patches (kept
    or not; the full-width keys of ``last_layer_vision_keys`` (H, 1 + N, d), heads concatenated), weights not
    normalised; one more token ``sum_{r not a centre} a_r x_r`` carries the pruned patches. ``x`` =
    ``vision_features`` (N, Dv), the official layer-22 output (the feature layer).

    Follows 42Shawn/LLaVA-PruMerge (commit 1ca8b2ba) ``clip_encoder.py::token_prune_merge_advanced`` and
    ``outlier_dectection``: attention and keys of CLIP layer 23 (``encoder.layers[23]``, the last), features of
    layer 22 (``hidden_states[-2]``); ``signal_layer="feature"`` reads both at the feature layer (docs/fidelity.md).

    Returns ``Selection(kept=empty, sources, vision_tokens)``: output order ``[centres by decreasing attention,
    remainder]``; ``sources`` is ``[centre, neighbours by decreasing cosine]`` per centre, then the ascending
    non-centre patches; ``vision_tokens`` (budget, Dv) float32 (count=adaptive: C + 1 rows).

    Options:
        signal_layer: ``"last"`` (default, official: the tower's last layer) or ``"feature"`` (the feature layer's
            ``cls_logits`` / ``vision_keys``).
        count: ``"budget"`` (default: ``budget - 1`` centres, the budget honoured) or ``"adaptive"`` (official).
        neighbours: neighbours merged into each centre (official 32; at most N - 1).
        ties: ``"lower"`` or ``"topk"`` (torch.topk's order, official) for the attention rank and the neighbours.
    """

    name: ClassVar[str] = "prumerge"
    summary: ClassVar[str] = "top CLS-attention tokens each merged with key-nearest neighbours, + 1 (LLaVA-PruMerge)"
    reference: ClassVar[Reference] = Reference(
        PAPER,
        REPOSITORY,
        "IQR outliers of the CLS attention (count=adaptive), 32 key-nearest neighbours merged, one remainder token",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        COMMIT,
        "budget - 1 top full-width CLS-attention centres, 32 key-nearest neighbours merged by attention, one "
        "remainder token, attention and keys of the tower's last layer (official), float32",
        ("signal_layer=last", "count=adaptive", "ties=topk"),
        DIFFERENCES,
        random_agreement(
            30,
            "tests/pruners/test_prumerge.py::test_prumerge_reproduces_the_official_merge",
            "centres, every centre's neighbours and every output vector within 1e-5 against the official loop "
            "re-derived on 1024-dim CLIP-shaped q / k / features (10 seeds x budgets 64 / 128 / 192); count=adaptive, "
            "ties=topk with the official IQR count (numpy percentile) in 10 of 10 seeds",
        ),
        30,
    )
    flops_exact: ClassVar[bool] = True

    def centres(self, attention: Tensor, budget: int) -> Tensor:
        count = int(attention.numel() * outlier_ratio(attention)) if self.count == "adaptive" else budget - 1
        return ranked(attention, count, self.ties)


@register
@dataclass
class PruMergePlusSelector(_PruneMerge):
    """PruMerge+: PruMerge's centres plus spatially uniform samples, all merged with their neighbours.

    As :class:`PruMergeSelector`, with more centres appended after the attention-ranked ones (ascending), so
    spatially spread patches survive. ``count="budget"`` (default): ``A = round((budget - 1) * attention_fraction)``
    attention-ranked centres and ``S = budget - 1 - A`` samples evenly spaced in raster order over the other patches
    ``R`` (ascending): ``R[floor(i |R| / S)]``, ``i = 0..S-1``. The default fraction 1/4 is the official mix: its
    sample stride ``step / 3`` (``step = N / A``) gives about three samples per attention centre. ``count="adaptive"``
    (official): ``A`` by the IQR rule, samples ``0, s, 2s, .. < N - 1`` with ``s = int(int(1 / ratio) / 3)`` that
    are not centres already (no samples when there is no outlier, where the official code divides by zero; ``s``
    at least 1). Every centre then merges its neighbours; one remainder token as PruMerge.

    Follows 42Shawn/LLaVA-PruMerge (commit 1ca8b2ba) ``clip_encoder.py::token_prune_merge_advanced_plus`` with
    ``if_adaptive=True``; the attention and keys are the last layer's, as there (``signal_layer``).

    Returns ``Selection`` as PruMerge's: output order ``[attention centres, samples, remainder]``.

    Options:
        signal_layer, count, neighbours, ties: as PruMerge.
        attention_fraction: share of the budget's centres ranked by attention under ``count="budget"``.
    """

    name: ClassVar[str] = "prumerge_plus"
    summary: ClassVar[str] = (
        "PruMerge's centres plus spatially uniform samples, each merged with neighbours (PruMerge+)"
    )
    reference: ClassVar[Reference] = Reference(
        PAPER,
        REPOSITORY,
        "PruMerge+ (token_prune_merge_advanced_plus): IQR outliers plus samples of stride int(1/ratio)/3",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        COMMIT,
        "a quarter of budget - 1 centres by full-width CLS attention, the rest evenly spaced in raster order, each "
        "merged with 32 key-nearest neighbours by attention, one remainder token, attention and keys of the tower's "
        "last layer (official), float32",
        ("signal_layer=last", "count=adaptive", "ties=topk"),
        DIFFERENCES
        + (
            "count=budget spaces its samples evenly over the non-centre patches to fill the budget; the official "
            "stride int(int(1/ratio)/3) over 0..N-2 (index N - 1 never sampled) is count=adaptive's",
        ),
        random_agreement(
            30,
            "tests/pruners/test_prumerge.py::test_prumerge_plus_reproduces_the_official_merge",
            "centres, samples, every centre's neighbours and every output vector within 1e-5 against the official "
            "loop re-derived on 1024-dim CLIP-shaped q / k / features (10 seeds x budgets 64 / 128 / 192); "
            "count=adaptive, ties=topk with the official IQR count and stride in 10 of 10 seeds",
        ),
        30,
    )
    flops_exact: ClassVar[bool] = True

    attention_fraction: float = option(
        0.25, Real(low=0.0, high=1.0), "share of the centres ranked by attention under count=budget"
    )

    def centres(self, attention: Tensor, budget: int) -> Tensor:
        tokens = attention.numel()
        if self.count == "adaptive":
            ratio = outlier_ratio(attention)
            top = ranked(attention, int(tokens * ratio), self.ties)
            stride = max(1, int(int(1 / ratio) / 3)) if ratio else 0
            candidates = torch.arange(0, tokens - 1, stride) if stride else torch.zeros(0, dtype=torch.long)
            samples = candidates[~torch.isin(candidates, top)]
        else:
            top = ranked(attention, round((budget - 1) * self.attention_fraction), self.ties)
            others = torch.ones(tokens, dtype=torch.bool)
            others[top] = False
            rest = torch.nonzero(others).flatten()
            wanted = budget - 1 - top.numel()
            samples = rest[torch.arange(wanted) * rest.numel() // wanted] if wanted else rest[:0]
        return torch.cat([top, samples])
