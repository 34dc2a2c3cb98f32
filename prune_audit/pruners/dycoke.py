"""DyCoke: a clip's temporal steps pruned against earlier steps of their group of four (the input stage), and the
decode-time KV-cache pruning by a query row's attention, recorded as one in-LLM stage."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from prune_audit.pruners.base import InputSelector, Reference, Selection, Stage, top_k_indices
from prune_audit.pruners.fastv import last_row_attention
from prune_audit.pruners.fidelity import Fidelity, random_agreement
from prune_audit.pruners.options import Choice, Real, option
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import REFERENCE_DEPTH, ReferenceLayer, SingleStageSelector
from prune_audit.pruners.signals import VIDEO_GRID, InputSignals, LayerSignals

#: the defaults of lmms_eval/models/llava_onevision.py in KD-TAO/DyCoke, which its eval.sh leaves as they are:
#: ``dycoke_k`` (share of a pruned step's tokens dropped), ``dycoke_p`` (share of the visual tokens the decoding
#: query does not attend to), ``dycoke_l`` (the decoder layer whose input is pruned; layer l - 1's attention picks)
TTM_RATIO = 0.7
KV_RATIO = 0.8
KV_LAYER = 3
#: ``official``: the loops' own bounds (an odd last step dropped, the last group of a multiple of four keeps its
#: third step whole); ``complete``: every step takes part (an odd last step kept whole, every group's third pruned)
TTM_EDGES = ("official", "complete")
#: a step's role in :func:`ttm_plan`: dropped whole (the official loops never reach it)
DROPPED = -1
#: ``kept``: the last visual token survives every selection, as the official range stops one token short of it
LAST_TOKEN_RULES = ("kept", "ranked")


def ttm_plan(steps: int, edges: str = "official") -> list[int]:
    """Each temporal step's reference in DyCoke's temporal token merging (``dycole_ttm``) of ``steps`` steps: the
    step itself when it is kept whole, the earlier step it is pruned against, or :data:`DROPPED`.

    Pairs (2i, 2i + 1): the second pruned against the first. Groups of four (4i .. 4i + 3): the third pruned against
    the first (the pair stage had kept it whole); the fourth stays pruned against the third's original tokens.
    """
    if steps == 1:  # one step, nothing to compare (the official code fails on it): kept whole
        return [0]
    plan = [DROPPED] * steps
    pairs = steps - steps % 2
    for first in range(0, pairs, 2):
        plan[first], plan[first + 1] = first, first
    if edges == "complete" and steps % 2:
        plan[steps - 1] = steps - 1  # an odd last step: a pair's first with no second, kept whole
    last_group = steps - 4 if edges == "official" else steps - 2  # range(0, F - 4, 4) officially
    for first in range(0, max(last_group, 0), 4):
        plan[first + 2] = first
    return plan


def step_similarity(features: Tensor, step: int, reference: int, per_step: int, pair: bool) -> Tensor:
    """(h * w,) float32 cosine of each token of ``step`` to the token at its (row, col) in ``reference``.

    ``features`` is the clip's (T * h * w, D) merged tokens. The pair stage normalises both steps first, the group
    stage does not (the official code's two loops; the same cosine up to rounding).
    """
    now = features[step * per_step : (step + 1) * per_step].float()
    before = features[reference * per_step : (reference + 1) * per_step].float()
    if pair:
        now, before = torch.nn.functional.normalize(now, dim=1), torch.nn.functional.normalize(before, dim=1)
    return torch.nn.functional.cosine_similarity(before, now, dim=1)


def step_quotas(count: int, whole: int, pruned: int, per_step: int) -> list[int]:
    """Tokens kept in each of ``pruned`` pruned steps when ``count`` are kept and ``whole`` tokens belong to whole
    steps: the rest split evenly, the earlier steps one more while it does not divide (all zero below ``whole``)."""
    rest = min(max(count - whole, 0), pruned * per_step)
    share, extra = divmod(rest, pruned) if pruned else (0, 0)
    return [share + (index < extra) for index in range(pruned)]


def official_count(plan: list[int], per_step: int, ratio: float) -> int:
    """Tokens the official code keeps: every whole step, ``int((1 - dycoke_k) h w)`` of each pruned one."""
    whole = sum(reference == step for step, reference in enumerate(plan))
    pruned = sum(reference not in (step, DROPPED) for step, reference in enumerate(plan))
    return whole * per_step + pruned * int((1 - ratio) * per_step)


@register
@dataclass
class DyCokeSelector(InputSelector):
    """DyCoke's temporal token merging on a clip's merged tokens (Tao et al., CVPR 2025; KD-TAO/DyCoke).

    ``signals.video_grid`` is the clip's (T, h, w) token grid, the (T * h * w, D) ``features`` time-major then
    row-major. A DyCoke frame is a temporal step here (two frames on Qwen2.5-VL, h * w tokens), as in the
    Qwen2.5-VL port the official README links (mvish7/dycoke_token_compression, ``dycoke_num_tokens_per_frame``
    = tokens per step). In each group of four steps (a, b, c, d) a is kept whole, b is pruned against a, c against
    a and d against c (:func:`ttm_plan`): a pruned step keeps its tokens least similar (cosine) to the token at the
    same (row, col) of its reference, ties to the lower index. The official "merging" keeps those tokens and drops
    the rest: nothing is averaged, so no merged tokens.

    How many: ``merging_ratio`` 0 (default) keeps the budget, ``min(budget, N)``: the whole steps, then the rest
    split evenly over the pruned steps (the earlier ones one more while it does not divide; derived, not
    official). ``merging_ratio`` k in (0, 1) is the official ``dycoke_k``: each pruned step keeps ``int((1 - k) h
    w)``, the count capped at the budget and given at a budget of every token (k = 0.7, the official default,
    reproduces the official code). A budget below the whole steps' tokens keeps their first ones in clip order
    (the official always keeps them whole). ``edges`` (:data:`TTM_EDGES`): ``official`` follows the loops' bounds,
    so an odd last step is dropped whole, hence fewer than the budget can be fed (``fills_budget`` False).

    Kept tokens stay in clip order with their original M-RoPE positions (the family's); the official lays a pruned
    frame's survivors out in ascending similarity, renumbering LLaVA-OneVision's 1-D positions. On a still image
    the adapter gives no ``video_grid`` and DyCoke is refused in one line, as EVS.

    Reference: KD-TAO/DyCoke ``llava/model/llava_arch.py`` ``dycole_ttm`` (commit dd746349), defaults of
    ``lmms_eval/models/llava_onevision.py`` (``dycoke_k`` 0.7). Its decode-time KV pruning is ``dycoke_kv``.
    """

    name: ClassVar[str] = "dycoke"
    summary: ClassVar[str] = "each step pruned to its tokens least like its group's earlier step (DyCoke TTM, video)"
    requires: ClassVar[frozenset[str]] = frozenset({"features", VIDEO_GRID})
    fills_budget: ClassVar[bool] = False  # edges=official drops an odd last step whole, as the official loops
    reference: ClassVar[Reference] = Reference(
        "DyCoke: Dynamic Compression of Tokens for Fast Video Large Language Models (CVPR 2025, arXiv 2411.15024)",
        "KD-TAO/DyCoke",
        "llava_arch.py dycole_ttm on the clip's merged tokens, a frame = a temporal step; its decode-time KV "
        "pruning is the in-LLM dycoke_kv",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "dd746349",
        "groups of four steps: the first whole, the second and third pruned against the first, the fourth against "
        "the third, to their least similar tokens; the budget split evenly over the pruned steps",
        ("merging_ratio=0.7",),
        (
            "a frame is a temporal step (two frames on Qwen2.5-VL), as the Qwen2.5-VL port linked from the official "
            "README (mvish7/dycoke_token_compression @7d164a07); the official runs on LLaVA-OneVision's 196-token "
            "frames",
            "the count is the budget by default, spread evenly over the pruned steps (derived); merging_ratio=K "
            "gives the official int((1 - K) h w) per pruned step (0.7 above: the official dycoke_k), capped at the "
            "budget and given at a budget of every token; a budget below the whole steps' tokens keeps their "
            "first ones (the official keeps them whole)",
            "edges=official (default) keeps the loops' bounds: an odd last step is dropped whole and a multiple of "
            "four steps keeps the last group's third step whole; edges=complete keeps an odd last step whole and "
            "prunes every group's third; below 5 steps the official code fails (torch.stack of no group), here "
            "the groups' stage is skipped",
            "kept tokens stay in clip order at their original M-RoPE positions; the official lays a pruned frame's "
            "survivors out by ascending similarity with renumbered 1-D positions (LLaVA-OneVision)",
            "exact ties to the lower index (the official torch.topk leaves them unspecified); fp32 cosines (the "
            "official: the model dtype)",
        ),
        "kept sets identical in all 60 random clips at the official ratios (3 seeds, 5 grids of 4 to 9 steps, "
        "4 ratios) to a token-by-token re-derivation of dycole_ttm, and in all 60 at budgets to its budget split "
        "(test_dycoke.py::test_official_ratio_equals_the_rederived_dycole_ttm, "
        "test_budget_split_equals_the_rederived_quotas)",
    )
    #: cosines are elementwise products and sums (no matrix product); sorting counts zero
    flops_exact: ClassVar[bool] = True

    merging_ratio: float = option(
        0.0,
        Real(0.0, 1.0, open_high=True),
        "0: keep the budget; k in (0, 1): the official dycoke_k, int((1 - k) h w) per pruned step, capped at the budget",
    )
    edges: str = option("official", Choice(TTM_EDGES), "official loop bounds (an odd last step dropped) or complete")

    def select(self, signals: InputSignals, budget: int, generator: torch.Generator | None = None) -> Selection:
        """The DyCoke kept set of ``signals.num_tokens`` clip tokens (the budget short-cut of the base class would
        skip the official count under ``merging_ratio``)."""
        budget, (steps, rows, cols) = self._checked_clip(signals, budget)
        n = signals.num_tokens
        if budget >= n and self.merging_ratio == 0:
            return Selection(kept=torch.arange(n, dtype=torch.long))
        plan, per_step = ttm_plan(steps, self.edges), rows * cols
        count = min(budget, n)
        if self.merging_ratio > 0:
            count = min(count, official_count(plan, per_step, self.merging_ratio))
        return Selection(kept=self._kept(signals.features.detach(), plan, per_step, count))

    def _kept(self, features: Tensor, plan: list[int], per_step: int, count: int) -> Tensor:
        """(k,) ascending kept token indices: the whole steps' tokens (their first ``count`` when fewer), each
        pruned step's quota of least similar tokens."""
        whole = [step for step, reference in enumerate(plan) if reference == step]
        pruned = [step for step, reference in enumerate(plan) if reference not in (step, DROPPED)]
        whole_tokens = torch.cat([torch.arange(s * per_step, (s + 1) * per_step) for s in whole])
        parts = [whole_tokens[:count]]
        quotas = step_quotas(count, whole_tokens.numel(), len(pruned), per_step)
        for step, quota in zip(pruned, quotas, strict=True):
            if quota == 0:
                continue
            pair = plan[step] == step - 1  # the pair stage's second step; else a group's third step
            similarity = step_similarity(features, step, plan[step], per_step, pair)
            parts.append(step * per_step + top_k_indices(-similarity, quota))
        return torch.sort(torch.cat(parts)).values


def kv_kept_count(num_visual: int, ratio: float, last_token: str) -> int:
    """Visual tokens the official decode-time pruning leaves a query: ``int(img_len (1 - dycoke_p))`` of the
    ranked ``img_len`` (every visual token but the last under ``last_token="kept"``), plus that last one."""
    if last_token == "kept":
        return int((num_visual - 1) * (1 - ratio)) + 1
    return int(num_visual * (1 - ratio))


@register
@dataclass
class DyCokeKVSelector(SingleStageSelector):
    """DyCoke's dynamic KV-cache pruning as one in-LLM stage (KD-TAO/DyCoke ``modeling_qwen2.py``).

    Officially, at every generated token after the first, the head-mean attention of that token's row at layer
    ``dycoke_l - 1`` = 2 over the visual tokens (``PrunableDynamicCache.dycoke_pruning``) picks the top
    ``int(img_len (1 - dycoke_p))`` (``dycoke_p`` 0.8) for layers 3 and deeper of that step; ``img_len`` is one
    short of the visual tokens, so the last one always survives. The prefill, and the first answer token, see
    every token. Here the same rule is one stage at the input of layer ``layer`` (3, on the 32-layer reference
    scaled to the model's depth: 3 on the 28 layers of LLaVA-OneVision-7B and Qwen2.5-VL-7B), scored by the last
    prompt row of layer 2 (``signal_layer`` previous, as the official reads the previous layer's output attention),
    its kept set fixed for the prompt's deeper layers and the whole KV cache. Kept tokens keep their positions
    (the official gathers the rotated keys).

    ``budget_rule="average"`` (default): the count is solved so the layer average is the budget (FastV's
    ``k ~ (L B - K N) / (L - K)``). ``budget_rule="paper"``: the official count for ``pruning_ratio`` (``dycoke_p``),
    capped at the budget (a budget of every token keeps all). ``last_token="kept"`` (official) keeps the last
    visual token whatever its score; ``ranked`` ranks it with the others. Composed after the temporal merging as
    ``dycoke+dycoke_kv``, both stages are recorded.

    Reference: KD-TAO/DyCoke (commit dd746349) ``llava/model/language_model/modeling_qwen2.py``
    (``PrunableDynamicCache.update_cache`` and ``dycoke_pruning``, the layer loop of ``Qwen2Model.forward``).
    """

    name: ClassVar[str] = "dycoke_kv"
    summary: ClassVar[str] = "DyCoke's decode-time KV pruning as one stage: layer 2's last-row attention, at layer 3"
    requires: ClassVar[frozenset[str]] = frozenset({"text_probs"})
    clip_method: ClassVar[bool] = True  # DyCoke's second stage: reads the LLM, not the clip's grid
    reference: ClassVar[Reference] = Reference(
        "DyCoke: Dynamic Compression of Tokens for Fast Video Large Language Models (CVPR 2025, arXiv 2411.15024)",
        "KD-TAO/DyCoke",
        "modeling_qwen2.py PrunableDynamicCache.dycoke_pruning (dycoke_l 3, dycoke_p 0.8) as one prefill stage",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "dd746349",
        "one stage at layer 3: the last prompt row's head-mean attention at layer 2 keeps the top visual tokens and "
        "the last one, to the budget average",
        ("budget_rule=paper",),
        (
            "the official prunes at decoding only: from the second generated token on, each step's own layer-2 "
            "row picks the visual tokens its layers 3 and deeper attend to, the prompt and the first answer token "
            "seeing every token (on a one-token answer the official output is the input stage's alone); here one "
            "prefill stage chosen by the last prompt row, which the prompt's deeper layers and the KV cache also "
            "lose",
            "the official re-selects only at a step whose row has cosine < 0.9 with the previous step's, and a step "
            "whose row stays similar attends to every visual token (kv_cache left None); its previous row is "
            "never reset between questions; a stage has one fixed kept set",
            "budget_rule=average solves the count to the budget average (derived); budget_rule=paper gives the "
            "official int((n - 1) (1 - 0.8)) + 1, capped at the budget",
            "exact ties to the lower index (the official torch.topk(sorted=False) leaves them unspecified); fp32 "
            "scores unless score_dtype=model",
        ),
        random_agreement(
            30,
            "test_dycoke.py::test_kv_stage_equals_the_rederived_update_cache",
            "the stage's kept set against the official keep indices of update_cache on random attention rows "
            "(its image range one token short)",
        ),
        30,
    )
    flops_exact: ClassVar[bool] = True  # no products of its own: it ranks the attention the model gives it

    layer: int = option(KV_LAYER, ReferenceLayer(1, REFERENCE_DEPTH - 1), "the decoder layer whose input is pruned")
    pruning_ratio: float = option(
        KV_RATIO, Real(0.0, 1.0, open_high=True), "dycoke_p: share of the visual tokens the paper rule drops"
    )
    last_token: str = option(
        "kept", Choice(LAST_TOKEN_RULES), "kept (the official range stops one short of it) or ranked with the rest"
    )
    signal_layer = "previous"  # the official reads the previous layer's attention output (not an option)

    def paper_stages(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        """The official count at the stage, capped at the budget; a budget of every token keeps all."""
        keep = min(budget, kv_kept_count(num_visual, self.pruning_ratio, self.last_token))
        keep = num_visual if budget >= num_visual else keep
        return [Stage(layer, keep) for layer in self._layers(num_layers)]

    def prune(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        """(k,) ascending alive positions: the last one (``last_token="kept"``) and the best attended."""
        self._check_signals(signals)
        n, keep = signals.num_alive, min(stage.keep, signals.num_alive)
        if keep >= n:
            return torch.arange(n, dtype=torch.long)
        if keep <= 0:  # nothing left to rank (a tiny model's solved count can reach 0)
            return torch.zeros(0, dtype=torch.long)
        scores = self.model_precision(last_row_attention(self.inputs(signals)), signals).clone()
        if self.last_token == "kept":
            scores[-1] = float("inf")
        return top_k_indices(scores, keep, self.ties, self.ranking_dtype(signals.model_dtype))
