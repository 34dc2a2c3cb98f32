"""Splitting questions across processes by image: ``--shard I/N``, torchrun and accelerate."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

from prune_audit.errors import PruneAuditError
from prune_audit.integers import is_digits, parse_integer


class HasImage(Protocol):
    image: str


Q = TypeVar("Q", bound=HasImage)


@dataclass(frozen=True)
class Shard:
    """Shard ``index`` (0-based) of ``count``."""

    index: int
    count: int

    @property
    def writer(self) -> str:
        return f"{self.index:04d}of{self.count:04d}"


def parse_shard(text: str) -> Shard:
    """Parse ``I/N`` with 0 <= I < N."""
    try:
        index_text, count_text = text.split("/")
        shard = Shard(parse_integer(index_text), parse_integer(count_text))
    except ValueError:
        raise PruneAuditError(f"--shard must look like I/N (e.g. 0/4), got {text!r}") from None
    if not 0 <= shard.index < shard.count:
        raise PruneAuditError(f"--shard {text}: need 0 <= I < N; shards are numbered from 0")
    return shard


def shard_questions(questions: Sequence[Q], shard: Shard) -> list[Q]:
    """The questions whose image falls in ``shard``; images are dealt round-robin in sorted order.

    Sharding by image keeps every question of one image in one process, so the
    vision pass is shared and image-level statistics need no cross-process state.
    """
    images = sorted({q.image for q in questions})
    mine = set(images[shard.index :: shard.count])
    return [q for q in questions if q.image in mine]


def launcher_shard() -> Shard | None:
    """The shard given by torchrun / accelerate environment variables, if launched that way."""
    world_size = _launcher_number("WORLD_SIZE", "1")
    if world_size <= 1:
        return None
    rank = _launcher_number("RANK", "0")
    if rank >= world_size:
        raise PruneAuditError(
            f"RANK={rank} is not below WORLD_SIZE={world_size}; launch with torchrun or accelerate, or unset both"
        )
    return Shard(rank, world_size)


def _launcher_number(name: str, default: str) -> int:
    """A non-negative integer set by torchrun / accelerate; anything else is a one-line error."""
    text = os.environ.get(name, default).strip()
    if not is_digits(text):
        raise PruneAuditError(
            f"{name} must be a non-negative integer (torchrun and accelerate set it), got {text!r}; "
            f"unset it or launch with torchrun or accelerate"
        )
    return int(text)


class ProcessGroup:
    """A gloo process group for the barrier and the rank-0 merge; a no-op in a single process."""

    def __init__(self, shard: Shard | None) -> None:
        self.active = False
        if shard is None:
            return
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group(backend="gloo")
        self.active = True

    def barrier(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.barrier()

    def close(self) -> None:
        if self.active:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.active = False
