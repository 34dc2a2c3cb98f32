"""The cost table of docs/compute.md and README.md from a study's summary.csv (issue 26).

    python -m benchmarks.compute_table STUDY/summary.csv                   # every run: docs/compute.md
    python -m benchmarks.compute_table STUDY/summary.csv --compact \\
        --runs dense,cls_attn@64,divprune@64                               # chosen runs, fewer columns: README.md

One row per run of the study: accuracy, ECE (and AUROC), mean prefill FLOPs and their share of the same
questions' dense FLOPs (``flops_relative``), mean KV-cache KiB, FLOP-equivalent tokens and the mean latency
parts in ms per question (vision / selection / prefill). ``benchmarks/demo_numbers.sh`` writes both tables.
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path

FULL = ("run", "accuracy", "ECE", "AUROC", "MFLOPs", "of dense", "KV KiB", "FLOP-eq. tokens", "latency ms")
COMPACT = ("run", "acc.", "ECE", "MFLOPs (of dense)", "KV KiB", "ms vision / sel. / prefill")


def _latency(row: dict[str, str]) -> str:
    parts = ("mean_latency_vision_ms", "mean_latency_selection_ms", "mean_latency_prefill_ms")
    return " / ".join(f"{float(row[part]):.1f}" for part in parts)


def table_rows(rows: list[dict[str, str]], compact: bool) -> list[tuple[str, ...]]:
    """The cells of each summary row (``compact``: the README's columns)."""
    cells = []
    for row in rows:
        mflops, share, kib = (
            float(row["mean_flops"]) / 1e6,
            float(row["flops_relative"]),
            float(row["mean_kv_bytes"]) / 1024,
        )
        accuracy, ece = f"{float(row['accuracy']):.3f}", f"{float(row['ece']):.3f}"
        if compact:
            cells.append((row["run"], accuracy, ece, f"{mflops:.1f} ({share:.1%})", f"{kib:.0f}", _latency(row)))
        else:
            cells.append(
                (
                    row["run"],
                    accuracy,
                    ece,
                    f"{float(row['auroc']):.3f}",
                    f"{mflops:.1f}",
                    f"{share:.1%}",
                    f"{kib:.0f}",
                    f"{float(row['mean_flop_equivalent_tokens']):.1f}",
                    _latency(row),
                )
            )
    return cells


def markdown(summary: Path, runs: list[str] | None, compact: bool) -> str:
    """The markdown table of ``summary``'s runs (all, in its order, or ``runs`` in that order)."""
    with summary.open(newline="") as handle:
        by_run = {row["run"]: row for row in csv.DictReader(handle)}
    missing = [name for name in runs or [] if name not in by_run]
    if missing:
        raise SystemExit(f"error: {summary} has no run {', '.join(missing)}; its runs: {', '.join(by_run)}")
    chosen = [by_run[name] for name in runs] if runs else list(by_run.values())
    header = COMPACT if compact else FULL
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cells) + " |" for cells in table_rows(chosen, compact)]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("summary", type=Path, help="a study's summary.csv")
    parser.add_argument("--runs", help="comma-separated run names, in table order (default: every run)")
    parser.add_argument("--compact", action="store_true", help="the README's columns")
    args = parser.parse_args(argv)
    if not args.summary.is_file():
        parser.error(f"{args.summary} is not a file; pass the summary.csv a `prune-audit study` wrote")
    print(markdown(args.summary, args.runs.split(",") if args.runs else None, args.compact), end="")


if __name__ == "__main__":
    main()
