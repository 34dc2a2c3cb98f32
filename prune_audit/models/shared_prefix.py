"""The demo trainer's fast forward: the image prefix runs once per image, the questions reuse its cache.

Family-independent: the adapters pass their language model, LM head and, for 3-D
M-RoPE (Qwen2.5-VL), explicit position ids.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn


def shared_prefix_logits(
    language: nn.Module,
    lm_head: nn.Module,
    features: Tensor,
    prefix_ids: Tensor,
    image_positions: Tensor,
    suffixes: Sequence[Tensor],
    per_image: int,
    *,
    prefix_positions: Tensor | None = None,
    suffix_start: int | None = None,
    every_position: bool = False,
) -> Tensor:
    """(B * per_image, V) next-token logits after each suffix, the image prefix run once per image.

    Equal to the full forward of ``prefix + suffix`` (the demo tests check it): the prefix's
    KV cache is repeated for the image's questions and only the suffixes run per question.

    Args:
        language: the decoder (``inputs_embeds`` / ``input_ids``, ``position_ids``, ``cache``).
        features: (B, N, D) projected image features.
        prefix_ids: (P,) prompt ids up to the end of the image span, shared by all prompts.
        image_positions: (N,) positions of the image tokens in ``prefix_ids``.
        suffixes: B * per_image (T_i,) id tensors after the image span, grouped by image.
        prefix_positions: (planes, P) position ids of the prefix; None: the decoder's default
            (0..P-1, then counting on through the cache).
        suffix_start: position id of every suffix's first token (with ``prefix_positions``).
        every_position: return (B * per_image, T_max, V) logits at every suffix position instead
            (right-padded; rows past a suffix's length are padding), for a loss on every answer token.
    """
    batch = features.shape[0]
    embeds = language.embed_tokens(prefix_ids).unsqueeze(0).repeat(batch, 1, 1)
    embeds[:, image_positions] = features.to(embeds.dtype)
    lengths = torch.tensor([suffix.numel() for suffix in suffixes])
    # right padding: causal attention keeps real positions independent of the pad tail
    padded = torch.nn.utils.rnn.pad_sequence(list(suffixes), batch_first=True, padding_value=0)
    if prefix_positions is None:
        cache = language(inputs_embeds=embeds, use_cache=True).cache
        cache.batch_repeat_interleave(per_image)
        hidden = language(input_ids=padded, cache=cache).last_hidden_state
    else:
        planes = prefix_positions.shape[0]
        cache = language(
            inputs_embeds=embeds, position_ids=prefix_positions[:, None].expand(planes, batch, -1), use_cache=True
        ).cache
        cache.batch_repeat_interleave(per_image)
        steps = suffix_start + torch.arange(padded.shape[1])
        positions = steps.view(1, 1, -1).expand(planes, len(suffixes), -1)
        hidden = language(input_ids=padded, cache=cache, position_ids=positions).last_hidden_state
    if every_position:
        return lm_head(hidden)
    return lm_head(hidden[torch.arange(len(suffixes)), lengths - 1])


__all__ = ["shared_prefix_logits"]
