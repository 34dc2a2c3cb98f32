"""PruneVid: temporal segments of a clip by DPC-KNN over its frames, static tokens merged over each segment's
frames, then DPC-KNN clusters of each segment's static tokens and of each frame's dynamic tokens merged."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from prune_audit.flop_convention import matmul
from prune_audit.pruners.arithmetic import SelectorWork
from prune_audit.pruners.base import InputSelector, Reference, Selection
from prune_audit.pruners.crop_scope import grid_budgets
from prune_audit.pruners.fastvid import peak_scores
from prune_audit.pruners.fidelity import Fidelity
from prune_audit.pruners.options import Flag, Real, option
from prune_audit.pruners.ranking import ranked_indices
from prune_audit.pruners.registry import register
from prune_audit.pruners.signals import VIDEO_GRID, InputSignals

#: the official DPC-KNN's neighbours (``k=7``), in the temporal and the spatial clustering alike
NEIGHBOURS = 7
#: the official clusters a group of tokens only above this size (``shape[1] > 14``); smaller ones pass whole
SMALL_GROUP = 14

#: a (size,) draw of the densities' tie noise
Noise = Callable[[int], Tensor]
#: ``Selection.llm_state`` key: the groups the in-LLM part (``prunevid_llm``) ranks in, each a (m,) LongTensor of
#: positions among the tokens fed (a segment's static outputs, a step's dynamic outputs; the official
#: ``static_sizes`` / ``dynamic_sizes`` / ``window_sizes``)
TOKEN_GROUPS = "prunevid_groups"
#: the paper and repository both PruneVid selectors (this stage and ``prunevid_llm``) reproduce
PAPER = "PruneVid: Visual Token Pruning for Efficient Video Large Language Models (ACL Findings 2025, arXiv 2412.16117)"
REPOSITORY = "Visual-AI/PruneVid"


def dpc_clusters(tokens: Tensor, count: int, noise: Noise) -> tuple[Tensor, Tensor]:
    """DPC-KNN of the (n, D) ``tokens`` into ``count`` clusters (``cluster_dpc_knn``): the (count,) centres, the
    highest density-peak scores first (ties to the lower index), and the (n,) cluster of each token: its nearest
    centre (the first on ties), a centre its own."""
    scores, distance = peak_scores(tokens, NEIGHBOURS, noise(tokens.shape[0]).to(tokens.device))
    centres = ranked_indices(scores, count).to(tokens.device)
    labels = distance[:, centres].argmin(dim=1)
    labels[centres] = torch.arange(centres.numel(), device=tokens.device)
    return centres, labels


def label_runs(labels: list[int]) -> list[tuple[int, int, int]]:
    """``(label, first, last)`` of each maximal run of equal ``labels``, in order."""
    runs: list[tuple[int, int, int]] = []
    for index, label in enumerate(labels):
        if runs and runs[-1][0] == label and runs[-1][2] == index - 1:
            runs[-1] = (label, runs[-1][1], index)
        else:
            runs.append((label, index, index))
    return runs


def run_length(labels: list[int], start: int, step: int) -> int:
    """How many labels equal ``labels[start]`` run from ``start`` on in direction ``step`` (-1 or 1)."""
    index = start
    while 0 <= index < len(labels) and labels[index] == labels[start]:
        index += step
    return abs(index - start)


def refined_labels(labels: list[int]) -> list[int]:
    """``refine_clusters``: each cluster keeps its longest runs of frames (every run of that length) and loses the
    others, a cluster whose runs are all single frames loses them all; each lost run, left to right, joins the
    neighbouring run (left or right, in the labels refined so far) that is longer, the left one on ties, cluster
    0 when there is none."""
    refined = list(labels)
    runs = label_runs(labels)
    for label in set(labels):
        own = [(first, last) for cluster, first, last in runs if cluster == label]
        longest = max(last - first + 1 for first, last in own)
        for first, last in own:
            if longest == 1 or last - first + 1 < longest:
                refined[first : last + 1] = [-1] * (last - first + 1)
    index = 0
    while index < len(refined):
        if refined[index] != -1:
            index += 1
            continue
        end = index
        while end < len(refined) and refined[end] == -1:
            end += 1
        left = run_length(refined, index - 1, -1) if index > 0 else 0
        right = run_length(refined, end, 1) if end < len(refined) else 0
        fill = refined[index - 1] if index > 0 and left >= right else refined[end] if end < len(refined) else 0
        refined[index:end] = [fill] * (end - index)
        index = end
    return refined


def temporal_segments(step_means: Tensor, ratio: float, noise: Noise) -> list[int]:
    """The lengths of the segments of the T steps from their (T, D) mean tokens: DPC-KNN into ``max(1, int(T
    ratio))`` clusters, refined to runs (:func:`refined_labels`), a segment per run."""
    steps = step_means.shape[0]
    _, labels = dpc_clusters(step_means, min(max(1, int(steps * ratio)), steps), noise)
    return [last - first + 1 for _, first, last in label_runs(refined_labels(labels.tolist()))]


def static_positions(frames: Tensor, threshold: float) -> Tensor:
    """(L,) whether each position of a segment's (W, L, D) frames is static: the mean cosine of its W tokens over
    the W (W - 1) ordered pairs of different frames above ``threshold`` (none in a one-frame segment)."""
    width = frames.shape[0]
    if width == 1:  # the official 0 / 0 is NaN: nothing static
        return torch.zeros(frames.shape[1], dtype=torch.bool, device=frames.device)
    total = F.normalize(frames, dim=-1).sum(dim=0)  # sum over pairs of u_w . u_t = |sum_w u_w|^2
    similarity = ((total * total).sum(dim=-1) - width) / (width * (width - 1))
    return similarity > threshold


@dataclass
class Group:
    """Tokens PruneVid clusters together: (m, D) ``features`` at (m,) ``positions`` of a step, spanning ``steps``
    (a segment's static tokens, averaged over its steps; or one step's dynamic tokens)."""

    features: Tensor
    positions: Tensor
    steps: list[int]


def segment_groups(frames: Tensor, first_step: int, threshold: float) -> list[Group]:
    """A segment's (W, L, D) frames from step ``first_step`` on as groups: its static tokens (the mean over the
    W frames), then each frame's dynamic tokens; positions in raster order, empty groups left out."""
    static = static_positions(frames, threshold)
    still, moving = static.nonzero().flatten(), (~static).nonzero().flatten()
    steps = list(range(first_step, first_step + frames.shape[0]))
    groups = [Group(frames[:, still].mean(dim=0), still, steps)]
    groups += [Group(frames[w, moving], moving, [step]) for w, step in enumerate(steps)]
    return [group for group in groups if group.positions.numel()]


