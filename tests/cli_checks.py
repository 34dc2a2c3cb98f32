"""Checks shared by the CLI safety tests: a one-line refusal, and the bytes of every file under a folder."""

from __future__ import annotations

from pathlib import Path


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
    return {str(p): p.read_bytes() for d in directories for p in sorted(Path(d).rglob("*"))
            if p.is_file() and ".prune-audit.lock" not in p.name}
