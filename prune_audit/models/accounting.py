"""What one answered question's prefill ran on, as :class:`~prune_audit.compute.cost.QuestionTokens`.

The models layer knows which signals were computed and how many tokens each part saw; the
arithmetic is ``prune_audit.compute``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from prune_audit.compute.cost import PrefillCost, QuestionTokens, StageProbe, prefill_cost
from prune_audit.models.layer_signals import (
    ATTENTION_SIGNALS,
    KEY_SIGNALS,
    ROPE_SIGNALS,
    VALUE_SIGNALS,
    VISUAL_ROW_SIGNALS,
)
from prune_audit.models.prefill_assembly import reruns_tower_only, vision_layer_requests
from prune_audit.pruners.arithmetic import SelectorWork
from prune_audit.pruners.base import Selection
from prune_audit.pruners.composed import RunSelector, budget_parts, selector_parts
from prune_audit.pruners.crop_scope import crop_budgets
from prune_audit.pruners.frame_scope import frame_flops, runs_per_frame
from prune_audit.pruners.signals import LAST_LAYER_CLS_SIGNALS, PADDED_CROPS, STEP_ATTENTION

if TYPE_CHECKING:
    from prune_audit.models.answers import Answer
    from prune_audit.models.base import VisionLanguageModel
    from prune_audit.models.prepared import Prepared


def question_cost(
    vlm: VisionLanguageModel,
    item: Prepared,
    answer: Answer,
    selector: RunSelector | None,
    budget: Any,
    selection: Selection | None,
    forced: bool,
) -> PrefillCost:
    """The cost columns of ``answer``, the prefill of ``item`` under ``selector`` at ``budget``.

    ``forced``: the kept sets were given (``forced_kept`` / ``forced_stages``), so no selector ran. A composed
    selector counts both parts: the input part's signals and arithmetic on the image's tokens, the in-LLM part's
    probes and arithmetic on the tokens the input part fed (its stages follow the input stage in ``answer``).
    """
    shape = vlm.shape
    text_tokens = item.input_ids.numel() - item.num_visual
    # a selection in its own output order is fed without the image's layout tokens (LLaVA-NeXT's newlines)
    unlaid = item.image_span[1] - item.image_span[0] - item.num_visual if selection and selection.in_output_order else 0
    text_after = item.input_ids.numel() - item.image_span[1]
    input_ran, llm_ran = selector_parts(selector if not forced else None)
    input_budget, llm_budget = budget_parts(selector, budget)
    input_requires = vlm.signals_for(input_ran) if input_ran is not None else frozenset()
    layer_requires = vlm.signals_for(llm_ran) if llm_ran is not None else frozenset()
    fed = item.num_visual if selection is None else selection.num_output_tokens
    alive = [fed]  # visual tokens before each in-LLM stage, then after the last
    if llm_ran is not None:
        # the input stage's entry (after any vision-tower cuts) leads a composed answer's stages
        first = 1 + len(selection.tower_stages) if selection is not None else 0
        llm_stages = zip(answer.kept_stages[first:], answer.merged_stages[first:])
        alive += [len(kept) + len(merged) for kept, merged in llm_stages]
    rope, visual_rows = bool(layer_requires & ROPE_SIGNALS), bool(layer_requires & VISUAL_ROW_SIGNALS)
    probes = tuple(
        StageProbe(text_tokens - unlaid + before, text_after + (before if visual_rows else 0),
                   bool(layer_requires & ATTENTION_SIGNALS), bool(layer_requires & KEY_SIGNALS), before if rope else 0,
                   bool(layer_requires & VALUE_SIGNALS))
        for before in alive[:-1]
    )  # fmt: skip
    tower_merges, tower_crop_stages = (), ()
    crops = vlm.tower_crops(item)
    if "merging_tower" in input_requires:  # the tower run with the selector's step merging or cutting in it
        stages = [(layer, len(kept)) for layer, kept in zip(answer.stage_layers, answer.kept_stages)]
        tower_merges = input_ran.tower_merges(item.num_visual, input_budget, shape.vision.layers, stages)
    elif selection is not None and selection.tower_crop_merges:  # that run on each crop alone (FlowCut anyres)
        tower_merges, patches = selection.tower_crop_merges, crops["crop_grid"][0] * crops["crop_grid"][1]
        tower_crop_stages = ((patches, patches - sum(tower_merges)),) * crops["crops"]
    vision_layer = vision_layer_requests(vlm, llm_ran) if llm_ran is not None else frozenset()
    # as the prefill decides: a run tower with merges or cuts stands in for the stock pass unless another signal
    # reads the stock states (the stock pass that keeps every token runs no rerun: no tower_merges)
    stock_tower = not (tower_merges and reruns_tower_only(input_requires | vision_layer))
    crop_stages = ()
    if layer_requires and PADDED_CROPS in vision_layer:  # VScan per crop: padded grids
        patches = crops["crop_grid"][0] * crops["crop_grid"][1]
        crops["projected_tokens"] = crops["crops"] * patches  # the padding patches are projected too
        vision_keep = vlm.schedule(llm_ran, fed, llm_budget)[0].keep
        if vision_keep < fed:  # else every token is kept, nothing scanned
            crop_stages = tuple(
                (patches, llm_ran.scan_count(share, crops["crop_grid"]))
                for share in crop_budgets(vision_keep, [patches] * crops["crops"])
            )
    work = {"feature_width": shape.language.hidden, "vision_width": shape.vision.width,
            "key_width": vlm.vision_head_dim, "hidden": shape.language.hidden, "text_rows": text_after,
            "kv_width": shape.language.kv_heads * shape.language.head_dim}  # fmt: skip
    arithmetic = 0
    if input_ran is not None:
        input_work = SelectorWork(
            tokens=item.num_visual,
            kept=input_budget,
            stages=(),
            options=input_ran.options(),
            tower_merges=tower_merges,
            grid=item.grid,
            crop_stages=tower_crop_stages,
            sizes=selection.work_sizes if selection is not None else (),
            **work,
        )  # fmt: skip
        clip = item.video_grid  # on a clip a per-frame selector ran on each temporal step alone: summed per step
        if clip is not None and runs_per_frame(input_ran, clip):
            arithmetic += frame_flops(input_ran, input_work, clip)
        else:
            arithmetic += input_ran.flops(input_work)
    if llm_ran is not None:
        arithmetic += llm_ran.flops(
            SelectorWork(
                tokens=fed,
                kept=llm_budget,
                stages=tuple(zip(alive[:-1], alive[1:])),
                options=llm_ran.options(),
                crop_stages=crop_stages,
                **work,
            )  # fmt: skip
        )
    merged_inputs = selection is not None and selection.sources is not None and selection.llm_tokens is None
    tokens = QuestionTokens(
        grid=item.grid,
        text_tokens=text_tokens,
        layout_dropped=unlaid,
        text_after=text_after,
        visual_tokens=item.num_visual,
        visual_per_layer=tuple(answer.tokens_per_layer),
        cls_probe=bool(input_requires & vlm.cls_probe_signals),
        last_cls_probe=bool(input_requires & LAST_LAYER_CLS_SIGNALS),
        vision_layer_probe=bool((input_requires | layer_requires) & vlm.layer_probe_signals),
        step_attention=STEP_ATTENTION in input_requires and item.video_grid is not None,
        demand_probe="demand" in input_requires,
        text_chunks=vlm.text_chunks(item) if "text_relevance" in input_requires else 0,
        reprojected=len(selection.sources) if merged_inputs else 0,
        tower_merges=tower_merges,
        # the tower step's own traits (MustDrop's: merges after the MLP, the next layer's CLS row for its key set)
        tower_merges_after_mlp=getattr(input_ran, "merges_after_mlp", False),
        tower_next_cls_row=getattr(input_ran, "reads_next_layer", False) and _layer_after_feature(vlm),
        stock_tower=stock_tower,
        dense_grid=item.dense_grid,
        stage_probes=probes,
        selector_flops=arithmetic,
        **crops,
    )
    return prefill_cost(shape, tokens)


def _layer_after_feature(vlm: VisionLanguageModel) -> bool:
    """Whether the vision tower has a layer after the feature layer (the merging tower's next CLS row runs)."""
    return getattr(vlm.model.config.vision_config, "num_hidden_layers", 0) > vlm.shape.vision.layers


__all__ = ["question_cost"]
