"""Question ids are unique over every question file read together: one rule for the task readers.

A reader notes each question it reads (``note_question``) in a map shared by the files read
together, so a question repeated within one file or across two (the same file passed twice, or a
copy of it) is refused naming both places, instead of being asked, scored and counted twice.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from pathlib import Path

from prune_audit.errors import PruneAuditError


@dataclass(frozen=True)
class QuestionPlace:
    """Where a question is: its file and line (JSON Lines), entry (a JSON list) or row (Parquet), and how messages
    name it."""

    path: Path
    unit: str
    number: int
    name: str

    def __str__(self) -> str:
        return f"{self.path}:{self.number}" if self.unit == "line" else f"{self.path}: {self.unit} {self.number}"

    def named_from(self, other: QuestionPlace) -> str:
        """This place as a message about ``other`` names it: without the file when both are in one."""
        return f"{self.unit} {self.number}" if self.path == other.path else str(self)


QuestionPlaces = dict[Hashable, QuestionPlace]
"""Question key -> where it was read (the map the files read together share)."""


def note_question(key: Hashable, place: QuestionPlace, seen: QuestionPlaces) -> None:
    """Note that question ``key`` is at ``place``; a key ``seen`` already holds is refused naming both places."""
    if seen.get(key) == place:
        raise PruneAuditError(f"{place.path} is given twice; pass each question file once")
    if key in seen:
        raise PruneAuditError(
            f"{place}: {place.name} repeats {seen[key].named_from(place)}; keep each question once "
            f"(pass each question file once)"
        )
    seen[key] = place


__all__ = ["QuestionPlace", "QuestionPlaces", "note_question"]
