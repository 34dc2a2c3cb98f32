"""Dempster-Shafer evidence on the frame {I (informative), U (uninformative)} for E2S-Pruner.

Masses are tensors of shape (..., 3) ordered ``[I, U, Theta]`` (``Theta`` = {I, U},
ignorance), non-negative and summing to 1. The rules follow E2S-Pruner (arXiv
2608.23253, sections on head evidence and layer fusion); no public code exists, so
this is written from the paper's equations (see the selectors spec, section 12).
"""

from __future__ import annotations

import torch
from torch import Tensor

INFORMATIVE, UNINFORMATIVE, IGNORANCE = 0, 1, 2

# below this normaliser the two masses are in total conflict and Dempster's rule is undefined
_TOTAL_CONFLICT = 1e-12


def vacuous_mass(*shape: int) -> Tensor:
    """(*shape, 3) total ignorance ``[0, 0, 1]``: the neutral element of Dempster's rule."""
    mass = torch.zeros(*shape, 3, dtype=torch.float32)
    mass[..., IGNORANCE] = 1.0
    return mass


def dempster_combine(m1: Tensor, m2: Tensor) -> tuple[Tensor, Tensor]:
    """Dempster's rule of combination for two bodies of evidence on {I, U}.

    Args:
        m1, m2: (..., 3) masses ``[I, U, Theta]`` (broadcastable).

    Returns:
        ``(m, K)``: the combined (..., 3) mass and the (...) conflict
        ``K = m1(I) m2(U) + m1(U) m2(I)``, with
        ``m(I) = [m1(I) m2(I) + m1(I) m2(Theta) + m1(Theta) m2(I)] / (1 - K)``,
        ``m(U)`` symmetric and ``m(Theta) = m1(Theta) m2(Theta) / (1 - K)``.

    The normaliser is the sum of the three numerators, which equals ``1 - K`` for
    valid masses but stays exact in float32 when ``K`` is close to 1. Guard: under
    total conflict (normaliser below 1e-12, e.g. ``m1 = [1, 0, 0]``, ``m2 = [0, 1, 0]``)
    the rule is undefined; the result is then the vacuous mass ``[0, 0, 1]`` (the
    conflict becomes ignorance, as in Yager's rule) and ``K`` is returned as computed,
    so no NaN arises and the E2S priority of such a token is 1 (conflict protects it).
    """
    i1, u1, t1 = m1.unbind(-1)
    i2, u2, t2 = m2.unbind(-1)
    conflict = i1 * u2 + u1 * i2
    numerators = torch.stack([i1 * i2 + i1 * t2 + t1 * i2, u1 * u2 + u1 * t2 + t1 * u2, t1 * t2], dim=-1)
    normaliser = numerators.sum(-1, keepdim=True)
    defined = normaliser > _TOTAL_CONFLICT
    combined = torch.where(
        defined, numerators / normaliser.clamp_min(_TOTAL_CONFLICT), vacuous_mass(*normaliser.shape[:-1])
    )
    return combined, conflict


def head_masses(text_logits: Tensor, reliability: bool = True) -> Tensor:
    """Per-token masses from the heads' text-to-visual logits at one layer.

    Args:
        text_logits: (H, T, n) pre-softmax logits ``q_t . k_n / sqrt(d)``.
        reliability: if False, every token gets reliability 1 (E2S ablation
            "w/o reliability": masses are the bare head-mean support, no ignorance).

    Returns:
        (n, 3) masses ``[rho * pbar, rho * (1 - pbar), 1 - rho]`` where, per head,
        ``r = softmax_n(mean_t logits)``, support ``p = n r / (1 + n r)`` (0.5 at average
        attention), ``pbar`` the head mean of ``p``, and reliability
        ``rho = clip(clarity * consistency, 0, 1)`` with ``clarity = |2 mean_h (p - 0.5)|``
        and ``consistency = 1 - 2 mean_h |p - pbar|``.
    """
    logits = text_logits.detach().float().mean(dim=1)  # (H, n)
    num_alive = logits.shape[-1]
    weighted = num_alive * torch.softmax(logits, dim=-1)
    support = weighted / (1 + weighted)  # (H, n)
    mean_support = support.mean(dim=0)
    if reliability:
        clarity = (2 * (support - 0.5).mean(dim=0)).abs()
        consistency = 1 - 2 * (support - mean_support).abs().mean(dim=0)
        rho = (clarity * consistency).clamp(0.0, 1.0)
    else:
        rho = torch.ones_like(mean_support)
    return torch.stack([rho * mean_support, rho * (1 - mean_support), 1 - rho], dim=-1)


def priority(mass: Tensor, conflict: Tensor | None = None) -> Tensor:
    """(...) keep priority ``q = 1 - (1 - Pl(I)) (1 - K)`` with ``Pl(I) = 1 - m(U)``.

    Without ``conflict`` (conflict protection switched off) this is ``Pl(I)``.
    """
    plausibility = 1 - mass[..., UNINFORMATIVE]
    if conflict is None:
        return plausibility
    return 1 - (1 - plausibility) * (1 - conflict)
