"""G-Prune: information flow over a similarity graph of the visual tokens, top nodes kept."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from prune_audit.flop_convention import matmul
from prune_audit.pruners.arithmetic import SelectorWork
from prune_audit.pruners.base import InputSelector, Reference, as_float32
from prune_audit.pruners.fidelity import Fidelity, random_agreement
from prune_audit.pruners.options import Choice, Integer, Real, option
from prune_audit.pruners.ranking import TOP_K_TIES
from prune_audit.pruners.registry import register
from prune_audit.pruners.signals import InputSignals
from prune_audit.pruners.similarity import similarity_blocks, unit_rows

#: the official code's stand-ins: a logit this close to zero is no edge, and a non-edge gets this logit
NO_EDGE = 1e-6
NON_EDGE_LOGIT = -5000.0


def transition_matrix(features: Tensor, threshold: float, temperature: float) -> tuple[Tensor, Tensor]:
    """The graph's row-stochastic transition matrix and each node's degree.

    With ``c_ij`` the cosine of the (N, D) rows, an edge joins i and j where ``c_ij >= threshold``
    (the self loop included); row i is the softmax over its edges of ``c_ij / temperature`` (a logit
    within 1e-6 of zero counts as no edge, as the official code marks non-edges by zeroing them).
    The degree of i is the number of nonzero entries of its row after the softmax.

    The matrix is the one N x N matrix held: built in row blocks of bounded size (``pruners.similarity``),
    each thresholded, softmaxed and counted in place.

    Returns:
        ``(P, degree)``: (N, N) float32, each row summing to 1, and (N,) float32.
    """
    unit = unit_rows(features)
    n = unit.shape[0]
    transition, degree = torch.empty(n, n), torch.empty(n)
    for rows, block in similarity_blocks(unit, out=transition):  # cosines, then logits, then probabilities
        block.masked_fill_(block < threshold, 0.0).div_(temperature)
        block.masked_fill_(block.abs() < NO_EDGE, NON_EDGE_LOGIT)
        block.copy_(torch.softmax(block, dim=1))
        degree[rows] = (block > 0).sum(dim=1).float()
    return transition, degree


def propagated_scores(features: Tensor, threshold: float, temperature: float, iterations: int) -> Tensor:
    """(N,) importance: each token's feature norm sent ``iterations`` steps along the transition matrix,
    divided by the receiving token's degree: ``(w P^t)_j / deg_j`` with ``w_i = ||x_i||``.

    The vector is multiplied ``iterations`` times by ``P`` (``((w P) P) ...``) instead of forming ``P^t`` as
    the official ``torch.matrix_power`` does: the same product, far fewer operations, float rounding apart.
    """
    transition, degree = transition_matrix(features, threshold, temperature)
    flow = as_float32(features).norm(dim=1)[None]  # (1, N)
    for _ in range(iterations):
        flow = flow @ transition
    return flow[0] / degree


@register
@dataclass
class GPruneSelector(InputSelector):
    """Keep the tokens that gather most information over a similarity graph (G-Prune).

    Nodes are the projector outputs ``features`` (N, D); :func:`transition_matrix` links tokens of cosine
    at least ``threshold`` and normalises each row by a softmax at ``temperature``; each token's feature
    norm flows ``iterations`` steps along it and each token's received flow, divided by its degree
    (:func:`propagated_scores`), ranks it; the top ``budget`` are kept in raster order. Follows
    jytmelon/G-Prune ``LLaVA-NeXT/llava/model/llava_arch.py::prepare_inputs_labels_for_multimodal``
    (similarity 0.5, temperature 0.03, 5 iterations) with the integer budget in place of
    ``int(keep_ratio * n)``.

    The official code is for LLaVA-NeXT only: it runs on the base view's 576 tokens and on the unpadded
    tile grid separately (``int(keep_ratio * n)`` of each) and keeps every row-end newline. Here one graph
    spans all of an image's visual tokens (one grid on LLaVA-1.5, the base view's computation); on
    LLaVA-NeXT ``budget_scope=crop`` builds one per crop (base view and each tile), which is not the official
    split either.

    Options:
        threshold: cosine below which two tokens are not linked (0.5, official).
        temperature: softmax temperature of the links (0.03, official).
        iterations: propagation steps (5, official).
        ties: ``"lower"`` (exact ties to the lower index) or ``"topk"`` (``torch.topk``'s order, official).
    """

    name: ClassVar[str] = "gprune"
    summary: ClassVar[str] = (
        "top tokens by information flow over a cosine-similarity graph of projector outputs (G-Prune)"
    )
    requires: ClassVar[frozenset[str]] = frozenset({"features"})
    reference: ClassVar[Reference] = Reference(
        "What Kind of Visual Tokens Do We Need? Training-free Visual Token Pruning for Multi-modal Large "
        "Language Models from the Perspective of Graph (G-Prune, AAAI 2025, arXiv 2501.02268)",
        "jytmelon/G-Prune",
        "projector outputs, cosine graph at 0.5, softmax at temperature 0.03, 5 steps, feature-norm flow / degree",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "5e226fb3",
        "cosine graph >= 0.5, row softmax at 0.03, feature norms propagated 5 steps, divided by degree, top-k, "
        "float32, one graph over the image's tokens",
        ("ties=topk",),
        (
            "the flow is a vector multiplied 5 times by the transition matrix, not torch.matrix_power's P^5 (the "
            "same product; last-bit rounding differs)",
            "one graph over all of an image's tokens; the official LLaVA-NeXT code builds one on the base view and "
            "one on the unpadded tile grid, each keeping int(keep_ratio * n), and keeps the row-end newlines; "
            "there is no official LLaVA-1.5 code (the graph over its 576 tokens is the base view's computation)",
            "float32 (the official code computes in the model's fp16, where a link of weight below 6e-8 underflows "
            "and leaves the degree)",
            "exact ties to the lower index (torch.topk leaves them unspecified; ties=topk uses it)",
        ),
        random_agreement(
            30,
            "tests/pruners/test_gprune.py::test_gprune_reproduces_the_official_kept_set",
            "576 tokens, 4096-dim projector outputs, budgets 64/128/192, seeds 0-9, against torch.matrix_power",
        ),
        30,
    )

    flops_exact: ClassVar[bool] = True
    #: its propagation needs only a set of features: on a clip, each temporal step alone (``pruners.frame_scope``)
    per_frame: ClassVar[bool] = True

    threshold: float = option(0.5, Real(low=-1.0, high=1.0), "cosine below which two tokens are not linked")
    temperature: float = option(0.03, Real(low=0.0, open_low=True), "softmax temperature of the links")
    iterations: int = option(5, Integer(low=1), "propagation steps of the feature-norm flow")
    ties: str = option("lower", Choice(TOP_K_TIES), "exact ties to the lower index, or torch.topk's order (official)")

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """The N x N cosine matrix of the projector outputs, then one (1 x N) @ (N x N) product per step."""
        if work.kept >= work.tokens:
            return 0
        iterations = cls(**work.options).iterations
        return matmul(work.tokens, work.feature_width, work.tokens) + iterations * matmul(1, work.tokens, work.tokens)

    def score(self, signals: InputSignals, generator: torch.Generator | None) -> Tensor:
        """(N,) propagated flow of ``features`` (N, D), divided by each token's degree."""
        return propagated_scores(signals.features, self.threshold, self.temperature, self.iterations)
