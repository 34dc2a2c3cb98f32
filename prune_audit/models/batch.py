"""A batch of token rows for the decoder loop (:mod:`prune_audit.models.executor`): rows that carry each
token's kind and positions, packed left-padded, gathered after pruning and renumbered under ``compact``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from prune_audit.models.kinds import MERGED, PAD, prunable


@dataclass
class TokenRow:
    """One prompt as the language model receives it.

    Attributes:
        embeddings: (L, D) input embeddings (visual tokens already inserted).
        kinds: (L,) grid index of each visual token, or TEXT_BEFORE / TEXT_AFTER / MERGED.
        positions: (P, L) position ids (P = 1 for 1-D RoPE, 3 for M-RoPE).
    """

    embeddings: Tensor
    kinds: Tensor
    positions: Tensor


@dataclass
class Batch:
    """Left-padded rows: hidden (B, L, D), valid/kinds (B, L), positions (P, B, L).

    ``origin`` (B, L) is each token's index in its unpruned prompt (-1 for padding).
    """

    hidden: Tensor
    valid: Tensor
    kinds: Tensor
    positions: Tensor
    embeddings: Tensor | None = None  # (B, L, D) carried only when a selector reads them
    origin: Tensor | None = None

    @property
    def size(self) -> int:
        return self.hidden.shape[0]

    def row_indices(self, row: int) -> Tensor:
        return torch.nonzero(self.valid[row]).flatten()

    def map_columns(self, change: Callable[[Tensor | None, Any, int], Tensor | None]) -> Batch:
        """A batch of ``change(field, padding fill, column dim)`` applied to every per-token field."""
        return Batch(
            hidden=change(self.hidden, 0, 1),
            valid=change(self.valid, False, 1),
            kinds=change(self.kinds, PAD, 1),
            positions=change(self.positions, 0, 2),
            embeddings=change(self.embeddings, 0, 1),
            origin=change(self.origin, -1, 1),
        )

    def visual_counts(self) -> list[int]:
        visual = prunable(self.kinds) | (self.kinds == MERGED)
        return (visual & self.valid).sum(dim=1).tolist()


def pack(rows: Sequence[TokenRow], carry_embeddings: bool = False) -> Batch:
    """Left-pad ``rows`` into one batch (the last prompt position is column -1 of every row)."""
    length = max(row.kinds.numel() for row in rows)
    first = rows[0]
    size, width, planes = len(rows), first.embeddings.shape[-1], first.positions.shape[0]
    embeddings = first.embeddings.new_zeros(size, length, width)
    valid = torch.zeros(size, length, dtype=torch.bool, device=first.kinds.device)
    kinds = torch.full((size, length), PAD, dtype=torch.long, device=first.kinds.device)
    positions = torch.zeros(planes, size, length, dtype=torch.long, device=first.kinds.device)
    origin = torch.full((size, length), -1, dtype=torch.long, device=first.kinds.device)
    for b, row in enumerate(rows):
        n = row.kinds.numel()
        embeddings[b, length - n :] = row.embeddings
        valid[b, length - n :] = True
        kinds[b, length - n :] = row.kinds
        positions[:, b, length - n :] = row.positions
        origin[b, length - n :] = torch.arange(n, device=origin.device)
    return Batch(embeddings, valid, kinds, positions, embeddings if carry_embeddings else None, origin)


def gather_rows(batch: Batch, keep: Sequence[Tensor]) -> Batch:
    """Keep, for every row ``b``, the layout columns ``keep[b]`` (ascending), re-packed to the left."""
    length = max(int(k.numel()) for k in keep)

    def take(tensor: Tensor | None, fill: Any, dim: int) -> Tensor | None:
        if tensor is None:
            return None
        shape = list(tensor.shape)
        shape[dim] = length
        out = torch.full(shape, fill, dtype=tensor.dtype, device=tensor.device)
        for b, columns in enumerate(keep):
            n = columns.numel()
            if dim == 1:
                out[b, length - n :] = tensor[b, columns]
            else:
                out[:, b, length - n :] = tensor[:, b, columns]
        return out

    return batch.map_columns(take)


def compact_positions(batch: Batch) -> Batch:
    """Renumber each row's valid tokens 0..n-1 (all position planes alike)."""
    ranks = torch.cumsum(batch.valid.long(), dim=1) - 1
    positions = torch.where(batch.valid, ranks, 0).unsqueeze(0).expand_as(batch.positions).clone()
    return replace(batch, positions=positions)


def attention_mask(valid: Tensor) -> Tensor:
    """(B, 1, L, L) boolean mask: causal, valid keys only, and the diagonal always on."""
    length = valid.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=valid.device).tril()
    allowed = causal[None] & valid[:, None, :]
    allowed |= torch.eye(length, dtype=torch.bool, device=valid.device)[None]
    return allowed[:, None]
