"""HoliTom's outer-LLM merging of a clip: global redundancy-aware temporal segmentation, each segment's temporally
static tokens merged over its frames, then DPC-kNN merging of the static tokens and top-attention dynamic ones."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from prune_audit.pruners.base import InputSelector, Reference, Selection
from prune_audit.pruners.fastvid import distance_peak_scores
from prune_audit.pruners.fidelity import Fidelity
from prune_audit.pruners.options import Flag, Integer, Real, option
from prune_audit.pruners.ranking import ranked_indices
from prune_audit.pruners.registry import register
from prune_audit.pruners.signals import STEP_ATTENTION, VIDEO_GRID, InputSignals
from prune_audit.pruners.sparsevlm import pairwise_distances

#: bisection steps of the ratio search (``fitted_ratio``): the float ratio to well below one token
RATIO_STEPS = 60


def static_windows(above: Tensor, max_window: int) -> tuple[list[tuple[int, int]], int]:
    """The segmentation of T frames that merges the most static tokens, from ``above`` (T - 1, S): whether each
    token's cosine to the same token of the next frame exceeds the threshold.

    A window [s, e] of L = e - s + 1 frames saves ``L - 1`` tokens for each token above the threshold in all its
    neighbouring pairs; the dynamic programme over frames takes the best windows of 2 to ``max_window`` frames or
    a single frame (a window only where it saves strictly more; among equal windows the shortest). Returns the
    windows, (start, end) inclusive in frame order, and the tokens saved."""
    steps = above.shape[0] + 1
    saved = [[0] * steps for _ in range(steps)]
    for start in range(steps - 1):
        still = above[start:].int().cumprod(dim=0).sum(dim=1).tolist()  # static tokens of [start, start + 1 + i]
        for offset, count in enumerate(still):
            saved[start][start + 1 + offset] = count * (offset + 1)
    best, first = [0] * steps, [0] * steps
    for end in range(steps):
        best[end], first[end] = best[end - 1] if end else 0, end
        for length in range(2, min(end + 1, max_window) + 1):
            start = end - length + 1
            value = (best[start - 1] if start else 0) + saved[start][end]
            if value > best[end]:
                best[end], first[end] = value, start
    windows, end = [], steps - 1
    while end >= 0:
        windows.append((first[end], end))
        end = first[end] - 1
    return windows[::-1], best[-1]


@dataclass(frozen=True)
class Window:
    """A segment of the clip: frames ``start..end`` (inclusive) and its (S,) ``static`` tokens (none alone)."""

    start: int
    end: int
    static: Tensor

    @property
    def frames(self) -> int:
        return self.end - self.start + 1


def dynamic_counts(tokens: int, ratio: float, context_share: float) -> tuple[int, int]:
    """(dominant, contextual) tokens a frame keeps of its ``tokens`` dynamic ones at the segment ratio:
    ``ceil(n r)`` in all, ``round((1 - D) ceil(n r))`` of them by attention (the official counts)."""
    total = math.ceil(tokens * ratio)
    dominant = round(total * (1 - context_share))
    return dominant, total - dominant


def output_count(windows: list[Window], ratio: float, context_share: float) -> int:
    """Tokens fed at the segment ratio: each frame's dynamic ones and ``round(n_static r)`` per window."""
    total = 0
    for window in windows:
        static = int(window.static.sum())
        total += window.frames * sum(dynamic_counts(window.static.numel() - static, ratio, context_share))
        total += round(static * ratio) if window.frames > 1 else 0
    return total


def segment_ratio(ratio: float, tokens: int, saved: int) -> float:
    """The official ratio of the tokens left after the temporal merge: ``min(r / ((N - saved) / N), 1)``."""
    return min(ratio / ((tokens - saved) / tokens), 1.0)


