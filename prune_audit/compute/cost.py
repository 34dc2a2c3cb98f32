"""Per-question cost: the record's FLOP, KV-cache and equivalent-token columns from realised token counts."""

from __future__ import annotations

from dataclasses import dataclass

from prune_audit.compute import flops
from prune_audit.compute.shape import ModelShape

SIGNAL_SOURCES: dict[str, str] = {
    "vision_cls_row": "the CLS row of the feature layer's attention, recomputed from its projections (CLS-attention "
    "selectors)",
    "vision_last_cls_row": "the CLS row of the vision tower's last layer's attention and its keys, recomputed from "
    "its projections on its input, the layer before's output (PruMerge's official layer)",
    "vision_layer_attention": "every vision encoder layer's attention recomputed on its input (per-layer vision "
    "signals: HiPrune, VScan)",
    "vision_merging_tower": "the vision tower run with merges or cuts between its layers (ToMe location=tower, "
    "FlowCut), in place of the stock pass",
    "vision_step_attention": "on a clip, the vision tower's last block's queries and keys recomputed on its input, "
    "each temporal step's mean query against its merged tokens' mean keys (FastVID, HoliTom)",
    "clip_text_tower": "the CLIP text tower on the question (CDPruner's text relevance)",
    "decoder_demand_rows": "attention rows of the text after the image at decoder layer 0 over the unpruned prompt "
    "(coverage's demand)",
    "decoder_attention_rows": "attention rows of the text after the image at each in-LLM stage's signal layer, "
    "with that layer's values where read (FlowCut)",
    "decoder_key_norms": "the keys of each in-LLM stage's signal layer, for their norms",
    "decoder_rope_logits": "all-ones RoPE logits of the text after the image against the alive visual tokens "
    "(SparseVLM v2)",
}
"""Where a selector's signals came from beyond the prefill itself, by record value (``signal_sources``), in the
order a record lists them; their FLOPs are in ``flops_vision`` / ``flops_llm``. Attention rows and keys are
probes (``models.probe``: the rows needed, recomputed from the layer's own weights in plain tensor operations),
the merging tower and the CLIP text tower run their own modules; no layer is switched to eager attention, so every
layer runs the run's kernel (manifest ``attn_implementation``)."""


@dataclass(frozen=True)
class StageProbe:
    """A decoder-layer probe an in-LLM stage reads its signals from (``models.layer_signals``).

    Attributes:
        keys: sequence length the probe reads (text + visual tokens alive at the stage).
        queries: query rows of its attention (the text after the image, and the alive visual tokens where
            ``visual_probs`` is read).
        attention: whether attention rows are read (``text_probs`` / ``text_logits`` / ``visual_probs``).
        key_norms: whether key norms are read (a second key projection).
        rope_columns: visual tokens the all-ones RoPE logits are formed against (0: not read).
        values: whether the values of the ``keys`` tokens are read (a value projection).
    """

    keys: int
    queries: int
    attention: bool
    key_norms: bool
    rope_columns: int = 0
    values: bool = False


