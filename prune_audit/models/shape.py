"""The :class:`~prune_audit.compute.shape.ModelShape` of a loaded model, read from its config."""

from __future__ import annotations

from typing import Any

from prune_audit.compute.shape import ClipTextShape, LanguageShape, VisionShape


def language_shape(text_config: Any) -> LanguageShape:
    """The decoder of a Llama-style ``text_config`` (Llama, Qwen2)."""
    heads = text_config.num_attention_heads
    head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
    return LanguageShape(
        layers=text_config.num_hidden_layers,
        hidden=text_config.hidden_size,
        intermediate=text_config.intermediate_size,
        heads=heads,
        kv_heads=getattr(text_config, "num_key_value_heads", None) or heads,
        head_dim=head_dim,
        vocab=text_config.vocab_size,
    )


def llava_vision_shape(config: Any, feature_index: int, class_tokens: int = 1) -> VisionShape:
    """CLIP's tower up to encoder layer ``feature_index`` (the adapter runs no later layer) and the 2-layer projector;
    ``class_tokens=0`` for SigLIP (LLaVA-OneVision), whose tower has no CLS."""
    vision, text_width = config.vision_config, config.text_config.hidden_size
    return VisionShape(
        layers=feature_index,
        width=vision.hidden_size,
        mlp_width=vision.intermediate_size,
        mlp_matrices=2,
        patch_inputs=vision.num_channels * vision.patch_size**2,
        class_tokens=class_tokens,
        merge=1,
        window=0,
        full_attention_layers=(),
        projector=((vision.hidden_size, text_width), (text_width, text_width)),
    )


def qwen_vision_shape(config: Any) -> VisionShape:
    """Qwen2.5-VL's windowed ViT (every block runs) and its 2x2 patch merger."""
    vision = config.vision_config
    merged_width = vision.hidden_size * vision.spatial_merge_size**2
    return VisionShape(
        layers=vision.depth,
        width=vision.hidden_size,
        mlp_width=vision.intermediate_size,
        mlp_matrices=3,
        patch_inputs=vision.in_channels * vision.temporal_patch_size * vision.patch_size**2,
        class_tokens=0,
        merge=vision.spatial_merge_size,
        window=vision.window_size // vision.spatial_merge_size // vision.patch_size,
        full_attention_layers=tuple(vision.fullatt_block_indexes),
        projector=((merged_width, merged_width), (merged_width, vision.out_hidden_size)),
    )


def clip_text_shape(clip: Any, vision_width: int) -> ClipTextShape:
    """The text tower of a ``CLIPModel`` read against vision states of ``vision_width``."""
    text = clip.config.text_config
    return ClipTextShape(
        layers=text.num_hidden_layers,
        width=text.hidden_size,
        mlp_width=text.intermediate_size,
        context=text.max_position_embeddings,
        projection=clip.config.projection_dim,
        vision_width=vision_width,
    )


__all__ = ["language_shape", "llava_vision_shape", "qwen_vision_shape", "clip_text_shape"]
