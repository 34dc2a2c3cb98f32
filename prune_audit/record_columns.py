"""One record column: name, Arrow type, nullability, meaning, and who writes it.

The type every declarer of columns shares: ``records.schema`` (the task-agnostic core and the intervene
columns) and each task (``Task.record_columns``, the columns only its rows hold). It sits at the root, below
both, because the tasks declare columns and the records layer assembles them (``records.schema.run_columns``).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

RUN_COMMANDS = ("run", "intervene")
INTERVENE_COMMANDS = ("intervene",)


@dataclass(frozen=True)
class Column:
    """One record column.

    Attributes:
        name: the Parquet column name.
        type: its Arrow type.
        nullable: whether a row may hold null (NaN in a float column is a value, not null).
        meaning: what the value is, for docs/records.md.
        written_by: the commands whose records carry the column.
        tasks: the tasks whose rows hold it (``prune_audit.tasks``); empty for the task-agnostic core. A task's
            own column is null in the rows of every other task, so its Arrow field is nullable; ``nullable``
            says whether it may be null in its own tasks' rows. A task declares its columns without it: the
            run schema fills it in (``records.schema.run_columns``).
    """

    name: str
    type: pa.DataType
    nullable: bool
    meaning: str
    written_by: tuple[str, ...] = RUN_COMMANDS
    tasks: tuple[str, ...] = ()

    def field(self) -> pa.Field:
        return pa.field(self.name, self.type, nullable=self.nullable or bool(self.tasks))


def column(name: str, type_: pa.DataType, meaning: str, nullable: bool = False) -> Column:
    """A run column (written by ``run`` and carried by ``intervene``)."""
    return Column(name, type_, nullable, meaning)


INT_LIST = pa.list_(pa.int64())

__all__ = ["INTERVENE_COMMANDS", "INT_LIST", "RUN_COMMANDS", "Column", "column"]
