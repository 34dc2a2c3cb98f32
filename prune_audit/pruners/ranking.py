"""Top-k with a declared tie rule: the one ranking every scoring selector uses (kvpress-style: a method
scores, the base ranks)."""

from __future__ import annotations

import torch
from torch import Tensor

TOP_K_TIES = ("lower", "topk")
"""The ``ties`` option of the top-k selectors: exact ties to the lower index (deterministic everywhere), or
``torch.topk``'s own order among them in the dtype the official code ranks in (reproduces its kept set on the
same hardware: the order among exact ties is the kernel's, unspecified across devices and versions)."""


def top_k_indices(scores: Tensor, k: int, ties: str = "lower", dtype: torch.dtype | None = None) -> Tensor:
    """Ascending indices of the ``k`` largest scores.

    Args:
        scores: (N,) any float dtype; NaN is treated as the lowest score.
        ties: ``"lower"``: exact ties go to the lower index; ``"topk"``: ``torch.topk`` on the scores cast to
            ``dtype`` (the model's half dtype under ``score_dtype="model"``, else their own) picks among them.
    """
    if ties == "topk":
        values = torch.nan_to_num(scores if dtype is None else scores.to(dtype), nan=float("-inf"))
        return torch.sort(torch.topk(values, min(k, values.numel())).indices).values
    return torch.sort(ranked_indices(scores, k)).values


def ranked_indices(scores: Tensor, k: int) -> Tensor:
    """Indices of the ``k`` largest scores, best first; ties go to the lower index, NaN ranks last.

    Args:
        scores: (N,) any float dtype.
    """
    scores = torch.nan_to_num(scores.float(), nan=float("-inf"))
    # stable sort on -score keeps index order among equal scores
    return torch.sort(-scores, stable=True).indices[: min(k, scores.numel())]
