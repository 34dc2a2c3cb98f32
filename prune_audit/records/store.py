"""Durable, resumable run records: atomic Parquet part files compacted into ``records.parquet``.

Every batch of finished questions is written as its own part file (temporary name,
fsync, atomic rename), so a run killed at any moment, SIGKILL included, loses at
most the batch in flight and never leaves a half-written file under a final name.
Resuming reads the keys already present and skips them. Compaction concatenates
the parts, sorts them into question-file order and replaces ``records.parquet``
atomically; the parts are removed only after that, and a reader always takes the
union of ``records.parquet`` and any parts, de-duplicated by key.

Records belong to their manifest: every file carries the manifest's ``run_id`` in its
Parquet metadata, and every reader and resume refuses a file of another run (or of none),
a key repeated with other values, and rows outside the run's planned questions. A folder
holding records without a manifest is refused, never adopted.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from prune_audit.errors import PruneAuditError
from prune_audit.records.consistency import record_problem
from prune_audit.records.manifest import MANIFEST_FILE, read_manifest
from prune_audit.records.schema import KEY_COLUMNS, RECORDS_FILE, RUN_ID_METADATA, Record, run_columns, run_schema
from prune_audit.safety.atomic import write_atomic

PARTS_DIR = "parts"
COMPACTION_RETRIES = 5
T = TypeVar("T")


def stamped(table: pa.Table, run_id: str) -> pa.Table:
    """``table`` with ``run_id`` in its schema metadata, written into the Parquet file with it."""
    return table.replace_schema_metadata({RUN_ID_METADATA: run_id.encode()})


def write_table_atomic(table: pa.Table, path: Path) -> None:
    """Write ``table`` to ``path`` so that ``path`` is either absent, old, or complete."""
    write_atomic(path, lambda handle: pq.write_table(table, handle))


class RecordStore:
    """The records of one run directory, possibly written by several processes.

    ``manifest`` is the run's (``run_id`` and ``num_questions`` are read): files of another
    run are refused, and so are rows beyond its planned questions.
    """

    def __init__(self, run_dir: Path, manifest: Mapping[str, Any], writer: str = "0") -> None:
        self.run_dir = Path(run_dir)
        self.parts_dir = self.run_dir / PARTS_DIR
        self.writer = writer
        self.run_id: str = manifest["run_id"]
        self.planned: int = manifest["num_questions"]

    def part_files(self) -> list[Path]:
        if not self.parts_dir.is_dir():
            return []
        return sorted(p for p in self.parts_dir.glob("part-*.parquet"))

    def append(self, rows: Sequence[Record]) -> Path | None:
        """Persist one batch of finished records as a new part file; a record breaking a rule of
        ``records.consistency`` (a bug of the writer) is refused before the batch is written."""
        if not rows:
            return None
        for row in rows:
            problem = record_problem(row)
            if problem is not None:
                raise PruneAuditError(
                    f"record of question {row['split']}/{row['question_id']} is inconsistent "
                    f"({problem}); it was not written: please report this with the command line"
                )
        self.parts_dir.mkdir(parents=True, exist_ok=True)
        table = stamped(pa.Table.from_pylist(list(rows), schema=run_schema()), self.run_id)
        path = self.parts_dir / f"part-{self.writer}-{uuid.uuid4().hex}.parquet"
        write_table_atomic(table, path)
        return path

    def read(self) -> pa.Table:
        """All records present (compacted file and parts), de-duplicated by key, in question order."""
        tables = self._read_each(lambda path: read_records_file(path, self.run_id))
        table = pa.concat_tables(tables) if tables else run_schema().empty_table()
        table = unique_records(table, str(self.run_dir))
        self._check_planned(len(table), table["order"].to_pylist())
        return table

    def done_keys(self) -> set[tuple[str, int]]:
        """Keys of the records present, every file checked as ``read`` does."""
        counts: Counter[tuple[str, int]] = Counter()
        for table in self._read_each(lambda path: _read_keys(path, self.run_id)):
            counts.update(zip(table["split"].to_pylist(), table["question_id"].to_pylist()))
        if any(count > 1 for count in counts.values()):  # a compaction in flight; ``read`` checks the copies agree
            self.read()
        self._check_planned(len(counts))
        return set(counts)

    def compact(self) -> pa.Table:
        """Replace ``records.parquet`` with every record present, then drop the parts."""
        parts = self.part_files()
        table = self.read()
        write_table_atomic(stamped(table, self.run_id), self.run_dir / RECORDS_FILE)
        for part in parts:
            part.unlink(missing_ok=True)
        if self.parts_dir.is_dir() and not any(self.parts_dir.iterdir()):
            self.parts_dir.rmdir()
        return table

    def _check_planned(self, count: int, orders: Sequence[int] = ()) -> None:
        """At most the run's planned questions, each at its own position of the question list."""
        if count > self.planned:
            found = f"{count} records for its {self.planned} planned questions"
        elif any(not 0 <= order < self.planned for order in orders) or len(set(orders)) != len(orders):
            found = f"records outside the positions of its {self.planned} planned questions (column order)"
        else:
            return
        raise PruneAuditError(
            f"{self.run_dir} holds {found}; they were not all written by this run: remove the folder, or re-run "
            f"into a new --out"
        )

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


