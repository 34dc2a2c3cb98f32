"""VisionZip: dominant tokens by CLS attention plus merged contextual tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from prune_audit.pruners.arithmetic import SelectorWork, matmul
from prune_audit.pruners.base import (
    TOP_K_TIES,
    InputSelector,
    Reference,
    Selection,
    as_float32,
    cls_probabilities,
    rounded_to,
    top_k_indices,
)
from prune_audit.pruners.fidelity import CLS_HALF, INPUT_DTYPE, TIES_TOPK_HALF, Fidelity, random_agreement
from prune_audit.pruners.layout import ONE_CLS
from prune_audit.pruners.options import Choice, Real, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import SCORE_DTYPES
from prune_audit.pruners.signals import InputSignals
from prune_audit.pruners.similarity import unit_rows, unit_rows_in


@register
@dataclass
class VisionZipSelector(InputSelector):
    """Dominant tokens (CLS included) plus contextual tokens merged by key similarity (VisionZip).

    The budget splits into ``C = round(budget * contextual_fraction)`` contextual and
    ``D = budget - C`` dominant tokens; the default 5/32 gives the reference splits
    54+10, 108+20 and 162+30 for 64, 128 and 192. Dominant: the CLS token and the
    ``D - 1`` patches with the largest head-summed CLS attention. The other patches R
    (raster order) are clustered: targets are R's members at positions
    ``0, step, 2 step, ...`` with ``step = max(1, |R| // C)``; every other member of R
    joins the target whose head-mean key (``vision_keys``) is most cosine-similar.
    A contextual token is ``target + mean(members)`` (the reference's sum; a target
    without members is itself). Follows dvlab-research/VisionZip
    ``clip_encoder.py::CLIPVisionTower_VisionZip.forward``.

    Returns ``Selection(kept=dominant patches ascending, sources, vision_tokens)`` with
    output order ``[CLS, dominant patches in raster order, contextual tokens in target
    order]``: ``sources`` is empty for CLS (no grid location), ``[j]`` for a dominant
    patch and ``[target, members...]`` for a contextual token; ``vision_tokens`` is
    (budget, Dv) float32, to be cast to the projector's dtype.

    Options:
        contextual_fraction: share of the budget given to contextual tokens.
        score_dtype: ``"float32"`` (default) or ``"model"``: the CLS attention is formed
            from the CLS logits in the model dtype (``signals.model_dtype``) as the
            reference's eager attention forms it (:func:`cls_probabilities`); it and the keys,
            their head sum / head mean and the member-to-target cosines are rounded to the
            model dtype before their top-k / argmax, and the keys' unit normalisation, the
            features and the contextual tokens' sums, means and results are computed in it,
            as the reference computes them in fp16/bf16 (ties then go to the lower index);
            the reductions in between accumulate in float32.
    """

    name: ClassVar[str] = "visionzip"
    summary: ClassVar[str] = "CLS + top CLS-attention patches, rest merged into contextual tokens (VisionZip)"
    layout_need: ClassVar[str] = ONE_CLS  # its dominant tokens rank one CLS row
    #: its official LLaVA-NeXT code (dvlab-research/VisionZip 3151f6d ``visionzip/llava_arch.py``) takes each crop's
    #: CLS, dominant and contextual tokens (``pruners.crop_merge``)
    per_crop_grid: ClassVar[bool] = True
    requires: ClassVar[frozenset[str]] = frozenset({"cls_attention", "vision_keys", "vision_features", "cls_feature"})
    merges: ClassVar[bool] = True
    reference: ClassVar[Reference] = Reference(
        "VisionZip: Longer is Better but Not Necessary in Vision Language Models (CVPR 2025, arXiv 2412.04467)",
        "dvlab-research/VisionZip",
        "CLIP layer 22; dominant includes CLS; 54+10 / 108+20 / 162+30",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "3151f6df",
        "CLS + dominant tokens by CLS attention, contextual merge (54+10 / 108+20 / 162+30), float32 scores",
        ("score_dtype=model", "ties=topk"),
        (
            TIES_TOPK_HALF,
            "ties to the lower index",
            INPUT_DTYPE + "; under score_dtype=model the head-mean keys, their unit normalisation, the "
            "member-to-target cosines and the merged vectors are computed in the model dtype as well",
            "the contextual tokens' grid sources (target and members) are recorded in merged_stages and count "
            "towards retention (records schema 4), so an object merged into a contextual token is not lost; "
            "visualize hatches their cells",
        ),
        random_agreement(
            30,
            "test_visionzip.py::test_visionzip_reproduces_the_official_dominant_and_contextual_tokens",
            "dominant set, every contextual token's target and members, and every output vector within 1e-5; "
            "1024-dim CLIP states, 16 heads x 64-dim keys; score_dtype=model: rounded saliency, keys and cosines "
            "on an fp16 case where float32 differs (test_input_selectors.py); "
            + CLS_HALF
            + "dominant set with score_dtype=model 30 of 30 in both, float32 29 and 9 of 30; the whole forward "
            "against the official one run in fp16 / bf16: dominant set, contextual groups and every output vector "
            "bit for bit with score_dtype=model in 30 of 30 each, float32 scoring the same sets in 0 of 30 "
            "(test_visionzip.py::test_visionzip_model_dtype_reproduces_the_official_half_precision_forward)",
        ),  # fmt: skip
        30,
        "fp16 30 of 30, bf16 30 of 30 with score_dtype=model, ties=topk: dominant set against the official "
        "torch.topk on the half CLS attention (test_fidelity.py::test_ties_topk_reproduces_the_official_half_precision_topk); with "
        "score_dtype=model the whole forward (dominant set, contextual groups, output vectors) bit for bit in 30 "
        "of 30 each (test_visionzip.py::test_visionzip_model_dtype_reproduces_the_official_half_precision_forward)",
        {"fp16": 30, "bf16": 30},
    )

    flops_exact: ClassVar[bool] = True

    contextual_fraction: float = option(
        5 / 32, Real(low=0.0, high=1.0, open_high=True), "share of the budget given to contextual tokens"
    )
    score_dtype: str = option("float32", Choice(SCORE_DTYPES), "float32, or the model dtype as the official code")
    ties: str = option("lower", Choice(TOP_K_TIES), "exact ties to the lower index, or torch.topk's order (official)")

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """Member-to-target cosines of the head-mean keys: M members x C targets."""
        dominant, contextual = cls(**work.options).split(work.kept)
        if contextual <= 0:
            return 0
        members = work.tokens - (dominant - 1) - contextual  # the CLS token counts towards the dominant tokens
        return matmul(members, work.key_width, contextual)

    def split(self, budget: int) -> tuple[int, int]:
        """``(dominant incl. CLS, contextual)`` token counts for ``budget``."""
        contextual = min(round(budget * self.contextual_fraction), budget - 1)
        return budget - contextual, contextual

    def _select(self, signals: InputSignals, budget: int, generator: torch.Generator | None) -> Selection:
        dominant_count, contextual_count = self.split(budget)
        dtype = signals.model_dtype if self.score_dtype == "model" and signals.model_dtype != torch.float32 else None
        saliency = rounded_to(cls_probabilities(signals, dtype).sum(dim=0), dtype)
        dominant = top_k_indices(saliency, dominant_count - 1, self.ties, self.ranking_dtype(signals.model_dtype))
        rest = torch.ones(signals.num_tokens, dtype=torch.bool)
        rest[dominant] = False
        features = rounded_to(as_float32(signals.vision_features), dtype)
        sources = [torch.zeros(0, dtype=torch.long)] + [index.reshape(1) for index in dominant]
        tokens = [rounded_to(as_float32(signals.cls_feature), dtype)[None], features[dominant]]
        if contextual_count:
            keys = rounded_to(
                rounded_to(as_float32(signals.vision_keys), dtype).mean(dim=0)[1:], dtype
            )  # (N, d) patches
            contextual_sources = _contextual_clusters(torch.nonzero(rest).flatten(), keys, contextual_count, dtype)
            sources += contextual_sources
            tokens.append(torch.stack([_merge(features, group, dtype) for group in contextual_sources]))
        return Selection(kept=dominant, sources=sources, vision_tokens=torch.cat(tokens))


def _contextual_clusters(remaining: Tensor, keys: Tensor, count: int, dtype: torch.dtype | None) -> list[Tensor]:
    """Groups ``[target, members...]`` of the ``remaining`` patches.

    Args:
        remaining: (R,) ascending grid indices not kept as dominant, R > count.
        keys: (N, d) head-mean keys of the patches.
        count: number of contextual tokens (targets).
        dtype: None (float32) or the model dtype in which the keys are normalised and the
            (M, count) member-to-target cosines rounded before the argmax.

    Returns:
        ``count`` LongTensors, target first, then its members ascending.
    """
    step = max(1, remaining.numel() // count)
    is_target = torch.zeros(remaining.numel(), dtype=torch.bool)
    is_target[torch.arange(count) * step] = True
    targets, members = remaining[is_target], remaining[~is_target]
    unit = unit_rows(keys) if dtype is None else unit_rows_in(keys, dtype)
    assignment = torch.argmax(rounded_to(unit[members] @ unit[targets].T, dtype), dim=1)  # (M,) target slot per member
    return [torch.cat([targets[slot].reshape(1), members[assignment == slot]]) for slot in range(count)]


def _merge(features: Tensor, group: Tensor, dtype: torch.dtype | None) -> Tensor:
    """(Dv,) target feature plus the mean of its members' features (0 when it has none).

    With a model ``dtype`` (``features`` already rounded to it), the members' sum, the mean
    and the result are each rounded to it, as the reference's half-precision ``bmm``,
    division and addition round them.
    """
    target, members = group[0], group[1:]
    if members.numel() == 0:
        return features[target]
    if dtype is None:
        return features[target] + features[members].mean(dim=0)
    mean = rounded_to(rounded_to(features[members].sum(dim=0), dtype) / members.numel(), dtype)
    return rounded_to(features[target] + mean, dtype)
