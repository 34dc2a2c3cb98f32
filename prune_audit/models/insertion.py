"""Tokens a merging in-LLM selector adds: their layout entries, sources and positions.

A merged token gets the kind ``merged_kind(j)`` (``j`` its index in the row's registry
of grid sources; a member that is itself merged contributes its sources), the hidden
state the selector computed, the mean input embedding of its members (only read by
selectors that need embeddings), and the floor of its members' mean position ids in
every plane; under ``compact`` positions the loop renumbers it with every other token.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from prune_audit.models.kinds import merged_index, merged_kind
from prune_audit.pruners.base import TokenMerge

if TYPE_CHECKING:
    from prune_audit.models.batch import Batch


@dataclass
class Insertion:
    """Merged tokens to insert into one row: at ``at`` among its kept layout columns.

    hidden (M, D), kinds (M,), positions (P, M), embeddings (M, D) or None.
    """

    at: int
    hidden: Tensor
    kinds: Tensor
    positions: Tensor
    embeddings: Tensor | None


def insertion_for(
    batch: Batch, row: int, visual_columns: Tensor, alive: Tensor, merge: TokenMerge, registry: list[list[int]]
) -> Insertion:
    """The tokens of ``merge`` as layout entries of ``row``; their grid sources are appended to ``registry``.

    Args:
        visual_columns: (n,) layout columns of the row's alive visual tokens.
        alive: (n,) their kinds (grid index, or ``merged_kind(j)`` with sources ``registry[j]``).
    """
    kinds, positions, embeddings = [], [], []
    for members in merge.members:
        members = members.to(visual_columns.device)
        member_kinds = alive[members].tolist()
        sources = set()
        for kind in member_kinds:
            sources.update([kind] if kind >= 0 else registry[merged_index(kind)])
        kinds.append(merged_kind(len(registry)))
        registry.append(sorted(sources))
        member_columns = visual_columns[members]
        positions.append(batch.positions[:, row, member_columns].sum(dim=1) // members.numel())
        if batch.embeddings is not None:
            embeddings.append(batch.embeddings[row, member_columns].float().mean(dim=0))
    device = batch.hidden.device
    return Insertion(
        at=0,
        hidden=merge.hidden.to(device, batch.hidden.dtype),
        kinds=torch.tensor(kinds, dtype=torch.long, device=device),
        positions=torch.stack(positions, dim=1),
        embeddings=torch.stack(embeddings).to(batch.embeddings.dtype) if embeddings else None,
    )


def replace_in_place(
    batch: Batch, row: int, visual_columns: Tensor, alive: Tensor, merge: TokenMerge, registry: list[list[int]]
) -> None:
    """Write the tokens of ``merge`` over the kept tokens ``merge.replaces`` of ``row`` (layout slot and
    position ids stay); their kinds become merged kinds whose grid sources are appended to ``registry``.

    Args:
        visual_columns: (n,) layout columns of the row's alive visual tokens.
        alive: (n,) their kinds; updated in place with the new kinds.
    """
    for index, (target, members) in enumerate(zip(merge.replaces.tolist(), merge.members)):
        members = members.to(visual_columns.device)
        sources = set()
        for kind in alive[members].tolist():
            sources.update([kind] if kind >= 0 else registry[merged_index(kind)])
        column = visual_columns[target]
        batch.hidden[row, column] = merge.hidden[index].to(batch.hidden.device, batch.hidden.dtype)
        if batch.embeddings is not None and batch.embeddings is not batch.hidden:
            batch.embeddings[row, column] = (
                batch.embeddings[row, visual_columns[members]].float().mean(dim=0).to(batch.embeddings.dtype)
            )
        alive[target] = batch.kinds[row, column] = merged_kind(len(registry))
        registry.append(sorted(sources))


def with_insertions(batch: Batch, keep: list[Tensor], insertions: list[Insertion | None]) -> tuple[Batch, list[Tensor]]:
    """``batch`` with every row's inserted tokens appended as extra columns, and ``keep`` placing them.

    Row b's M_b tokens occupy columns L..L+M_b-1 (padding in the other rows); its kept
    columns become ``keep[b][:at] + those + keep[b][at:]``, for :func:`gather_rows`.
    """
    length = batch.hidden.shape[1]
    extra = max(insertion.kinds.numel() for insertion in insertions if insertion is not None)

    def widened(tensor: Tensor | None, fill: Any, dim: int) -> Tensor | None:
        if tensor is None:
            return None
        shape = list(tensor.shape)
        shape[dim] = extra
        return torch.cat([tensor, torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)], dim=dim)

    wide = batch.map_columns(widened)
    columns = []
    for b, insertion in enumerate(insertions):
        if insertion is None:
            columns.append(keep[b])
            continue
        count = insertion.kinds.numel()
        added = slice(length, length + count)
        wide.hidden[b, added] = insertion.hidden
        wide.valid[b, added] = True
        wide.kinds[b, added] = insertion.kinds
        wide.positions[:, b, added] = insertion.positions
        if wide.embeddings is not None and insertion.embeddings is not None:
            wide.embeddings[b, added] = insertion.embeddings
        new = torch.arange(length, length + count, device=keep[b].device)
        columns.append(torch.cat([keep[b][: insertion.at], new, keep[b][insertion.at :]]))
    return wide, columns


__all__ = ["Insertion", "insertion_for", "replace_in_place", "with_insertions"]