@dataclass(frozen=True)
class QuestionTokens:
    """What one question's prefill ran on.

    Attributes:
        grid: (rows, cols) of language-model visual tokens (each ``merge x merge`` vision patches).
        text_tokens: prompt tokens that are not visual.
        layout_dropped: of those, the image's layout tokens (LLaVA-NeXT's row newlines) the pruned prompt does not
            hold (a selection fed in its own output order: VisionZip and FlowCut per crop).
        text_after: text tokens after the image.
        visual_tokens: language-model visual tokens of the unpruned prompt (N).
        visual_per_layer: visual tokens at the input of each decoder layer, as realised.
        cls_probe: the CLS-row probe of the feature layer ran.
        last_cls_probe: the CLS-row probe of the tower's last layer ran (on the feature layer's output).
        vision_layer_probe: every encoder layer's attention was recomputed (per-layer vision signals).
        step_attention: a clip's step attention was formed (FastVID's; ``crops`` temporal steps of ``crop_grid``).
        demand_probe: the layer-0 probe over the full prompt ran (coverage's demand).
        text_chunks: CLIP text chunks of CDPruner's relevance (0: not computed).
        reprojected: merged tokens an input-level merge sent through the projector again.
        tower_merges: tokens merged or cut in each layer of the tower run with a selector's step between its layers
            (ToMe ``location=tower``, FlowCut; empty: none ran); where the tower ran on ``crops`` crops, those of
            each crop, every crop cutting as many (FlowCut's anyres stage).
        tower_merges_after_mlp: those merges fell after each layer's MLP, not between attention and MLP (MustDrop).
        tower_next_cls_row: that run also formed the CLS row of the layer after the feature layer (MustDrop's key set).
        stock_tower: the stock tower and the projector ran on every token; False: the tower ran once, as
            ``tower_merges``' run, and the projector on its output tokens (``reprojected``).
        stage_probes: the decoder probes of in-LLM stages.
        selector_flops: the selector's own arithmetic (``Selector.flops``).
        crops: images the vision tower ran on for this question (LLaVA-NeXT: the base view and each tile; a Qwen
            clip: each temporal step, within which its tower attends).
        crop_grid: (rows, cols) patches of each crop when the tower ran on crops; None: ``grid`` times the merge.
        projected_tokens: tokens the projector ran on when not the visual tokens (LLaVA-OneVision projects the
            unpadded tile grid, then downsamples it); None: ``visual_tokens``.
        dense_grid: (rows, cols) of the image as given when the prefill ran on it resized before the processor
            (an image-resizing selector: ``grid`` and ``visual_tokens`` are the resized image's), which the dense
            cost counts; None: ``grid``.
    """

    grid: tuple[int, int]
    text_tokens: int
    text_after: int
    visual_tokens: int
    visual_per_layer: tuple[int, ...]
    cls_probe: bool = False
    last_cls_probe: bool = False
    vision_layer_probe: bool = False
    step_attention: bool = False
    demand_probe: bool = False
    text_chunks: int = 0
    reprojected: int = 0
    tower_merges: tuple[int, ...] = ()
    tower_merges_after_mlp: bool = False
    tower_next_cls_row: bool = False
    stock_tower: bool = True
    stage_probes: tuple[StageProbe, ...] = ()
    layout_dropped: int = 0
    selector_flops: int = 0
    crops: int = 1
    crop_grid: tuple[int, int] | None = None
    projected_tokens: int | None = None
    dense_grid: tuple[int, int] | None = None


@dataclass(frozen=True)
class PrefillCost:
    """The cost columns of one record (docs/compute.md).

    Attributes:
        flops_vision: vision tower to the feature layer, projector, and the vision-side signals
            (CLS probes, per-layer attention probes, CDPruner's CLIP text tower, re-projection of merged tokens);
            a tower run with merges or cuts (ToMe ``location=tower``, FlowCut) in place of the stock tower.
        flops_selector: the selector's own arithmetic.
        flops_llm: decoder layers at their realised lengths, in-LLM probes, the LM head at the last position.
        flops: their sum.
        flops_dense: the same question unpruned (vision tower, projector, every layer at the full length, head).
        flops_decode_token: one generated token after this prefill (its KV cache).
        kv_bytes: KV-cache bytes after the prefill.
        flop_equivalent_tokens: the dense sequence length whose language-model prefill costs
            ``flops - flops_vision_dense`` (the unpruned vision tower and projector are not counted; a selector
            that cuts inside the tower gets its savings there back as tokens).
        signal_sources: the ``SIGNAL_SOURCES`` the selector's signals needed (empty: none), or None when not
            known (a cost imported with another tool's kept sets).
    """

    flops_vision: int
    flops_selector: int
    flops_llm: int
    flops: int
    flops_dense: int
    flops_decode_token: int
    kv_bytes: int
    flop_equivalent_tokens: float
    signal_sources: tuple[str, ...] | None = None