@dataclass
class Output:
    """One output token: its (D,) ``token``, its ascending clip ``sources`` and the cell it is kept at without
    merging (``anchor``: a cluster's centre, a static token's, in the group's first step)."""

    token: Tensor
    sources: Tensor
    anchor: int


def group_outputs(group: Group, count: int, per_step: int, noise: Noise) -> list[Output]:
    """``count`` output tokens of ``group``: its tokens in raster order when ``count`` holds them all, otherwise
    the means of its DPC-KNN clusters, best centre first (``compute_cluster_vectors``); none at ``count`` 0."""
    if count == 0:
        return []
    steps = torch.tensor(group.steps, device=group.positions.device)
    cells = steps[:, None] * per_step + group.positions[None, :]  # (steps, m)
    if count >= group.positions.numel():
        members = [torch.tensor([i]) for i in range(group.positions.numel())]
        centres = list(range(group.positions.numel()))
    else:
        centre_rows, labels = dpc_clusters(group.features, count, noise)
        members = [(labels == j).nonzero().flatten() for j in range(count)]
        centres = centre_rows.tolist()
    return [
        Output(
            group.features[rows].mean(dim=0),
            cells[:, rows.to(cells.device)].flatten().sort().values.cpu(),
            int(cells[0, centre]),
        )
        for rows, centre in zip(members, centres, strict=True)
    ]


