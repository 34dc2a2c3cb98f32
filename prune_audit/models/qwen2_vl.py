"""Qwen2-VL (``Qwen2VLForConditionalGeneration``): Qwen2.5-VL's predecessor, one file.

What differs from Qwen2.5-VL (:mod:`prune_audit.models.qwen`) lies inside the vision
tower only: every vision block attends to the whole image (no window attention),
blocks use LayerNorm and a GELU MLP instead of RMSNorm and SwiGLU, and the merger
LayerNorms the 2x2 patch group before its MLP. Everything the pruning code touches
is the same:

- geometry: ``Qwen2VLImageProcessor`` ``smart_resize`` to multiples of 28 px, one
  LLM token per 2x2 merge of 14-px patches, row-major (``qwen_smart_resize``);
- positions: 3-D M-RoPE ids from the model's ``get_rope_index`` over the unpruned
  prompt; pruned prompts keep the ids of the surviving tokens (as E2S-Pruner's and
  every public Qwen2-VL port do);
- signals: the merged features and the layer-0 text demand; no CLS token, no CLIP
  text space, so CLS- and text-relevance selectors are refused;
- prompt: the ChatML template with ``<|vision_start|><|image_pad|>...<|vision_end|>``.

Budgets count the merged tokens (the LLM's visual tokens), as for Qwen2.5-VL.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from prune_audit.compute.shape import VisionShape
from prune_audit.models.qwen import QwenModel

PROMPT_TEMPLATE = "qwen2_vl"


class Qwen2VLModel(QwenModel):
    """Qwen2-VL adapter: the Qwen2.5-VL adapter on the Qwen2-VL classes."""

    family = "qwen2_vl"
    takes_video = False  # its video path (M-RoPE time axis, processor) is not the Qwen2.5-VL one read here
    #: HiPrune's per-layer attention is formed only for Qwen2.5-VL's tower, the one its official code runs
    input_signals = frozenset({"features", "demand"})
    missing_signals_reason = (
        "its vision tower has no CLS token, no per-layer CLS attention, no HiPrune port to it and no CLIP text space"
    )
    display_name = "Qwen2-VL"
    grounding = None  # Qwen2-VL writes <|box_start|>(x1,y1),(x2,y2)<|box_end|> on a 0-1000 grid: no convention yet
    prompt_templates = (PROMPT_TEMPLATE,)

    @classmethod
    def transformers_class(cls) -> type:
        from transformers import Qwen2VLForConditionalGeneration

        return Qwen2VLForConditionalGeneration

    @property
    def vision_head_dim(self) -> int:
        """Width of one vision-tower attention head (its ``hidden_size`` is the merger's output width)."""
        vision = self.model.config.vision_config
        return vision.embed_dim // vision.num_heads

    @staticmethod
    def vision_shape(config: Any) -> VisionShape:
        """Qwen2-VL's ViT (every block global, LayerNorm + fc1/fc2 MLP of ``mlp_ratio``) and its 2x2 merger."""
        vision = config.vision_config
        merged_width = vision.embed_dim * vision.spatial_merge_size**2
        return VisionShape(
            layers=vision.depth,
            width=vision.embed_dim,
            mlp_width=int(vision.embed_dim * vision.mlp_ratio),
            mlp_matrices=2,
            patch_inputs=vision.in_channels * vision.temporal_patch_size * vision.patch_size**2,
            class_tokens=0,
            merge=vision.spatial_merge_size,
            window=0,
            full_attention_layers=(),
            projector=((merged_width, merged_width), (merged_width, vision.hidden_size)),
        )

    @classmethod
    def build_tiny(
        cls, save_dir: str | Path, *, words: Sequence[str], text_layers: int = 2, seed: int = 0, **sizes: Any
    ) -> Path:
        """A random-weight checkpoint of this family for offline tests (:func:`build_qwen2_vl`)."""
        return build_qwen2_vl(save_dir, words=words, text_layers=text_layers, seed=seed, **sizes)


def build_qwen2_vl(
    save_dir: str | Path,
    *,
    words: Sequence[str],
    image_size: int = 112,
    patch_size: int = 14,
    spatial_merge_size: int = 2,
    vision_embed_dim: int = 32,
    vision_layers: int = 2,
    vision_heads: int = 2,
    text_hidden_size: int = 64,
    text_intermediate_size: int = 128,
    text_layers: int = 2,
    text_heads: int = 4,
    text_kv_heads: int = 2,
    mrope_section: Sequence[int] = (2, 3, 3),
    seed: int = 0,
) -> Path:
    """Save a randomly initialised ``Qwen2VLForConditionalGeneration`` with its image processor and tokenizer.

    The image processor is pinned to ``image_size**2`` pixels (min = max), so a square
    image gives an ``image_size / (patch_size * spatial_merge_size)``-square token grid.
    ``sum(mrope_section)`` must be ``head_dim / 2``. The real Qwen2-VL-7B widths are
    ``vision_embed_dim=1280, vision_layers=32, vision_heads=16, text_hidden_size=3584,
    text_intermediate_size=18944, text_layers=28, text_heads=28, text_kv_heads=4,
    mrope_section=(16, 24, 24)``.
    """
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    from prune_audit.models.build import qwen_tokenizer
    from prune_audit.models.tiny_qwen import qwen_text_config, qwen_vision_token_ids, save_tiny_qwen

    save_dir = Path(save_dir)
    tokenizer = qwen_tokenizer(words)
    config = Qwen2VLConfig(
        vision_config={
            "depth": vision_layers,
            "embed_dim": vision_embed_dim,
            "hidden_size": text_hidden_size,  # the merger's output width: the LLM's
            "num_heads": vision_heads,
            "patch_size": patch_size,
            "spatial_merge_size": spatial_merge_size,
            "temporal_patch_size": 2,
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
        ),
        **qwen_vision_token_ids(tokenizer),
    )
    pixels = image_size * image_size
    return save_tiny_qwen(
        Qwen2VLForConditionalGeneration,
        config,
        tokenizer,
        save_dir,
        seed=seed,
        patch_size=patch_size,
        merge_size=spatial_merge_size,
        min_pixels=pixels,
        max_pixels=pixels,
    )


__all__ = ["Qwen2VLModel", "build_qwen2_vl", "PROMPT_TEMPLATE"]
