"""EVS: Efficient Video Sampling, the temporal-redundancy pruning of a video clip's tokens (vLLM)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from prune_audit.pruners.base import InputSelector, Reference, Selection
from prune_audit.pruners.fidelity import Fidelity
from prune_audit.pruners.options import Real, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.signals import VIDEO_GRID, InputSignals

#: the dissimilarity vLLM gives every token of the first temporal step, above any ``1 - cos`` (at most 2)
FIRST_STEP_SCORE = 255.0


def retained_count(tokens_per_step: int, steps: int, pruning_rate: float) -> int:
    """vLLM's ``compute_retained_tokens_count``: ``int(T * h * w * (1 - q))`` tokens, never fewer than one
    temporal step's ``h * w`` (the first step is always kept whole)."""
    return max(tokens_per_step, int(tokens_per_step * steps * (1 - pruning_rate)))


def temporal_dissimilarity(features: Tensor, video_grid: tuple[int, int, int]) -> Tensor:
    """(T * h * w,) float32 EVS scores of a clip's (T * h * w, D) merged tokens, time-major then row-major:
    ``1 - cos`` between each token and the token at the same (row, col) one temporal step earlier, and
    ``FIRST_STEP_SCORE`` for every token of the first step."""
    steps, rows, cols = video_grid
    grid = features.float().reshape(steps, rows, cols, -1)
    changed = 1 - torch.nn.functional.cosine_similarity(grid[1:], grid[:-1], dim=-1)  # (T - 1, h, w)
    first = torch.full((1, rows, cols), FIRST_STEP_SCORE, dtype=changed.dtype, device=changed.device)
    return torch.cat([first, changed]).flatten()


@register
@dataclass
class EVSSelector(InputSelector):
    """Efficient Video Sampling on a clip's merged tokens (vLLM ``vllm/multimodal/evs.py``).

    ``signals.video_grid`` is the clip's (T, h, w) token grid after the spatial merge (T temporal steps, each two
    frames on Qwen2.5-VL), the (T * h * w, D) ``features`` time-major then row-major. Each token's score is its
    dissimilarity ``1 - cos`` to the token at the same (row, col) one step earlier; every token of the first step
    scores 255, so that step is kept whole first. The top scores are kept (vLLM's stable descending argsort: ties
    go to the lower index) and returned in the clip's order; kept tokens keep their original M-RoPE positions, as
    vLLM's Qwen2.5-VL path computes them (``compute_mrope_for_media`` over the whole clip, then the mask).

    How many: ``pruning_rate`` 0 (default) keeps the budget, ``min(budget, N)``. ``pruning_rate`` q in (0, 1) is
    vLLM's ``--video-pruning-rate``: ``max(h * w, int(N * (1 - q)))`` tokens, capped at the budget (a budget of N or
    more gives vLLM's count exactly; the first step then always survives whole, as in vLLM, which a budget below
    one step's h * w cannot give: the first step's tokens are then kept in raster order).

    Only a clip has temporal steps: on a still image the adapter gives no ``video_grid`` and EVS is refused in one
    line (every family's support table says no; the Qwen2.5-VL adapter provides the grid only on a clip,
    ``QwenModel.prepare_video``). A one-step clip (two frames) has nothing to compare: every token scores 255 and
    the budget keeps the first ones in raster order.

    Reference: vllm-project/vllm ``vllm/multimodal/evs.py`` (``compute_retention_mask``,
    ``compute_retained_tokens_count``) at commit 094f1178.
    """

    name: ClassVar[str] = "evs"
    summary: ClassVar[str] = "temporal dissimilarity to the previous frame pair's token, first pair kept (EVS, video)"
    requires: ClassVar[frozenset[str]] = frozenset({"features", VIDEO_GRID})
    reference: ClassVar[Reference] = Reference(
        "Efficient Video Sampling: Pruning Temporally Redundant Tokens for Faster VLM Inference (arXiv 2510.14624)",
        "vllm-project/vllm",
        "vllm/multimodal/evs.py compute_retention_mask on the merged video embeddings, first temporal step kept",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "094f1178",
        "1 - cosine to the same token one temporal step earlier, first step kept whole, top by budget",
        ("pruning_rate=0.75",),
        (
            "the count is the budget by default (vLLM derives it from its --video-pruning-rate); pruning_rate=Q "
            "gives vLLM's count for rate Q (0.75 above: any rate in (0, 1) alike) capped at the budget, so a "
            "budget of every token reproduces vLLM",
        ),
        "kept sets identical in all 48 random clips at budgets and all 48 at pruning rates (3 seeds, 4 grids, 4 "
        "budgets or rates) to a token-by-token re-derivation of compute_retention_mask "
        "(test_evs.py::test_evs_equals_the_rederived_retention_mask, test_pruning_rate_is_vllms_video_pruning_rate)",
    )
    #: cosine similarities are elementwise products and sums (no matrix product); sorting counts zero
    flops_exact: ClassVar[bool] = True

    pruning_rate: float = option(
        0.0,
        Real(0.0, 1.0, open_high=True),
        "0: keep the budget; q in (0, 1): vLLM's --video-pruning-rate count, capped at the budget",
    )

    def select(self, signals: InputSignals, budget: int, generator: torch.Generator | None = None) -> Selection:
        """The EVS kept set of ``signals.num_tokens`` clip tokens (the budget short-cut of the base class would skip
        vLLM's own count under ``pruning_rate``)."""
        budget, (steps, rows, cols) = self._checked_clip(signals, budget)
        n = signals.num_tokens
        count = min(budget, n)
        if self.pruning_rate > 0:
            count = min(count, retained_count(rows * cols, steps, self.pruning_rate))
        if count >= n:
            return Selection(kept=torch.arange(n, dtype=torch.long))
        scores = temporal_dissimilarity(signals.features.detach(), (steps, rows, cols))
        order = torch.argsort(scores, descending=True, stable=True)
        return Selection(kept=torch.sort(order[:count].cpu()).values)