def fitted_ratio(windows: list[Window], budget: int, tokens: int, saved: int, context_share: float) -> float:
    """The retention ratio: ``budget / N`` where its official counts fit the budget, else the largest ratio below
    it whose counts do (bisection; the counts grow with the ratio, the official rounding up can exceed it)."""
    low, high = 0.0, budget / tokens
    if output_count(windows, segment_ratio(high, tokens, saved), context_share) <= budget:
        return high
    for _ in range(RATIO_STEPS):
        middle = (low + high) / 2
        fits = output_count(windows, segment_ratio(middle, tokens, saved), context_share) <= budget
        low, high = (middle, high) if fits else (low, middle)
    return low


def clustered(tokens: Tensor, distance: Tensor, centres: Tensor, beta: float) -> tuple[Tensor, list[Tensor]]:
    """Every other row of the (n, D) ``tokens`` joins its nearest of the ascending ``centres`` by ``distance``
    (the first on ties); a centre with members becomes ``beta x + (1 - beta) mean(members)``. Returns the (k, D)
    merged centres and each one's rows, itself first."""
    others = torch.ones(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    others[centres] = False
    rows = others.nonzero().flatten()
    choice = distance[rows][:, centres].argmin(dim=1)  # (n - k,)
    merged, groups = [], []
    for j, centre in enumerate(centres.tolist()):
        members = rows[choice == j]
        token = tokens[centre]
        merged.append(beta * token + (1 - beta) * tokens[members].mean(dim=0) if members.numel() else token)
        groups.append(torch.cat([centres[j : j + 1], members]))
    return torch.stack(merged), groups


@dataclass
class Output:
    """Output tokens of a clip: each one's clip index, feature and, for a merged one, its clip members."""

    index: list[int]
    feature: list[Tensor]
    members: list[Tensor | None]

    def add(self, index: int, feature: Tensor, members: Tensor | None = None) -> None:
        self.index.append(index)
        self.feature.append(feature)
        self.members.append(members)


@register
@dataclass
class HoliTomSelector(InputSelector):
    """HoliTom's outer-LLM merging on a clip's merged tokens (cokeshao/HoliTom, LLaVA-OneVision / LLaVA-Video).

    ``signals.video_grid`` is the clip's (T, h, w) grid (a "frame" is a temporal step of S = h w merged tokens),
    ``features`` the (T S, D) tokens time-major, ``step_attention`` (T S,) the attention each token gets in the
    tower's last block (the salience; see below). With r = budget / N:

    1. Temporal segmentation (``static_windows``): a token is static between frames t and t + 1 where its cosine
       to itself exceeds ``threshold`` (tau); the windows (2 to ``max_window`` frames, or single frames) that save
       the most tokens by keeping each token static across a whole window once, by dynamic programming.
    2. Temporal merging: a window's static tokens become their mean over its frames; the saved count raises the
       ratio of the rest to ``r' = min(r N / (N - saved), 1)``.
    3. Spatial merging per window: its ``round(n_static r')`` static centres by DPC-kNN (``k = min(K, count)``
       neighbours, ``density_noise``) absorb the other static tokens (nearest centre,
       ``beta x + (1 - beta) mean``); each frame keeps ``ceil(n_dyn r')`` dynamic tokens, the top ``step_attention``
       (with ``context_share`` D > 0, a share D of them DPC-kNN centres of the others, merged alike).

    Output tokens are in clip order: a static centre at its cell of the window's first frame (its members: that
    cell and its members' cells in every frame of the window), a contextual centre at its own cell; with
    ``merge=false`` nothing is merged (the static centres keep their first frame's own token, members dropped).

    Official defaults (``scripts/eval_ov-7b_holitom.sh``, ``eval_vid-7b_holitom.sh``; the code's environment
    defaults): RETAIN_RATIO 0.10 to 0.25, T (tau) 0.65 at 0.10 and 0.80 otherwise (0.8 the code's default, taken
    here), BETA 0.6, D 0, K 7, MAX_WINDOW_SIZE 1024, 32 frames on LLaVA-OneVision-7B and 64 on LLaVA-Video-7B; the
    official repository has no Qwen2.5-VL code or script. Its inner-LLM merge (``HOLITOM_k=18``, ``HOLITOM_r=0.5``:
    at layer 18 the last prompt token's head-mean attention of layer 17 keeps ``round(n / 2)`` visual tokens and
    folds every other one, in index order, into its most cosine-similar kept one by ``(h_kept + h) / 2``, the kept
    tokens keeping their positions) is the in-LLM selector ``holitom_llm`` (``pruners.holitom_llm``): alone this
    selector is the official "HoliTom (w/o M)", composed as ``holitom+holitom_llm`` the official "HoliTom".

    Departures: the salience is ``step_attention`` (the softmax of each temporal step's mean query in the last
    tower block, the one clip attention the Qwen2.5-VL adapter gives) where the official reads SigLIP's last-layer
    attention averaged over heads and every query, pooled as the features; the budget is at most fed
    (``fitted_ratio``: where the official per-frame rounding up exceeds r N, the largest ratio whose counts fit;
    a budget too small for any token at a positive ratio keeps the budget's highest-attention tokens); tokens in
    clip order (the official LLaVA-OneVision order puts a window's static tokens before its frames, LLaVA-Video's
    grid order puts them in the first frame as here); float32 (the official bf16); distances from exact differences
    (the official ``torch.cdist`` takes its matrix-product form, whose float32 cancellation blurs the small
    distances of near-duplicate static means: one of the 36 test clips ranks otherwise with it); ties to the lower
    index; the density noise drawn from the run's generator, each frame's then the window's static tokens'.

    Reference: cokeshao/HoliTom ``holitom/llava_arch.py`` (``select_static_windows``,
    ``get_static_dynamic_features``, ``merge_tokens_by_attention_density``, ``merge_tokens_by_density``,
    ``cluster_dpc_knn``, ``merge_tokens_by_clustering``), ``holitom/modeling_qwen2.py`` (the inner-LLM merge) and
    ``scripts/`` at commit e9b2972f; ModelTC/llmc ``llmc/compression/token_reduction/holitom.py`` (5cceda95, the
    same algorithm) read as a second reference.
    """

    name: ClassVar[str] = "holitom"
    summary: ClassVar[str] = (
        "segments a clip to merge its temporally static tokens, then DPC-kNN merging and top-attention tokens (HoliTom)"
    )
    requires: ClassVar[frozenset[str]] = frozenset({"features", STEP_ATTENTION, VIDEO_GRID})
    fills_budget: ClassVar[bool] = False
    reference: ClassVar[Reference] = Reference(
        "HoliTom: Holistic Token Merging for Fast Video Large Language Models (NeurIPS 2025, arXiv 2505.21334)",
        "cokeshao/HoliTom",
        "holitom/llava_arch.py: the outer-LLM merge of the pooled video tokens (the inner-LLM one: holitom_llm)",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "e9b2972f",
        "windows of static tokens by dynamic programming (tau=0.8), static tokens merged over each window, its "
        "DPC-kNN centres (K=7) absorbing the other static tokens (beta=0.6), each frame's top-attention dynamic "
        "tokens (D=0), at retention budget / N raised by the tokens saved",
        (),
        (
            "the outer-LLM stage alone, the official 'HoliTom (w/o M)'; the official HOLITOM_k=18 / HOLITOM_r=0.5 "
            "inner-LLM merge is the in-LLM selector holitom_llm (its own row), composed as holitom+holitom_llm "
            "(the official 'HoliTom')",
            "the salience is the tower's step attention (each temporal step's mean query, FastVID's), where the "
            "official reads SigLIP's last-layer attention averaged over every query",
            "at most the budget is fed: where the official per-frame rounding up exceeds budget / N, the largest "
            "ratio whose counts fit; a budget below one token a frame keeps its highest-attention tokens",
            "tokens in clip order (a window's static tokens in its first frame, the LLaVA-Video grid order; "
            "LLaVA-OneVision's puts them before the window's frames); float32 where the official runs in bf16; "
            "ties to the lower index; the 1e-6 density noise from the run's generator; distances from exact "
            "differences where the official torch.cdist takes the matrix-product form (its float32 cancellation "
            "changed one of the 36 test clips' centres when tried)",
            "Qwen2.5-VL keeps original positions and so refuses merged tokens: there merge=false runs (static centres "
            "keep their first frame's token, nothing merged)",
        ),
        "kept sets and sources identical, merged tokens within 1e-5, in all 36 random clips (3 seeds, 4 grids of 4 "
        "to 8 steps of 36 to 108 tokens a step, 3 budgets) to a loop-by-loop float64 re-derivation of the official forward "
        "at the selector's ratio without the density noise (budget / N in 1 of them; in 35 the official counts at "
        "budget / N exceed the budget by 1 to 5 tokens, and both run at the largest ratio that fits), in 6 with "
        "D=0.5 and in a clip with the noise drawn alike "
        "(test_holitom.py::test_holitom_equals_the_rederived_forward, test_the_contextual_share_merges_alike, "
        "test_the_density_noise_is_drawn_from_the_runs_generator)",
    )
    #: distances from differences and norms, similarities elementwise, means sums: no matrix product to count
    flops_exact: ClassVar[bool] = True

    threshold: float = option(0.8, Real(-1.0, 1.0), "tau: a token is static where its next-frame cosine exceeds it")
    max_window: int = option(1024, Integer(2), "the longest window of frames the segmentation takes")
    beta: float = option(0.6, Real(0.0, 1.0), "a merged centre's weight on its own token")
    neighbours: int = option(7, Integer(1), "DPC-kNN's K: the density over min(K, centres) nearest tokens")
    context_share: float = option(0.0, Real(0.0, 1.0), "D: the share of a frame's dynamic tokens merged by DPC-kNN")
    merge: bool = option(True, Flag(), "merge (temporal means and clusters), or keep the centres' own tokens")
    density_noise: float = option(1e-6, Real(0.0), "uniform noise added to the densities (the official 1e-6)")

    @property
    def merges(self) -> bool:  # type: ignore[override]  # the class says False: an instance merges under ``merge``
        """Whether this instance feeds merged tokens: with ``merge`` on."""
        return self.merge

    def select(self, signals: InputSignals, budget: int, generator: torch.Generator | None = None) -> Selection:
        """HoliTom's output tokens of ``signals.num_tokens`` clip tokens: ``kept`` each one's clip index,
        ``sources`` and ``llm_tokens`` (with merging) each one's members and feature, in clip order."""
        budget, (steps, rows, cols) = self._checked_clip(signals, budget)
        n, per_step = signals.num_tokens, rows * cols
        attention = signals.step_attention.detach().float().flatten()  # checked present above
        if budget >= n:
            return Selection(kept=torch.arange(n, dtype=torch.long))
        frames = signals.features.detach().float().reshape(steps, per_step, -1)
        units = F.normalize(frames, dim=-1)
        above = (units[:-1] * units[1:]).sum(dim=-1) > self.threshold  # (T - 1, S)
        spans, saved = static_windows(above, self.max_window)
        alone = torch.zeros(per_step, dtype=torch.bool, device=above.device)
        windows = [Window(a, b, above[a:b].all(dim=0) if b > a else alone) for a, b in spans]
        ratio = segment_ratio(fitted_ratio(windows, budget, n, saved, self.context_share), n, saved)
        if output_count(windows, ratio, self.context_share) == 0:
            return Selection(kept=torch.sort(ranked_indices(attention, budget)).values.cpu())
        output = Output([], [], [])
        for window in windows:
            self._dynamic(frames, attention.view(steps, per_step), window, ratio, output, generator)
            self._static(frames, window, ratio, output, generator)
        return self._selection(output)

    def _centres(self, tokens: Tensor, count: int, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
        """(count,) ascending DPC-kNN centres of the (n, D) ``tokens`` and their (n, n) distances (/ sqrt(D))."""
        distance = pairwise_distances(tokens)  # exact differences: near-duplicate static means keep their distances
        noise = (torch.rand(tokens.shape[0], generator=generator) * self.density_noise).to(tokens.device)
        scores = distance_peak_scores(distance, min(self.neighbours, count), noise)
        return torch.sort(ranked_indices(scores, count)).values, distance

    def _dynamic(
        self,
        frames: Tensor,
        attention: Tensor,
        window: Window,
        ratio: float,
        output: Output,
        generator: torch.Generator | None,
    ) -> None:
        """Each frame's dynamic tokens of ``window`` in the (T, S, D) ``frames``: the top (T, S) ``attention``
        ones and, with ``context_share``, DPC-kNN centres of the rest merged."""
        cells = (~window.static).nonzero().flatten()
        dominant, contextual = dynamic_counts(cells.numel(), ratio, self.context_share)
        per_step = window.static.numel()
        for frame in range(window.start, window.end + 1):
            top = ranked_indices(attention[frame, cells], dominant)
            for cell in cells[top].tolist():
                output.add(frame * per_step + cell, frames[frame, cell])
            if contextual == 0:
                continue
            rest = torch.ones(cells.numel(), dtype=torch.bool, device=cells.device)
            rest[top] = False
            others = cells[rest]
            found = self._centres(frames[frame, others], contextual, generator)
            self._add_centres(frames, frames[frame, others], others, found, range(frame, frame + 1), output)

    def _static(
        self, frames: Tensor, window: Window, ratio: float, output: Output, generator: torch.Generator | None
    ) -> None:
        """A window's static tokens: their means over its frames, ``round(n r)`` DPC-kNN centres merging them."""
        cells = window.static.nonzero().flatten()
        count = round(cells.numel() * ratio)
        if window.frames == 1 or count == 0:
            return
        means = frames[window.start : window.end + 1, cells].mean(dim=0)  # (n_static, D)
        found = self._centres(means, count, generator)
        self._add_centres(frames, means, cells, found, range(window.start, window.end + 1), output)

    def _add_centres(
        self, frames: Tensor, tokens: Tensor, cells: Tensor, found: tuple[Tensor, Tensor], span: range, output: Output
    ) -> None:
        """The ``found`` (centres, distances) of the (n, D) ``tokens`` of frame cells ``cells``, each merged with its
        members over the frames ``span`` and placed in its first; with ``merge=false`` that frame's own token."""
        centres, distance = found
        per_step = frames.shape[1]
        if not self.merge:
            for cell in cells[centres].tolist():
                output.add(span[0] * per_step + cell, frames[span[0], cell])
            return
        merged, groups = clustered(tokens, distance, centres, self.beta)
        offsets = torch.tensor(span, device=cells.device)[:, None] * per_step
        for token, group in zip(merged, groups, strict=True):
            members = torch.sort((offsets + cells[group][None, :]).flatten()).values
            output.add(span[0] * per_step + int(cells[group[0]]), token, members)

    def _selection(self, output: Output) -> Selection:
        """The output tokens in clip order."""
        order = sorted(range(len(output.index)), key=lambda i: output.index[i])
        kept = torch.tensor([output.index[i] for i in order], dtype=torch.long)
        if all(members is None for members in output.members):
            return Selection(kept=kept)
        sources = [
            torch.tensor([output.index[i]]) if output.members[i] is None else output.members[i].cpu() for i in order
        ]
        return Selection(kept=kept, sources=sources, llm_tokens=torch.stack([output.feature[i] for i in order]))
