"""PruneVid's stage inside the language model: at one decoder layer the text's attention keeps a share of each
token group the stage before the LLM formed (a segment's static tokens, a step's dynamic tokens)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from prune_audit.pruners.base import FED_KINDS, Reference, Stage, top_k_indices, validate_budget
from prune_audit.pruners.crop_scope import grid_budgets
from prune_audit.pruners.fidelity import Fidelity, random_agreement
from prune_audit.pruners.options import Choice, Real, option
from prune_audit.pruners.prunevid import PAPER, REPOSITORY, TOKEN_GROUPS
from prune_audit.pruners.registry import register
from prune_audit.pruners.schedule import REFERENCE_DEPTH, ReferenceLayer, SingleStageSelector, solve_schedule
from prune_audit.pruners.signals import VIDEO_GRID, LayerSignals

#: the official ``alpha`` of scripts/eval.sh: the share of each group kept
ALPHA = 0.4
#: the decoder layer whose input is pruned: the official ``selected_layer`` 10 prunes its own output
STAGE_LAYER = 11
#: ``official``: ``alpha`` of each group at the official layer, whatever the budget; ``average``: the count at that
#: layer solved so the layer average is the budget, split over the groups by size
PRUNEVID_RULES = ("official", "average")


def text_attention(text_probs: Tensor) -> Tensor:
    """(n,) float32 score of each alive visual token: its largest attention probability over the (H, T, n)
    ``text_probs`` heads and text rows (``process_attention``'s two ``max``)."""
    return text_probs.detach().float().amax(dim=(0, 1))


def step_groups(alive: Tensor, video_grid: tuple[int, int, int]) -> list[Tensor]:
    """(m,) positions among the (n,) ``alive`` codes of each temporal step of the (T, h, w) clip with alive tokens,
    in step order; tokens without a cell (negative codes) one group after them."""
    per_step = video_grid[1] * video_grid[2]
    labels = torch.where(alive >= 0, torch.div(alive, per_step, rounding_mode="floor"), video_grid[0])
    return [(labels == label).nonzero().flatten() for label in torch.unique(labels).tolist()]


def group_counts(sizes: list[int], alpha: float, keep: int | None) -> list[int]:
    """Tokens kept of each group of ``sizes``: the official ``int(m alpha)``, or (``keep`` given) ``keep`` split
    over the groups in proportion to their sizes (largest remainder, ``crop_scope.grid_budgets``)."""
    if keep is None:
        return [int(size * alpha) for size in sizes]
    return grid_budgets(keep, sizes)


def kept_in_groups(scores: Tensor, groups: list[Tensor], counts: list[int], ties: str, dtype: Any = None) -> Tensor:
    """(k,) ascending positions: the ``counts[g]`` best ``scores`` of each group ``groups[g]`` (ties as ``ties``)."""
    parts = [group[top_k_indices(scores[group], count, ties, dtype)] for group, count in zip(groups, counts) if count]
    return torch.sort(torch.cat(parts)).values if parts else torch.zeros(0, dtype=torch.long)


@register
@dataclass
class PruneVidLLMSelector(SingleStageSelector):
    """PruneVid's in-LLM stage (``VTPWindowCache``) as one stage at the input of decoder layer ``layer``.

    Officially, decoder layer ``selected_layer`` = 10 of PLLaVA-7B (32 layers) returns its attention: its largest
    probability over heads and the text rows after the image (``text_probs``, max over H and T, the layer's own:
    ``signal_layer`` previous) scores each visual token; in each token group the stage before the LLM formed (per
    segment its static tokens, and each step's dynamic tokens) the ``int(m alpha)`` best of its m tokens are kept
    (``alpha`` 0.4); layer 10's output and the KV cache of layers 0 to 10 are sliced to them, positions kept. Here:
    a stage at the input of layer ``layer`` (11 on the 32-layer reference, scaled to the model's depth: 10 on
    Qwen2.5-VL-7B's 28), scored by the previous layer's ``text_probs``. Composed as ``prunevid+prunevid_llm``,
    the groups come from the input part (``Selection.llm_state``, positions among the tokens fed, each found in
    the sequence by its kind, ``base.FED_KINDS``: merged tokens are laid out in another order on LLaVA-OneVision); alone on a clip (or after an input part that hands none: prunevid at keep-all, another selector)
    each temporal step's alive tokens are one group.

    ``budget_rule="official"`` (default): ``alpha`` of each group whatever the budget (the realised counts are
    recorded per stage; ``averages_budget`` False). ``budget_rule="average"``: the count at the same layer solved
    so that the layer average is the budget (FastV's ``k ~ (L B - K N) / (L - K)``), split over the groups in
    proportion to their sizes (largest remainder), each group's best kept; a budget below the layers before the
    stage is refused in one line naming the smallest reachable one.

    Decoding (``decode_keeps_final``, ``decode_keeps_final_everywhere``): the official slices the KV cache of every
    layer up to ``selected_layer`` to the kept tokens, so decoded tokens attend to them alone in every layer; the
    executor masks the dropped tokens' cache columns in every layer (``models.executor.final_cache_keys``).

    Departures: exact ties to the lower index (the official ``torch.topk`` leaves them to the kernel); float32
    scores unless ``score_dtype=model``; a group's count from its own size where the official ``view(window_size,
    -1)`` needs equal dynamic groups in a segment (they are, at the official ratio); the text rows are every
    prompt token after the image span (Qwen2.5-VL's ``<|vision_end|>`` among them).

    Reference: Visual-AI/PruneVid (commit b12600c6) ``models/pllava/elastic_cache.py`` (``VTPWindowCache``:
    ``process_attention``, ``obtain_language_attention``, ``prompt_prefill``), ``models/pllava/llama.py`` (the
    layer loop calling it after ``selected_layer``), ``scripts/eval.sh`` (``selected_layer`` 10, ``alpha`` 0.4).
    """

    name: ClassVar[str] = "prunevid_llm"
    summary: ClassVar[str] = (
        "PruneVid's in-LLM stage: layer 10's max text attention keeps alpha=0.4 of each pre-LLM token group (video)"
    )
    requires: ClassVar[frozenset[str]] = frozenset({"text_probs", VIDEO_GRID})
    clip_method: ClassVar[bool] = True
    reference: ClassVar[Reference] = Reference(
        PAPER,
        REPOSITORY,
        "VTPWindowCache at selected_layer 10, alpha 0.4 of each static / dynamic group of merge_frames_dynamic",
    )
    fidelity: ClassVar[Fidelity] = Fidelity(
        "b12600c6",
        "one stage after layer 10: each token's largest text attention (over heads and text rows) keeps int(m 0.4) "
        "of each group the pre-LLM stage formed (a segment's static tokens, a step's dynamic ones), whatever the "
        "budget; the KV cache of every earlier layer sliced to them for decoding",
        (),
        (
            "a stage at the input of layer 11 of the 32-layer reference (PLLaVA-7B's own depth), scaled to the "
            "model's (10 of Qwen2.5-VL-7B's 28), scored by the previous layer's attention as the official reads "
            "layer 10's output attention",
            "budget_rule=official (default) keeps alpha=0.4 of each group whatever the budget; budget_rule=average "
            "solves one count to the budget's layer average (derived), split over the groups by size, and refuses "
            "a budget below the layers before the stage",
            "composed as prunevid+prunevid_llm the groups are the input part's; alone on a clip, or after an input "
            "part that hands none, each temporal step is a group (the official always runs both stages)",
            "decoding attends to the kept tokens in every layer, as the official sliced cache (a masked cache "
            "here); the prompt's layers before the stage saw every token, as officially",
            "the text rows are every prompt position after the image span (on Qwen2.5-VL <|vision_end|> among them, "
            "which PLLaVA's prompt has not); exact ties to the lower index (the official torch.topk leaves them to "
            "the kernel); fp32 scores unless score_dtype=model; a group's count from its own size (the official view(window_size, -1) needs a "
            "segment's dynamic groups equal, which they are at the official cluster ratio)",
        ),
        random_agreement(
            30,
            "test_prunevid_llm.py::test_stage_equals_the_rederived_process_attention",
            "the stage's kept set against a transcription of process_attention on random attention and groups (10 seeds x alpha 0.4, alpha 0.25 and the average rule)",
        ),
        30,
    )
    flops_exact: ClassVar[bool] = True  # no products of its own: maxima and ranks of the attention it is given
    decode_keeps_final: ClassVar[bool] = True  # the official slices the earlier layers' KV cache to the survivors
    decode_keeps_final_everywhere: ClassVar[bool] = True  # every layer up to selected_layer, not from it on

    layer: int = option(
        STAGE_LAYER, ReferenceLayer(1, REFERENCE_DEPTH - 1), "the decoder layer whose input is pruned (official 11)"
    )
    budget_rule: str = option(
        "official", Choice(PRUNEVID_RULES), "official: alpha of each group whatever the budget; average: the budget"
    )
    alpha: float = option(ALPHA, Real(0.0, 1.0), "the share of each group kept under budget_rule=official")
    signal_layer = "previous"  # the official reads the layer's own output attention (not an option)

    @property
    def averages_budget(self) -> bool:
        return self.budget_rule == "average"  # official: alpha of each group, whatever the budget

    @property
    def schedule_follows_tower(self) -> bool:
        return self.budget_rule == "official"  # its count follows each clip's groups: no planned count

    def schedule(self, num_layers: int, num_visual: int, budget: int) -> list[Stage]:
        """One stage at the scaled layer: every token there under ``official`` (the groups decide what survives),
        else the count whose layer average is ``budget``."""
        budget = validate_budget(budget)
        layers = self._layers(num_layers)
        if self.budget_rule == "official":
            return [Stage(layer, num_visual) for layer in layers]
        smallest = math.ceil(layers[0] * num_visual / num_layers)
        if budget < smallest and budget < num_visual:
            raise ValueError(
                f"{self.name} prunes at decoder layer {layers[0]} of {num_layers}, so {num_visual} visual tokens "
                f"average at least {smallest}; raise the budget to {smallest} or use budget_rule=official"
            )
        return solve_schedule(layers, [1.0], num_layers, num_visual, budget)

    def prune(self, stage: Stage, signals: LayerSignals, state: dict[str, Any]) -> Tensor:
        """(k,) ascending alive positions: each group's best attended, ``int(m alpha)`` or its share of the count."""
        self._check_signals(signals)
        n = signals.num_alive
        groups = self._groups(signals, state)
        keep = None if self.budget_rule == "official" else min(stage.keep, n)
        counts = group_counts([group.numel() for group in groups], self.alpha, keep)
        scores = self.model_precision(text_attention(self.inputs(signals).text_probs), signals).cpu()
        return kept_in_groups(scores, groups, counts, self.ties, self.ranking_dtype(signals.model_dtype))

    def _groups(self, signals: LayerSignals, state: dict[str, Any]) -> list[Tensor]:
        """Each group's (m,) alive positions: the input part's (positions among the tokens fed, named by their
        ``FED_KINDS`` where the prefill gives them, else the alive positions themselves), or the temporal steps."""
        groups = state.get(TOKEN_GROUPS)
        alive = signals.alive.cpu()
        if groups is None:
            return step_groups(alive, signals.video_grid)
        kinds = state.get(FED_KINDS)
        if kinds is not None:  # the sequence may hold the tokens fed in another order than the selection's
            groups = [torch.isin(alive, kinds[group]).nonzero().flatten() for group in groups]
        if sum(group.numel() for group in groups) != alive.numel():
            raise ValueError(
                f"{self.name}'s groups hold {sum(g.numel() for g in groups)} tokens, the stage {alive.numel()}"
            )
        return groups
