"""Plain text for the terminal: paragraphs wrapped at word boundaries to its width.

Identifiers (selector names, signal names, paths, ``KEY=VALUE``) are never broken inside:
a word longer than the line stays whole on a line of its own.
"""

from __future__ import annotations

import shutil
import sys
import textwrap
from typing import TextIO

FALLBACK_COLUMNS = 80
"""Width when the output is not a terminal and $COLUMNS is not set."""


def terminal_width() -> int:
    """$COLUMNS, else the terminal's width, else 80 (output piped or in a log)."""
    return shutil.get_terminal_size((FALLBACK_COLUMNS, 24)).columns


class Page:
    """Lines of text, each paragraph wrapped at word boundaries to ``width``, printed at once."""

    def __init__(self, width: int | None = None) -> None:
        self.width = width or terminal_width()
        self.lines: list[str] = []

    def paragraph(self, text: str, indent: int = 0, hang: int | None = None) -> None:
        """``text`` from column ``indent``, its continuation lines from column ``hang`` (default: ``indent``)."""
        self.lines += textwrap.wrap(
            text,
            self.width,
            initial_indent=" " * indent,
            subsequent_indent=" " * (indent if hang is None else hang),
            break_long_words=False,
            break_on_hyphens=False,
        ) or [""]

    def blank(self) -> None:
        self.lines.append("")

    def show(self, file: TextIO | None = None) -> None:
        print("\n".join(self.lines), file=file or sys.stdout)
