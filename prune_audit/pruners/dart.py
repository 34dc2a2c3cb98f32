"""DART: keep pivot tokens and the tokens least duplicated with respect to them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from prune_audit.pruners.arithmetic import SelectorWork, matmul
from prune_audit.pruners.base import Reference, Stage, ranked_indices, top_k_indices
from prune_audit.pruners.fidelity import Fidelity, random_agreement
from prune_audit.pruners.options import Choice, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import SIGNAL_LAYERS, SingleStageSelector
from prune_audit.pruners.signals import LayerSignals

VISUAL_PIVOTS = 4
TEXT_PIVOTS = 4


def ranked_top_k(scores: Tensor, k: int, ties: str = "lower", dtype: torch.dtype | None = None) -> Tensor:
    """(k,) indices of the ``k`` largest (N,) ``scores``, best first (``torch.topk``'s order).

    ``ties="lower"``: exact ties to the lower index; ``"topk"``: ``torch.topk`` on the scores cast to ``dtype``
    (None: their own), its order among exact ties, as the official code ranks the key norms.
    """
    if ties == "topk":
        return torch.topk(scores if dtype is None else scores.to(dtype), k).indices
    return ranked_indices(scores, k)


def half_dissimilarity(pivot: Tensor, rows: Tensor, dtype: torch.dtype) -> Tensor:
    """(N,) float32 holding ``-F.cosine_similarity(pivot, rows)`` computed in ``dtype``, as the official code.

    ``F.cosine_similarity`` divides each vector by its norm (rounded to ``dtype``), multiplies the unit
    vectors elementwise in ``dtype`` and sums the products (accumulated in float32, rounded once); in half
    precision about half of the values differ by an ulp from the float32 cosine rounded afterwards.

    Args:
        pivot: (D,) float hidden state of the pivot.
        rows: (N, D) float hidden states of the candidates.
    """
    return (-F.cosine_similarity(pivot.to(dtype), rows.to(dtype), dim=-1)).float()


def set_iteration_order(image_indices: list[int], query_indices: list[int]) -> list[int]:
    """Positions into ``image_indices + query_indices`` in the order ``list(set(image_indices + query_indices))`` visits them.

    The reference builds this set of prompt indices; a Python set of ints iterates in
    an order fixed by the ints and their insertion order, so building the same set
    reproduces it exactly.
    """
    indices = image_indices + query_indices
    return [indices.index(value) for value in set(indices)]


def picks_per_pivot(picks: int, num_pivots: int) -> list[int]:
    """Split ``picks`` over the pivots in order: equal shares, the first ``picks % num_pivots`` get one more."""
    share, extra = divmod(picks, num_pivots)
    return [share + (1 if index < extra else 0) for index in range(num_pivots)]


@register
@dataclass
class DARTSelector(SingleStageSelector):
    """DART (Wen et al., "Stop Looking for Important Tokens ... Duplication Matters More", 2025; ZichenWen1/DART).

    One stage at the input of decoder layer ``layer`` (K = 2, scaled on other depths),
    no attention weights:

    1. Pivots: the 4 alive visual tokens and the 4 text tokens (after the image) with
       the largest L1 norm of their post-RoPE keys (``key_norms``, ``text_key_norms``).
    2. Pivots are visited in ascending sequence order (visual pivots, then text
       pivots; ``pivot_order="sequence"``, default). The reference iterates
       ``list(set(image_indices + query_indices))`` over the pivots' prompt indices
       (hash order, which depends on where the image sits in the prompt);
       ``pivot_order="set"`` builds that same Python set from the tokens' indices in
       the unpruned prompt and visits the pivots in its iteration order.
    3. For each pivot, the candidates (alive visual tokens that are not pivots and not
       yet picked) with the **lowest** cosine similarity of ``normed_hidden_states``
       (the model's final norm on the layer input) to the pivot are picked.
    4. Kept: the visual pivots and every pick, in raster order; original positions kept.

    ``budget_rule="paper"``: ``per = budget // 8`` picks per pivot, so ``4 + 8 per``
    tokens are kept (68 / 132 / 196 for 64 / 128 / 192), the reference's
    ``max_num_trunction`` rule. ``budget_rule="average"`` (default): the kept count is
    solved so the layer average equals the budget (as FastV) and the
    ``keep - 4`` picks are split over the pivots in order, the first ones taking one
    more when it does not divide (in paper mode it always divides). With ``keep <= 4``
    the top-``keep`` visual pivots are kept.

    ``signal_layer="previous"`` (default, reference): the key norms are those of layer
    K-1's post-RoPE keys (the reference's ``K_states`` of the layer before the cut);
    ``"current"``: layer K's keys on its input. ``normed_hidden_states`` are the final
    norm of layer K's input (= layer K-1's output, as the reference) either way.

    ``score_dtype="model"`` with a half model dtype: the key norms and normed hidden states rounded to
    it, the dissimilarities computed as the official ``-F.cosine_similarity`` in it
    (:func:`half_dissimilarity`) and ranked there; ``ties="topk"`` ranks the key norms and each
    pivot's remaining candidates (ascending, as the official list of its index set) with
    ``torch.topk``, reproducing the official kept set on the same hardware.

    Deviations: ties to the lower index by default (``torch.topk`` leaves them unspecified).
    """

    name: ClassVar[str] = "dart"
    summary: ClassVar[str] = "key-norm pivots + least-duplicated tokens by hidden-state cosine, layer K=2"
    requires: ClassVar[frozenset[str]] = frozenset(
        {"key_norms", "text_key_norms", "normed_hidden_states", "text_normed_hidden_states"}
    )
    reference: ClassVar[Reference] = Reference(
        "Stop Looking for Important Tokens in Multimodal Language Models: Duplication Matters More (DART), 2025",
        "ZichenWen1/DART",
        "code read from the vendored copy in Chenfei-Liao/VTC-Bench external/DART",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "vendored in Chenfei-Liao/VTC-Bench 983e443e; fork xqy1111111/DART 02476570",
        "pivots visited in ascending sequence order; key norms of layer K-1 (signal_layer=previous); average rule",
        ("budget_rule=paper", "pivot_order=set", "score_dtype=model", "ties=topk"),
        (
            "default pivot order is ascending (the official Python-set order depends on where the image sits "
            "in the prompt); pivot_order=set reproduces it",
            "ties to the lower index by default; ties=topk ranks the key norms and each pivot's remaining "
            "candidates with torch.topk as the official code does (its order among exact ties is the kernel's: "
            "use it to reproduce a run on the same hardware, the default for deterministic audits)",
            "score_dtype=model rounds the key norms and normed hidden states to the model dtype and computes the "
            "dissimilarities as the official -F.cosine_similarity in it (norms, unit vectors and products rounded, "
            "the sum accumulated in float32 and rounded once); float32 cosines rounded afterwards differ by an "
            "ulp in about half of the values",
        ),
        random_agreement(
            30,
            "test_dart.py::test_dart_set_order_reproduces_the_official_iteration",
            "pivot_order=sequence (default): 0 of 30",
        ),  # fmt: skip
        30,
        "fp16 30 of 30, bf16 30 of 30 random cases, and 10 of 10 each with a quarter of the rows duplicated, "
        "with budget_rule=paper, pivot_order=set, score_dtype=model, ties=topk against the official cosine "
        "written out in half on CPU (test_dart.py::test_dart_model_dtype_reproduces_the_official_half_"
        "precision_cosine); float32 cosines rounded afterwards 15 and 0 of 30",
        {"fp16": 30, "bf16": 30},
    )

    #: nominal: matrix-vector products, which ``FlopCounterMode`` does not count (``pruners.arithmetic``)
    flops_exact: ClassVar[bool] = False

    signal_layer: str = option("previous", Choice(SIGNAL_LAYERS), "keys of layer K-1 (reference) or layer K")
    pivot_order: str = option("sequence", Choice(("sequence", "set")), "pivot visiting order; set = official")

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """Per stage, one matrix-vector product of the alive hidden states per pivot visited (``VISUAL_PIVOTS``
        visual and up to ``TEXT_PIVOTS`` text pivots; none when the visual pivots alone fill the stage)."""
        total = 0
        for alive, keep in work.stages:
            visual = min(VISUAL_PIVOTS, keep)
            if 0 < keep < alive and visual < keep:
                total += (visual + min(TEXT_PIVOTS, work.text_rows)) * matmul(alive, work.hidden, 1)
        return total

    def paper_keep(self, budget: int) -> int:
        return VISUAL_PIVOTS + (VISUAL_PIVOTS + TEXT_PIVOTS) * (budget // 8)

    def prune(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        if not 0 < stage.keep < signals.num_alive:
            return super().prune(stage, signals, state)  # nothing or everything: the base handles it
        self._check_signals(signals)
        signals = self.inputs(signals)
        dtype = self.ranking_dtype(signals.model_dtype)
        visual_pivots = ranked_top_k(signals.key_norms, min(VISUAL_PIVOTS, stage.keep), self.ties, dtype)
        if visual_pivots.numel() == stage.keep:
            return torch.sort(visual_pivots).values
        text_pivots = ranked_top_k(signals.text_key_norms, TEXT_PIVOTS, self.ties, dtype)
        if dtype is None:
            hidden = F.normalize(signals.normed_hidden_states.detach().float(), dim=-1)
            text_hidden = F.normalize(signals.text_normed_hidden_states.detach().float(), dim=-1)
        else:  # the official cosine in the model dtype normalises inside F.cosine_similarity
            hidden, text_hidden = signals.normed_hidden_states, signals.text_normed_hidden_states
        pivot_hidden = torch.cat([hidden[visual_pivots], text_hidden[text_pivots]])  # (P, D), rank order
        pivot_hidden = pivot_hidden[self.visiting_order(signals, visual_pivots, text_pivots)]
        candidate = torch.ones(signals.num_alive, dtype=torch.bool)
        candidate[visual_pivots] = False
        kept = [visual_pivots]
        shares = picks_per_pivot(stage.keep - visual_pivots.numel(), pivot_hidden.shape[0])
        for pivot, share in zip(pivot_hidden, shares):
            # the official code ranks the remaining candidates alone, in ascending order
            pool = torch.nonzero(candidate).flatten()
            if dtype is None:
                dissimilarity = self.model_precision(-(hidden @ pivot), signals)[pool]
            else:
                dissimilarity = half_dissimilarity(pivot, hidden[pool], dtype)
            picks = pool[top_k_indices(dissimilarity, share, self.ties, dtype)]
            candidate[picks] = False
            kept.append(picks)
        return torch.sort(torch.cat(kept)).values

    def visiting_order(self, signals: LayerSignals, visual_pivots: Tensor, text_pivots: Tensor) -> Tensor:
        """(P,) positions into ``visual_pivots + text_pivots`` (each in rank order) in the order pivots are visited."""
        if self.pivot_order == "set":
            if signals.sequence_index is None or signals.text_sequence_index is None:
                raise ValueError(
                    "dart pivot_order='set' needs the tokens' prompt indices, which the model did not provide"
                )
            order = set_iteration_order(
                signals.sequence_index[visual_pivots].tolist(), signals.text_sequence_index[text_pivots].tolist()
            )
            return torch.tensor(order, dtype=torch.long)
        # ascending sequence order: visual pivots by grid index, then text pivots by position
        visual = torch.argsort(visual_pivots)
        text = torch.argsort(text_pivots) + visual_pivots.numel()
        return torch.cat([visual, text])
