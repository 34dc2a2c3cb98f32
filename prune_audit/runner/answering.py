"""The model's answers to prepared questions: grouped by answer mode and budget, each question with its own seed.

``execute`` answers a run's batches through it, ``imported`` re-answers under imported kept sets, the Python API
its calls; none of them depends on another for it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from prune_audit.compute.budget import resolve_budget

if TYPE_CHECKING:
    import torch

    from prune_audit.answer_modes import AnswerMode
    from prune_audit.compute.budget import Budget
    from prune_audit.models import Answer, Prepared, VisionLanguageModel
    from prune_audit.models.prepared import ForcedStages
    from prune_audit.pruners.base import Selector
    from prune_audit.tasks import TaskQuestion


def question_seed(seed: int, split: str, question_id: int) -> int:
    """A per-question seed, so results do not depend on batching, sharding or resuming."""
    digest = hashlib.sha256(f"{seed}:{split}:{question_id}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def question_generator(seed: int, question: TaskQuestion) -> torch.Generator:
    """The question's own random generator (``question_seed``)."""
    import torch

    return torch.Generator().manual_seed(question_seed(seed, question.split, question.question_id))


def answer_grouped(
    vlm: VisionLanguageModel,
    selector: Selector | None,
    budget: Budget,
    prepared: Sequence[Prepared],
    modes: Sequence[AnswerMode],
    generators: Sequence[torch.Generator] | None = None,
    forced_kept: Sequence[Sequence[int]] | None = None,
    forced_stages: Sequence[ForcedStages] | None = None,
) -> list[Answer]:
    """Answers in row order, asked in groups of one answer mode and one token budget (resolved per image: a
    share ``11%`` of its tokens, ``all`` of them), so answers do not depend on the batch. ``generators``,
    ``forced_kept`` and ``forced_stages`` hold one entry per row (as ``VisionLanguageModel.answer``)."""
    budgets = [resolve_budget(budget, item.budget_tokens) for item in prepared]
    groups: dict[tuple, list[int]] = {}
    for row, key in enumerate(zip(budgets, modes)):
        groups.setdefault(key, []).append(row)
    by_row: dict[int, Answer] = {}
    for (row_budget, mode), rows in groups.items():
        group = vlm.answer(
            [prepared[i] for i in rows],
            selector,
            row_budget,
            mode=mode,
            generator=_pick(generators, rows),
            forced_kept=_pick(forced_kept, rows),
            forced_stages=_pick(forced_stages, rows),
        )
        by_row.update(zip(rows, group))
    return [by_row[index] for index in range(len(prepared))]


def _pick(values: Sequence | None, rows: Sequence[int]) -> list | None:
    """The entries of ``rows`` (None stays None)."""
    return None if values is None else [values[row] for row in rows]
