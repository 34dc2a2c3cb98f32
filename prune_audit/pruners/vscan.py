"""VScan: global and local scans of the vision encoder's CLS attention, then pruning at a middle LLM layer."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, get_args

import torch
from torch import Tensor

from prune_audit.pruners.arithmetic import SelectorWork, matmul
from prune_audit.pruners.base import BudgetScoped, PositionMode, Reference, Stage, TokenMerge, rounded_to
from prune_audit.pruners.crop_scope import crop_budgets
from prune_audit.pruners.fastv import last_row_attention
from prune_audit.pruners.fidelity import HALF_EXACT_CASES, HALF_ONCE, Fidelity, half_exact, random_agreement
from prune_audit.pruners.hiprune import scaled_vision_layer
from prune_audit.pruners.layout import PADDED_CROP_GRID
from prune_audit.pruners.options import Choice, Flag, Integer, Real, option
from prune_audit.pruners.ranking import ranked_indices, top_k_indices
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import (
    REFERENCE_DEPTH,
    ReferenceLayer,
    ScheduledSelector,
    average_visual_tokens,
    scale_layers,
    scale_reference_counts,
)
from prune_audit.pruners.signals import LayerSignals
from prune_audit.pruners.similarity import unit_rows

LOCAL_COUNTS = ("fill", "official")
ATTENTION_ROPES = ("applied", "skipped")
#: the README's settings: average budget -> tokens after the vision stage and after LLM layer 16 (576 tokens)
VSCAN_COUNTS = {64: (96, 32), 128: (192, 64), 192: (288, 96)}
CROP_MERGE = "crop_merge"  # the per-crop vision stage's merged tokens, from ``prune`` to ``merge`` (row state)


def window_scan(
    scores: Tensor, cells: Tensor, grid: tuple[int, int], window: int, per_window: int,
    ties: str = "lower", dtype: torch.dtype | None = None,
) -> Tensor:  # fmt: skip
    """VScan's local scan: the ``per_window`` best tokens of every full ``window x window`` block of the grid.

    Args:
        scores: (n,) score of each alive token; cells: (n,) its grid cell (-1: none, never chosen).
        grid: (rows, cols); blocks tile it from the top left, partial blocks at the right and bottom
            edges are not scanned (the official 24 x 24 grid has none at window 6).
        ties, dtype: as :func:`~prune_audit.pruners.ranking.top_k_indices`, on each block's scores in
            raster order (the official ``window_flat``).

    Returns:
        (m,) positions among the alive tokens, block by block in raster order, ascending in each.
    """
    rows, cols = grid
    at_cell = torch.full((rows * cols,), -1, dtype=torch.long)
    on_grid = torch.nonzero(cells >= 0).flatten()
    at_cell[cells[on_grid]] = on_grid
    chosen = []
    for top in range(0, rows - window + 1, window):
        for left in range(0, cols - window + 1, window):
            block = torch.tensor([(top + r) * cols + left + c for r in range(window) for c in range(window)])
            positions = at_cell[block]
            positions = positions[positions >= 0]
            chosen.append(positions[top_k_indices(scores[positions], per_window, ties, dtype)])
    return torch.cat(chosen) if chosen else torch.zeros(0, dtype=torch.long)


def greedy_window_scan(
    scores: Tensor, cells: Tensor, grid: tuple[int, int], window: int, count: int,
    ties: str = "lower", dtype: torch.dtype | None = None,
) -> Tensor:  # fmt: skip
    """VScan's Qwen2.5-VL local scan (``window_selection``): tokens in decreasing score, each taken while its
    ``window x window`` block holds fewer than ``ceil(count / W)``, until ``count`` are taken.

    Args:
        scores: (n,) score of each alive token; cells: (n,) its grid cell (-1: none, never chosen).
        grid: (rows, cols); the ``W`` blocks tile it from the top left, cells past the last full block
            of a row or column count toward that block (at least one block per axis: the official code
            divides by zero on a side under ``window``).
        count: tokens to take (the blocks' limits always allow it).
        ties: ``"lower"``: equal scores in index order; ``"topk"``: ``torch.argsort(descending=True)`` on the
            scores in ``dtype``, the official order.

    Returns:
        (count,) positions among the alive tokens, in the order taken.
    """
    rows, cols = grid
    blocks_down, blocks_across = max(1, rows // window), max(1, cols // window)
    limit = math.ceil(count / (blocks_down * blocks_across))
    if ties == "topk":
        order = torch.argsort(scores if dtype is None else scores.to(dtype), descending=True)
    else:
        order = ranked_indices(scores, scores.numel())
    on_grid = cells[order] >= 0
    order, order_cells = order[on_grid], cells[order][on_grid]
    block = (order_cells // cols // window).clamp(max=blocks_down - 1) * blocks_across + (
        order_cells % cols // window
    ).clamp(max=blocks_across - 1)
    held = [0] * (blocks_down * blocks_across)
    taken: list[int] = []
    for position, index in zip(order.tolist(), block.tolist()):
        if len(taken) == count:
            break
        if held[index] < limit:
            held[index] += 1
            taken.append(position)
    return torch.tensor(taken, dtype=torch.long)


def global_scan(deep: Tensor, local: Tensor, count: int, ties: str, dtype: torch.dtype | None) -> Tensor:
    """(count,) ascending positions of the largest ``deep`` attention (n,) outside the ``local`` ones (m,).

    ``ties="topk"`` ranks as the official code does, ``torch.topk`` over the whole row with the local tokens'
    attention set to 0 (in ``dtype``), so its order among exact ties is the kernel's over the full row;
    ``"lower"`` ranks only the other tokens, ties to the lower index.
    """
    if ties == "topk":
        zeroed = deep.clone()
        zeroed[local] = 0
        return top_k_indices(zeroed, count, ties, dtype)
    rest = torch.ones(deep.numel(), dtype=torch.bool)
    rest[local] = False
    candidates = torch.nonzero(rest).flatten()
    return candidates[top_k_indices(deep[candidates], count)]


def nearest_merge(hidden: Tensor, kept: Tensor) -> TokenMerge | None:
    """VScan's token merging: every token not ``kept`` joins the kept token of highest cosine similarity,
    and each kept token that gains members becomes the mean of itself and them (in its own place).

    Args:
        hidden: (n, D) float32 states of the alive tokens; kept: (k,) ascending positions among them.
    """
    pruned = torch.ones(hidden.shape[0], dtype=torch.bool)
    pruned[kept] = False
    pruned = torch.nonzero(pruned).flatten()
    if pruned.numel() == 0 or kept.numel() == 0:
        return None
    unit = unit_rows(hidden)
    nearest = torch.argmax(unit[pruned] @ unit[kept].T, dim=1)  # (p,) slot in kept; ties to the first
    slots = torch.unique(nearest)
    members = [torch.cat([kept[slot].reshape(1), pruned[nearest == slot]]) for slot in slots.tolist()]
    merged = torch.stack([hidden[group].mean(dim=0) for group in members])
    return TokenMerge(merged, [torch.sort(group).values for group in members], replaces=kept[slots])


@register
@dataclass
class VScanSelector(ScheduledSelector, BudgetScoped):
    """VScan: local and global scans of the vision encoder's CLS attention with merging, then a middle LLM stage.

    Two stages. At the input of decoder layer 0 (the vision stage, ``T_v`` tokens): the local
    scan keeps the ``int(T_v (1 - global_share)) // W`` best tokens of each of the ``W`` full
    ``window_size``-square blocks of the grid by the head-mean CLS attention of a shallow encoder
    layer (``layer_cls_attention``; :func:`window_scan`); the global scan adds the best of the rest
    by the CLS attention of the feature layer (the last row). With ``merge_pruned`` (official) every other
    token joins its most cosine-similar kept token on the projector outputs (the layer-0
    ``hidden_states``) and a kept token with members becomes their mean in its own slot
    (:func:`nearest_merge`; the records carry it as a merged token with its cells). At the input of
    ``llm_layer`` (the LLM stage, ``T_l`` tokens): the head-mean attention of the last prompt token,
    computed by that layer on its input (softmax over every key), keeps the top ``T_l``.

    Budget: ``budget_rule="average"`` (default): ``T_l = round(llm_share * B)`` and ``T_v`` solved
    so that the layer average is ``B``; on 32 layers with the stage at 16, ``B`` = 64 gives 96 and
    32, the official default (``--visual_token_num 96 --layer_list [16] --image_token_list [32]``),
    128 and 192 give 192/64 and 288/96. ``"paper"``: those three settings only, counts scaled to the
    model's tokens. As the vision stage is at layer 0, any budget is feasible.

    Follows Tencent/SelfEvolvingAgent ``VScan/llava/model/llava_arch.py::encode_images``,
    ``window_cls_selection`` and ``token_merging`` and ``modeling_llama_x.py::layer_prune`` (commit
    a82450e1): shallow layer ``attentions[5]`` (the 6th of the 23 CLIP layers run; scaled on other
    towers as HiPrune's object layer), deep ``attentions[-2]``, window 6 on 24 x 24, global share 0.5,
    positions renumbered after each stage.

    ``score_dtype="model"`` at the vision stage: the per-layer CLS attention rounded to the model dtype
    (the official head mean of its half CLS rows, exact when the adapter's signal is that half mean)
    and ranked in it; ``ties="topk"``: ``torch.topk`` on each window and on the deep row with the local
    tokens zeroed (:func:`global_scan`), as the official code. The merge stays float32.

    Differences: ties go to the lower index by default (``torch.topk`` leaves them unspecified); the attention
    and the merge are computed in float32 by default (the official code in fp16); the global scan excludes the
    local tokens (the official zeroes their attention, the same set unless other attention is exactly
    0); ``local_count="fill"`` (default) gives the global scan what the local scan leaves of ``T_v``
    so every stage keeps its count (``"official"``: the global scan takes ``T_v - int(T_v / 2)``
    whatever the blocks held, fewer tokens where ``W`` does not divide ``int(T_v / 2)``); grids other
    than 24 x 24 (the official code asserts 576 tokens) scan only their full blocks.

    On Qwen2.5-VL (no CLS: its adapter passes ``layer_attention`` instead of ``layer_cls_attention``), as ``VScan/qwen/model/qwen2_5_vl_custom.py`` and
    ``qwen2_5_vl_utils.py`` (same commit, the SDPA path its eval scripts patch): the scores are the attention
    each merged token receives (``layer_attention``: mean of its 4 patches over query patches, window order
    undone; the official head sum is the head mean times the head count), the local scan on the first
    full-attention block (``full_attention_layers[0]``, block 8 of 32 on the 7B; the last without any) by
    :func:`greedy_window_scan` with ``qwen_window_size`` 4 taking ``int(T_v (1 - global_share))`` (the
    official ``T_v // 2``), the global scan on the last block; then the same merging and LLM stage. Its
    README's ``--layer-list [14] --image-token-ratio-list [0.333]`` on 28 layers is this schedule's stage at
    16 / 32 of the depth with ``T_l = T_v / 3`` (``llm_share`` 0.5 at half depth). Differences there: the LLM
    stage keeps ``round(B llm_share)`` where the official keeps ``int(0.333 T_v)`` (one fewer when it
    truncates); the official ``T_v = int(0.167 N)`` is a ratio, here ``T_v`` follows from the budget. The
    official Qwen ``layer_prune`` leaves q and k unrotated (its M-RoPE call is commented out; the LLaVA one
    rotates): ``attention_rope="skipped"`` does the same, the default applies the layer's RoPE.

    On LLaVA-NeXT, with ``budget_scope="crop"`` (refused there on the whole image), as ``encode_images`` on the
    batch of crops and ``prepare_inputs_labels_for_multimodal``'s unpadding of its index mask (same commit; its
    ``scripts/llava1_6``: ``--visual_token_num 96`` per crop, ``--layer_list [16] --image_token_list [32]``):
    ``T_v`` is split evenly over the K crops (the base view and each tile), each crop runs both scans and the
    merging in its own padded 24 x 24 grid, padding patches included (:meth:`_per_crop_stage`, reading
    ``LayerSignals.padded_crops``); then the tiles are unpadded: a kept patch in the padding is dropped, with
    the tokens merged into it, so fewer than ``T_v`` tokens may remain; padding patches merged into a kept
    visual token stay in its mean. Row newlines are never counted nor pruned. The LLM stage is LLaVA-1.5's on
    the surviving tokens. Differences: here the budget is the image's and the stage count ``T_v`` follows
    from it (the official fixes 96 per crop). The official LLM stage (``modeling_llama_x.py::layer_prune``)
    keeps LLaVA-1.5's lengths: its image length is ``min(96, span)`` where the span holds every crop's kept
    tokens and the newlines, so it ranks only the span's first 96 tokens (the base view's kept ones), by the
    attention of the row at ``prompt_len + 96 - 1`` (inside the image span, not the last prompt token), keeps
    32 of them and leaves the tiles' tokens and newlines; here the LLM stage ranks every alive visual token by
    the last prompt token's attention and keeps ``T_l`` of them.

    Options (besides ``budget_rule``, ``score_dtype`` and ``ties``, which act on both stages):
        llm_layer: decoder layer of the LLM stage on the 32-layer reference, scaled.
        llm_share: ``T_l`` as a share of the budget.
        global_share: share of ``T_v`` chosen by the global scan.
        window_size: side of the local scan's blocks, in grid cells.
        shallow_layer: 1-based encoder layer of the local scan among the 23 run on LLaVA-1.5, scaled.
        local_count: ``"fill"`` (every stage keeps its count) or ``"official"``.
        qwen_window_size: side of the Qwen2.5-VL local scan's blocks, in merged tokens.
        merge_pruned: fold the pruned tokens into their nearest kept token at the vision stage (official).
        positions: position ids after pruning (the official code renumbers).
        attention_rope: ``"applied"`` (the layer's RoPE in the LLM stage's attention) or ``"skipped"`` (the
            official Qwen code).
        budget_scope: ``"image"``, or ``"crop"``: the vision stage per crop in its padded grid (LLaVA-NeXT).
    """

    name: ClassVar[str] = "vscan"
    summary: ClassVar[str] = (
        "local + global scans of vision CLS (Qwen: received) attention with merging, then LLM layer 16 (VScan)"
    )
    layout_need: ClassVar[str] = PADDED_CROP_GRID
    per_crop_grid: ClassVar[bool] = True  # its official code scans and merges in each crop's padded grid, then unpads
    requires: ClassVar[frozenset[str]] = frozenset({"layer_cls_attention", "hidden_states", "text_probs"})
    substitutes: ClassVar[dict[str, str]] = {"layer_cls_attention": "layer_attention"}  # Qwen2.5-VL: received
    reference: ClassVar[Reference] = Reference(
        "VScan: Rethinking Visual Token Reduction for Efficient Large Vision-Language Models (arXiv 2505.22654)",
        "Tencent/SelfEvolvingAgent",
        "folder VScan/; CLIP layers 6 (local, window 6) and 23 (global); 96 tokens, then 32 at LLM layer 16",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "a82450e1",
        "6 x 6 window scan of CLIP layer 6, global scan of layer 23, merging; LLM layer 16; 96 then 32 for 64; float32; Qwen2.5-VL (VScan/qwen/): greedy 4 x 4 window limits on the received attention (4-patch mean, window order undone; models.qwen) of the first full-attention block, global scan of the last, merging; LLM stage at half depth (14 of 28) with a third of the vision-stage tokens",  # fmt: skip
        ("score_dtype=model", "ties=topk"),
        (
            "lower-index ties, float32 (ties=topk, score_dtype=model: topk order, fp16); global scan excludes the local tokens",
            "local_count=fill lets the global scan fill the stage (the same at 96/192/288); official: fewer elsewhere",
            "grids other than 24 x 24 scan their full blocks (official: asserts 576); shallow layer scaled as HiPrune's",
            "merged tokens keep their kept token's slot and carry their cells",
            "Qwen: T_l = round(B llm_share) = T_v / 3 where the official keeps int(0.333 T_v) (one fewer when it truncates), T_v from the budget where the official takes int(0.167 N); a side under 4 merged tokens is one window (official: divides by 0)",
            "Qwen: the LLM stage's attention has M-RoPE applied as the layer applies it unless attention_rope=skipped (the official Qwen layer_prune leaves q and k unrotated; the LLaVA one rotates)",
            "LLaVA-NeXT (budget_scope=crop only, as its llava_arch.encode_images): scans and merging in each crop's padded grid, a kept padding patch dropped at unpadding with what merged into it; T_v is the image's, split evenly over the crops (official: 96 per crop); the LLM stage ranks every alive visual token by the last prompt token's attention and keeps T_l (the official layer_prune keeps LLaVA-1.5's lengths: it ranks only the image span's first min(96, span) tokens, the base view's kept ones, by the row at prompt_len + 95, inside the span, keeps 32 of them and leaves the tiles' tokens and newlines)",
        ),
        random_agreement(
            30,
            "test_vscan.py::test_vscan_vision_stage_reproduces_the_official_scans_and_merging",
            "kept sets and merged 4096-dim features (atol 1e-5), vision stages 96/192/288; Qwen path: test_qwen_attention_signals.py 36 of 36 (7B-like: 16 heads, 4 x 4 windows, 6..20-token sides, 3584-dim features); LLaVA-NeXT per crop: test_llava_next.py::test_vscan_runs_per_crop_on_llava_next_as_its_official_code, 2 of 2 tiny images (kept sets exact, merged inputs atol 1e-5)",
        ),
        30,  # fmt: skip
        half_agreement=half_exact(
            "the official half CLS head mean at the vision stage (the LLM stage, eager as FastV's: 30 of 30 too)",
            HALF_ONCE + " (head)",
            30,
            30,
        )
        + "; Qwen path in bf16 (the 7B's dtype), 16 x 20 tokens: 30 of 30 (and 10 + 10 tie cases) given the official thrice-rounded bf16 reductions, 0 of 30 given the adapter's float32 signal rounded once (20-25 distinct bf16 values among 320 tokens: the official set is mostly the kernel's order among ties; no half twin on Qwen)",
        half_cases=HALF_EXACT_CASES,  # fmt: skip
    )

    flops_exact: ClassVar[bool] = True

    llm_layer: int = option(16, ReferenceLayer(1, REFERENCE_DEPTH - 1), "decoder layer of the LLM stage")
    llm_share: float = option(0.5, Real(low=0.0, high=1.0, open_low=True), "LLM-stage tokens as a share of the budget")
    global_share: float = option(0.5, Real(low=0.0, high=1.0), "share of the vision stage chosen by the global scan")
    window_size: int = option(6, Integer(low=1), "side of the local scan's blocks in grid cells")
    shallow_layer: int = option(6, Integer(low=1, high=23), "1-based local-scan layer of the 23 run on LLaVA-1.5")
    qwen_window_size: int = option(4, Integer(low=1), "side of the Qwen2.5-VL local scan's blocks in merged tokens")
    local_count: str = option("fill", Choice(LOCAL_COUNTS), "global scan fills the stage, or the official count")
    merge_pruned: bool = option(True, Flag(), "merge pruned tokens into their nearest kept token (official)")
    positions: PositionMode = option(
        "compact", Choice(get_args(PositionMode)), "position ids after pruning (official renumbers)"
    )
    attention_rope: str = option(
        "applied", Choice(ATTENTION_ROPES), "RoPE in the LLM stage's attention (official Qwen: skipped)"
    )

    @classmethod
    def flops(cls, work: SelectorWork) -> int:
        """The vision stage's merge (:func:`nearest_merge`): each pruned token's cosine to every kept one, over the
        image or, per crop, over that crop's padded patches."""
        if not work.stages or not work.options["merge_pruned"]:
            return 0
        scopes = work.crop_stages or work.stages[:1]
        return sum(matmul(alive - kept, work.hidden, kept) for alive, kept in scopes if 0 < kept < alive)

    def solved_stages(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        """``[Stage(0, T_v), Stage(llm_layer scaled, T_l)]`` whose layer average is ``budget`` (within rounding)."""
        layer = scale_layers([self.llm_layer], REFERENCE_DEPTH, num_layers)[0]
        llm = min(max(1, round(budget * self.llm_share)), budget, num_visual)
        vision = round((budget * num_layers - llm * (num_layers - layer)) / layer)
        if vision > num_visual:  # the vision stage cannot keep more than every token: the LLM stage keeps more
            vision = num_visual
            llm = min(num_visual, round((budget * num_layers - vision * layer) / (num_layers - layer)))
        return [Stage(0, vision), Stage(layer, min(llm, vision))]

    def paper_stages(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        """The README's settings (:data:`VSCAN_COUNTS`) scaled to ``num_visual``; other budgets are refused."""
        layer = scale_layers([self.llm_layer], REFERENCE_DEPTH, num_layers)[0]

        def stages_for(counts: tuple[int, int]) -> list[Stage]:
            vision, llm = scale_reference_counts(counts, num_visual)
            return [Stage(0, vision), Stage(layer, llm)]

        if budget >= num_visual:
            return [Stage(0, num_visual), Stage(layer, num_visual)]
        if budget not in VSCAN_COUNTS:
            valid = ", ".join(
                f"{b} (average {average_visual_tokens(stages_for(c), num_layers, num_visual):.2f})"
                for b, c in VSCAN_COUNTS.items()
            )
            raise ValueError(
                f"vscan with budget_rule='paper' defines budgets {valid} only; use budget_rule='average' for {budget}"
            )
        return stages_for(VSCAN_COUNTS[budget])

    def prune(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        if stage.layer > 0:
            return super().prune(stage, signals, state)
        self._check_signals(signals)
        n = signals.num_alive
        if stage.keep >= n:
            return torch.arange(n, dtype=torch.long)
        half = self.ranking_dtype(signals.model_dtype)
        if self.budget_scope == "crop":
            kept, state[CROP_MERGE] = self._per_crop_stage(stage.keep, signals, half)
            return kept
        if signals.layer_cls_attention is None:
            return self._received_attention_scans(stage.keep, signals, half)
        official = signals.model_layer_cls_attention if half is not None else None  # the half model's own, if passed
        attention = rounded_to((signals.layer_cls_attention if official is None else official).float(), half)  # (Lv, n)
        return self._cls_scans(attention, signals.alive, signals.grid, stage.keep, half)

    def _cls_scans(
        self, attention: Tensor, cells: Tensor, grid: tuple[int, int], keep: int, half: torch.dtype | None
    ) -> Tensor:
        """(keep,) ascending positions kept by the local scan of the shallow layer's CLS attention and the global
        scan of the last layer's, on ``attention`` (Lv, n) of tokens at ``cells`` (n,) of ``grid``."""
        shallow = attention[scaled_vision_layer(self.shallow_layer, attention.shape[0])]
        local_target, per_window, _ = self._local_counts(keep, grid)
        local = window_scan(shallow, cells, grid, self.window_size, per_window, self.ties, half)
        global_count = keep - (local.numel() if self.local_count == "fill" else local_target)
        deep = torch.nan_to_num(attention[-1], nan=float("-inf"))
        chosen = global_scan(deep, local, global_count, self.ties, half)
        return torch.sort(torch.cat([local, chosen])).values

    def _local_counts(self, keep: int, grid: tuple[int, int]) -> tuple[int, int, int]:
        """The local scan's share of ``keep`` on ``grid``: ``(int(keep (1 - global_share)), per window, blocks)``."""
        blocks = (grid[0] // self.window_size) * (grid[1] // self.window_size)
        local_target = int(keep * (1 - self.global_share))
        return local_target, local_target // blocks if blocks else 0, blocks

    def scan_count(self, keep: int, grid: tuple[int, int]) -> int:
        """Tokens the two scans keep when asked for ``keep`` on a full ``grid``: ``keep``, or under
        ``local_count="official"`` fewer where the blocks do not divide the local share (compute accounting)."""
        local_target, per_window, blocks = self._local_counts(keep, grid)
        return keep if self.local_count == "fill" else keep - local_target + per_window * blocks

    def _per_crop_stage(
        self, keep: int, signals: LayerSignals, half: torch.dtype | None
    ) -> tuple[Tensor, TokenMerge | None]:
        """The vision stage in each crop's padded grid (``budget_scope="crop"``, VScan's LLaVA-NeXT code).

        Each of the K crops scans its P patches (padding included) at its share of ``keep``
        (:func:`~prune_audit.pruners.crop_scope.crop_budgets`), and with ``merge_pruned`` every other patch of the
        crop joins its nearest kept patch (:func:`nearest_merge` on the padded projector outputs); then, as the
        official unpadding of the index mask, a kept patch in the padding is dropped with what merged into it, and
        padding patches merged into a kept visual token stay in its mean (its record lists its visual members only).

        Returns:
            (k,) ascending kept positions among the alive tokens, and the merged tokens that replace kept ones.
        """
        crops = signals.padded_crops
        if crops is None or not torch.equal(signals.alive, torch.arange(crops.patch_of.numel())):
            raise ValueError(
                "vscan's per-crop vision stage needs every crop's padded patches and runs first, on "
                "every visual token; drop --option budget_scope=crop"
            )
        official = crops.model_cls_attention if half is not None else None
        attention = (crops.cls_attention if official is None else official).float().cpu()  # (K, Lv, P)
        features = crops.features.float().cpu()  # (K, P, D)
        count, _, per_crop = attention.shape
        token_at = torch.full((count * per_crop,), -1, dtype=torch.long)  # visual token of each patch; -1: padding
        token_at[crops.patch_of] = torch.arange(crops.patch_of.numel())
        kept, merged, members, replaces = [], [], [], []
        for crop, share in enumerate(crop_budgets(keep, [per_crop] * count)):
            if share == 0:
                continue
            cells = torch.arange(per_crop)
            patches = self._cls_scans(rounded_to(attention[crop], half), cells, crops.grid, share, half)
            tokens = token_at[crop * per_crop :][:per_crop]  # (P,) visual token of each patch of this crop
            kept.append(tokens[patches][tokens[patches] >= 0])
            merge = nearest_merge(features[crop], patches) if self.merge_pruned else None
            for index, (target, group) in enumerate(
                zip([] if merge is None else merge.replaces.tolist(), [] if merge is None else merge.members)
            ):
                if tokens[target] >= 0:  # a kept patch in the padding is unpadded away with its members
                    merged.append(merge.hidden[index])
                    members.append(tokens[group][tokens[group] >= 0])
                    replaces.append(int(tokens[target]))
        kept_tokens = torch.cat(kept).sort().values if kept else torch.zeros(0, dtype=torch.long)
        if not merged:
            return kept_tokens, None
        return kept_tokens, TokenMerge(torch.stack(merged), members, replaces=torch.tensor(replaces, dtype=torch.long))

    def _received_attention_scans(self, keep: int, signals: LayerSignals, half: torch.dtype | None) -> Tensor:
        """The vision stage on Qwen2.5-VL's received attention (``layer_attention`` (Lv, n)): the greedy local
        scan of the first full-attention block, then the global scan of the last block."""
        attention = rounded_to(signals.layer_attention.float(), half)
        shallow = attention[(signals.full_attention_layers or (attention.shape[0] - 1,))[0]]
        local_count = int(keep * (1 - self.global_share))
        local = greedy_window_scan(shallow, signals.alive, signals.grid, self.qwen_window_size, local_count,
                                   self.ties, half)  # fmt: skip
        deep = torch.nan_to_num(attention[-1], nan=float("-inf"))
        return torch.sort(torch.cat([local, global_scan(deep, local, keep - local.numel(), self.ties, half)])).values

    def merge(self, stage: Stage, signals: LayerSignals, state: dict[str, Any], kept: Tensor) -> TokenMerge | None:
        """The vision stage's merged tokens, each in the place of its kept token (None without ``merge_pruned``)."""
        if stage.layer > 0 or not self.merge_pruned:
            return None
        if self.budget_scope == "crop":
            return state.pop(CROP_MERGE, None)  # absent when the stage kept every token
        return nearest_merge(signals.hidden_states.float(), kept)

    def score(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        """The LLM stage: the last prompt token's head-mean attention to each alive visual token."""
        return last_row_attention(signals)
