"""Durable, resumable run records: atomic Parquet part files compacted into ``records.parquet``.

Every batch of finished questions is written as its own part file (temporary name,
fsync, atomic rename), so a run killed at any moment, SIGKILL included, loses at
most the batch in flight and never leaves a half-written file under a final name.
Resuming reads the keys already present and skips them. Compaction concatenates
the parts, sorts them into question-file order and replaces ``records.parquet``
atomically; the parts are removed only after that, and a reader always takes the
union of ``records.parquet`` and any parts, de-duplicated by key.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from prune_audit.errors import PruneAuditError
from prune_audit.records.schema import KEY_COLUMNS, RECORDS_FILE, RUN_SCHEMA, Record
from prune_audit.safety.atomic import write_atomic

PARTS_DIR = "parts"
COMPACTION_RETRIES = 5


def write_table_atomic(table: pa.Table, path: Path) -> None:
    """Write ``table`` to ``path`` so that ``path`` is either absent, old, or complete."""
    write_atomic(path, lambda handle: pq.write_table(table, handle))


class RecordStore:
    """The records of one run directory, possibly written by several processes."""

    def __init__(self, run_dir: Path, writer: str = "0") -> None:
        self.run_dir = Path(run_dir)
        self.parts_dir = self.run_dir / PARTS_DIR
        self.writer = writer

    def part_files(self) -> list[Path]:
        if not self.parts_dir.is_dir():
            return []
        return sorted(p for p in self.parts_dir.glob("part-*.parquet"))

    def append(self, rows: Sequence[Record]) -> Path | None:
        """Persist one batch of finished records as a new part file."""
        if not rows:
            return None
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        table = pa.Table.from_pylist(list(rows), schema=RUN_SCHEMA)
        path = self.parts_dir / f"part-{self.writer}-{uuid.uuid4().hex}.parquet"
        write_table_atomic(table, path)
        return path

    def read(self) -> pa.Table:
        """All records present (compacted file and parts), de-duplicated by key, in question order."""
        tables = self._read_each(read_records_file)
        if not tables:
            return RUN_SCHEMA.empty_table()
        table = pa.concat_tables(tables)
        return _sorted_unique(table)

    def done_keys(self) -> set[tuple[str, int]]:
        keys: set[tuple[str, int]] = set()
        for table in self._read_each(_read_keys):
            keys.update(zip(table["split"].to_pylist(), table["question_id"].to_pylist()))
        return keys

    def compact(self) -> pa.Table:
        """Replace ``records.parquet`` with every record present, then drop the parts."""
        parts = self.part_files()
        table = self.read()
        write_table_atomic(table, self.run_dir / RECORDS_FILE)
        for part in parts:
            part.unlink(missing_ok=True)
        if self.parts_dir.is_dir() and not any(self.parts_dir.iterdir()):
            self.parts_dir.rmdir()
        return table

    def _read_each(self, read: Callable[[Path], pa.Table]) -> list[pa.Table]:
        """``read`` of every source; restarted when a part vanishes (another process compacted it into
        ``records.parquet`` meanwhile, so the next listing holds its rows)."""
        for _ in range(COMPACTION_RETRIES):
            try:
                return [read(path) for path in self._sources()]
            except FileNotFoundError:
                continue
        return [read(path) for path in self._sources()]

    def _sources(self) -> list[Path]:
        compacted = self.run_dir / RECORDS_FILE
        return ([compacted] if compacted.is_file() else []) + self.part_files()


def check_records_schema(path: Path, schema: pa.Schema = RUN_SCHEMA) -> None:
    """Refuse a records file whose columns or types differ from this version's schema."""
    found = pq.read_schema(path)
    expected = {field.name: field.type for field in schema}
    present = {field.name: field.type for field in found}
    missing = [name for name in expected if name not in present]
    changed = [name for name in expected if name in present and present[name] != expected[name]]
    if missing or changed:
        what = f"lacks column {', '.join(missing)}" if missing else f"has other types for {', '.join(changed)}"
        raise PruneAuditError(
            f"{path} {what}: it was written by an older prune-audit or another tool; re-run with this version"
        )


def read_records_file(path: Path, schema: pa.Schema = RUN_SCHEMA) -> pa.Table:
    """One records file, checked against ``schema`` and cast to it (column order included)."""
    check_records_schema(path, schema)
    return pq.read_table(path).select(schema.names).cast(schema)


def _read_keys(path: Path) -> pa.Table:
    check_records_schema(path)
    return pq.read_table(path, columns=list(KEY_COLUMNS))


def _sorted_unique(table: pa.Table) -> pa.Table:
    table = table.sort_by([("order", "ascending")])
    seen: set[tuple[str, int]] = set()
    keep = []
    for index, key in enumerate(zip(table["split"].to_pylist(), table["question_id"].to_pylist())):
        if key not in seen:
            seen.add(key)
            keep.append(index)
    return table.take(keep) if len(keep) != table.num_rows else table


def merge_tables(tables: Iterable[pa.Table]) -> pa.Table:
    """Union of record tables in question order, one row per key."""
    table = pa.concat_tables([t.select(RUN_SCHEMA.names).cast(RUN_SCHEMA) for t in tables])
    return _sorted_unique(table)
