"""``prune-audit intervene``, step 3: the answers under each swap -> records (``INTERVENE_SCHEMA``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.parquet as pq

from prune_audit.records.schema import Record, intervene_schema
from prune_audit.runner.build import AnsweredQuestion, QuestionEvidence, build_records
from prune_audit.runner.intervene.swaps import Swap

if TYPE_CHECKING:
    from prune_audit.data.retention import ObjectArea
    from prune_audit.models import Answer, Prepared
    from prune_audit.tasks import Task, TaskQuestion


def intervention_rows(
    task: Task,
    question: TaskQuestion,
    record: Record,
    prepared: Prepared,
    evidence: QuestionEvidence,
    area: ObjectArea,
    swaps: dict[str, Swap],
    answers: Sequence[Answer],
) -> list[Record]:
    """One record per condition: the run's columns for the forced answer plus the swap's columns (the object area
    changed counted on ``area``, the region the swaps moved)."""
    answered = [AnsweredQuestion(question, answer, prepared, record["image_id"], record["order"]) for answer in answers]
    rows = build_records(task, answered, [evidence] * len(answered))
    for row, (condition, swap) in zip(rows, swaps.items()):
        row.update(
            condition=condition,
            cells_changed=swap.size,
            object_area_changed=swap.object_area_changed(area.area_per_token),
        )
    return rows


def records_table(rows: Sequence[Record]) -> pa.Table:
    return pa.Table.from_pylist(list(rows), schema=intervene_schema())


def parquet_bytes(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()
