"""The kind of every token in the language-model loop: a grid index (>= 0) or one of these codes."""

from __future__ import annotations

from torch import Tensor

TEXT_BEFORE = -1  # text before the image span (system prompt, "USER:")
TEXT_AFTER = -2  # question and template suffix after the image span
PAD = -3
MERGED = -4  # a visual token without a single grid location (VisionZip CLS / contextual)
# kinds below MERGED: tokens a merging in-LLM selector inserted, MERGED - 1 - j for the row's j-th one


def merged_kind(index: int) -> int:
    """The kind of the row's ``index``-th token inserted by an in-LLM merge."""
    return MERGED - 1 - index


def merged_index(kind: int) -> int:
    """Inverse of :func:`merged_kind`."""
    return MERGED - 1 - kind


def prunable(kinds: Tensor) -> Tensor:
    """Bool mask of the visual tokens an in-LLM stage scores: grid tokens and in-LLM merged tokens."""
    return (kinds >= 0) | (kinds < MERGED)


__all__ = ["TEXT_BEFORE", "TEXT_AFTER", "PAD", "MERGED", "merged_kind", "merged_index", "prunable"]
