"""Report files: strict JSON, long-format CSV and an all-or-nothing write of a set of files."""

from __future__ import annotations

import csv
import io
import json
import math
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from prune_audit.safety.atomic import staging_folder


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


def write_files(directory: Path, files: Mapping[str, str | bytes]) -> list[Path]:
    """Write every file into ``directory`` or none of them.

    Files are first written into a hidden staging folder beside them, then each is moved
    into place with an atomic rename; a failure before the moves leaves ``directory``
    untouched. A staging folder left by a killed process is removed by the next
    ``hold_output_dir`` of ``directory``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(directory)
    try:
        for name, content in files.items():
            data = content.encode("utf-8") if isinstance(content, str) else content
            try:
                (staging / name).write_bytes(data)
            except OSError as error:  # name the file being written, not the hidden staging copy
                raise OSError(error.errno, error.strerror, str(directory / name)) from error
        written = []
        for name in files:
            os.replace(staging / name, directory / name)
            written.append(directory / name)
        return written
    finally:
        shutil.rmtree(staging, ignore_errors=True)
