"""A selector's own arithmetic: the sizes it depends on (:class:`SelectorWork`) and how its products count.

Each selector states its formula on its class (``Selector.flops``, ``Selector.flops_exact``); ``compute``
adds it to the model's FLOPs as ``flops_selector``. The signals a selector reads (probes, CLIP text tower) are
the model's part (``compute.flops``); a selector's formula counts only what ``select`` / ``prune`` / ``merge``
compute. Products are counted as in ``compute.flops`` (``flop_convention.matmul``: ``2 m k n``); norms, softmax, top-k and
sorting count zero.

``exact`` formulas count every (m, k) @ (k, n) product the implementation runs; where those products' sizes
depend on the data (FastVID's segments and density candidates, PruneVid's static tokens and clusters), the
selection reports the sizes it ran on (``Selection.work_sizes``) and the formula sums its products over them
(``SelectorWork.sizes``), still a pure function of ``work``. ``nominal``
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

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from prune_audit.flop_convention import matmul


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
        kv_width: the decoder's key/value heads times their width (in-LLM selectors' ``values``).
        text_rows: text tokens after the image (the rows in-LLM selectors score with).
        stages: in-LLM stages as ``(visual tokens alive before, kept after)``.
        options: the selector's options (``Selector.options()``).
        tower_merges: tokens ToMe merges in each vision-tower layer with ``location=tower`` (empty otherwise).
        grid: (rows, cols) of the image's visual tokens (MustDrop's 3 x 3 windows tile it).
        crop_stages: ``(patches, kept)`` of each crop a vision stage runs in alone, padding patches included
            (VScan with ``budget_scope="crop"``; empty otherwise: the stages are over the image).
        sizes: the data-dependent sizes the input-level selection reported (``Selection.work_sizes``), one tuple
            per unit of work in the layout the selector's ``flops`` names; empty for the others.
    """

    tokens: int = 0
    kept: int = 0
    feature_width: int = 0
    vision_width: int = 0
    key_width: int = 0
    hidden: int = 0
    kv_width: int = 0
    text_rows: int = 0
    stages: tuple[tuple[int, int], ...] = ()
    options: Mapping[str, Any] = field(default_factory=dict)
    tower_merges: tuple[int, ...] = ()
    grid: tuple[int, int] = (0, 0)
    crop_stages: tuple[tuple[int, int], ...] = ()
    sizes: tuple[tuple[int, ...], ...] = ()


__all__ = ["SelectorWork", "matmul"]
