"""Report files: strict JSON and long-format CSV; ``write_files`` (from ``safety.atomic``) writes a set of them."""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Iterator, Mapping
from typing import Any

from prune_audit.safety.atomic import write_files


def json_ready(value: Any) -> Any:
    """``value`` with NaN and infinities replaced by None, so the output is strict JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(key): json_ready(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(item) for item in value]
    return value


def to_json(value: Any) -> str:
    return json.dumps(json_ready(value), indent=2, allow_nan=False) + "\n"


def estimates(tree: Mapping[str, Any], path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], dict]]:
    """Every {"value", "ci95"} leaf of a nested report, with the keys leading to it.

    A plain number (not a bool) is yielded as an estimate without interval.
    """
    for key, item in tree.items():
        if isinstance(item, Mapping) and "value" in item and "ci95" in item:
            yield (*path, key), item
        elif isinstance(item, Mapping):
            yield from estimates(item, (*path, key))
        elif isinstance(item, (int, float)) and not isinstance(item, bool):
            yield (*path, key), {"value": item, "ci95": [None, None]}


def estimates_csv(rows: Mapping[str, Mapping[str, Any]], sections: tuple[str, ...]) -> str:
    """CSV with columns run, section, group, metric, value, ci_low, ci_high (empty when not estimated).

    Args:
        rows: run label -> report of that run.
        sections: the report keys to export; nested keys below a section become ``group``
            (joined by "/") and ``metric``.
    """
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(["run", "section", "group", "metric", "value", "ci_low", "ci_high"])
    for label, report in rows.items():
        for section in sections:
            for keys, leaf in estimates(report.get(section) or {}):
                numbers = [_number(value) for value in (leaf["value"], *leaf["ci95"])]
                writer.writerow([label, section, "/".join(keys[:-1]), keys[-1], *numbers])
    return buffer.getvalue()


def _number(value: float | None) -> str:
    return "" if value is None or (isinstance(value, float) and not math.isfinite(value)) else repr(float(value))


__all__ = ["json_ready", "to_json", "estimates", "estimates_csv", "write_files"]  # write_files: safety.atomic's
