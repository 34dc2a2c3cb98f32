"""Qwen3-VL (``Qwen3VLForConditionalGeneration``): the Qwen2.5-VL adapter plus deepstack features.

What the pruning code sees differently from Qwen2.5-VL (:mod:`prune_audit.models.qwen`):

- geometry: the same ``Qwen2VLImageProcessor`` ``smart_resize`` with 16-px patches, so one
  LLM token per 2x2 merge covers 32x32 processed pixels, row-major (``qwen_smart_resize``);
- positions: 3-D M-RoPE ids from the model's ``get_rope_index`` (images need no
  timestamps); the decoder's rotary table interleaves the three planes over the
  frequencies (``mrope_interleaved``) inside ``rotary_emb``, so the loop only passes ids;
- deepstack: the vision tower also merges the states of a few of its blocks
  (``deepstack_visual_indexes``) into one (N, D) feature set each, and the stock decoder
  adds the k-th set to the visual tokens' hidden states after decoder layer k. The
  pruned prefill does the same through :attr:`DecoderStack.after_layer`: after layer k
  every visual token still in the sequence gets row ``kind`` (its grid index) of the
  k-th set, so deepstack features are pruned with exactly the kept set of the main
  tokens, at input level and in the LLM alike. Tokens an in-LLM selector merges
  (SparseVLM's recycled tokens) get no deepstack addition: there is no official
  pruned Qwen3-VL merge to follow (documented in docs/models.md);
- attention: the decoder normalises each head's queries and keys (``q_norm``,
  ``k_norm``) before RoPE; the attention probe applies them too.

No CLS token, no CLIP text space: the CLS selectors and CDPruner are refused, as are
merging input-level selectors (merged tokens have no 3-D position). Budgets count the
merged tokens.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from prune_audit.compute.shape import VisionShape
from prune_audit.models.base import without_direct_forwards
from prune_audit.models.batch import Batch
from prune_audit.models.prepared import Prepared, VisionOutput
from prune_audit.models.qwen import QwenModel

PROMPT_TEMPLATE = "qwen3_vl"


@without_direct_forwards  # Qwen2.5-VL's direct forwards drop the deepstack features the decoder adds
class Qwen3VLModel(QwenModel):
    """Qwen3-VL adapter (dense decoders; one image per prompt)."""

    family = "qwen3_vl"
    takes_video = False  # its video path (M-RoPE time axis, processor) is not the Qwen2.5-VL one read here
    #: HiPrune's per-layer attention is formed only for Qwen2.5-VL's tower, the one its official code runs
    input_signals = frozenset({"features", "demand"})
    missing_signals_reason = (
        "its vision tower has no CLS token, no per-layer CLS attention, no HiPrune port to it and no CLIP text space"
    )
    display_name = "Qwen3-VL"
    grounding = None  # Qwen3-VL writes bbox_2d on a 0-1000 grid, not Qwen2.5-VL's pixels: no convention yet
    prompt_templates = (PROMPT_TEMPLATE,)

    @classmethod
    def transformers_class(cls) -> type:
        from transformers import Qwen3VLForConditionalGeneration

        return Qwen3VLForConditionalGeneration

    @staticmethod
    def vision_shape(config: Any) -> VisionShape:
        """Qwen3-VL's ViT (every block global, fc1/fc2 MLP) and its mergers: the main 2x2 merger and one
        per deepstack set, each applied to every language-model visual token."""
        vision = config.vision_config
        merged_width = vision.hidden_size * vision.spatial_merge_size**2
        merger = ((merged_width, merged_width), (merged_width, vision.out_hidden_size))
        return VisionShape(
            layers=vision.depth,
            width=vision.hidden_size,
            mlp_width=vision.intermediate_size,
            mlp_matrices=2,
            patch_inputs=vision.in_channels * vision.temporal_patch_size * vision.patch_size**2,
            class_tokens=0,
            merge=vision.spatial_merge_size,
            window=0,
            full_attention_layers=(),
            projector=merger * (1 + len(vision.deepstack_visual_indexes)),
        )

    @classmethod
    def build_tiny(
        cls, save_dir: str | Path, *, words: Sequence[str], text_layers: int = 2, seed: int = 0, **sizes: Any
    ) -> Path:
        """A random-weight checkpoint of this family for offline tests (:func:`build_qwen3_vl`)."""
        return build_qwen3_vl(save_dir, words=words, text_layers=text_layers, seed=seed, **sizes)

    def __init__(self, model, image_processor, tokenizer, **kwargs):
        super().__init__(model, image_processor, tokenizer, **kwargs)
        #: ``sets``: per batch row of the current prefill, the (N, D) deepstack sets in decoder-layer order; one per
        #: thread, since threads sharing this model each run their own prefill between ``_vision`` and the loop
        self._deepstack = threading.local()
        self.loop.stack.after_layer = self._add_deepstack

    def _vision(self, prepared: Sequence[Prepared], requires: frozenset[str]) -> list[VisionOutput]:
        pixels = torch.cat([item.pixel_values for item in prepared]).to(self.device)
        grid_thw = torch.cat([item.extras["image_grid_thw"] for item in prepared]).to(self.device)
        output = self.model.model.get_image_features(pixels, grid_thw, return_dict=True)
        # get_image_features splits every deepstack set per image: [set k][image b] -> [image b][set k]
        self._deepstack.sets = [list(per_image) for per_image in zip(*output.deepstack_features)]
        return [VisionOutput(per_image) for per_image in output.pooler_output]

    def _add_deepstack(self, layer: int, hidden: Tensor, batch: Batch) -> Tensor:
        """(B, L, D) ``hidden`` after decoder layer ``layer`` plus, while ``layer`` has a deepstack set,
        each surviving visual token's own row of it (the stock decoder's ``_deepstack_process``)."""
        sets: list[list[Tensor]] = getattr(self._deepstack, "sets", [])
        if not sets or layer >= len(sets[0]):
            return hidden
        hidden = hidden.clone()
        for b in range(batch.size):
            columns = torch.nonzero(batch.valid[b] & (batch.kinds[b] >= 0)).flatten()
            features = sets[b][layer].to(hidden.device, hidden.dtype)
            hidden[b, columns] += features[batch.kinds[b, columns]]
        return hidden


def build_qwen3_vl(
    save_dir: str | Path,
    *,
    words: Sequence[str],
    image_size: int = 128,
    patch_size: int = 16,
    spatial_merge_size: int = 2,
    vision_hidden_size: int = 32,
    vision_layers: int = 2,
    vision_heads: int = 2,
    deepstack_visual_indexes: Sequence[int] = (0, 1),
    text_hidden_size: int = 64,
    text_intermediate_size: int = 128,
    text_layers: int = 2,
    text_heads: int = 4,
    text_kv_heads: int = 2,
    mrope_section: Sequence[int] = (2, 3, 3),
    seed: int = 0,
) -> Path:
    """Save a randomly initialised ``Qwen3VLForConditionalGeneration`` with its image processor and tokenizer.

    The image processor is pinned to ``image_size**2`` pixels, so a square image gives an
    ``image_size / (patch_size * spatial_merge_size)``-square token grid. The deepstack sets
    come from the vision blocks ``deepstack_visual_indexes`` and are added after decoder
    layers 0, 1, ...; ``sum(mrope_section)`` must be ``head_dim / 2`` (interleaved M-RoPE). The
    real Qwen3-VL-8B widths are ``vision_hidden_size=1152, vision_layers=27, vision_heads=16,
    deepstack_visual_indexes=(8, 16, 24), text_hidden_size=4096, text_intermediate_size=12288,
    text_layers=36, text_heads=32, text_kv_heads=8, mrope_section=(24, 20, 20)`` (head_dim 128).
    """
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    from prune_audit.models.build import qwen_tokenizer
    from prune_audit.models.tiny_qwen import qwen_text_config, qwen_vision_token_ids, save_tiny_qwen

    save_dir = Path(save_dir)
    tokenizer = qwen_tokenizer(words)
    config = Qwen3VLConfig(
        vision_config={
            "depth": vision_layers,
            "hidden_size": vision_hidden_size,
            "intermediate_size": 2 * vision_hidden_size,
            "num_heads": vision_heads,
            "patch_size": patch_size,
            "spatial_merge_size": spatial_merge_size,
            "temporal_patch_size": 2,
            "out_hidden_size": text_hidden_size,
            "num_position_embeddings": 64,
            "deepstack_visual_indexes": list(deepstack_visual_indexes),
        },
        text_config=qwen_text_config(
            tokenizer,
            hidden=text_hidden_size,
            intermediate=text_intermediate_size,
            layers=text_layers,
            heads=text_heads,
            kv_heads=text_kv_heads,
            mrope_section=mrope_section,
            max_positions=512,
            interleaved=True,
        ),
        **qwen_vision_token_ids(tokenizer),
    )
    pixels = image_size * image_size
    return save_tiny_qwen(
        Qwen3VLForConditionalGeneration,
        config,
        tokenizer,
        save_dir,
        seed=seed,
        patch_size=patch_size,
        merge_size=spatial_merge_size,
        min_pixels=pixels,
        max_pixels=pixels,
    )


__all__ = ["Qwen3VLModel", "build_qwen3_vl", "PROMPT_TEMPLATE"]