def signal_sources(tokens: QuestionTokens) -> tuple[str, ...]:
    """The ``SIGNAL_SOURCES`` that ran for ``tokens``' question, in their order."""
    stages = tokens.stage_probes
    ran = {
        "vision_cls_row": tokens.cls_probe,
        "vision_last_cls_row": tokens.last_cls_probe,
        "vision_layer_attention": tokens.vision_layer_probe,
        "vision_merging_tower": bool(tokens.tower_merges),
        "vision_step_attention": tokens.step_attention,
        "clip_text_tower": tokens.text_chunks > 0,
        "decoder_demand_rows": tokens.demand_probe,
        "decoder_attention_rows": any(probe.attention or probe.values for probe in stages),
        "decoder_key_norms": any(probe.key_norms for probe in stages),
        "decoder_rope_logits": any(probe.rope_columns for probe in stages),
    }
    return tuple(name for name in SIGNAL_SOURCES if ran[name])


def prefill_cost(shape: ModelShape, tokens: QuestionTokens) -> PrefillCost:
    """The cost columns of one question's prefill."""
    vision, language = shape.vision, shape.language
    patch_grid = tokens.crop_grid or (tokens.grid[0] * vision.merge, tokens.grid[1] * vision.merge)
    stock_tower = tokens.crops * flops.vision_tower(vision, patch_grid) + flops.projector(
        vision, tokens.projected_tokens or tokens.visual_tokens
    )
    dense_tower, dense_visual = stock_tower, tokens.visual_tokens
    if tokens.dense_grid is not None:  # the tower ran on a resized image: the dense one is the image as given
        rows, cols = tokens.dense_grid
        dense_visual = rows * cols
        dense_tower = flops.vision_tower(vision, (rows * vision.merge, cols * vision.merge))
        dense_tower += flops.projector(vision, dense_visual)
    tower = stock_tower if tokens.stock_tower else 0
    # the last layer's probe is the same products as the feature layer's (one CLS query, every key, logits twice)
    signals = tokens.crops * flops.cls_probe(vision, patch_grid) * (tokens.cls_probe + tokens.last_cls_probe)
    signals += tokens.crops * flops.vision_layer_probes(vision, patch_grid) if tokens.vision_layer_probe else 0
    signals += flops.step_attention(vision, patch_grid, tokens.crops) if tokens.step_attention else 0
    if tokens.text_chunks:
        signals += flops.clip_text_relevance(shape.clip_text, tokens.text_chunks, tokens.visual_tokens)  # type: ignore[arg-type]  # text chunks: only with a CLIP text tower
    if tokens.tower_merges:
        signals += tokens.crops * flops.merging_tower(  # on each crop where the tower ran on crops (FlowCut anyres)
            vision, patch_grid, tokens.tower_merges, tokens.tower_merges_after_mlp, tokens.tower_next_cls_row
        )
    signals += flops.projector(vision, tokens.reprojected)
    lengths = [tokens.text_tokens - tokens.layout_dropped + visual for visual in tokens.visual_per_layer]
    full = tokens.text_tokens + tokens.visual_tokens
    probes = sum(
        flops.decoder_probe(language, p.queries, p.keys, p.attention, p.key_norms, p.rope_columns, p.values)
        for p in tokens.stage_probes
    )
    if tokens.demand_probe:
        probes += flops.decoder_probe(language, tokens.text_after, full, attention_rows=True, key_norms=False)
    llm = flops.language_prefill(language, lengths) + probes
    total = tower + signals + tokens.selector_flops + llm
    return PrefillCost(
        flops_vision=tower + signals,
        flops_selector=tokens.selector_flops,
        flops_llm=llm,
        flops=total,
        flops_dense=dense_tower
        + flops.language_prefill(language, [tokens.text_tokens + dense_visual] * language.layers),
        flops_decode_token=flops.decode_token(language, lengths),
        kv_bytes=flops.kv_bytes(language, lengths, shape.dtype_bytes),
        flop_equivalent_tokens=flops.flop_equivalent_tokens(language, total - dense_tower),
        signal_sources=signal_sources(tokens),
    )


__all__ = ["SIGNAL_SOURCES", "StageProbe", "QuestionTokens", "PrefillCost", "signal_sources", "prefill_cost"]
