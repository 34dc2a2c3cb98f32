"""``prune-audit pope``: score POPE answers, build POPE question sets, inspect question files."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from prune_audit.cli.common import handle_errors

app = typer.Typer(
    name="pope",
    help="POPE question files: score answers, build question sets from COCO, inspect files.",
    no_args_is_help=True,
)

METRIC_COLUMNS = ("n", "accuracy", "precision", "recall", "f1", "yes_ratio", "tp", "fp", "tn", "fn")


def _print_columns(title: str, columns: dict[str, dict[str, str]]) -> None:
    """One table column per entry (a split or a file's split), one row per field."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    table.add_column("")
    for name in columns:
        table.add_column(name, justify="right", overflow="fold")
    fields = list(dict.fromkeys(field for column in columns.values() for field in column))
    for field in fields:
        table.add_row(field, *(column.get(field, "") for column in columns.values()))
    Console().print(table)


def _format(value: Any) -> str:
    if isinstance(value, float):
        return "nan" if value != value else f"{value:.4f}"
    return str(value)


@app.command("score")
@handle_errors
def score(
    answers: Annotated[
        Path, typer.Argument(help="Answers (JSON Lines): POPE 'answer' lines or LLaVA 'question_id'+'text'.")
    ],
    pope: Annotated[
        list[Path],
        typer.Option(
            "--pope",
            help="POPE question file(s) with labels; LLaVA's merged llava_pope_test.jsonl may be added with them.",
        ),
    ],
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Score answers as POPE's evaluate.py does: per split and averaged over splits."""
    from prune_audit.analysis.outputs import to_json
    from prune_audit.data.pope_score import score_files

    report = score_files(answers, pope)
    if json_output:
        print(to_json(report), end="")
        return
    columns = {
        split: {key: _format(metrics[key]) for key in METRIC_COLUMNS} for split, metrics in report["splits"].items()
    }
    _print_columns(f"POPE scores (answers matched by {report['matched_by']})", columns)


@app.command("build")
@handle_errors
def build(
    annotations: Annotated[Path, typer.Option("--annotations", help="COCO instances JSON (2014 or 2017 naming).")],
    out: Annotated[Path, typer.Option("--out", help="Directory for <prefix>_pope_<split>.json files.")],
    images: Annotated[
        int, typer.Option("--images", min=1, help="Images to sample among those with >= 3 objects.")
    ] = 500,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the image sample and the negatives.")] = 0,
    split: Annotated[
        list[str] | None, typer.Option("--split", help="random, popular, adversarial (repeat; default all three).")
    ] = None,
    prefix: Annotated[str, typer.Option("--prefix", help="File name prefix.")] = "coco",
) -> None:
    """Build POPE-style question sets from COCO instances with POPE's rules (seeded, deterministic)."""
    from prune_audit.data.coco import CocoInstances
    from prune_audit.data.pope import POPE_SPLITS
    from prune_audit.data.pope_build import build_pope, write_pope_files
    from prune_audit.safety.fingerprint import file_sha256
    from prune_audit.safety.names import check_plain_name
    from prune_audit.safety.ownership import check_output_dir, hold_output_dir

    check_plain_name(prefix, "--prefix")
    splits = tuple(split or POPE_SPLITS)
    # the folder is rewritten only by the same build (same files again), never by another one
    settings = {
        "annotations_sha256": file_sha256(annotations) if annotations.is_file() else None,
        "images": images,
        "seed": seed,
        "splits": list(splits),
        "prefix": prefix,
    }
    check_output_dir(out, "pope build", settings)
    coco = CocoInstances.load(annotations)
    question_sets = build_pope(coco, sample_images=images, seed=seed, splits=splits)
    with hold_output_dir(out, "pope build", settings):
        written = write_pope_files(question_sets, out, prefix=prefix)
    for path in written:
        print(path)


@app.command("info")
@handle_errors
def info(
    files: Annotated[list[Path], typer.Argument(help="POPE question files (JSON Lines).")],
    annotations: Annotated[
        Path | None,
        typer.Option(
            "--annotations",
            help="COCO instances JSON: also check that objects are COCO categories and 'yes' objects have masks.",
        ),
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Counts per split, images, yes/no balance and unmatched objects of question files."""
    from prune_audit.analysis.outputs import to_json
    from prune_audit.data.coco import CocoInstances
    from prune_audit.data.pope import describe_question_files

    coco = CocoInstances.load(annotations) if annotations is not None else None
    report = describe_question_files(files, coco)
    if json_output:
        print(to_json(report), end="")
        return
    columns = {}
    for entry in report:
        for split, summary in entry["splits"].items():
            column = {key: _format(value) for key, value in summary.items() if key != "unknown_objects"}
            if coco is not None:
                column["unknown_objects"] = ", ".join(summary["unknown_objects"]) or "-"
            columns[f"{Path(entry['path']).name}\n{split}"] = column
    _print_columns("POPE question files", columns)
