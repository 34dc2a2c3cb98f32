"""The dimensions the FLOP and KV-cache formulas need, independent of any model library."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class VisionShape:
    """The vision tower as far as the model reads it, and the projector after it.

    Attributes:
        layers: encoder layers run, up to the one producing the feature layer the model reads.
        width: hidden width Dv (= heads x head dim).
        mlp_width: the MLP's inner width.
        mlp_matrices: weight matrices of the MLP: 2 for fc1/fc2 (CLIP), 3 for a gated MLP (Qwen2.5-VL).
        patch_inputs: input values of one patch embedding (channels x kernel volume); its matmul is
            ``patch_inputs -> width`` per patch.
        class_tokens: tokens added before the patches (1 for CLIP's CLS, 0 without).
        merge: side of the square of patches merged into one language-model token (1: none).
        window: side, in merged tokens, of a windowed-attention window (0: every layer attends globally).
        full_attention_layers: encoder layers attending over the whole image when ``window`` > 0.
        projector: ``(inputs, outputs)`` of each projector matmul, applied to every language-model
            visual token (inputs of the first = ``width x merge**2``).
    """

    layers: int
    width: int
    mlp_width: int
    mlp_matrices: int
    patch_inputs: int
    class_tokens: int
    merge: int
    window: int
    full_attention_layers: tuple[int, ...]
    projector: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class LanguageShape:
    """A Llama-style decoder: attention with grouped K/V heads and a gated MLP.

    Attributes:
        layers: decoder layers.
        hidden: hidden width D.
        intermediate: the gated MLP's inner width.
        heads: query heads H.
        kv_heads: key/value heads (H for multi-head attention, fewer under GQA).
        head_dim: width d of one head (H x d need not equal D).
        vocab: rows of the LM head.
    """

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int


@dataclass(frozen=True)
class ClipTextShape:
    """The CLIP text tower CDPruner's text relevance runs (``None`` on models without one).

    Attributes:
        layers, width, mlp_width: the text encoder's layers, width and MLP inner width (fc1/fc2).
        context: tokens of one zero-padded chunk (the text tower's context length).
        projection: width of the shared image/text embedding space.
        vision_width: width of the vision states the image projection reads.
    """

    layers: int
    width: int
    mlp_width: int
    context: int
    projection: int
    vision_width: int


@dataclass(frozen=True)
class ModelShape:
    """Everything the cost formulas read from a model: towers, decoder and the KV-cache dtype.

    Attributes:
        vision: the vision tower and projector.
        language: the decoder.
        dtype_bytes: bytes of one key or value entry (2 for float16/bfloat16, 4 for float32).
        clip_text: the CLIP text tower for CDPruner's relevance, when one is loaded.
    """

    vision: VisionShape
    language: LanguageShape
    dtype_bytes: int
    clip_text: ClipTextShape | None = None


__all__ = ["VisionShape", "LanguageShape", "ClipTextShape", "ModelShape"]
