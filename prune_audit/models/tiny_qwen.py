"""The parts every tiny Qwen-VL builder shares (``build.build_qwen2_5_vl``, ``qwen2_vl``, ``qwen3_vl``): the
decoder's ``text_config``, the vision token ids and the seeded save with a fixed-size image processor."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch


def qwen_text_config(
    tokenizer,
    *,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    mrope_section: Sequence[int],
    max_positions: int,
    interleaved: bool = False,
) -> dict:
    """The ``text_config`` of a tiny Qwen-VL decoder: M-RoPE over ``mrope_section`` (which must sum to half the
    head width; ``interleaved``: Qwen3-VL's interleaved sections, with its explicit ``head_dim``), Qwen's end and
    padding tokens."""
    head_dim = hidden // heads
    if 2 * sum(mrope_section) != head_dim:
        raise ValueError(f"mrope_section {tuple(mrope_section)} must sum to head_dim / 2 = {head_dim // 2}")
    rope = {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": list(mrope_section)}
    ids = tokenizer.convert_tokens_to_ids
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": hidden,
        "intermediate_size": intermediate,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "max_position_embeddings": max_positions,
        "rope_parameters": {**rope, "mrope_interleaved": True} if interleaved else rope,
        "bos_token_id": None,
        "eos_token_id": ids("<|im_end|>"),
        "pad_token_id": ids("<|endoftext|>"),
        **({"head_dim": head_dim} if interleaved else {}),
    }


def qwen_vision_token_ids(tokenizer) -> dict[str, int]:
    """The image, video and vision start/end token ids a Qwen-VL config names."""
    ids = tokenizer.convert_tokens_to_ids
    return {
        "image_token_id": ids("<|image_pad|>"),
        "video_token_id": ids("<|video_pad|>"),
        "vision_start_token_id": ids("<|vision_start|>"),
        "vision_end_token_id": ids("<|vision_end|>"),
    }


def save_tiny_qwen(
    model_class: type,
    config,
    tokenizer,
    save_dir: Path,
    *,
    seed: int,
    patch_size: int,
    merge_size: int,
    min_pixels: int,
    max_pixels: int,
) -> Path:
    """Random weights of a Qwen-VL ``model_class`` for ``config`` (seeded with ``seed``), saved in ``save_dir``
    with a Qwen2-VL image processor of that pixel range and ``tokenizer``."""
    from transformers import Qwen2VLImageProcessorPil

    torch.manual_seed(seed)
    model = model_class(config).eval()
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=min_pixels,
        max_pixels=max_pixels,
        patch_size=patch_size,
        merge_size=merge_size,
        temporal_patch_size=2,
    )
    model.save_pretrained(save_dir)
    image_processor.save_pretrained(save_dir)
    tokenizer.save_pretrained(save_dir)
    return save_dir


__all__ = ["qwen_text_config", "qwen_vision_token_ids", "save_tiny_qwen"]
