"""Generate docs/records.md from the column definitions: ``python -m prune_audit.records.docs [PATH]``."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa

from prune_audit.records.manifest import CONFIG_FIELDS, MANIFEST_KEYS
from prune_audit.records.schema import INTERVENE_COLUMNS, run_columns

DOC_PATH = Path("docs") / "records.md"


def _type_name(type_: pa.DataType) -> str:
    if pa.types.is_list(type_):
        return f"list<{_type_name(type_.value_type)}>"
    return {"int64": "int64", "double": "float64", "string": "string", "bool": "bool"}[str(type_)]


def records_markdown() -> str:
    """docs/records.md, generated from the column definitions ."""
    lines = [
        "# Run records (`prune-audit run` and `prune-audit intervene` output)",
        "",
        "<!-- generated from prune_audit/records/schema.py and manifest.py by `python -m prune_audit.records.docs`; do not edit -->",
        "",
        "A run directory holds `records.parquet` (one row per question) and `manifest.json`.",
        "Rows are keyed by (`split`, `question_id`): POPE question ids repeat across splits.",
        "`intervene` writes the run columns plus its own, two rows (intervention, control) per question.",
        "Every records file (and `parts/` file) carries its manifest's `run_id` in its Parquet key-value metadata",
        "(`prune_audit.run_id`; `intervene`'s: the source run's); readers and resume refuse files of another run.",
        "",
        "| column | type | nullable | written by | meaning |",
        "|---|---|---|---|---|",
    ]
    for column in (*run_columns(), *INTERVENE_COLUMNS):
        nullable = "yes" if column.nullable else "no"
        lines.append(
            f"| {column.name} | {_type_name(column.type)} | {nullable} | {', '.join(column.written_by)} | {column.meaning} |"
        )
    lines += [
        "",
        "## manifest.json",
        "",
        "Top-level keys (`clip_text` for LLaVA and LLaVA-NeXT, `positions` for Qwen2.5-VL). A resume must match the",
        "configuration keys; `merge` refuses shards that differ in them.",
        "",
        "| key | configuration | meaning |",
        "|---|---|---|",
    ]
    for key, meaning in MANIFEST_KEYS:
        lines.append(f"| {key} | {'yes' if key in CONFIG_FIELDS else 'no'} | {meaning} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    """Write the generated table to PATH (default docs/records.md, relative to the working directory)."""
    args = sys.argv[1:] if argv is None else argv
    path = Path(args[0]) if args else DOC_PATH
    path.write_text(records_markdown(), encoding="utf-8")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
