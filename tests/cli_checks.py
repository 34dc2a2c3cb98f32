"""Helpers shared by the CLI and task tests: a one-line refusal, the bytes of every file under a folder, a changed
copy of an annotations file, JSON and JSON-lines input files, an answers file and the ``score --json`` report."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from typer.testing import CliRunner

from prune_audit.cli.main import app

runner = CliRunner()


def refused(result, *needles: str, code: int = 2) -> str:
    """Exit ``code``, one ``error:`` line on stderr holding every needle, no traceback."""
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def snapshot(*directories: Path) -> dict[str, bytes]:
    """Bytes of every file under ``directories`` except the lock files (their holder text changes)."""
    return {
        str(p): p.read_bytes()
        for d in directories
        for p in sorted(Path(d).rglob("*"))
        if p.is_file() and ".prune-audit.lock" not in p.name
    }


def changed_annotations(annotations: Path, folder: Path, change: Callable[[dict], None]) -> Path:
    """``folder/instances.json``: the COCO annotations of ``annotations`` after ``change`` edited them in place."""
    data = json.loads(annotations.read_text())
    change(data)
    path = folder / "instances.json"
    path.write_text(json.dumps(data))
    return path


def write_lines(path: Path, rows: list[object]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def write_json(path: Path, data: object) -> Path:
    path.write_text(json.dumps(data))
    return path


def answers_file(path: Path, rows: list[tuple[object, str]]) -> Path:
    path.write_text("".join(json.dumps({"question_id": qid, "text": text}) + "\n" for qid, text in rows))
    return path


def score_json(*args: str) -> dict:
    result = runner.invoke(app, ["score", *args, "--json"])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)
