"""Whole numbers typed by a user (options, environment variables, ids in input files).

Python's ``int()`` also takes ``"+3"``, ``" 3 "``, ``"3_000"`` and non-ASCII digits such as
``"٣"``, while ``str.isdigit()`` accepts ``"²"``, which ``int()`` then refuses with a Python
message. Every integer the user types is therefore read here: an optional minus sign and
ASCII digits, nothing else.
"""

from __future__ import annotations

import re

_INTEGER = re.compile(r"-?[0-9]+")


def is_integer_text(text: str) -> bool:
    """True when ``text`` is an optional ``-`` followed by ASCII digits only."""
    return _INTEGER.fullmatch(text) is not None


def is_digits(text: str) -> bool:
    """True when ``text`` is ASCII digits only (a non-negative integer, no sign)."""
    return is_integer_text(text) and not text.startswith("-")


def parse_integer(text: str) -> int:
    """``text`` as an int when it is an optional ``-`` and ASCII digits; ValueError otherwise."""
    if not is_integer_text(text):
        raise ValueError(f"not an integer: {text!r}")
    return int(text)
