"""Each selector's own arithmetic (``SELECTOR_FLOPS``): the products it computes to choose its tokens.

The signals a selector reads (probes, CLIP text tower) are the model's part (``compute.flops``);
here is only what ``select`` / ``prune`` / ``merge`` compute. Products are counted as in
``compute.flops`` (``2 m k n``); norms, softmax, top-k and sorting count zero.

``exact`` formulas count every (m, k) @ (k, n) product the implementation runs. ``nominal``
formulas count the official algorithm's plain form where the work depends on the data: DivPrune
(above N = 4096) and CDPruner fetch similarity rows speculatively (``pruners.similarity.SpeculativeRows``) and
coverage's weighted gains update only the rows a pick changes, so their realised products vary
per image; the nominal count is the full N x N similarity matrix plus one row per greedy step
(CDPruner: its Cholesky updates; coverage: the first weighted gains), as the reference code
computes it.
Matrix-vector products (DART's pivot similarities) are counted here although
``FlopCounterMode`` does not count ``aten.mv``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prune_audit.compute.flops import matmul
from prune_audit.pruners.dart import TEXT_PIVOTS, VISUAL_PIVOTS
from prune_audit.pruners.similarity import rows_per_block
from prune_audit.pruners.visionzip import VisionZipSelector


@dataclass(frozen=True)
class SelectorWork:
    """The sizes a selector's arithmetic depends on, for one question.

    Attributes:
        tokens: visual tokens an input-level selector chooses among (N).
        kept: its budget: the tokens it passes on.
        feature_width: width of ``features`` (the language model's input space).
        vision_width: width of ``vision_features`` (the vision tower's).
        key_width: width of one vision head (VisionZip's head-mean keys).
        hidden: the decoder's hidden width (in-LLM selectors' hidden states and embeddings).
        text_rows: text tokens after the image (the rows in-LLM selectors score with).
        stages: in-LLM stages as ``(visual tokens alive before, kept after)``.
        options: the selector's options (``Selector.options()``).
        tower_merges: tokens ToMe merges in each vision-tower layer with ``location=tower`` (empty otherwise).
        crop_stages: ``(patches, kept)`` of each crop a vision stage runs in alone, padding patches included
            (VScan with ``budget_scope="crop"``; empty otherwise: the stages are over the image).
    """

    tokens: int = 0
    kept: int = 0
    feature_width: int = 0
    vision_width: int = 0
    key_width: int = 0
    hidden: int = 0
    text_rows: int = 0
    stages: tuple[tuple[int, int], ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    tower_merges: tuple[int, ...] = ()
    crop_stages: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class SelectorFlops:
    """One selector's formula and whether it is exact (see the module docstring)."""

    formula: Callable[[SelectorWork], int]
    exact: bool


def _none(work: SelectorWork) -> int:
    return 0


def _divprune(work: SelectorWork) -> int:
    """The N x N cosine, held and read while it fits one block (``pruners.similarity.farthest_point_order``:
    exact there); above, one row per pick after the first (the speculative rows vary with the data)."""
    gram = matmul(work.tokens, work.feature_width, work.tokens)
    if rows_per_block(work.tokens) >= work.tokens:
        return gram
    return gram + max(work.kept - 1, 0) * matmul(1, work.feature_width, work.tokens)


def _cdpruner(work: SelectorWork) -> int:
    """Kernel rows ``r_i r_j cos(f_i, f_j)`` for all N and, at greedy step t, the t-term Cholesky update of N entries."""
    updates = sum(matmul(1, step, work.tokens) for step in range(work.kept))
    return matmul(work.tokens, work.feature_width, work.tokens) + updates


def _coverage(work: SelectorWork) -> int:
    """Centred cosine of the projector outputs, and the demand-weighted first gains (w @ gaps)."""
    return matmul(work.tokens, work.feature_width, work.tokens) + matmul(1, work.tokens, work.tokens)


def _scope(work: SelectorWork) -> int:
    """The cosine of the vision features; its unweighted greedy gains are element-wise updates of it."""
    return matmul(work.tokens, work.vision_width, work.tokens)


def _tome(work: SelectorWork) -> int:
    """Each bipartite round on n tokens: the ceil(n/2) x floor(n/2) cosine matrix (``pruners.tome.merge_round``)
    of the projector outputs, or with ``location=tower`` of the head-mean keys (CLS included) in each tower
    layer that merges (``tower_merges``; the tower rerun itself is the model's, ``compute.flops.merging_tower``)."""
    if work.tower_merges:
        total, count = 0, 1 + work.tokens
        for merged in work.tower_merges:
            total += matmul((count + 1) // 2, work.key_width, count // 2) if merged else 0
            count -= merged
        return total
    total, count = 0, work.tokens
    while count > work.kept:
        total += matmul((count + 1) // 2, work.feature_width, count // 2)
        count -= min(count - work.kept, count // 2)
    return total


def _vispruner(work: SelectorWork) -> int:
    """Each duplicate-removal round on R residual tokens: the ceil(R/2) x floor(R/2) cosine matrix."""
    important = int(work.kept * work.options["important_ratio"])
    keep, residual, total = work.kept - important, work.tokens - important, 0
    if keep <= 0:
        return 0
    while (removed := min(work.options["removal_step"], residual - keep)) > 0:
        total += matmul((residual + 1) // 2, work.vision_width, residual // 2)
        residual -= removed
    return total


def _visionzip(work: SelectorWork) -> int:
    """Member-to-target cosines of the head-mean keys (``pruners.visionzip``): M members x C targets."""
    dominant, contextual = VisionZipSelector(**work.options).split(work.kept)
    if contextual <= 0:
        return 0
    members = work.tokens - (dominant - 1) - contextual  # the CLS token counts towards the dominant tokens
    return matmul(members, work.key_width, contextual)


def _sparsevlm(work: SelectorWork) -> int:
    """The raters, once per question: visual x text embedding products at the first stage that scores
    (one that drops tokens; recycling's clustering is not counted)."""
    scoring = [alive for alive, after in work.stages if 0 < after < alive]
    return matmul(scoring[0], work.hidden, work.text_rows) if scoring else 0


def _vscan(work: SelectorWork) -> int:
    """The vision stage's merge (``pruners.vscan.nearest_merge``): each pruned token's cosine to every kept one,
    over the image or, per crop, over that crop's padded patches."""
    if not work.stages or not work.options["merge_pruned"]:
        return 0
    scopes = work.crop_stages or work.stages[:1]
    return sum(matmul(alive - kept, work.hidden, kept) for alive, kept in scopes if 0 < kept < alive)


def _dart(work: SelectorWork) -> int:
    """Per stage, one matrix-vector product of the alive hidden states per pivot visited (``VISUAL_PIVOTS``
    visual and up to ``TEXT_PIVOTS`` text pivots; none when the visual pivots alone fill the stage)."""
    total = 0
    for alive, keep in work.stages:
        visual = min(VISUAL_PIVOTS, keep)
        if 0 < keep < alive and visual < keep:
            total += (visual + min(TEXT_PIVOTS, work.text_rows)) * matmul(alive, work.hidden, 1)
    return total


SELECTOR_FLOPS: dict[str, SelectorFlops] = {
    "random": SelectorFlops(_none, exact=True),
    "uniform": SelectorFlops(_none, exact=True),
    "cls_attn": SelectorFlops(_none, exact=True),
    "pool": SelectorFlops(_none, exact=True),
    "fastv": SelectorFlops(_none, exact=True),
    "pdrop": SelectorFlops(_none, exact=True),
    "e2s": SelectorFlops(_none, exact=True),
    "v2drop": SelectorFlops(_none, exact=True),
    "tome": SelectorFlops(_tome, exact=True),
    "vispruner": SelectorFlops(_vispruner, exact=True),
    "visionzip": SelectorFlops(_visionzip, exact=True),
    "sparsevlm": SelectorFlops(_sparsevlm, exact=True),
    "sparsevlm2": SelectorFlops(_sparsevlm, exact=True),
    "hiprune": SelectorFlops(_none, exact=True),
    "vscan": SelectorFlops(_vscan, exact=True),
    "dart": SelectorFlops(_dart, exact=False),
    "divprune": SelectorFlops(_divprune, exact=False),
    "cdpruner": SelectorFlops(_cdpruner, exact=False),
    "coverage": SelectorFlops(_coverage, exact=False),
    "scope": SelectorFlops(_scope, exact=True),
}
"""Selector name -> its arithmetic; a selector not listed (a plugin) counts zero and is reported as nominal."""


def selector_flops(name: str, work: SelectorWork) -> tuple[int, bool]:
    """``(FLOPs, exact)`` of selector ``name``'s own arithmetic on ``work``."""
    entry = SELECTOR_FLOPS.get(name)
    if entry is None:
        return 0, False
    return entry.formula(work), entry.exact


__all__ = ["SelectorWork", "SelectorFlops", "SELECTOR_FLOPS", "selector_flops"]
