"""The record schema is defined once: docs/records.md is generated from it and the writers follow it."""

from pathlib import Path

from prune_audit.records.docs import records_markdown
from prune_audit.records.schema import INTERVENE_COLUMNS, INTERVENE_SCHEMA, RUN_COLUMNS, RUN_SCHEMA

DOC = Path(__file__).resolve().parents[2] / "docs" / "records.md"


def test_committed_doc_matches_the_schema():
    assert DOC.read_text(encoding="utf-8") == records_markdown(), (
        "docs/records.md is stale: run python -m prune_audit.records.docs"
    )


def test_every_column_is_defined_once_and_documented():
    names = [column.name for column in (*RUN_COLUMNS, *INTERVENE_COLUMNS)]
    assert len(names) == len(set(names))
    assert all(column.meaning and column.written_by for column in (*RUN_COLUMNS, *INTERVENE_COLUMNS))
    assert RUN_SCHEMA.names == names[: len(RUN_COLUMNS)] and INTERVENE_SCHEMA.names == names
