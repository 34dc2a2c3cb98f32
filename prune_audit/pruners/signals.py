"""The signals a model adapter computes for a selector: per image before the language model
(:class:`InputSignals`) and per layer inside it (:class:`LayerSignals`).

A selector declares the names it reads in ``requires``; the adapter fills only those. Pure tensor code:
no transformers import.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# InputSignals an in-LLM selector may read, per token (with their model-dtype twins where the adapter has them)
VISION_LAYER_SIGNALS = frozenset({"layer_cls_attention", "layer_attention"})
VISION_TOWER_FACTS = frozenset({"vision_tower", "full_attention_layers"})  # InputSignals that travel with them
#: the CLS row and keys of the tower's last encoder layer on the feature layer's output (PruMerge's official layer)
LAST_LAYER_CLS_SIGNALS = frozenset({"last_layer_cls_logits", "last_layer_vision_keys"})
#: what a per-crop in-LLM selector (``budget_scope="crop"``) asks the vision tower for: :class:`PaddedCrops`
PADDED_CROPS = "padded_crops"
#: the InputSignals field only a video clip gives: its temporal token grid (EVS); a still image has none
VIDEO_GRID = "video_grid"
#: the InputSignals field of a clip's tower attention by temporal step (FastVID's salience; Qwen2.5-VL clips)
STEP_ATTENTION = "step_attention"


@dataclass
class PaddedCrops:
    """Every crop's patches as the tower saw them, padding included (LLaVA-NeXT's tiles before unpadding), for a
    selector whose official code scans and merges in each crop's padded grid (VScan).

    Attributes:
        cls_attention: (K, Lv, P) head-mean CLS attention of each of the K crops to its own P patches, per encoder
            layer up to the feature layer (``InputSignals.layer_cls_attention`` before unpadding).
        model_cls_attention: its model-dtype twin (None for a float32 tower).
        features: (K, P, D) float32 projector outputs of every patch (the language model's inputs, padding too).
        grid: (rows, cols) of each crop's patch grid, rows x cols = P.
        patch_of: (N,) crop-major patch (crop x P + patch) of each visual token; the other patches are padding.
    """

    cls_attention: Tensor
    model_cls_attention: Tensor | None
    features: Tensor
    grid: tuple[int, int]
    patch_of: Tensor


@dataclass
class InputSignals:
    """Signals for one image before the language model (no batch dimension).

    Attributes:
        grid: (rows, cols) of the visual token grid; N = rows * cols, row-major.
        features: (N, D) projector outputs (LLM input space); None where only ``merging_tower`` was asked for (that
            run is the image's one tower pass).
        vision_features: (N, Dv) vision features at the feature layer (pre-projector).
        cls_attention: (H, N) CLS-token attention probabilities to the patches at the
            feature layer, not renormalised.
        cls_logits: (H, N + 1) the CLS row's attention logits as the official code forms
            them in the model dtype (query scaled in it, CLS at index 0); with a half
            ``model_dtype``, ``score_dtype="model"`` takes the probabilities from these
            (:func:`cls_probabilities`).
        vision_keys: (H, N + 1, d) that layer's keys, CLS at index 0.
        last_layer_cls_logits: (H, N + 1) as ``cls_logits``, of the tower's last encoder layer on its input (the
            output of the layer before it: LLaVA-1.5's feature layer -2), where the official code hooks that layer's
            q / k projections (PruMerge's layer 23); last_layer_vision_keys: (H, N + 1, d) its keys, CLS at index 0.
        cls_feature: (Dv,) the CLS hidden state at the feature layer.
        token_crops: (N,) on a tower that runs on several crops (LLaVA-NeXT's anyres), the crop each token was
            computed in; there is no image-wide CLS then (``cls_feature`` None, ``vision_keys`` index 0 NaN), and a
            :meth:`subset` within one crop takes that crop's from ``crop_cls_features`` / ``crop_cls_keys``.
        crop_cls_features: (K, Dv) each crop's CLS hidden state at the feature layer; crop_cls_keys: (H, K, d) its
            key at that layer.
        last_cls_logits: (N,) the head mean of the CLS row's attention logits ``q_cls . k_j / sqrt(d)`` (before the
            softmax) at the tower's last encoder layer, each token's from the CLS of the crop it was computed in
            (GlobalCom2's ``attn_maps[-1][:, 0, 1:]``).
        crop_layout: (4, 2) integers of an anyres image (LLaVA-NeXT): the base view's grid (rows, cols) of tokens
            0..B-1; the unpadded tile grid (rows, cols) of the tokens after them, row-major; the canvas in tiles
            (rows, cols), each tile one base-view-sized patch grid; the patch rows and columns unpadding removed at
            the top and at the left of the joined tile grid.
        text_relevance: (N,) CDPruner relevance before normalisation.
        model_text_relevance: (N,) the same as the official code computes it in the model dtype (unit
            embeddings, cosines and their mean each rounded to it; a float32 tensor); with a half
            ``model_dtype``, ``score_dtype="model"`` normalises this one (adapters of half models pass it).
        text_relevance_bounds, model_text_relevance_bounds: (2,) the min and max of the whole image's
            ``text_relevance`` / ``model_text_relevance``, set by :meth:`subset`: a crop's relevance is min-max
            normalised over the image's (CDPruner's LLaVA-NeXT code normalises over all crops at once).
        demand: (N,) demand weights for coverage selection (first-layer probe).
        layer_attention: (Lv, N) per encoder layer run (the feature layer's last): attention each patch gets,
            mean over heads and all 1 + N query rows (HiPrune); layer_cls_attention: the CLS row's (VScan).
            On Qwen2.5-VL every block, each merged token's mean over its 4 patches (``models.qwen``).
        model_layer_attention, model_layer_cls_attention: the same as the official code forms them in a half
            model's dtype (softmax and each mean rounded to it; float32 tensors), passed by half LLaVA adapters;
            ``score_dtype="model"`` reads these (HiPrune, VScan).
        vision_tower: the tower the per-layer signals come from (``"clip"`` or ``"qwen2_5_vl"``): which
            official layer numbers a per-layer selector uses (HiPrune).
        full_attention_layers: rows of ``layer_attention`` of full-attention blocks (Qwen's ``fullatt_block_indexes``).
        merging_tower: ``f(merge) -> (states (1 + M, Dv), sources)``: the tower run to the feature layer with
            ``merge`` between attention and MLP of each layer (ToMe's :class:`~prune_audit.pruners.tome.TowerMerging`).
        crop_merging_tower: on an anyres image (LLaVA-NeXT), ``f(step) -> (states (K, 1 + M, Dv), tokens (K, M))``:
            the tower run on its K crops as one batch to the feature layer with ``step`` between attention and MLP
            of each layer, every crop keeping as many patches (FlowCut's
            :class:`~prune_audit.pruners.flowcut.CropTowerCuts`); ``tokens`` the visual token of each kept crop
            patch, -1 for a tile patch that unpadding drops.
        video_grid: on a video clip, its (T, h, w) token grid after the spatial merge: T temporal steps (each two
            frames on Qwen2.5-VL) of h x w tokens, the N = T * h * w tokens time-major then row-major (``grid`` is
            then (T * h, w)); None on a still image. A :meth:`subset` is no longer the clip and has none.
        step_attention: on a video clip, (N,) the attention each merged token gets from its temporal step's mean
            query in the vision tower's last block: softmax over the step's merged tokens (each the mean key of its
            4 patches), mean over heads (FastVID's ``frame_attn_weights``; the Qwen2.5-VL adapter recomputes it).
        model_dtype: the dtype the model computes the signals in (the adapters pass the
            model's dtype; float32 for hand-built signals); ``score_dtype="model"`` rounds to it.
    """

    grid: tuple[int, int]
    features: Tensor | None = None
    vision_features: Tensor | None = None
    cls_attention: Tensor | None = None
    cls_logits: Tensor | None = None
    vision_keys: Tensor | None = None
    last_layer_cls_logits: Tensor | None = None
    last_layer_vision_keys: Tensor | None = None
    cls_feature: Tensor | None = None
    token_crops: Tensor | None = None
    crop_cls_features: Tensor | None = None
    crop_cls_keys: Tensor | None = None
    last_cls_logits: Tensor | None = None
    crop_layout: Tensor | None = None
    text_relevance: Tensor | None = None
    model_text_relevance: Tensor | None = None
    text_relevance_bounds: Tensor | None = None
    model_text_relevance_bounds: Tensor | None = None
    demand: Tensor | None = None
    layer_attention: Tensor | None = None
    layer_cls_attention: Tensor | None = None
    model_layer_attention: Tensor | None = None
    model_layer_cls_attention: Tensor | None = None
    vision_tower: str = "clip"
    full_attention_layers: tuple[int, ...] = ()
    merging_tower: Callable[[Any], tuple[Tensor, list[Tensor]]] | None = None
    crop_merging_tower: Callable[[Any], tuple[Tensor, Tensor]] | None = None
    video_grid: tuple[int, int, int] | None = None
    step_attention: Tensor | None = None
    model_dtype: torch.dtype = torch.float32

    @property
    def num_tokens(self) -> int:
        return self.grid[0] * self.grid[1]

    def subset(self, tokens: Tensor, grid: tuple[int, int] | None = None) -> InputSignals:
        """The signals of the visual tokens ``tokens`` ((M,) ascending indices) alone, laid on ``grid``
        ((rows, cols) with rows x cols = M, row-major; default one (1, M) row).

        Per-token tensors are sliced along their token axis (``cls_logits``, ``vision_keys`` and their
        ``last_layer_`` twins keep the CLS at index 0); image-level ones (``cls_feature``, the tower facts)
        stay. Tokens of one crop of a several-crop tower get that crop's CLS feature and key (``token_crops``;
        no several-crop family gives the ``last_layer_`` signals); the relevance keeps the image's bounds
        (``text_relevance_bounds``). The merging tower reruns the whole image, so it does not
        come along.
        """
        with_cls = torch.cat([tokens.new_zeros(1), tokens + 1])
        token_axis = {  # signal -> (its token axis, the indices along it)
            **dict.fromkeys(
                (
                    "features",
                    "vision_features",
                    "text_relevance",
                    "model_text_relevance",
                    "demand",
                    "token_crops",
                    "last_cls_logits",
                ),
                (0, tokens),
            ),
            **dict.fromkeys(
                (
                    "cls_attention",
                    "layer_attention",
                    "layer_cls_attention",
                    "model_layer_attention",
                    "model_layer_cls_attention",
                ),
                (1, tokens),
            ),
            **dict.fromkeys(
                ("cls_logits", "vision_keys", "last_layer_cls_logits", "last_layer_vision_keys"), (1, with_cls)
            ),
        }
        sliced = {}
        for name, (axis, index) in token_axis.items():
            value = getattr(self, name)
            sliced[name] = None if value is None else value.index_select(axis, index.to(value.device))
        grid = grid or (1, int(tokens.numel()))
        if grid[0] * grid[1] != tokens.numel():
            raise ValueError(f"a {grid[0]}x{grid[1]} grid cannot hold {tokens.numel()} tokens")
        for name in ("text_relevance", "model_text_relevance"):
            value, bounds = getattr(self, name), getattr(self, f"{name}_bounds")
            if value is not None and bounds is None:
                sliced[f"{name}_bounds"] = torch.stack([value.min(), value.max()])
        crops = sliced["token_crops"]
        if crops is not None and crops.numel() and bool((crops == crops[0]).all()):  # one crop: its own CLS
            crop = int(crops[0])
            if self.crop_cls_features is not None:
                sliced["cls_feature"] = self.crop_cls_features[crop]
            if sliced["vision_keys"] is not None and self.crop_cls_keys is not None:
                sliced["vision_keys"][:, 0] = self.crop_cls_keys[:, crop]
        return dataclasses.replace(
            self, grid=grid, merging_tower=None, crop_merging_tower=None, video_grid=None, step_attention=None, **sliced
        )


@dataclass
class LayerSignals:
    """Signals at the input of one decoder layer, for the visual tokens still alive.

    Attention, key and value signals (``text_logits``, ``text_probs``, ``key_norms``,
    ``text_key_norms``, ``values``, ``text_values``) come from layer ``layer`` itself, or from layer ``layer - 1``
    on its own input when the selector's ``signal_layer`` is ``"previous"`` (what that
    layer computed: the token set is the same). ``n`` alive visual tokens, ``T`` text
    tokens after the image span (the question and the chat-template suffix; the last
    one is the last prompt position), ``H`` query heads.

    Attributes:
        alive: (n,) original grid indices of the alive visual tokens, ascending; tokens a
            merging selector inserted at an earlier stage follow them, as negative codes
            (their sources are in the records, not here).
        grid: (rows, cols) of the original token grid.
        grid_parts: the (rows, cols) of each regular grid the original tokens form, laid end to end in index
            order (LLaVA-NeXT: the base view's and the tile grid, while ``grid`` is ``(1, N)``); empty: the one
            grid ``grid``.
        layer: index of the decoder layer whose input this is.
        num_layers: decoder depth.
        text_logits: (H, T, n) pre-softmax logits q_t . k_n / sqrt(d) of the text rows
            to the alive visual keys, RoPE applied as the layer applies it.
        text_probs: (H, T, n) attention probabilities of the text rows, softmax in
            float32 over every key the row sees, sliced to the visual columns.
        visual_probs: (H, n, n) the same for the rows of the alive visual tokens (causal: zero above the
            diagonal), sliced to the visual columns (FitPrune's self-attention).
        hidden_states: (n, D) layer input of the alive visual tokens.
        previous_hidden_states: (n, D) input of the previous layer for the same tokens.
        text_hidden_states: (T, D) layer input of the text tokens.
        normed_hidden_states: (n, D) the model's final norm applied to ``hidden_states``.
        text_normed_hidden_states: (T, D) the same for the text tokens.
        key_norms: (n,) L1 norm of the post-RoPE keys (all heads concatenated).
        text_key_norms: (T,) the same for the text tokens.
        values: (Hkv, n, d) the layer's value vectors of the alive visual tokens, one per key/value head (a
            grouped-query model's query heads share them; FlowCut's semantic attention and value norms).
        text_values: (Hkv, T, d) the same for the text tokens.
        embeddings: (n, D) LLM input embeddings of the alive visual tokens.
        text_embeddings: (T, D) LLM input embeddings of the text tokens.
        sequence_index: (n,) index of each alive visual token in the unpruned prompt.
        text_sequence_index: (T,) the same for the text tokens.
        layer_cls_attention: (Lv, n) ``InputSignals.layer_cls_attention`` of each alive token's cell (NaN: merged);
            model_layer_cls_attention: its twin; layer_attention, vision_tower, full_attention_layers: as such.
        rope_ones_logits: (T, n) ``q.k / sqrt(d)`` of all-ones q and k under the layer's RoPE there (SparseVLM v2).
        model_dtype: the dtype the model computes in (None: float32).
        padded_crops: every crop's padded patches, for a selector run with ``budget_scope="crop"`` (else None).
        video_grid: on a video clip, its (T, h, w) token grid (``InputSignals.video_grid``; ``grid`` is (T * h, w));
            None on a still image.
    """

    alive: Tensor
    grid: tuple[int, int]
    layer: int
    num_layers: int
    text_logits: Tensor | None = None
    text_probs: Tensor | None = None
    visual_probs: Tensor | None = None
    hidden_states: Tensor | None = None
    previous_hidden_states: Tensor | None = None
    text_hidden_states: Tensor | None = None
    normed_hidden_states: Tensor | None = None
    text_normed_hidden_states: Tensor | None = None
    key_norms: Tensor | None = None
    text_key_norms: Tensor | None = None
    values: Tensor | None = None
    text_values: Tensor | None = None
    embeddings: Tensor | None = None
    text_embeddings: Tensor | None = None
    sequence_index: Tensor | None = None
    text_sequence_index: Tensor | None = None
    layer_cls_attention: Tensor | None = None
    model_layer_cls_attention: Tensor | None = None
    layer_attention: Tensor | None = None
    vision_tower: str = "clip"
    full_attention_layers: tuple[int, ...] = ()
    rope_ones_logits: Tensor | None = None
    model_dtype: torch.dtype | None = None
    grid_parts: tuple[tuple[int, int], ...] = ()
    padded_crops: PaddedCrops | None = None
    video_grid: tuple[int, int, int] | None = None

    @property
    def num_alive(self) -> int:
        return int(self.alive.numel())

    def rounded(self) -> LayerSignals:
        """A copy whose float signals are rounded to ``model_dtype`` (kept as float32 tensors)."""
        if self.model_dtype is None:
            return self
        rounded: dict[str, Any] = {
            f.name: value.to(self.model_dtype).float()
            for f in dataclasses.fields(self)
            if isinstance(value := getattr(self, f.name), Tensor) and value.is_floating_point()
        }
        return dataclasses.replace(self, **rounded)