def check_run_layout(run_dir: Path) -> None:
    """Refuse a run directory whose files are folders (or the reverse), or that holds records without a
    manifest (left by an interrupted writer or copied in: nothing says whose they are)."""
    run_dir = Path(run_dir)
    for name, folder in ((MANIFEST_FILE, False), (RECORDS_FILE, False), (PARTS_DIR, True)):
        path = run_dir / name
        if path.exists() and path.is_dir() != folder:
            kind = "a folder" if folder else "a file"
            raise PruneAuditError(f"{path} is not {kind}; remove it, or pass another --out")
    if holds_records(run_dir) and not (run_dir / MANIFEST_FILE).exists():
        raise PruneAuditError(
            f"{run_dir} holds records but no {MANIFEST_FILE} (an interrupted write, or files copied in), so they "
            f"cannot be told to be a run's own: remove the folder, or pass another --out"
        )


def holds_records(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds any record file (compacted or a part)."""
    parts = Path(run_dir) / PARTS_DIR
    return (Path(run_dir) / RECORDS_FILE).exists() or (parts.is_dir() and any(parts.glob("part-*.parquet")))


def read_run(run_dir: Path) -> tuple[dict[str, Any], pa.Table]:
    """The run's validated manifest and its records, every file checked to be the run's own."""
    check_run_layout(run_dir)
    manifest = read_manifest(run_dir)
    return manifest, RecordStore(run_dir, manifest).read()


def _parquet(path: Path, read: Callable[[Path], T]) -> T:
    """``read(path)``, a damaged file refused in one line naming it (a vanished one re-raised for the retry)."""
    try:
        return read(path)
    except FileNotFoundError:
        raise
    except (pa.ArrowException, OSError) as error:
        reason = str(error).split(". ")[0].strip().rstrip(".")
        raise PruneAuditError(
            f"{path} is not a readable Parquet file ({reason}); remove it (its questions are answered again "
            f"by the same run command), or restore it"
        ) from None


def check_records_file(path: Path, run_id: str, schema: pa.Schema | None = None) -> None:
    """Refuse a records file of another run (or of none) or whose columns or types differ from ``schema`` (default
    the run schema); a task's own column may be absent where no row is that task's (``_lacked``)."""
    found = _parquet(path, pq.read_schema)
    expected = {field.name: field.type for field in schema or run_schema()}
    present = {field.name: field.type for field in found}
    missing = _lacked(path, [name for name in expected if name not in present])
    changed = [name for name in expected if name in present and present[name] != expected[name]]
    if missing or changed:
        what = f"lacks column {', '.join(missing)}" if missing else f"has other types for {', '.join(changed)}"
        raise PruneAuditError(
            f"{path} {what}: it was written by an older prune-audit or another tool; re-run with this version"
        )
    written = (found.metadata or {}).get(RUN_ID_METADATA, b"").decode(errors="replace")
    if written != run_id:
        whose = f"another run (run id {written[:12]}...)" if written else "no run (it carries no run id)"
        raise PruneAuditError(
            f"{path} belongs to {whose}, not to the run of its {MANIFEST_FILE} (run id {run_id[:12]}...): records are "
            f"never adopted from another run; remove it, or re-run into a new --out"
        )


def _lacked(path: Path, missing: list[str]) -> list[str]:
    """Of the ``missing`` columns, those the file must hold: the core ones, and a task's own where a row is that
    task's. A task's own column is null in every other task's rows, so a file recorded before a plug-in task
    declared its columns lacks them and reads them as null (``read_records_file``)."""
    owners = {column.name: set(column.tasks) for column in run_columns()}
    if "task" in missing or not any(owners.get(name) for name in missing):
        return missing
    tasks = set(_parquet(path, lambda source: pq.read_table(source, columns=["task"]))["task"].to_pylist())
    return [name for name in missing if not owners.get(name) or owners[name] & tasks]


def read_records_file(path: Path, run_id: str, schema: pa.Schema | None = None) -> pa.Table:
    """One records file of run ``run_id``, checked against ``schema`` (default the run schema) and cast to it
    (column order included; another task's column the file lacks reads as null); a key repeated within the file
    is refused."""
    schema = schema or run_schema()
    check_records_file(path, run_id, schema)
    table = _parquet(path, pq.read_table)
    for field in schema:
        if field.name not in table.column_names:
            table = table.append_column(field, pa.nulls(table.num_rows, field.type))
    table = table.select(schema.names).cast(schema)
    _check_unique_keys(table, path)
    return table


def _read_keys(path: Path, run_id: str) -> pa.Table:
    check_records_file(path, run_id)
    table = _parquet(path, lambda source: pq.read_table(source, columns=list(KEY_COLUMNS)))
    _check_unique_keys(table, path)
    return table


def _keys(table: pa.Table) -> list[tuple[str, int]]:
    return list(zip(table["split"].to_pylist(), table["question_id"].to_pylist()))


def _check_unique_keys(table: pa.Table, path: Path) -> None:
    repeated = [key for key, count in Counter(_keys(table)).items() if count > 1]
    if repeated:
        raise PruneAuditError(
            f"{path} holds {len(repeated)} questions twice (first {repeated[0][0]}/{repeated[0][1]}); it was not "
            f"written by prune-audit as is: remove it (its questions are answered again), or restore it"
        )


def unique_records(table: pa.Table, source: str) -> pa.Table:
    """Records in question order, one row per key; a key may repeat only with identical values (a part
    and the compacted file holding the same rows while a compaction finishes)."""
    table = table.sort_by([("order", "ascending")])
    first: dict[tuple[str, int], int] = {}
    repeats: list[tuple[int, int]] = []
    for index, key in enumerate(_keys(table)):
        if key in first:
            repeats.append((first[key], index))
        else:
            first[key] = index
    for kept, repeat in repeats:
        if repr(table.slice(kept, 1).to_pylist()) != repr(table.slice(repeat, 1).to_pylist()):
            split, question_id = _keys(table.slice(kept, 1))[0]
            raise PruneAuditError(
                f"{source} holds two different records of question {split}/{question_id}; they were not all "
                f"written by this run: remove the folder, or re-run into a new --out"
            )
    return table.take(sorted(first.values())) if repeats else table


def merge_tables(tables: Iterable[pa.Table], source: str) -> pa.Table:
    """Union of record tables in question order, one row per key (a key repeated with other values refused)."""
    schema = run_schema()
    return unique_records(pa.concat_tables([t.select(schema.names).cast(schema) for t in tables]), source)
