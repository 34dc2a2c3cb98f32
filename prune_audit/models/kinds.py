"""The kind of every token in the language-model loop: a grid index (>= 0) or one of these codes."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

TEXT_BEFORE = -1  # text before the image span (system prompt, "USER:")
TEXT_AFTER = -2  # question and template suffix after the image span
PAD = -3
MERGED = -4  # the bound below which kinds are visual tokens without a single grid location
# kinds below MERGED: merged tokens, MERGED - 1 - j for the row's j-th one: an input-level selection's tokens without
# one grid cell (VisionZip's CLS and contextual tokens, ``input_kinds``) first, then those a merging in-LLM selector
# inserted; the loop's registry (``LayerPlan.merged``) holds each one's grid sources


def merged_kind(index: int) -> int:
    """The kind of the row's ``index``-th token inserted by an in-LLM merge."""
    return MERGED - 1 - index


def merged_index(kind: int) -> int:
    """Inverse of :func:`merged_kind`."""
    return MERGED - 1 - kind


def input_kinds(sources: Sequence[Tensor], kept: Tensor) -> list[int]:
    """The kinds of an input-level selection's output tokens (``Selection.sources``), in output order: a kept cell's
    own token that cell, any other ``merged_kind(j)`` for the j-th of them (merged cells, a merge target without
    members, CLS without cells: ``Selection.merged_sources``' tokens and CLS; sources: ``input_registry``)."""
    own = set(kept.tolist())
    kinds, merged = [], 0
    for group in sources:
        if group.numel() == 1 and int(group[0]) in own:
            kinds.append(int(group[0]))
        else:
            kinds.append(merged_kind(merged))
            merged += 1
    return kinds


def input_registry(sources: Sequence[Tensor], kept: Tensor) -> list[list[int]]:
    """Ascending grid sources of the tokens ``input_kinds`` gives a merged kind, by their index j (CLS: none)."""
    own = set(kept.tolist())
    return [sorted(group.tolist()) for group in sources if not (group.numel() == 1 and int(group[0]) in own)]


def prunable(kinds: Tensor) -> Tensor:
    """Bool mask of the visual tokens an in-LLM stage scores: grid tokens and merged tokens (an input-level
    selection's, which a composed selector's in-LLM part prunes, and those an in-LLM merge inserted)."""
    return (kinds >= 0) | (kinds < MERGED)


__all__ = [
    "TEXT_BEFORE", "TEXT_AFTER", "PAD", "MERGED", "merged_kind", "merged_index", "input_kinds", "input_registry",
    "prunable",
]  # fmt: skip
