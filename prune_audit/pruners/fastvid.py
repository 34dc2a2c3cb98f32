"""FastVID: dynamic temporal segmentation of a clip, then per segment its salient tokens by the tower's attention and
density-peak context tokens that absorb the rest (DySeg, STPrune, DTM)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from prune_audit.pruners.arithmetic import SelectorWork, matmul
from prune_audit.pruners.base import InputSelector, Reference, Selection
from prune_audit.pruners.fidelity import Fidelity
from prune_audit.pruners.options import Flag, Integer, Real, option
from prune_audit.pruners.ranking import ranked_indices
from prune_audit.pruners.registry import register
from prune_audit.pruners.signals import STEP_ATTENTION, VIDEO_GRID, InputSignals

#: the density's neighbourhood: each token's 4 nearest tokens of its frame, itself included (``topk(k=4)``)
NEIGHBOURS = 4


def even_split(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` shares differing by one at most, the larger first (the official chunking)."""
    return [total // parts + (1 if part < total % parts else 0) for part in range(parts)]


def runs_between(cuts: list[int], length: int) -> list[int]:
    """The lengths of the runs of ``length`` frames cut after each frame in the ascending ``cuts``."""
    edges = [-1, *cuts, length - 1]
    return [b - a for a, b in zip(edges, edges[1:]) if b > a]


def dynamic_segments(step_means: Tensor, cuts: int, threshold: float) -> list[int]:
    """DySeg: segment lengths of the T steps from their (T, D) unit mean tokens: a cut after step t where the cosine
    of steps t and t + 1 is below ``threshold``, and after the ``cuts - 1`` least similar pairs (ties to the lower
    pair; at most T - 1)."""
    similar = (step_means[:-1] * step_means[1:]).sum(dim=-1)  # (T - 1,)
    lowest = ranked_indices(-similar, min(cuts - 1, similar.numel())).tolist()
    below = (similar < threshold).nonzero().flatten().tolist()
    return runs_between(sorted(set(lowest) | set(below)), step_means.shape[0])


@dataclass(frozen=True)
class Shares:
    """FastVID's counts for one segment: per frame its salient and context tokens."""

    salient: list[int]
    context: list[int]


def segment_shares(inner: list[int], per_frame: int, fastvid: FastVIDSelector, tokens_per_step: int) -> Shares:
    """The official counts of a segment whose frames run in ``inner`` (its sub-segments of near-identical frames,
    cosine at least ``fastvid.keep_threshold``): ``per_frame`` tokens a frame, a ``context_share`` of them
    (at least one) context tokens. One frame keeps both; otherwise only the last frame of each sub-segment keeps
    tokens: the salient ones split evenly over the sub-segments, the context ones over every ``temporal_stride``-th
    sub-segment counted from the last (at most half a frame each)."""
    frames, half = sum(inner), tokens_per_step // 2
    context = max(int(per_frame * frames * fastvid.context_share), 1)
    salient = per_frame * frames - context
    if frames == 1:
        return Shares([salient], [context])
    salient_parts = even_split(salient, len(inner))
    context_parts = even_split(context, math.ceil(len(inner) / fastvid.temporal_stride))
    stride = fastvid.temporal_stride
    anchors = [min(context_parts[i // stride], half) if i % stride == 0 else 0 for i in range(len(inner))][::-1]
    shares = Shares([], [])
    for size, kept_salient, kept_context in zip(inner, salient_parts, anchors, strict=True):
        shares.salient.extend([0] * (size - 1) + [min(kept_salient, tokens_per_step - kept_context)])
        shares.context.extend([0] * (size - 1) + [kept_context])
    return shares


def peak_scores(tokens: Tensor, neighbours: int, noise: Tensor) -> tuple[Tensor, Tensor]:
    """DPC-KNN's (n,) density-peak scores of the (n, D) ``tokens`` and their (n, n) distances d (Euclidean /
    sqrt(D)): density ``exp(-mean d^2)`` over the ``neighbours`` nearest (itself included, at most n) plus the (n,)
    ``noise``, times the distance to the nearest denser token (the largest distance of all for the densest)."""
    squares = (tokens * tokens).sum(dim=-1)
    gram = tokens @ tokens.T
    distance = (squares[:, None] + squares[None, :] - 2 * gram).clamp(min=0).sqrt() / math.sqrt(tokens.shape[1])
    return distance_peak_scores(distance, neighbours, noise), distance


def distance_peak_scores(distance: Tensor, neighbours: int, noise: Tensor) -> Tensor:
    """:func:`peak_scores` of n tokens from their (n, n) ``distance``, however it was computed."""
    nearest = distance.topk(min(neighbours, distance.shape[0]), dim=-1, largest=False).values
    density = torch.exp(-(nearest**2).mean(dim=-1)) + noise
    denser = density[None, :] > density[:, None]  # [i, j]: j is denser than i
    parent = torch.where(denser, distance, distance.max()).min(dim=-1).values
    return parent * density


def density_peaks(tokens: Tensor, count: int, noise: Tensor) -> Tensor:
    """(count,) ascending rows of the (n, D) ``tokens`` with the highest density-peak score (:func:`peak_scores`
    over the ``NEIGHBOURS`` nearest)."""
    scores, _ = peak_scores(tokens, NEIGHBOURS, noise)
    return torch.sort(ranked_indices(scores, count)).values


def merged_context(features: Tensor, salient: Tensor, targets: Tensor, floor: float) -> tuple[Tensor, list[Tensor]]:
    """DTM of one frame's context ``targets`` in a segment's (S, D) ``features``: every token that is neither salient
    nor one of these targets joins its most cosine-similar target (the first on ties); a target with m members
    becomes ``w x + (1 - w) mean(members)``, ``w = max(1 / (m + 1), floor)``. Returns the (k, D) merged targets and
    each one's segment rows (itself first)."""
    units = F.normalize(features, dim=-1)
    members = torch.ones(features.shape[0], dtype=torch.bool, device=features.device)
    members[salient], members[targets] = False, False
    others = members.nonzero().flatten()
    choice = (units[others] @ units[targets].T).argmax(dim=1)  # (m,)
    assign = F.one_hot(choice, targets.numel()).to(features.dtype)  # (m, k)
    counts = assign.sum(dim=0)[:, None]
    weight = (1 / (counts + 1)).clamp(min=floor)
    mean = (assign.T @ features[others]) / counts.clamp(min=1)
    merged = weight * features[targets] + (1 - weight) * mean
    groups = [torch.cat([targets[j : j + 1], others[choice == j]]) for j in range(targets.numel())]
    return merged, groups


@dataclass
class SegmentOutput:
    """A segment's output tokens, in segment rows: own tokens (``rows``) and merged ones (``merged``, ``groups``);
    ``work`` the ``(candidates, context, others)`` of each frame with context tokens (``FastVIDSelector.flops``)."""

    rows: list[int]
    merged: list[Tensor]
    groups: list[Tensor]
    work: list[tuple[int, int, int]]


@register
@dataclass
class FastVIDSelector(InputSelector):
    """FastVID on a clip's merged tokens (LunarShen/FastVID ``fastvid_qwen25vl``, Qwen2.5-VL).

    ``signals.video_grid`` is the clip's (T, h, w) grid (the official "frame" is a temporal step of h x w merged
    tokens), ``features`` the (T * h * w, D) merged tokens time-major, ``step_attention`` (T * h * w,) the
    attention each merged token gets from its step's mean query in the vision tower's last block (the official
    ``frame_attn_weights``).

    DySeg (``dynamic_segments``): the steps' unit mean tokens; a cut where neighbours' cosine is below
    ``segment_threshold`` (0.84) and at the ``segments - 1`` (7) least similar pairs. Per segment
    (``segment_shares``): ``int(h w r)`` tokens a frame at retention r = budget / N, ``context_share`` (0.4) of them
    context tokens; inside a segment, frames whose cosine to the previous is at least ``keep_threshold`` (0.95) form
    sub-segments whose last frame alone keeps tokens. STPrune: a frame's salient tokens are its top
    ``step_attention``; its context tokens are density peaks (``density_peaks``) among its other tokens. DTM
    (``merged_context``, ``merge=true``): every other token of the segment joins its most similar context token of
    that frame, averaged with weight ``max(1 / (m + 1), merge_floor)`` (0.6) on the target. Output tokens keep their
    original M-RoPE positions (a merged token its target's).

    The budget: r = budget / N gives about ``T int(h w r)`` tokens, at most the budget (``fills_budget`` False: the
    official counts round down and cap each frame). A budget below T (no whole token a frame) keeps the budget's
    highest-attention tokens (the official code has no rule there). Departures: float32 arithmetic (the official
    runs in bf16); exact ties to the lower index where ``torch.topk`` leaves them to the kernel; the density's
    1e-6 noise is drawn from the run's generator (``density_noise``; the official draws from the global RNG); at
    most T - 1 DySeg cuts and at most n density neighbours (the official code fails on clips of fewer than
    ``segments`` steps and frames of fewer than 4 candidates); zero tokens normalised with an epsilon.

    Reference: LunarShen/FastVID ``fastvid_qwen25vl/lmms-eval/lmms_eval/models/qwenvlutils/modeling_qwen2_5_vl.py``
    (``Qwen2_5_VLForConditionalGeneration.forward``, the vision attention's ``frame_attn_weights``) and
    ``fastvid_qwen25vl/scripts/eval.sh`` (the defaults) at commit a40a109c.
    """

    name: ClassVar[str] = "fastvid"
    summary: ClassVar[str] = (
        "segments by frame similarity, salient tokens by tower attention, density-peak context tokens merged (FastVID)"
    )
    requires: ClassVar[frozenset[str]] = frozenset({"features", STEP_ATTENTION, VIDEO_GRID})
    fills_budget: ClassVar[bool] = False
    reference: ClassVar[Reference] = Reference(
        "FastVID: Dynamic Density Pruning for Fast Video Large Language Models (NeurIPS 2025, arXiv 2503.11187)",
        "LunarShen/FastVID",
        "fastvid_qwen25vl: the merged video tokens before the LLM, salience from the tower's last block",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "a40a109c",
        "DySeg segments (c=8, tau=0.84), per segment salient tokens by step attention and density-peak context tokens "
        "(d=0.4, p=4) merging the rest (beta=0.6), at retention budget / N",
        (),
        (
            "the retention ratio is budget / N (the official script reads 0.27 for Qwen2.5-VL); a budget below T keeps "
            "the budget's highest-attention tokens (the official code has no rule)",
            "float32 where the official runs in bf16; exact ties to the lower index where its torch.topk leaves them "
            "to the kernel; the density's 1e-6 tie noise from the run's generator",
            "at most T - 1 DySeg cuts and 4 density neighbours among at most n tokens (the official code raises on "
            "clips of fewer than 8 steps and frames of fewer than 4 candidates)",
            "Qwen2.5-VL, the one family with clips, keeps original positions and so refuses merged tokens: there "
            "merge=false runs (salient and context tokens kept, nothing merged); the official merged token takes its "
            "target's position, which the adapter does not place yet",
        ),
        "kept sets and sources identical, merged tokens within 1e-5, in all 36 random clips (3 seeds, 4 grids of 9 to "
        "24 steps, 3 budgets; segments of up to 5 sub-segments) to a loop-by-loop float64 re-derivation of the "
        "official forward without the density noise, and in a clip with it drawn alike "
        "(test_fastvid.py::test_fastvid_equals_the_rederived_forward, "
        "test_the_density_noise_is_drawn_from_the_runs_generator); the official forward's own code, run once in "
        "float32 outside the tests with the same noise draws, gives the same 36 of 36",
        half_agreement=(
            "no half path: float32; the official forward run in bf16 on CPU on the same 36 clips keeps the same set "
            "in 12 (its bf16 frame means and attention move cuts and tie ranks; measured once, not a test)"
        ),
    )
    #: the density's Grams and DTM's products, counted over the sizes the selection reports (``Selection.work_sizes``)
    flops_exact: ClassVar[bool] = True

    segments: int = option(8, Integer(1), "DySeg's c: cuts at the c - 1 least similar neighbouring steps")
    segment_threshold: float = option(0.84, Real(-1.0, 1.0), "DySeg's tau: a cut where neighbours' cosine is below it")
    keep_threshold: float = option(0.95, Real(-1.0, 1.0), "sub-segments: frames at least this similar keep one frame")
    context_share: float = option(0.4, Real(0.0, 1.0), "STPrune's d: the share of context (density-peak) tokens")
    temporal_stride: int = option(4, Integer(1), "DTM's p: context tokens on every p-th sub-segment from the last")
    merge_floor: float = option(0.6, Real(0.0, 1.0), "DTM's beta: the least weight of a context token on itself")
    merge: bool = option(True, Flag(), "merge the other tokens into the context tokens (DTM), or drop them")
    density_noise: float = option(1e-6, Real(0.0), "uniform noise added to the densities (the official 1e-6)")

    @property
    def merges(self) -> bool:  # type: ignore[override]  # the class says True: the default merges
        """Whether this instance feeds merged tokens: with ``merge`` (DTM) on."""
        return self.merge

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """Exact, from the selection's ``work.sizes``: per frame with context tokens ``(candidates c, context k,
        others m)``, the density's Gram of the c candidates (2 c^2 D) and DTM's similarities and member sums of the m
        others against the k targets (4 m k D; m = 0 without merging). None at keep-all or a budget below T."""
        width = work.feature_width
        return sum(matmul(c, width, c) + 2 * matmul(m, width, k) for c, k, m in work.sizes)

    def select(self, signals: InputSignals, budget: int, generator: torch.Generator | None = None) -> Selection:
        """FastVID's output tokens of ``signals.num_tokens`` clip tokens: ``kept`` the salient and context tokens,
        ``sources`` and ``llm_tokens`` each output token's members and (merged) feature, in clip order."""
        budget, (steps, rows, cols) = self._checked_clip(signals, budget)
        n, per_step = signals.num_tokens, rows * cols
        attention = signals.step_attention.detach().float().flatten()  # checked present above
        if budget >= n:
            return Selection(kept=torch.arange(n, dtype=torch.long))
        if budget < steps:
            return Selection(kept=torch.sort(ranked_indices(attention, budget)).values.cpu())
        features = signals.features.detach().float()
        means = F.normalize(features.reshape(steps, per_step, -1).mean(dim=1), dim=-1)
        outputs, start = [], 0
        for length in dynamic_segments(means, self.segments, self.segment_threshold):
            frames = slice(start, start + length)
            inner = dynamic_segments(means[frames], 1, self.keep_threshold) if length > 1 else [1]
            shares = segment_shares(inner, budget // steps, self, per_step)
            rows_of = slice(start * per_step, (start + length) * per_step)
            output = self._segment(features[rows_of], attention[rows_of], shares, per_step, generator)
            outputs.append((start * per_step, output))
            start += length
        return self._selection(features, outputs)

    def _segment(
        self, features: Tensor, attention: Tensor, shares: Shares, per_step: int, generator: torch.Generator | None
    ) -> SegmentOutput:
        """One segment's (S, D) tokens and (S,) attention: its salient tokens, then each frame's context tokens."""
        salient, contexts, candidate_counts = [], [], []
        for frame, (kept, context) in enumerate(zip(shares.salient, shares.context, strict=True)):
            base = frame * per_step
            top = ranked_indices(attention[base : base + per_step], kept)
            salient.append(top + base)
            if context > 0:
                rest = torch.ones(per_step, dtype=torch.bool, device=features.device)
                rest[top] = False
                candidates = rest.nonzero().flatten()
                noise = torch.rand(candidates.numel(), generator=generator) * self.density_noise
                peaks = density_peaks(features[candidates + base], context, noise.to(features.device))
                contexts.append(candidates[peaks] + base)
                candidate_counts.append(candidates.numel())
        every_salient = torch.cat(salient)
        output = SegmentOutput(every_salient.tolist(), [], [], [])
        for targets, candidate_count in zip(contexts, candidate_counts, strict=True):
            # DTM's others: the segment's tokens neither salient nor this frame's targets (none without merging)
            others = features.shape[0] - every_salient.numel() - targets.numel() if self.merge else 0
            output.work.append((candidate_count, targets.numel(), others))
            if not self.merge:
                output.rows += targets.tolist()
                continue
            merged, groups = merged_context(features, every_salient, targets, self.merge_floor)
            output.merged += list(merged)
            output.groups += groups
        return output

    def _selection(self, features: Tensor, outputs: list[tuple[int, SegmentOutput]]) -> Selection:
        """The clip's output tokens in clip order (a merged token at its target's index)."""
        entries: list[tuple[int, Tensor, Tensor]] = []
        for offset, output in outputs:
            entries += [(offset + row, features[offset + row], torch.tensor([offset + row])) for row in output.rows]
            entries += [
                (offset + int(group[0]), token, (group + offset).cpu())
                for token, group in zip(output.merged, output.groups, strict=True)
            ]
        entries.sort(key=lambda entry: entry[0])
        kept = torch.tensor([entry[0] for entry in entries], dtype=torch.long)
        work = tuple(sizes for _, output in outputs for sizes in output.work)
        if not any(output.merged for _, output in outputs):
            return Selection(kept=kept, work_sizes=work)
        tokens = torch.stack([entry[1] for entry in entries])
        return Selection(kept=kept, sources=[entry[2] for entry in entries], llm_tokens=tokens, work_sizes=work)
