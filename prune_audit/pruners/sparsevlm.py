"""SparseVLM: progressive pruning by the attention of text "raters" chosen from the input embeddings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, get_args

import torch
from torch import Tensor

from prune_audit.pruners.arithmetic import SelectorWork, matmul
from prune_audit.pruners.base import (
    MODEL_ATTENTIONS,
    PositionMode,
    Reference,
    Stage,
    TokenMerge,
    ranked_indices,
    rounded_to,
)
from prune_audit.pruners.fidelity import Fidelity, random_agreement
from prune_audit.pruners.options import Choice, Flag, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import (
    REFERENCE_DEPTH,
    SIGNAL_LAYERS,
    ScheduledSelector,
    merge_stages,
    nearest_setting,
    scale_layers,
    solve_schedule,
)
from prune_audit.pruners.signals import LayerSignals

SPARSEVLM_LAYERS = (2, 6, 15)  # the layers whose attention scores; the reference prunes their outputs
# tokens kept after each stage, score.py of the reference (RETAIN_TOKN)
SPARSEVLM_COUNTS = {64: (66, 30, 17), 96: (238, 48, 26), 128: (303, 110, 36), 192: (300, 200, 110)}
RECYCLE_SHARE = 0.3  # the share of the pruned tokens (best by relevance) that recycling clusters
DENSITY_NOISE = 1e-6  # scale of the density tie-break noise (the reference's, drawn unseeded there)
NOISE_SEED = 0  # seed of that noise here, so records are reproducible


def recycled_selection(pruned: int) -> int:
    """Pruned tokens recycling clusters: ``int(0.3 pruned) + 1`` (0 when nothing is pruned)."""
    return int(pruned * RECYCLE_SHARE) + 1 if pruned > 0 else 0


def recycled_tokens(pruned: int) -> int:
    """Cluster tokens inserted when ``pruned`` tokens leave: ``int(selected / 10) + 1`` (0 when none)."""
    selected = recycled_selection(pruned)
    return int(selected / 10) + 1 if selected else 0


def recycled_tokens_per_layer(stages: Sequence[Stage], num_layers: int, num_visual: int) -> list[int]:
    """Visual tokens in the input of each decoder layer when every stage also inserts its recycled tokens."""
    counts, alive, pending = [], num_visual, sorted(stages, key=lambda stage: stage.layer)
    for layer in range(num_layers):
        while pending and pending[0].layer <= layer:
            keep = min(alive, pending.pop(0).keep)
            alive = keep + recycled_tokens(alive - keep)
        counts.append(alive)
    return counts


def recycled_average(stages: Sequence[Stage], num_layers: int, num_visual: int) -> float:
    """The realised layer-average number of visual tokens of a schedule with recycling."""
    return sum(recycled_tokens_per_layer(stages, num_layers, num_visual)) / num_layers


def pairwise_distances(points: Tensor) -> Tensor:
    """(N, N) L2 distances of (N, C) ``points`` divided by sqrt(C), from exact differences row by row."""
    return torch.stack([(point - points).norm(dim=-1) for point in points]) / points.shape[-1] ** 0.5


def cluster_and_merge(points: Tensor, clusters: int, noise: Tensor) -> tuple[Tensor, Tensor]:
    """DPC-kNN clustering and per-cluster average, as SparseVLM's ``cluster_and_merge`` (utils.py).

    Distances ``d`` are pairwise L2 / sqrt(C); density ``rho_i = exp(-mean of d_ij^2 over
    the k = clusters nearest j, i itself included) + noise_i``; ``delta_i`` is the distance
    to the nearest point of higher density (the largest distance for the densest); the
    ``clusters`` points of largest ``rho * delta`` are the centres, in that order (ties to
    the lower index); every point joins its nearest centre (ties to the earlier centre),
    each centre its own cluster; a merged token is ``sum x_i / (count + 1e-6)`` over its
    cluster, the reference's average.

    Args:
        points: (N, C) float hidden states; N >= clusters >= 1.
        noise: (N,) added to the density (the reference: unseeded ``rand * 1e-6``).

    Returns:
        merged (clusters, C) and assignment (N,) cluster index of every point.
    """
    distances = pairwise_distances(points)
    nearest = torch.topk(distances, k=clusters, dim=-1, largest=False).values
    density = (-(nearest**2).mean(dim=-1)).exp() + noise
    denser = density[None, :] > density[:, None]
    parent = torch.where(denser, distances, distances.max()).min(dim=-1).values
    centres = ranked_indices(parent * density, clusters)
    assignment = distances[centres].argmin(dim=0)
    assignment[centres] = torch.arange(clusters)
    counts = torch.zeros(clusters).index_add_(0, assignment, torch.ones(len(points))) + 1e-6
    weighted = points * (1.0 / counts[assignment])[:, None]
    return torch.zeros(clusters, points.shape[-1]).index_add_(0, assignment, weighted), assignment


def rater_flops(work: SelectorWork) -> int:
    """The raters' products, once per question (SparseVLM and its v2.0): visual x text embedding products at the
    first stage that scores (one that drops tokens; recycling's clustering is not counted)."""
    scoring = [alive for alive, after in work.stages if 0 < after < alive]
    return matmul(scoring[0], work.hidden, work.text_rows) if scoring else 0


def select_raters(embeddings: Tensor, text_embeddings: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """(T,) bool: the text tokens whose relevance to the image is above the mean.

    ``P = softmax over text of V T^T`` (V: (n, D) visual, T: (T, D) text input
    embeddings), ``w = mean over visual tokens of P``; raters are ``w > mean(w)``.
    If no token is above the mean (all equally relevant) every text token rates.
    ``dtype`` (the model's half dtype under ``score_dtype="model"``): as the official code computes
    them in it, ``V T^T``, ``P``, ``w`` and ``mean(w)`` each rounded to it (reductions accumulated in
    float32); None: float32 throughout.
    """
    if dtype is None:
        relevance = torch.softmax(embeddings.detach().float() @ text_embeddings.detach().float().T, dim=-1).mean(dim=0)
        raters = relevance > relevance.mean()
    else:
        logits = rounded_to(embeddings.detach().float() @ text_embeddings.detach().float().T, dtype)
        relevance = rounded_to(rounded_to(torch.softmax(logits, dim=-1), dtype).mean(dim=0), dtype)
        raters = relevance > rounded_to(relevance.mean(), dtype)
    return raters if bool(raters.any()) else torch.ones_like(raters)


@register
@dataclass
class SparseVLMSelector(ScheduledSelector):
    """SparseVLM v1.5 without recycling (Zhang et al., ICML 2025; Gumpest/SparseVLMs, branch main).

    Raters: chosen once per question from the LLM input embeddings of the visual and
    the text tokens after the image (question and template suffix), see
    :func:`select_raters`; kept in ``state`` so later stages use the same raters.
    Score at each stage: attention probabilities of the rater rows, mean over heads
    and raters, to each alive visual token; keep the top ``keep``. Positions are
    compacted (v1.5 truncates ``position_ids``).

    Scoring layers 2, 6, 15. ``signal_layer="previous"`` (default, reference): layer
    ``l`` runs on all tokens, its own attention probabilities score, and its *output*
    is pruned (stages at the inputs of layers 3, 7, 16). ``"current"``: the stage is at
    the input of layer ``l``, scored by layer ``l``'s probe there (tokens leave one
    layer earlier). ``budget_rule="paper"``: the reference's counts 192 -> 300/200/110,
    128 -> 303/110/36, 96 -> 238/48/26, 64 -> 66/30/17, realising 202.75 / 140.81 / 79.19
    for 192 / 128 / 64 on 32 layers x 576 tokens with the reference semantics (188.19 /
    123.94 / 61.72 with ``"current"``). ``budget_rule="average"`` (default): the nearest
    of those as a shape, solved so the realised average matches the budget.
    ``score_dtype="model"`` (a half model dtype): as the reference computes in it, the raters from the
    rounded input embeddings (:func:`select_raters`), the attention by the reference's own
    ``scaled_dot_product_attention`` (``model_attention="scaled"``, default: ``q.k`` rounded, multiplied by
    ``1/sqrt(d)`` in the model dtype, softmax of the half logits; ``"eager"``: LlamaAttention's eager
    recipe, as before this option existed, see ``DecoderProbe.probabilities``), the head mean rounded, then
    the rater mean rounded; ``ties="topk"`` ranks those half scores with ``torch.topk``.

    ``recycle=true`` (the reference's v1.5 default; off by default here so records of
    pure pruning stay as they were): at each stage the ``int(0.3 p) + 1`` of the ``p``
    pruned tokens with the highest relevance, best first, are clustered by
    :func:`cluster_and_merge` on their hidden states at the stage (layer l's output
    under ``signal_layer="previous"``) into ``int(selected / 10) + 1`` tokens, inserted
    after the kept visual tokens; they are visual tokens for later stages (scored,
    pruned or merged again). Stage ``keep`` counts the kept tokens before recycling;
    the realised layer averages on 32 x 576 with the paper rule are 206.50 / 145.41 /
    82.25 for 192 / 128 / 64 (spec: ~206 / 145 / 82); the average rule solves the counts
    so that the average *with* the recycled tokens matches the budget.

    Deviations: (1) exactly ``keep`` tokens are kept (the reference caps at ``n - 1``);
    ties to the lower index. (2) Recycling: the density noise that the reference draws
    unseeded (``rand * 1e-6``) is drawn from a generator seeded with 0 for every
    stage, so the clusters are reproducible; clustering runs in float32 (the reference
    in the model dtype, where the noise rounds away below fp16's resolution, density ties
    fall to the GPU ``topk``'s unspecified order and the merged sums are atomic half-precision
    adds whose order varies between runs: nothing deterministic reproduces those).
    """

    name: ClassVar[str] = "sparsevlm"
    summary: ClassVar[str] = "attention of text raters chosen from input embeddings, layers 2/6/15 (+ recycling)"
    requires: ClassVar[frozenset[str]] = frozenset({"text_probs", "embeddings", "text_embeddings"})
    reference: ClassVar[Reference] = Reference(
        "SparseVLM: Visual Token Sparsification for Efficient Vision-Language Model Inference, ICML 2025",
        "Gumpest/SparseVLMs",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "26a5f488",
        "raters from input embeddings; layer l's attention prunes its output (signal_layer=previous); average rule; "
        "no token recycling",
        ("budget_rule=paper", "recycle=true", "score_dtype=model", "ties=topk"),
        (
            "recycling is off by default so that pure-pruning records stay comparable with the other selectors; "
            "recycle=true inserts the reference's DPC-kNN cluster tokens after the kept ones (merged tokens and "
            "their grid sources are recorded in merged_stages and count towards retention)",
            "recycle=true: the density tie-break noise (rand x 1e-6, unseeded in the official code) is drawn from a "
            "generator seeded with 0, so runs are reproducible; clustering runs in float32, also under "
            "score_dtype=model (the official code clusters in the model dtype, where its 1e-6 noise rounds away below "
            "fp16's resolution, density ties fall to the GPU topk's unspecified order and the merged sums are atomic "
            "half-precision adds whose order varies between runs, so no deterministic computation reproduces them); "
            "ties in relevance among the pruned tokens are ordered by the lower index (torch.topk leaves them "
            "unspecified)",
            "exactly keep tokens (the official code caps at n - 1); ties to the lower index by default; ties=topk "
            "ranks with torch.topk on the half scores as the official code (its order among exact ties is the "
            "kernel's: use it to reproduce a run on the same hardware, the default for deterministic audits)",
            "score_dtype=model computes as the official code does in the model dtype: raters from the rounded input "
            "embeddings (V T^T, its softmax, the visual mean and its mean each rounded), the attention by the "
            "official utils.scaled_dot_product_attention (model_attention=scaled, default: q.k rounded with float32 "
            "accumulation as on GPU, times 1/sqrt(d) in the model dtype, softmax of the half logits on the model's "
            "device; model_attention=eager keeps LlamaAttention's eager recipe, / sqrt(d) and a float32 softmax "
            "rounded, as before the option existed: in fp16 the two scalings differ in about 0.1 % of the logits), "
            "the head mean rounded, then the rater mean rounded",
        ),
        random_agreement(
            30,
            "test_fidelity.py::test_attention_and_variation_scorers_reproduce_the_official_top_k",
            "one stage; first-stage kept sets identical to the top-k of the previous layer's eager rater attention "
            "in 2 of 2 prompts on the tiny LLaVA (test_fidelity.py); paper rule realises "
            "202.75 / 140.81 / 79.19 (test_schedule.py); recycle=true: kept sets, cluster members and merged "
            "vectors (bit for bit) identical to a re-implementation of the official cluster_and_merge in 30 of "
            "30 random stages at 576 tokens x 4096 dims with distinct relevances "
            "(test_sparsevlm.py::test_recycling_reproduces_the_official_cluster_and_merge; with float ties in "
            "relevance 29 of 30: one tie reorders the points summed into one cluster), paper rule with "
            "recycling realises 206.50 / 145.41 / 82.25 (test_recycling.py)",
        ),  # fmt: skip
        30,
        "fp16 30 of 30, bf16 30 of 30 random cases, and 10 of 10 each with a quarter of the keys duplicated "
        "(whole attention columns tied) and with integer keys (many equal probabilities), first stage with score_dtype=model, ties=topk against the official "
        "raters and attn_postprocess_topk written out in half on CPU from the official half attention "
        "(test_sparsevlm.py::test_sparsevlm_model_dtype_reproduces_the_official_half_precision_scores); "
        "score_dtype=model with lower-index ties 19 and 5 of 30, float32 scores 16 and 0 of 30; the probe's "
        "model_attention=scaled rows are the official scaled_dot_product_attention of a half tiny LLaVA bit for "
        "bit with q.k accumulated in float32 as on GPU "
        "(test_sparsevlm.py::test_scaled_attention_is_the_official_sparsevlm_attention_of_a_half_model); on CPU "
        "the official half q @ k^T GEMM may round a few dot products differently, as many as the CPU's kernels make "
        "(`python -m benchmarks.half_kernels`); kept sets still 30 of 30 against it (test_fidelity.py::test_fastv_"
        "and_pdrop_keep_the_official_set_despite_the_cpu_fp16_gemm)",
        {"fp16": 30, "bf16": 30},
    )

    flops_exact: ClassVar[bool] = True

    reference_counts: ClassVar[Mapping[int, Sequence[int]]] = SPARSEVLM_COUNTS

    positions: PositionMode = option(
        "compact", Choice(get_args(PositionMode)), "position ids after pruning (v1.5 compacts)"
    )
    signal_layer: str = option(
        "previous", Choice(SIGNAL_LAYERS), "prune layer l's output by its attention (reference) or its input by a probe"
    )
    recycle: bool = option(False, Flag(), "merge the best pruned tokens into DPC-kNN cluster tokens (reference v1.5)")
    model_attention: str = option(
        "scaled", Choice(MODEL_ATTENTIONS), "attention under score_dtype=model: the reference's own (scaled) or eager"
    )

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        return rater_flops(work)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.recycle:  # the clusters average the pruned tokens' hidden states
            self.requires = type(self).requires | {"hidden_states"}  # type: ignore[misc]  # an instance's own (Selector.requires_on)

    @property
    def reference_layers(self) -> tuple[int, ...]:  # type: ignore[override]
        """Stage layers (inputs) on the 32-layer reference: after the scoring layers, or at them."""
        shift = 1 if self.signal_layer == "previous" else 0
        return tuple(layer + shift for layer in SPARSEVLM_LAYERS)

    def score(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        half = self.ranking_dtype(signals.model_dtype)
        if "raters" not in state:
            state["raters"] = select_raters(signals.embeddings, signals.text_embeddings, half)
        rows = signals.text_probs.detach().float()[:, state["raters"], :]  # (H, raters, n)
        if half is None:
            return rows.mean(dim=(0, 1))
        # the reference rounds the head mean of its half attention, then takes the rater mean
        return rounded_to(rows.mean(dim=0), half).mean(dim=0)

    def merge(self, stage: Stage, signals: LayerSignals, state: dict[str, Any], kept: Tensor) -> TokenMerge | None:
        """The recycled cluster tokens of ``stage`` (None without ``recycle`` or when nothing is pruned)."""
        pruned = torch.ones(signals.num_alive, dtype=torch.bool)
        pruned[kept] = False
        pruned = torch.nonzero(pruned).flatten()
        if not self.recycle or pruned.numel() == 0:
            return None
        inputs = self.inputs(signals)
        relevance = self.model_precision(self.score(stage, inputs, state), signals)
        selected = pruned[ranked_indices(relevance[pruned], recycled_selection(pruned.numel()))]
        noise = torch.rand(selected.numel(), generator=torch.Generator().manual_seed(NOISE_SEED)) * DENSITY_NOISE
        clusters = recycled_tokens(pruned.numel())
        merged, assignment = cluster_and_merge(inputs.hidden_states.float()[selected], clusters, noise)
        return TokenMerge(merged, [torch.sort(selected[assignment == c]).values for c in range(clusters)])

    def solved_stages(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        """The average rule; with ``recycle`` the kept counts are solved so the average *with* recycled tokens
        matches, refused when the closest is more than one token away (a budget too small for recycling)."""
        if not self.recycle:
            return super().solved_stages(num_layers, num_visual, budget)
        layers, shape = merge_stages(
            scale_layers(self.reference_layers, REFERENCE_DEPTH, num_layers),
            nearest_setting(self.reference_counts, budget, num_visual),
        )

        def stages_for(target: float) -> list[Stage]:
            return solve_schedule(layers, shape, num_layers, num_visual, target)

        best = stages_for(budget)  # refuses a budget below what the layers before the first stage use
        low, high = layers[0] * num_visual / num_layers, float(budget)
        for _ in range(40):  # the recycled average grows with the target: bisect it
            middle = (low + high) / 2
            stages = stages_for(middle)
            average = recycled_average(stages, num_layers, num_visual)
            if abs(average - budget) < abs(recycled_average(best, num_layers, num_visual) - budget):
                best = stages
            low, high = (middle, high) if average < budget else (low, middle)
        realised = recycled_average(best, num_layers, num_visual)
        if abs(realised - budget) > 1:
            raise ValueError(
                f"with recycle=true the closest realised average to budget {budget} on {num_layers} layers x "
                f"{num_visual} tokens is {realised:.2f}; raise the budget or use recycle=false"
            )
        return best