def label_groups(labels: list[int]) -> list[Tensor]:
    """The (m,) positions of each label among ``labels`` (one per token fed), in label order, empty ones left out."""
    positions: dict[int, list[int]] = {}
    for position, label in enumerate(labels):
        positions.setdefault(label, []).append(position)
    return [torch.tensor(positions[label], dtype=torch.long) for label in sorted(positions)]


def official_targets(sizes: list[int], cluster_ratio: float) -> list[int]:
    """Each group's official output count: ``int(m r)`` clusters (at least one) of a group above
    ``SMALL_GROUP`` tokens, every token of a smaller one; every token at ``cluster_ratio`` 0 (the budget's rule)."""
    if cluster_ratio == 0:
        return list(sizes)
    return [max(1, int(size * cluster_ratio)) if size > SMALL_GROUP else size for size in sizes]


@register
@dataclass
class PruneVidSelector(InputSelector):
    """PruneVid's stage before the language model on a clip's merged tokens (Visual-AI/PruneVid
    ``merge_frames_dynamic``; a "frame" is a temporal step of h x w merged tokens, two frames on Qwen2.5-VL).

    ``signals.video_grid`` is the clip's (T, h, w) grid, ``features`` its (T * h * w, D) merged tokens time-major
    then row-major. Segments (:func:`temporal_segments`): DPC-KNN (k = 7 neighbours, distances / sqrt(D), density
    tie noise ``density_noise``) of the T step means into ``int(T temporal_segment_ratio)`` clusters (0.25, at
    least one), refined so that each cluster is one run of steps; a segment per run. In each segment of W steps
    (:func:`segment_groups`) a position is static when its tokens' mean cosine over the W (W - 1) pairs of
    different steps exceeds ``tau`` (0.8): the static tokens become their mean over the W steps, one group; each
    step's other (dynamic) tokens form a group of their own. Each group of m tokens (:func:`group_outputs`) is
    clustered by DPC-KNN into its count of clusters, each the mean of its members (a centre joins itself, every
    other token its nearest centre); with ``merge=true`` the output is in the official order: per segment its
    static clusters, then each step's dynamic ones, each group's clusters best centre first.

    How many: ``cluster_ratio`` r in (0, 1) is the official count, ``int(m r)`` clusters of a group above 14 tokens
    (0.5 in the official scripts), every token of a smaller group, capped at the budget; a budget of N or more gives
    the official output. ``cluster_ratio`` 0 (default) derives the counts from the budget: a budget of N or more
    keeps every token, a budget of at least the groups' tokens keeps them whole, a smaller one is split over the
    groups in proportion to their sizes (largest remainder, ``crop_scope.grid_budgets``; a group's share of 0 drops
    it, a share of all its tokens keeps them unclustered). Under the budget cap the official counts are split the
    same way; ``fills_budget`` False: the output can fall short of the budget.

    ``merge=false`` (Qwen2.5-VL, whose adapter keeps original M-RoPE positions and refuses merged tokens): each
    output token is its anchor cell's own token instead (a cluster's centre, a static token at the segment's first
    step), in clip order, nothing averaged. The official LLM stage (``VTPWindowCache``: at decoder layer 10, the
    text's attention to the visual tokens, max over heads and text rows, keeps ``alpha`` 0.4 of each segment's
    static tokens and of each step's dynamic tokens, and prunes the KV cache of layers 0..10 alike) is the in-LLM
    selector ``prunevid_llm``: composed as ``prunevid+prunevid_llm`` it ranks in the groups this stage hands it
    (``Selection.llm_state[TOKEN_GROUPS]``: each group's positions among the tokens fed; none at keep-all).

    Departures: float32 (the official: the model dtype); the density noise from the run's generator (the official:
    the global RNG); exact ties to the lower index where the official torch.topk leaves them to the kernel; at most
    n neighbours and at least one cluster of steps or of a group (the official fails on clips of fewer than 7
    steps, and where int(m r) is 0); a one-step segment has no static tokens (the official divides 0 by 0); distances from the Gram matrix (the
    official ``torch.cdist``); means of a cluster summed in member order (the official: a one-hot product).

    Reference: Visual-AI/PruneVid ``models/pllava/modeling_pllava.py`` (``cluster_dpc_knn``, ``refine_clusters``,
    ``segment_lengths``, ``merge_frames_dynamic``), ``models/pllava/elastic_cache.py`` (``VTPWindowCache``) and
    ``scripts/eval.sh`` (tau 0.8, temporal_segment_ratio 0.25, cluster_ratio 0.5, selected_layer 10, alpha 0.4;
    PLLaVA, 16 frames of 12 x 12) at commit b12600c6; ModelTC/llmc ``token_reduction/prunevid.py`` (61b6f485,
    the same stage on LLaVA-OneVision, without the LLM stage) read as a second reference.
    """

    name: ClassVar[str] = "prunevid"
    summary: ClassVar[str] = (
        "segments by clustering frames, static tokens merged over a segment, DPC-KNN clusters merged (PruneVid)"
    )
    requires: ClassVar[frozenset[str]] = frozenset({"features", VIDEO_GRID})
    fills_budget: ClassVar[bool] = False
    reference: ClassVar[Reference] = Reference(
        PAPER,
        REPOSITORY,
        "merge_frames_dynamic on the clip's merged tokens before the LLM, a frame = a temporal step; the in-LLM "
        "attention stage (VTPWindowCache) is the in-LLM prunevid_llm (prunevid+prunevid_llm)",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "b12600c6",
        "segments by DPC-KNN of the step means (0.25 T clusters), static tokens (cosine > 0.8) averaged over a "
        "segment, each segment's static and each step's dynamic tokens clustered by DPC-KNN (k=7) and averaged, "
        "the budget split over those groups by size",
        ("cluster_ratio=0.5",),
        (
            "a frame is a temporal step of h x w merged tokens (two frames on Qwen2.5-VL); the official runs on "
            "PLLaVA's 16 frames of 12 x 12 pooled tokens (ModelTC/llmc's port on LLaVA-OneVision's frames)",
            "the counts follow the budget by default: a budget below the groups' tokens split over the groups by "
            "size (derived); cluster_ratio=R gives the official int(m R) clusters of groups above 14 tokens (0.5 "
            "above: the official scripts'), split the same way under a smaller budget, exact at a budget of every "
            "token",
            "the official LLM stage (VTPWindowCache at decoder layer 10: alpha=0.4 of each segment's static tokens "
            "and of each step's dynamic tokens by the text's attention, the KV cache of layers 0 to 10 alike) is "
            "the in-LLM prunevid_llm, run as prunevid+prunevid_llm (its row); prunevid alone is the stage before "
            "the LLM alone (as llmc's port)",
            "Qwen2.5-VL keeps original M-RoPE positions and so refuses merged tokens: there merge=false runs (each "
            "output its anchor cell's own token: a cluster's centre, a static token at its segment's first step, "
            "in clip order); merged tokens, where a family takes them, are in the official order",
            "float32 where the official runs in the model dtype; the density's 1e-6 tie noise from the run's "
            "generator; exact ties to the lower index where its torch.topk leaves them to the kernel; at most n "
            "neighbours and at least one cluster (the official fails on clips of fewer than 7 steps); a one-step "
            "segment has no static tokens (the official divides 0 by 0)",
        ),
        "output tokens, their sources and merged features (within 1e-5) identical in all 12 random clips at the "
        "official ratio and all 36 at budgets (3 seeds, 4 grids of 8 to 16 steps of 30 to 64 tokens, 3 budgets; "
        "static groups, groups of at most 14 tokens and one-step segments among them) to a float64 transcription of "
        "merge_frames_dynamic without the density noise "
        "(test_prunevid.py::test_official_ratio_equals_the_rederived_merge_frames_dynamic, "
        "test_budget_split_equals_the_rederived_groups_clustered); the official functions' own code, run once in "
        "float32 outside the tests with the same noise draws, gives the same 12 of 12",
        half_agreement=(
            "no half path: float32; the official code run in bf16 on CPU on the same 12 clips gives the same output "
            "counts in 12 and the same tokens (within 3e-2) in 2 (bf16 densities swallow the 1e-6 noise and tie; "
            "measured once, not a test)"
        ),
    )
    #: the DPC-KNN Grams, counted over the sizes the selection reports (``Selection.work_sizes``)
    flops_exact: ClassVar[bool] = True

    tau: float = option(0.8, Real(-1.0, 1.0), "static tokens: mean cosine over a segment's frames above it")
    temporal_segment_ratio: float = option(
        0.25, Real(0.0, 1.0, open_low=True), "segment clusters: int(T x ratio) of the T steps (at least one)"
    )
    cluster_ratio: float = option(
        0.0,
        Real(0.0, 1.0, open_high=True),
        "0: counts from the budget; r in (0, 1): the official int(m r) clusters of a group above 14 tokens, capped",
    )
    merge: bool = option(True, Flag(), "average static tokens and clusters (official), or keep their anchor cells")
    density_noise: float = option(1e-6, Real(0.0), "uniform noise added to the densities (the official 1e-6)")

    @property
    def merges(self) -> bool:  # type: ignore[override]  # the class says True: the default merges
        """Whether this instance feeds merged tokens: with ``merge`` on."""
        return self.merge

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """Exact, from the selection's ``work.sizes``: ``(n,)`` for each DPC-KNN run (the T step means', then each
        group clustered into fewer clusters than its n tokens), each a Gram of its n tokens (2 n^2 D). None at
        keep-all."""
        return sum(matmul(n, work.feature_width, n) for (n,) in work.sizes)

    def select(self, signals: InputSignals, budget: int, generator: torch.Generator | None = None) -> Selection:
        """PruneVid's output tokens of ``signals.num_tokens`` clip tokens: with ``merge`` the (M, D) ``llm_tokens``
        and each one's ``sources`` in the official order, ``kept`` the one-cell ones; without, the ascending
        ``kept`` anchor cells."""
        budget, (steps, rows, cols) = self._checked_clip(signals, budget)
        n, per_step = signals.num_tokens, rows * cols
        if budget >= n and self.cluster_ratio == 0:
            return Selection(kept=torch.arange(n, dtype=torch.long))
        frames = signals.features.detach().float().reshape(steps, per_step, -1)
        noise: Noise = lambda size: torch.rand(size, generator=generator) * self.density_noise  # noqa: E731
        groups, start = [], 0
        for length in temporal_segments(frames.mean(dim=1), self.temporal_segment_ratio, noise):
            groups += segment_groups(frames[start : start + length], start, self.tau)
            start += length
        sizes = [group.positions.numel() for group in groups]
        counts = grid_budgets(budget, official_targets(sizes, self.cluster_ratio))
        per_group = [group_outputs(group, count, per_step, noise) for group, count in zip(groups, counts)]
        # the DPC-KNN runs: the step means', then each group's clustered into fewer outputs than its tokens
        work = ((steps,), *((size,) for size, count in zip(sizes, counts) if 0 < count < size))
        outputs = [out for outs in per_group for out in outs]
        labels = [index for index, outs in enumerate(per_group) for _ in outs]
        if not self.merge:  # fed in clip order: the groups' positions follow the sorted anchors
            order = sorted(range(len(outputs)), key=lambda i: outputs[i].anchor)
            kept = torch.tensor([outputs[i].anchor for i in order], dtype=torch.long)
            state = {TOKEN_GROUPS: label_groups([labels[i] for i in order])}
            return Selection(kept=kept, llm_state=state, work_sizes=work)
        sources = [out.sources for out in outputs]
        kept = torch.tensor(sorted(int(source[0]) for source in sources if source.numel() == 1), dtype=torch.long)
        tokens = torch.stack([out.token for out in outputs])
        state = {TOKEN_GROUPS: label_groups(labels)}  # fed in output order
        return Selection(kept=kept, sources=sources, llm_tokens=tokens, llm_state=state, work_sizes=work)
