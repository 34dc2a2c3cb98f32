"""``prune-audit export``: a run's kept sets and answers written to a kept-set file (``records.interchange``), or
its answers as LLaVA's answers file; ``runner.imported`` reads such a file back as a run."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from prune_audit.errors import PruneAuditError

if TYPE_CHECKING:
    import pyarrow as pa


def _read_whole_run(run_dir: Path) -> tuple[dict[str, Any], pa.Table]:
    """The run's manifest and records; a run holding fewer questions than it planned (a shard, a stopped run) is
    refused, since an exported file would pass for the whole run."""
    from prune_audit.records.store import read_run

    manifest, records = read_run(Path(run_dir))
    if records.num_rows < manifest["num_questions"]:
        raise PruneAuditError(
            f"{run_dir} holds {records.num_rows} of its {manifest['num_questions']} planned questions (a shard or a "
            f"run stopped midway), so the exported file would be incomplete without saying so; finish it with the "
            f"same prune-audit run command (or merge its shards), then export"
        )
    return manifest, records


def export_run(run_dir: Path, out: Path) -> int:
    """Write the kept sets and answers of the run in ``run_dir`` to ``out`` (.jsonl or .parquet); the number of
    questions. ``out`` may be new or a kept-set file (``export`` rewrites only its own kind of file), in a folder no
    command owns (``safety.ownership``: a run's, a calibration's folder are refused). A run holding fewer questions
    than it planned (a shard, a stopped run) is refused: the file would pass for the whole run."""
    from prune_audit.records.interchange import (
        check_suffix,
        header_of,
        is_kept_set_file,
        question_line,
        write_kept_sets,
    )
    from prune_audit.safety.ownership import check_output_dir

    check_suffix(out, "--out")
    manifest, records = _read_whole_run(run_dir)  # the input first: a mistyped run is named as such
    check_output_dir(out.parent, "export", shared=True)  # as every writer: never into another command's folder
    if out.exists() and not (out.is_file() and is_kept_set_file(out)):
        raise PruneAuditError(
            f"--out {out} exists and is not a kept-set file; export never replaces other files: pass a new file name"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    write_kept_sets(header_of(manifest), [question_line(record) for record in records.to_pylist()], out)
    return records.num_rows


def check_answers_path(out: Path) -> None:
    """Refuse an answers file name that is not .jsonl or already exists (export never replaces a file)."""
    if out.suffix != ".jsonl":
        raise PruneAuditError(f"--answers writes JSON Lines, got {out.name}; pass a FILE.jsonl")
    if out.exists():
        raise PruneAuditError(f"--answers {out} exists; export never replaces a file: pass a new file name")


def export_answers(run_dir: Path, out: Path) -> int:
    """Write the run's answers as LLaVA's answers file (one ``question_id`` + ``text`` line per question, the form
    ``prune-audit score`` reads) to ``out`` (a new .jsonl file); the number of answers."""
    import json

    from prune_audit.safety.atomic import write_text_atomic
    from prune_audit.safety.ownership import check_output_dir

    check_answers_path(out)
    _, records = _read_whole_run(run_dir)  # the input first: a mistyped run is named as such
    check_output_dir(out.parent, "export", shared=True)  # as every writer: never into another command's folder
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = records.select(["question_id", "answer_text"]).to_pylist()
    write_text_atomic(
        "".join(json.dumps({"question_id": row["question_id"], "text": row["answer_text"]}) + "\n" for row in rows), out
    )
    return len(rows)


__all__ = ["check_answers_path", "export_answers", "export_run"]
