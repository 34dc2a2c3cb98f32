"""LLaVA-NeXT (LLaVA-1.6) in the Hugging Face layout (``LlavaNextForConditionalGeneration``).

Vision: the CLIP tower runs on every crop of the anyres tiling (the base view, then the tiles of
the best-resolution canvas; ``data.multigrid``), features of ``vision_feature_layer`` without CLS
through the MLP projector, as LLaVA-1.5 on each crop. ``pack_image_features`` then keeps the base
view's 576 patches and the tiles' patches joined into one grid and unpadded; those are the
image's N visual tokens (up to 576 + 48 x 48 = 2,880 at a 672-px canvas), numbered base view
first, then the tile grid row-major (``Prepared.extras["crop_patches"]`` maps each to its crop
patch). The model also puts the learned ``image_newline`` embedding after every tile-grid row.

Newlines are not visual tokens: no pixels, never counted in a budget, never pruned, never a text
query row. They keep their place in the image span (after their row, as ``pack_image_features``
puts them) with the kind ``TEXT_BEFORE`` (kept like the prompt before the image); a pruned row
keeps every newline and the surviving visual tokens in prompt order.

Positions: 1-D RoPE; after input-level selection the prompt is simply shorter (compact), as for
LLaVA-1.5. Uniform's lattice, pooling, ToMe and E2S's novelty blocks need only the grid layout: they run on
each of the two regular grids (``grid_parts``; ``PER_GRID``); a merged token takes its first cell's
place among the newlines (``input_row``). HiPrune is refused on the whole image (its neighbours lie on one grid)
and runs with ``budget_scope=crop`` (each crop's tokens one grid), as its official LLaVA-NeXT code selects per
crop; so does VScan (``pruners.layout.PADDED_CROP_GRID``), its vision stage scanning and merging in each
crop's padded grid (``PaddedCrops``: the tower's padding patches too), then dropping the padding as the official
unpadding.
CLS-attention selectors read each crop's own CLS row (``_crop_cls_rows``, as the official LLaVA-NeXT ports of
VisionZip and FasterVLM). VisionZip runs with ``budget_scope=crop`` only, as its official LLaVA-NeXT code: each
crop's CLS state and keys (``crop_cls_features``, ``crop_cls_keys``), its tokens laid out without newlines
(``pruners.crop_merge``); on the whole image there is no one CLS token. CDPruner runs with a CLIP text tower
(``clip_text``): each visual token's relevance from its own patch state as on LLaVA-1.5
(``LlavaModel.text_relevance``), min-max normalised over the image's tokens also under ``budget_scope=crop``,
as its official LLaVA-NeXT code normalises over all crops (docs/models.md). ``budget_scope=crop``
(``crop_tokens``) splits any input selector's budget evenly over the crops. A selector that allocates the budget
over the crops itself from the base view's attention (thumbnail guidance) reads ``CROP_SIGNALS``: each crop's CLS
logits at the tower's last encoder layer (``_last_cls_logits``) and the crops' layout (``_crop_layout``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch
from torch import Tensor

from prune_audit.errors import PruneAuditError
from prune_audit.models.base import without_direct_forwards
from prune_audit.models.batch import TokenRow
from prune_audit.models.kinds import TEXT_AFTER, TEXT_BEFORE, input_kinds
from prune_audit.models.llava import LAYER_SIGNALS, LlavaModel
from prune_audit.models.prefill_assembly import token_row
from prune_audit.models.prepared import Prepared, VisionOutput, find_image_span
from prune_audit.models.probe import clip_attention_block, clip_cls_row
from prune_audit.models.selector_support import crop_grid_for, per_grid_for, refused_for
from prune_audit.pruners.base import Selection
from prune_audit.pruners.layout import (
    GRID_BLOCKS,
    GRID_MERGE,
    GRID_SPLIT,
    ONE_CLS,
    ONE_GRID,
    PADDED_CROP_GRID,
)
from prune_audit.pruners.signals import PADDED_CROPS, PaddedCrops

#: what the anyres image lacks for a selector that needs one grid, one CLS token or a crop's padded grid on the
#: whole image (``Selector.layout_need``): those whose official LLaVA-NeXT code selects in each crop's own grid
#: run with ``budget_scope=crop`` (``Selector.per_crop_grid``)
LACKS = frozenset({ONE_GRID, ONE_CLS, PADDED_CROP_GRID})
#: how a selector that needs only a grid layout runs on each of the image's two regular grids (``grid_parts``),
#: by its ``Selector.per_grid`` kind: a project choice (none has official LLaVA-NeXT code), docs/models.md
MERGE_PER_GRID = (
    "per grid: it merges within the base view's grid and within the tile grid, the budget split over "
    "them in proportion to their tokens, each merged token placed at its first cell among the row "
    "newlines (a project choice, no official code)"
)
PER_GRID = MappingProxyType(
    {
        GRID_BLOCKS: "per grid: its novelty blocks split the base view's grid and the tile grid each (a project choice; "
        "E2S has no public code)",
        GRID_MERGE: MERGE_PER_GRID,
        GRID_SPLIT: "per grid: the budget split over the base view's grid and the tile grid in proportion to their "
        "tokens (a project choice, no official code); with --option budget_scope=crop an even share per crop",
    }
)
#: the anyres crops as a thumbnail-guided selector reads them: each crop's CLS logits at the tower's last encoder
#: layer and the crops' layout (``InputSignals.last_cls_logits``, ``crop_layout``)
CROP_SIGNALS = frozenset({"last_cls_logits", "crop_layout"})
NEWLINE_KIND = TEXT_BEFORE  # kept like the text before the image: never pruned, never a query row


@without_direct_forwards  # LLaVA-1.5's single-crop direct forwards do not see the anyres crops
class LlavaNextModel(LlavaModel):
    """LLaVA-NeXT adapter (one image per prompt, anyres tiling with unpadding and row newlines)."""

    family = "llava_next"
    input_signals = frozenset(
        {"features", "demand", "vision_features", "cls_attention", "vision_keys", "cls_feature", "text_relevance"}
        | {"crop_merging_tower"}
        | LAYER_SIGNALS
        | CROP_SIGNALS
    )
    # one CLS row and its keys per crop (the last encoder layer's for last_cls_logits: the same products)
    cls_probe_signals = frozenset({"cls_attention", "vision_keys", "last_cls_logits"})
    layer_probe_signals = LAYER_SIGNALS  # every crop's encoder attention
    missing_signals_reason = (
        "its visual tokens form two grids (base view and unpadded tiles), each crop with its own CLS token; "
        "selectors on one grid or one CLS run per crop (budget_scope=crop) only where their official LLaVA-NeXT "
        "code does (hiprune, visionzip, vscan)"
    )
    display_name = "LLaVA-NeXT"
    grounding = None  # anyres tiles, no padded square: LLaVA-1.5's box frame does not apply
    several_crops = True
    lacks = LACKS
    crop_grid_selectors = crop_grid_for(lacks)
    per_grid_selectors = per_grid_for(PER_GRID, lacks)
    token_grids = "several grids"
    refused_selectors = refused_for(lacks)

    @classmethod
    def transformers_class(cls) -> type:
        from transformers import LlavaNextForConditionalGeneration

        return LlavaNextForConditionalGeneration

    @classmethod
    def build_tiny(
        cls, save_dir: str | Path, *, words: Sequence[str], text_layers: int = 2, seed: int = 0, image_size: int = 56
    ) -> Path:
        """A random-weight checkpoint of this family for offline tests (:func:`build_llava_next`)."""
        return build_llava_next(save_dir, words=words, text_layers=text_layers, seed=seed, tile=image_size)

    def __init__(
        self,
        model,
        processor,
        *,
        model_id: str,
        prompt_template: str | None = None,
        system_prompt: str | None = None,
        clip: tuple[Any, Any] | None = None,
    ):
        image_processor = processor.image_processor
        tile = model.config.vision_config.image_size
        size, crop = dict(image_processor.size), dict(image_processor.crop_size)
        if (
            size.get("shortest_edge", size.get("height")) != tile
            or crop.get("height") != tile
            or (crop.get("width") != tile)
        ):
            raise PruneAuditError(
                f"{model_id}: the LLaVA-NeXT processor's size {size} and crop_size {crop} must both be the tower's "
                f"{tile}-px input (each crop is then used whole)"
            )
        super().__init__(
            model, processor, model_id=model_id, prompt_template=prompt_template, system_prompt=system_prompt, clip=clip
        )
        self.tile = tile
        self.pinpoints = [tuple(int(side) for side in pair) for pair in model.config.image_grid_pinpoints]

    def tiling_parameters(self) -> dict[str, Any]:
        """The anyres tiling parameters of ``data.multigrid``: the config's pinpoints, tile and patch side."""
        return {
            "pinpoints": self.pinpoints,
            "tile": self.tile,
            "patch_size": self.model.config.vision_config.patch_size,
        }

    def token_geometry(self, image_size: tuple[int, int]):
        """The base view plus the unpadded anyres tile grid (``data.multigrid.anyres_geometry``)."""
        from prune_audit.data.multigrid import anyres_geometry

        return anyres_geometry(image_size, **self.tiling_parameters())

    def prepare(self, image, question: str) -> Prepared:
        from prune_audit.data.multigrid import anyres_crop_patches

        image = image.convert("RGB")
        encoded = self.processor(images=image, text=self.prompt(question), return_tensors="pt")
        input_ids = encoded["input_ids"][0]
        start, end = find_image_span(input_ids, self.model.config.image_token_id)
        layout = self.tiling_parameters()
        geometry = self.token_geometry(image.size)
        base, tiles = geometry.grids
        if geometry.num_tokens + tiles.grid_rows != end - start:
            raise PruneAuditError(
                f"the prompt holds {end - start} image tokens but the anyres geometry gives {geometry.num_tokens} "
                f"visual tokens and {tiles.grid_rows} newlines; check the processor's image_grid_pinpoints"
            )
        return Prepared(
            input_ids=input_ids,
            image_span=(start, end),
            grid=geometry.grid,
            pixel_values=encoded["pixel_values"][0],
            question=question,
            image_size=image.size,
            geometry=geometry,
            extras={
                "image_sizes": encoded["image_sizes"],
                "visual_columns": visual_columns(start, base.num_tokens, tiles.grid),
                "crop_patches": torch.from_numpy(anyres_crop_patches(image.size, **layout)),
            },
        )

    # ----- vision ---------------------------------------------------------------------
    def _vision(self, prepared: Sequence[Prepared], requires: frozenset[str]) -> list[VisionOutput]:
        outputs = []
        for item in prepared:  # images have different crop counts: one tower call per image
            crops = item.pixel_values.to(self.device, self.dtype)
            hidden = self._tower_states(crops)
            order = item.extras["crop_patches"].to(self.device)  # (N,) crop-major patch of each visual token
            patches = hidden[self.feature_index][:, 1:]  # (K, P, Dv), CLS dropped
            visual = patches.flatten(0, 1)[order]  # (N, Dv)
            projector = self.model.model.multi_modal_projector
            padded = projector(patches) if PADDED_CROPS in requires else None  # (K, P, D): padding patches too
            signals = {}
            if requires & {"vision_features", "text_relevance"}:
                signals["vision_features"] = visual
            if requires & {"cls_attention", "vision_keys"}:
                probs, keys = self._crop_cls_rows(hidden)  # (H, K, 1 + P), (H, K, 1 + P, d)
                if "cls_attention" in requires:
                    signals["cls_attention"] = probs[:, :, 1:].flatten(1)[:, order]
                if "vision_keys" in requires:  # no image-wide CLS: index 0 NaN, each crop's own in crop_cls_keys
                    patch_keys = keys[:, :, 1:].flatten(1, 2)[:, order]
                    signals["vision_keys"] = torch.cat([torch.full_like(patch_keys[:, :1], torch.nan), patch_keys], 1)
                    signals["crop_cls_keys"] = keys[:, :, 0]
            if "cls_feature" in requires:  # each crop's CLS state; a subset within one crop reads its own
                signals["crop_cls_features"] = hidden[self.feature_index][:, 0]
            if requires & {"cls_feature", "vision_keys"}:
                signals["token_crops"] = self._token_crops(item).to(self.device)
            if "last_cls_logits" in requires:
                signals["last_cls_logits"] = self._last_cls_logits(hidden)[:, 1:].flatten()[order]
            if "crop_layout" in requires:
                signals["crop_layout"] = self._crop_layout(item).to(self.device)
            per_crop = self._layer_signals(hidden) if requires & (LAYER_SIGNALS | {PADDED_CROPS}) else {}
            # each (K, Lv, P) over the crops, to (Lv, N) in visual-token order
            signals.update(
                {
                    name: value.transpose(0, 1).flatten(1)[:, order]
                    for name, value in per_crop.items()
                    if name.removeprefix("model_") in requires
                }
            )
            if "crop_merging_tower" in requires:
                signals["crop_merging_tower"] = partial(self._crop_merging_tower, crops, order.cpu())
            if padded is not None:
                side = self.tile // self.model.config.vision_config.patch_size
                signals[PADDED_CROPS] = PaddedCrops(
                    per_crop["layer_cls_attention"],
                    per_crop.get("model_layer_cls_attention"),
                    padded.float(),
                    (side, side),
                    order.cpu(),
                )
            features = projector(visual) if padded is None else padded.flatten(0, 1)[order]
            outputs.append(VisionOutput(features, signals))
        return outputs

    def _crop_merging_tower(self, crops: Tensor, order: Tensor, step: Callable) -> tuple[Tensor, Tensor]:
        """``InputSignals.crop_merging_tower``: the tower on the (K, 3, H, W) ``crops`` up to the feature layer with
        ``step`` between the attention and the MLP of every layer (FlowCut's anyres cuts, every crop keeping as
        many patches): the (K, 1 + M, Dv) states, each crop's CLS first, and the (K, M) visual token of each kept
        crop patch (-1 where unpadding drops it), from ``order`` (N,) the crop-major patch of each visual token.
        Each crop's attention is :func:`clip_attention_block` on that crop alone, as the batched tower computes it."""
        tower = self.vision_tower
        hidden = tower.pre_layrnorm(tower.embeddings(crops))  # (K, 1 + P, Dv)
        tokens = torch.full((hidden.shape[0] * (hidden.shape[1] - 1),), -1, dtype=torch.long)
        tokens[order] = torch.arange(order.numel())
        tokens = tokens.view(hidden.shape[0], -1)
        layers = tower.encoder.layers[: self.feature_index]
        for index, layer in enumerate(layers):
            blocks = [clip_attention_block(layer, crop, None) for crop in hidden]
            metric = torch.stack([step.metric(heads.cls_probs, heads.keys, heads.values) for _, heads in blocks])
            hidden = hidden + torch.stack([attended for attended, _ in blocks])
            hidden, tokens = step(index, len(layers), hidden, metric.cpu(), tokens)
            hidden = hidden + layer.mlp(layer.layer_norm2(hidden))
        return hidden, tokens

    def _crop_cls_rows(self, hidden: list[Tensor]) -> tuple[Tensor, Tensor]:
        """(H, K, 1 + P) each crop's CLS attention over its own 1 + P tokens at the feature layer and
        (H, K, 1 + P, d) that layer's keys, crops in order (CLS at index 0 of each crop).

        As VisionZip's LLaVA-NeXT code (dvlab-research/VisionZip ``visionzip/llava_arch.py``, 3151f6d) and
        FasterVLM's read them: the tower runs on each crop alone, so each crop has its own CLS row, a softmax
        over that crop's 1 + P tokens, and VisionZip merges a crop's contextual tokens by that crop's keys.
        No logits come along (``cls_logits``): one softmax does not span the crops, so ``score_dtype="model"``
        rounds these probabilities instead of recomputing them.
        ``hidden``: the tower states of the K crops, each (K, 1 + P, Dv).
        """
        layer = self.vision_tower.encoder.layers[self.feature_index - 1]  # its output is the feature layer
        probs, keys, _ = clip_cls_row(layer, hidden[self.feature_index - 1])  # (K, H, 1 + P), (K, H, 1 + P, d)
        return probs.transpose(0, 1), keys.transpose(0, 1)

    def _last_cls_logits(self, hidden: list[Tensor]) -> Tensor:
        """(K, 1 + P) each crop's CLS logits ``q . k / sqrt(d)`` at the tower's last encoder layer, head mean.

        As GlobalCom2's customised CLIP attention returns them (xuyang-liu16/GlobalCom2 96b2d00,
        ``apply_customvit.py``: the head mean of the scaled logits before the softmax; ``llava_arch.py`` reads
        ``attn_maps[-1][:, 0, 1:]``). The last layer's input is the output of the layer before it, which
        ``_tower_states`` computes when the feature layer is the penultimate (LLaVA-NeXT's -2) or the last.
        ``hidden``: the tower states of the K crops, each (K, 1 + P, Dv).
        """
        layers = self.vision_tower.encoder.layers
        last = len(layers) - 1
        if last > self.feature_index:
            raise PruneAuditError(
                f"last_cls_logits reads the vision tower's last encoder layer, past vision_feature_layer "
                f"{self.model.config.vision_feature_layer} the tower is run to; use a checkpoint whose feature "
                f"layer is -2 or -1"
            )
        _, _, logits = clip_cls_row(layers[last], hidden[last])  # (K, H, 1 + P)
        return logits.mean(dim=1)

    def _crop_layout(self, item: Prepared) -> Tensor:
        """(4, 2) ``InputSignals.crop_layout``: the base view's grid, the unpadded tile grid, the canvas in tiles
        and the patch rows and columns unpadding cut at the top and left (``data.multigrid.anyres_layout``)."""
        from prune_audit.data.multigrid import anyres_layout

        layout = anyres_layout(item.image_size, **self.tiling_parameters())
        base, _ = item.geometry.grids
        canvas = (layout.canvas[0] // self.tile, layout.canvas[1] // self.tile)
        return torch.tensor([base.grid, layout.grid, canvas, layout.cut])

    def crop_tokens(self, item: Prepared) -> list[tuple[Tensor, tuple[int, int]]]:
        """Per crop, its ascending visual tokens and their (rows, cols): the base view's grid, then each tile's
        unpadded tokens, a rectangle of the tile grid (tiles that unpadding empties are left out)."""
        crop_of = self._token_crops(item)
        base, tiles = item.geometry.grids
        tile_cols = tiles.grid[1]
        crops = []
        for crop in torch.unique(crop_of):
            tokens = torch.nonzero(crop_of == crop).flatten()
            if crop == 0:
                crops.append((tokens, base.grid))
            else:  # the tile's unpadded tokens: the rows and columns of the tile grid that lie in it
                rows = torch.unique((tokens - base.num_tokens) // tile_cols).numel()
                crops.append((tokens, (rows, tokens.numel() // rows)))
        return crops

    def grid_parts(self, item: Prepared) -> list[tuple[Tensor, tuple[int, int]]]:
        """The base view's grid (tokens 0..B-1) and the tile grid after it (unpadded; for LLaVA-OneVision after
        the ``anyres_max`` resize), each regular and row-major."""
        base, tiles = item.geometry.grids
        return [
            (torch.arange(base.num_tokens), base.grid),
            (torch.arange(base.num_tokens, item.num_visual), tiles.grid),
        ]

    def _token_crops(self, item: Prepared) -> Tensor:
        """(N,) the crop (0: base view, then the tiles row-major over the canvas) each visual token was computed in."""
        side = self.tile // self.model.config.vision_config.patch_size
        return item.extras["crop_patches"] // (side * side)

    def tower_crops(self, prepared: Prepared) -> dict[str, Any]:
        """The tower ran on every crop (base view and tiles) of ``tile // patch`` squared patches."""
        side = self.tile // self.model.config.vision_config.patch_size
        return {"crops": int(prepared.pixel_values.shape[0]), "crop_grid": (side, side)}

    def input_row(self, item: Prepared, output: VisionOutput, selection: Selection | None) -> TokenRow:
        """The language-model input of one prompt: the visual tokens fed and every newline, in prompt order.

        A kept token keeps its place among the newlines; a merging selector's output token (pool, ToMe: merged
        within one grid, ``select_per_grid``) takes the place of its first (lowest-index) source cell, so the
        tile grid's newlines stay after the rows they close (a project convention: no official LLaVA-NeXT code
        merges). VisionZip per crop lays its tokens out in its selection's order without newlines, as its
        LLaVA-NeXT code does (``pruners.crop_merge``). Positions are compact (1-D RoPE): the row's own order.
        """
        if selection is not None and selection.in_output_order:  # VisionZip's per-crop layout, no newlines
            return token_row(self, item, output, selection)
        start, end = item.image_span
        device = self.device
        ids = item.input_ids.to(device)
        embed = self.loop.stack.embed_tokens
        visual_at = item.extras["visual_columns"].to(device) - start  # span offset of each visual token
        is_newline = torch.ones(end - start, dtype=torch.bool, device=device)
        is_newline[visual_at] = False
        newline_at = torch.nonzero(is_newline).flatten()
        if selection is None or selection.sources is None:
            kinds = torch.arange(item.num_visual, device=device) if selection is None else selection.kept.to(device)
            visual = output.features[kinds]
        else:
            if any(group.numel() == 0 for group in selection.sources):
                raise PruneAuditError(
                    f"a merged token without grid cells has no place in the {self.display_name} "
                    f"prompt (its tile rows end in newlines)"
                )
            visual = (
                selection.llm_tokens.to(device, self.dtype)
                if selection.llm_tokens is not None
                else self.project(selection.vision_tokens.to(device, self.dtype))
            )
            kinds = torch.tensor(input_kinds(selection.sources, selection.kept), device=device)
            firsts = torch.tensor([int(group.min()) for group in selection.sources], device=device)
        slots = visual_at[kinds if selection is None or selection.sources is None else firsts]
        order = torch.argsort(torch.cat([slots, newline_at]), stable=True)
        newline = self.model.model.image_newline.to(self.dtype).expand(newline_at.numel(), -1)
        span = torch.cat([visual.to(self.dtype), newline])[order]
        span_kinds = torch.cat([kinds, torch.full((newline_at.numel(),), NEWLINE_KIND, device=device)])[order]
        embeddings = torch.cat([embed(ids[:start]), span, embed(ids[end:])])
        before = torch.full((start,), TEXT_BEFORE, device=device)
        after = torch.full((ids.numel() - end,), TEXT_AFTER, device=device)
        row_kinds = torch.cat([before, span_kinds, after])
        return TokenRow(embeddings, row_kinds, torch.arange(row_kinds.numel(), device=device)[None])

    def _family_description(self) -> dict[str, Any]:
        image_processor = self.processor.image_processor
        return {
            "processor": {
                "class": type(image_processor).__name__,
                "mode": "llava_next_anyres",
                "size": dict(image_processor.size),
                "crop_size": dict(image_processor.crop_size),
                "image_grid_pinpoints": [list(pair) for pair in self.pinpoints],
                "patch_size": self.model.config.vision_config.patch_size,
                "vision_feature_layer": self.model.config.vision_feature_layer,
            },
            "clip_text": None if self.clip is None else getattr(self.clip[0].config, "_name_or_path", ""),
        }


def visual_columns(start: int, base_tokens: int, tile_grid: tuple[int, int]) -> Tensor:
    """(N,) prompt column of each visual token of an image span starting at ``start``: the base view's
    ``base_tokens``, then each of the tile grid's rows followed by its newline (``pack_image_features``)."""
    rows, cols = tile_grid
    row_starts = base_tokens + torch.arange(rows) * (cols + 1)
    tile_columns = (row_starts[:, None] + torch.arange(cols)[None]).flatten()
    return start + torch.cat([torch.arange(base_tokens), tile_columns])


def build_llava_next(
    save_dir: str | Path,
    *,
    words: Sequence[str],
    tile: int = 56,
    patch_size: int = 14,
    vision_hidden_size: int = 64,
    vision_layers: int = 2,
    vision_heads: int = 4,
    text_hidden_size: int = 64,
    text_intermediate_size: int = 128,
    text_layers: int = 2,
    text_heads: int = 4,
    seed: int = 0,
) -> Path:
    """Save a randomly initialised ``LlavaNextForConditionalGeneration`` (CLIP + 2-layer projector + Llama) with its
    PIL processor: ``tile``-px crops, canvases of 1 x 2, 2 x 1 and 2 x 2 tiles (LLaVA-1.6's 336-px pinpoints
    scaled to the tile), the LLaVA-1.5 test tokenizer and chat template.

    The real LLaVA-v1.6-Vicuna-7B widths are ``tile=336, vision_hidden_size=1024, vision_layers=24,
    vision_heads=16, text_hidden_size=4096, text_intermediate_size=11008, text_layers=32, text_heads=32``
    (pinpoints up to 672 x 672 and 336 x 1008).
    """
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaNextConfig,
        LlavaNextForConditionalGeneration,
        LlavaNextImageProcessorPil,
        LlavaNextProcessor,
    )

    from prune_audit.models.build import (
        LLAVA_CHAT_TEMPLATE,
        LLAVA_TEMPLATE_WORDS,
        SPECIAL_TOKENS,
        _vocabulary,
        word_level_tokenizer,
    )

    if tile % patch_size:
        raise ValueError(f"tile {tile} must be a multiple of patch_size {patch_size}")
    save_dir = Path(save_dir)
    tokenizer = word_level_tokenizer(_vocabulary(words, SPECIAL_TOKENS, LLAVA_TEMPLATE_WORDS))
    pinpoints = [[tile, 2 * tile], [2 * tile, tile], [2 * tile, 2 * tile]]
    vision = CLIPVisionConfig(
        hidden_size=vision_hidden_size,
        intermediate_size=2 * vision_hidden_size,
        num_hidden_layers=vision_layers,
        num_attention_heads=vision_heads,
        image_size=tile,
        patch_size=patch_size,
        hidden_act="quick_gelu",
    )
    text = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=text_hidden_size,
        intermediate_size=text_intermediate_size,
        num_hidden_layers=text_layers,
        num_attention_heads=text_heads,
        num_key_value_heads=text_heads,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    config = LlavaNextConfig(
        vision_config=vision,
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        image_grid_pinpoints=pinpoints,
        image_seq_length=(tile // patch_size) ** 2,
    )
    torch.manual_seed(seed)
    model = LlavaNextForConditionalGeneration(config).eval()
    image_processor = LlavaNextImageProcessorPil(
        size={"shortest_edge": tile}, crop_size={"height": tile, "width": tile}, image_grid_pinpoints=pinpoints
    )
    processor = LlavaNextProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=patch_size,
        vision_feature_select_strategy="default",
        chat_template=LLAVA_CHAT_TEMPLATE,
        num_additional_image_tokens=1,
    )
    model.save_pretrained(save_dir)
    processor.save_pretrained(save_dir)
    return save_dir


__all__ = ["LlavaNextModel", "build_llava_next", "visual_columns", "LACKS", "PER_GRID", "CROP_SIGNALS"]
