"""FrameFusion: merge each token into the same-position token of the previous frame in the first LLM layers, then
prune the rest by attention, to a compute budget (video)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from prune_audit.pruners.base import Reference, Stage, TokenMerge, validate_budget
from prune_audit.pruners.fidelity import Fidelity
from prune_audit.pruners.options import Integer, Real, option
from prune_audit.pruners.ranking import ranked_indices, top_k_indices
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import ScheduledSelector
from prune_audit.pruners.signals import VIDEO_GRID, LayerSignals

#: the similarity the official code gives the first token of each patch position's chain (never merged)
CHAIN_START = -2.0
#: the state keys of one prompt's run through the stages
CELLS, COST, SPARSITY, MERGING_DONE, PRUNING_DONE, GROUPS = "cells", "cost", "sparsity", "merged", "pruned", "groups"


def pruning_ratio(sparsity: Sequence[float], cost: float, num_layers: int) -> float:
    """The official ``_compute_pruning_ratio``: the share of the current visual tokens to remove so that every layer
    after the ``len(sparsity)`` merging ones keeps the same count and the layers together process ``cost`` of the
    dense visual tokens (``cost`` = the budget's layer average / N). Each merging layer kept ``1 - sparsity[i]`` of
    its input; 0 when the remaining layers could afford every token. Where the merges already spent the cost (the
    official raises ``The cost is too small``) the ratio is 1: nothing more can be afforded."""
    kept, spent = 1.0, 0.0
    for share in sparsity:
        kept *= 1 - share
        spent += kept
    remain = num_layers * cost - spent
    if remain < 0:
        return 1.0
    per_layer = remain / ((num_layers - len(sparsity)) * kept)
    return 0.0 if per_layer > 1 else 1 - per_layer


def patch_chains(cells: Tensor, frame_tokens: int) -> Tensor:
    """(m,) positions among the alive tokens in the official ``token_index_by_patch`` order: patch position
    (``cell % frame_tokens``) first, then the alive order (time) within it; tokens without a cell (-1) are left out.

    Args:
        cells: (n,) the grid cell of each alive token (a merged token: its chain head's), -1 for none.
        frame_tokens: h * w tokens of one temporal step.
    """
    on_grid = torch.nonzero(cells >= 0).flatten()
    patch = cells[on_grid] % frame_tokens
    return on_grid[torch.sort(patch, stable=True).indices]


def chain_similarity(hidden: Tensor, order: Tensor, patch: Tensor) -> Tensor:
    """(m,) float32 cosine similarity of each token of ``order`` to the one before it in its patch position's
    chain (the same position one temporal step earlier among the alive tokens); ``CHAIN_START`` for each chain's
    first token. ``hidden``: (n, D) states of the alive tokens; ``patch``: (m,) patch position along ``order``."""
    states = hidden.float()[order]
    similarity = torch.nn.functional.cosine_similarity(states[1:], states[:-1], dim=-1)
    similarity = torch.where(patch[1:] == patch[:-1], similarity, torch.full_like(similarity, CHAIN_START))
    return torch.cat([similarity.new_full((1,), CHAIN_START), similarity])


def merge_groups(order: Tensor, flagged: Tensor) -> list[Tensor]:
    """The official ``merge_tokens_and_get_mask`` groups: every run of consecutive flagged chain positions merges
    into the chain token just before the run. Returns, per group, its (1 + r,) alive positions, head first.

    Args:
        order: (m,) alive positions in chain order; flagged: (f,) ascending chain positions to merge away (never a
            chain's first, whose similarity is ``CHAIN_START``).
    """
    groups: list[list[int]] = []
    previous = -2
    for position in flagged.tolist():
        if position != previous + 1:
            groups.append([int(order[position - 1])])
        groups[-1].append(int(order[position]))
        previous = position
    return [torch.tensor(group, dtype=torch.long) for group in groups]


@register
@dataclass
class FrameFusionSelector(ScheduledSelector):
    """FrameFusion (Fu et al., ICCV 2025, arXiv 2501.01986; thu-nics/FrameFusion) on a video clip's tokens inside the LLM.

    ``signals.video_grid`` is the clip's (T, h, w) token grid; the alive tokens are time-major, so token ``i``'s
    patch position is ``i % (h * w)`` and its predecessor in that position's chain is the alive token of the same
    position in the latest earlier temporal step (a merged token keeps its chain head's cell); the official Qwen2-VL
    path (``framefusion/models/qwenvl/modeling_qwen2_vl.py``) sets the same patch types, ``i % (h * w)`` over the
    merged video tokens.

    Merging (``FrameFusion.forward`` while not ``finish_merging``), once per stage from layer 0: the cosine
    similarity of each token's hidden state to its chain predecessor; the tokens at or above
    ``similarity_lower_bound`` (share ``r`` of the current visual tokens) merge into their predecessors: a run of
    consecutive merged chain tokens joins the token before the run, which becomes the plain mean of itself and the
    run in its own place and position (the records carry it as a merged token with all its cells). The cost model
    bounds it: with ``p`` = :func:`pruning_ratio` of the shares merged so far, ``r < p`` merges them all and records
    ``r`` (below ``ratio_lower_bound`` merging ends, and the next stage prunes); ``r >= p`` merges only the
    ``int(p * n)`` most similar and ends both merging and pruning.

    Pruning (the stage after merging ended): the head-mean attention of the last ``attention_rows`` prompt rows
    (softmax over every key, raw probabilities) to each alive visual token, mean over the rows; the top
    ``round(n (1 - p))`` stay, ``p`` = :func:`pruning_ratio` of all recorded shares. Later stages keep everything.

    Budget: the official ``cost`` is the share of the dense visual tokens the LLM layers process on average, so
    ``cost = budget / N`` and the realised layer average is the budget up to rounding (the process ends with the
    cost spent) or below it (the cost model found no more to remove). Its counts depend on the clip, so the schedule
    is one stage at every layer, each carrying the budget (its realised average where layer 0's merge reaches its
    bound); stages after the process ended keep every token. ``budget_rule`` is the same under both rules: the
    official parameter is this average. A budget of every token merges and prunes nothing (dense).

    Only a clip has frames: on a still image the adapter gives no ``video_grid`` and FrameFusion is refused in one
    line, as EVS.

    Reference: thu-nics/FrameFusion ``framefusion/main.py`` (``FrameFusion.forward``,
    ``compute_similarity_and_token_index_by_patch``, ``merge_tokens_and_get_mask``, ``_compute_pruning_ratio``) and
    ``framefusion/models/qwen2/modeling_qwen2_vl.py`` (where it runs) at commit fbec1d2e; defaults of
    ``apply_framefusion`` in its README: cost 0.3, similarity 0.6 (the paper tunes it per model), ratio 0.1;
    ``scaled_dot_product_attention(num=4)``: the last 4 query rows.

    Differences (stage machinery: stages act at a layer's input): the official merges at layer 0's input and then
    after each layer's attention (before its MLP), here at each layer's input (the similarity of the next merge
    reads that layer's output, after its MLP; layer 0 is exact); the official prunes after the attention of the
    layer after the last merge with that layer's attention, here at the next layer's input with that layer's own
    attention on the same tokens (a stage at layer 0 leaves no previous layer's attention to read); its cost model
    hard-codes 28 layers (its Qwen2 7B models), here the model's depth; the similarity is float32 (official: the
    model dtype), ties of the bounded merge go to the lower chain position (``torch.topk``: unspecified), and a
    prompt with fewer than ``attention_rows`` text rows after the clip averages those it has. Where the merges spent
    the cost (the official raises), merging stops and the next stage prunes every visual token. Every stage reads
    the hidden states and the last rows' attention (the accounting counts that signal work at every layer; the
    official forms the attention once, at its pruning layer).
    """

    name: ClassVar[str] = "framefusion"
    summary: ClassVar[str] = (
        "merge same-position tokens of adjacent frames by similarity in the first layers, then prune by attention "
        "(FrameFusion, video)"
    )
    requires: ClassVar[frozenset[str]] = frozenset({"hidden_states", "text_probs", VIDEO_GRID})
    reference: ClassVar[Reference] = Reference(
        "FrameFusion: Combining Similarity and Importance for Video Token Reduction on Large Vision Language Models "
        "(ICCV 2025, arXiv 2501.01986)",
        "thu-nics/FrameFusion",
        "framefusion/main.py FrameFusion.forward inside the Qwen2(-VL) decoder layers, cost 0.3, similarity 0.6",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "fbec1d2e",
        "merging of same-position tokens of adjacent temporal steps at cosine >= 0.6 from layer 0 while the merged "
        "share is >= 0.1, bounded by the cost model; then the last 4 prompt rows' attention prunes to the cost "
        "(= budget / N); float32",
        (),
        (
            "stages act at layer inputs: merges after layer 0 read each layer's output (official: after its "
            "attention, before its MLP), and the pruning reads the attention of the layer after the official's on "
            "the same tokens",
            "the cost model uses the model's depth (official: 28 layers, its Qwen2 7B models)",
            "similarity in float32 (official: the model dtype); bounded-merge ties to the lower chain position",
            "where the merges spent the cost (official: ValueError) the next stage prunes every visual token",
        ),
        "kept sets and merged states identical at every stage in all 36 random clips (3 seeds x 3 grids x 4 "
        "budgets, T 4..8, h x w 6x6..8x10, D 64..128) to a re-derivation of the official forward called once per "
        "stage (test_framefusion.py::test_framefusion_equals_the_rederived_official_forward); on the tiny "
        "Qwen2.5-VL clip keep-all equals dense and a repeated frame's layer-0 merge reaches the records "
        "(tests/models/test_qwen2_5_vl_video.py::test_framefusion_on_a_clip)",
    )
    #: cosine similarities and means are elementwise (no matrix product); ranking counts zero
    flops_exact: ClassVar[bool] = True

    similarity_lower_bound: float = option(
        0.6, Real(-1.0, 1.0), "cosine at or above which a token merges into its previous-frame twin"
    )
    ratio_lower_bound: float = option(
        0.1, Real(0.0, 1.0), "merging ends once a layer merges a smaller share of the visual tokens"
    )
    attention_rows: int = option(4, Integer(1), "last prompt rows whose attention ranks the pruning")

    def solved_stages(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        """One stage at every layer, each carrying ``min(budget, N)``: the counts follow from the clip."""
        return [Stage(layer, min(validate_budget(budget), num_visual)) for layer in range(num_layers)]

    def paper_stages(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        """The official parameter is the budget's share (``cost``): the same stages as the average rule."""
        return self.solved_stages(num_layers, num_visual, budget)

    def prune(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        """(k,) ascending positions among the alive tokens that survive ``stage``: a merge step, the pruning step,
        or everything once both ended (``state`` carries the run from stage to stage)."""
        self._check_signals(signals)
        n = signals.num_alive
        steps, rows, cols = signals.video_grid  # checked present above
        if steps * rows * cols != signals.grid[0] * signals.grid[1]:
            raise ValueError(f"video grid {steps}x{rows}x{cols} does not hold the clip's grid {signals.grid}")
        if COST not in state:  # the first stage: every token of the clip alive
            state.update({COST: stage.keep / max(n, 1), SPARSITY: [], MERGING_DONE: False, PRUNING_DONE: False})
            state[CELLS] = torch.where(signals.alive >= 0, signals.alive, -1)
        state[GROUPS] = []
        if len(state[CELLS]) != n:
            raise ValueError(f"framefusion's state holds {len(state[CELLS])} tokens, the stage {n}")
        if state[PRUNING_DONE]:
            return torch.arange(n, dtype=torch.long)
        kept = self._pruned(signals, state) if state[MERGING_DONE] else self._merged(signals, state)
        state[CELLS] = state[CELLS][kept]
        return kept

    def _pruned(self, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        """The official pruning step: the top ``round(n (1 - p))`` by the last rows' attention."""
        state[PRUNING_DONE] = True
        n = signals.num_alive
        ratio = pruning_ratio(state[SPARSITY], state[COST], signals.num_layers)
        probs = self.inputs(signals).text_probs.detach().float()  # (H, T, n)
        scores = self.model_precision(probs[:, -self.attention_rows :, :].mean(dim=(0, 1)), signals)
        return top_k_indices(scores, round(n * (1 - ratio)), self.ties, self.ranking_dtype(signals.model_dtype))

    def _merged(self, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        """One official merge step; the groups wait in ``state`` for :meth:`merge`."""
        n = signals.num_alive
        cells: Tensor = state[CELLS]
        _, rows, cols = signals.video_grid  # checked in prune
        order = patch_chains(cells, rows * cols)
        frame_tokens = order.numel()
        bound = pruning_ratio(state[SPARSITY], state[COST], signals.num_layers)
        if frame_tokens == 0 or bound >= 1:  # nothing to merge, or the cost is spent: prune next
            state[MERGING_DONE] = True
            return torch.arange(n, dtype=torch.long)
        similarity = chain_similarity(signals.hidden_states.detach(), order, cells[order] % (rows * cols))
        flagged = torch.nonzero(similarity >= self.similarity_lower_bound).flatten()
        share = flagged.numel() / frame_tokens
        if share < bound:
            state[SPARSITY].append(share)
            state[MERGING_DONE] = share < self.ratio_lower_bound
        else:
            flagged = torch.sort(ranked_indices(similarity, int(bound * frame_tokens))).values
            state[MERGING_DONE] = state[PRUNING_DONE] = True
        groups = merge_groups(order, flagged)
        state[GROUPS] = groups
        gone = torch.zeros(n, dtype=torch.bool)
        gone[order[flagged]] = True  # a group's head is never flagged: it stays, as the group's mean
        return torch.nonzero(~gone).flatten()

    def merge(self, stage: Stage, signals: LayerSignals, state: dict[str, Any], kept: Tensor) -> TokenMerge | None:
        """Each merge group's head becomes the plain mean of the group, in the head's place (official)."""
        groups: list[Tensor] = state.get(GROUPS, [])
        if not groups:
            return None
        hidden = signals.hidden_states.detach().float()
        means = torch.stack([hidden[group].mean(dim=0) for group in groups])
        heads = torch.tensor([int(group[0]) for group in groups], dtype=torch.long)
        return TokenMerge(means, [torch.sort(group).values for group in groups], replaces=heads)
