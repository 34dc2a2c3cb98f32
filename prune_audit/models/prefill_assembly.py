"""The pruned prefill's assembly, between a family's vision output and the language loop.

:meth:`VisionLanguageModel.prefill <prune_audit.models.base.VisionLanguageModel.prefill>` runs the vision tower
once, then for each prompt: the input-level selection (:func:`select_input`, on the :func:`input_signals` the
family provides), the language-model input row (the family's ``input_row``, by default :func:`token_row`), and
for in-LLM selectors the per-layer plan (:func:`layer_plan`). These read the model only through its public
surface: the family hooks the prefill uses (``full_positions``, ``project``, ``text_relevance``, ``input_row``,
``positions_for``) and its declarations (``input_positions``, ``family``), so the class holds the hooks and the
public API and this module the assembly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from prune_audit.errors import PruneAuditError
from prune_audit.models.batch import TokenRow
from prune_audit.models.executor import LayerPlan
from prune_audit.models.kinds import TEXT_AFTER, TEXT_BEFORE, input_kinds, input_registry
from prune_audit.models.layer_signals import text_demand
from prune_audit.models.prepared import ForcedStages, Prepared, VisionOutput
from prune_audit.pruners.base import FED_KINDS, InputSelector, LayerSelector, Selection, Stage
from prune_audit.pruners.crop_merge import select_merging_per_crop
from prune_audit.pruners.crop_scope import select_per_crop, select_per_grid
from prune_audit.pruners.frame_scope import runs_per_frame, select_per_frame
from prune_audit.pruners.serving import TOWER_HOOK_SIGNALS
from prune_audit.pruners.signals import PADDED_CROPS, VISION_LAYER_SIGNALS, InputSignals

if TYPE_CHECKING:  # the model is passed in; importing base at run time would be a cycle
    from prune_audit.models.base import VisionLanguageModel


def select_input(
    vlm: VisionLanguageModel,
    item: Prepared,
    output: VisionOutput,
    selector: InputSelector | None,
    budget: int | None,
    generator: torch.Generator | None,
    requires: frozenset[str],
    forced: Sequence[int] | None,
) -> Selection:
    """The input-level selection of one prompt: the ``forced`` kept indices (sorted, deduplicated, checked to lie
    in ``[0, item.num_visual)``), else ``selector`` at ``budget`` on the signals it ``requires`` (per crop under
    ``budget_scope="crop"``, a merging selector's crops joined as VisionZip's LLaVA-NeXT code joins them; per
    regular grid for the family's ``per_grid_selectors``; on a clip per temporal step for a ``per_frame`` selector)."""
    if forced is not None:
        kept = torch.as_tensor(sorted({int(i) for i in forced}), dtype=torch.long)
        if kept.numel() and (kept[0] < 0 or kept[-1] >= item.num_visual):
            raise PruneAuditError(f"forced kept indices must lie in [0, {item.num_visual})")
        return Selection(kept=kept)
    signals = input_signals(vlm, item, output, requires)
    per_crop = getattr(selector, "budget_scope", "image") == "crop"
    try:
        if per_crop and selector.merges:
            return select_merging_per_crop(selector, signals, vlm.crop_tokens(item), budget, generator)
        if per_crop:
            return select_per_crop(selector, signals, vlm.crop_tokens(item), budget, generator)
        if runs_per_frame(selector, item.video_grid):
            return select_per_frame(selector, signals, budget, generator)
        if selector.name in vlm.per_grid_selectors:
            return select_per_grid(selector, signals, vlm.grid_parts(item), budget, generator)
        return selector.select(signals, budget, generator)
    except ValueError as error:
        raise PruneAuditError(
            f"selector {selector.name!r} failed at budget {budget} on a {item.grid[0]}x{item.grid[1]} grid: {error}"
        ) from None


def input_signals(
    vlm: VisionLanguageModel, item: Prepared, output: VisionOutput, requires: frozenset[str]
) -> InputSignals:
    """What an input-level selector reads for one prompt: the (N, D) features and the vision output's signals in
    float32, plus CDPruner's (N,) text relevance and the (N,) text demand when ``requires`` names them. Deferred
    features (a tower-rerunning selector's, :class:`VisionOutput`) stay unread: None."""
    features = None if output.deferred else output.features.float()
    signals = InputSignals(grid=item.grid, features=features, model_dtype=vlm.dtype)
    for name, value in output.signals.items():
        setattr(signals, name, value.float() if isinstance(value, torch.Tensor) else value)  # merging_tower: a function
    if "text_relevance" in requires:
        relevance, in_model_dtype = vlm.text_relevance(item, output)
        signals.text_relevance, signals.model_text_relevance = relevance.float(), in_model_dtype.float()
    if "demand" in requires:
        signals.demand = text_demand(vlm.loop.stack, vlm.input_row(item, output, None))
    return signals


def token_row(vlm: VisionLanguageModel, item: Prepared, output: VisionOutput, selection: Selection | None) -> TokenRow:
    """The language-model input of one prompt whose visual tokens fill its image span in grid order: (L', D)
    embeddings with the selection applied (kept features, or merged tokens through the projector), (L',) kinds
    (grid index, a merged kind (``input_kinds``) or a text kind) and (P, L') position ids: renumbered under 'compact' input positions,
    else the unpruned prompt's columns."""
    start, end = item.image_span
    device = vlm.device  # a property that walks the parameters: read once
    ids = item.input_ids.to(device)
    embed = vlm.loop.stack.embed_tokens
    if selection is None:
        visual, kinds = output.features, torch.arange(item.num_visual, device=device)
    elif selection.sources is None:
        kept = selection.kept.to(device)
        visual, kinds = output.features[kept], kept
    else:
        visual = (
            selection.llm_tokens.to(device, vlm.dtype)
            if selection.llm_tokens is not None
            else vlm.project(selection.vision_tokens.to(device, vlm.dtype))
        )
        kinds = torch.tensor(input_kinds(selection.sources, selection.kept), device=device)
    embeddings = torch.cat([embed(ids[:start]), visual.to(vlm.dtype), embed(ids[end:])])
    before = torch.full((start,), TEXT_BEFORE, device=device)
    after = torch.full((ids.numel() - end,), TEXT_AFTER, device=device)
    all_kinds = torch.cat([before, kinds, after])
    full = vlm.full_positions(item).to(device)
    if selection is not None and vlm.input_positions == "compact":
        positions = torch.arange(all_kinds.numel(), device=device)[None].expand(full.shape[0], -1)
    elif selection is not None and bool((kinds < 0).any()):
        raise PruneAuditError(f"merged tokens have no original position on {vlm.family}")
    else:  # original columns: text before, the kept grid cells, text after
        text_after = torch.arange(end, ids.numel(), device=device)
        columns = torch.cat([torch.arange(start, device=device), start + kinds, text_after])
        positions = full[:, columns]
    return TokenRow(embeddings, all_kinds, positions)


def vision_layer_requests(vlm: VisionLanguageModel, selector: LayerSelector) -> frozenset[str]:
    """What the in-LLM ``selector`` asks the vision tower for on ``vlm``: the vision-layer signals it reads, and
    ``PADDED_CROPS`` (every crop's padded patches) when it reads them with ``budget_scope="crop"`` (VScan)."""
    requests = vlm.signals_for(selector) & VISION_LAYER_SIGNALS
    return requests | {PADDED_CROPS} if requests and getattr(selector, "budget_scope", "") == "crop" else requests


def reruns_tower_only(requests: frozenset[str]) -> bool:
    """Whether a vision request (an input selector's signals and the in-LLM part's vision-layer ones) is the tower
    rerun alone (``merging_tower``: ToMe ``location=tower``, FlowCut): the rerun is then the tower's one pass and the
    stock pass is deferred (:class:`VisionOutput`); any other signal reads the stock tower's states, so it runs."""
    return requests == TOWER_HOOK_SIGNALS


def layer_plan(
    vlm: VisionLanguageModel,
    prepared: Sequence[Prepared],
    selector: LayerSelector | None,
    budget: int | None,
    forced_stages: Sequence[ForcedStages] | None,
    selections: Sequence[Selection | None] | None = None,
) -> LayerPlan:
    """The in-LLM plan of a batch: each row's stages from ``forced_stages`` ((layer, kept indices) per stage),
    else ``selector``'s schedule at ``budget`` on the model's depth; every stage layer checked to exist.

    ``selections``: each row's input-level selection when one ran first (a composed selector, or an in-LLM
    selector's own tower stage): the schedule is solved on the tokens it feeds, its merged tokens' grid sources open
    the row's registry (``input_kinds``) and its ``llm_state`` the row's stage state.
    """
    grids = [item.grid for item in prepared]
    positions = vlm.positions_for(selector)  # in-LLM or forced stages: the family's layer position mode
    forced = None
    if forced_stages is not None:
        stages, forced = [], []
        for entries in forced_stages:
            ordered = sorted(entries, key=lambda entry: entry[0])
            stages.append([Stage(int(layer), len(set(kept))) for layer, kept in ordered])
            forced.append([torch.as_tensor(sorted(set(kept)), dtype=torch.long) for _, kept in ordered])
    else:
        fed = [
            item.num_visual if chosen is None else chosen.num_output_tokens
            for item, chosen in _rows(prepared, selections)
        ]
        stages = [vlm.schedule(selector, count, budget) for count in fed]
    for row in stages:
        for stage in row:
            if not 0 <= stage.layer < vlm.num_layers:
                raise PruneAuditError(f"stage layer {stage.layer} outside the model's {vlm.num_layers} layers")
    parts = [tuple(grid for _, grid in vlm.grid_parts(item)) for item in prepared]  # LLaVA-NeXT: base view, tiles
    merged = [
        [] if chosen is None or chosen.sources is None else input_registry(chosen.sources, chosen.kept)
        for _, chosen in _rows(prepared, selections)
    ]
    # a selector's own tower stage or a composed input part opens its rows' stage state (MustDrop's key set,
    # PruneVid's groups), with the kinds its positions among the tokens fed stand for
    states = [opened_state(chosen) for _, chosen in _rows(prepared, selections)]
    clips = [item.video_grid for item in prepared]  # a clip's (T, h, w): the frames of a temporal selector
    return LayerPlan(
        stages, grids, positions, selector, forced, states=states, merged=merged, grid_parts=parts, video_grids=clips
    )


def opened_state(chosen: Selection | None) -> dict:
    """A row's stage state from its input-level selection: its ``llm_state`` and, when that is not empty, the kinds
    of the tokens it fed in output order (``FED_KINDS``)."""
    if chosen is None or not chosen.llm_state:
        return {}
    kinds = chosen.kept.tolist() if chosen.sources is None else input_kinds(chosen.sources, chosen.kept)
    return {**chosen.llm_state, FED_KINDS: torch.tensor(kinds, dtype=torch.long)}


def _rows(
    prepared: Sequence[Prepared], selections: Sequence[Selection | None] | None
) -> list[tuple[Prepared, Selection | None]]:
    """Each prompt with its input-level selection (None where none ran)."""
    return list(zip(prepared, selections if selections is not None else [None] * len(prepared)))


__all__ = ["select_input", "input_signals", "token_row", "vision_layer_requests", "layer_plan"]
