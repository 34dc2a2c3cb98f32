"""``prune-audit intervene``: restore or remove the queried object's tokens, against a random control."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from prune_audit.cli.common import STAGE_HELP, QuietOption, ThreadsOption, handle_errors


@handle_errors
def intervene(
    run_dir: Annotated[
        Path, typer.Argument(help="Pruned run directory written by prune-audit run.", show_default=False)
    ],
    mode: Annotated[
        Optional[str],
        typer.Option("--mode", help="restore (lost objects get their cells back) or remove.", show_default=False),
    ] = None,
    max_cells: Annotated[int, typer.Option("--max-cells", help="Restore: most cells swapped per question.")] = 8,
    controls: Annotated[str, typer.Option("--controls", help="Control swaps: random.")] = "random",
    bootstrap: Annotated[int, typer.Option("--bootstrap", help="Image-clustered bootstrap resamples.")] = 2000,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the swapped cells and the bootstrap.")] = 0,
    out: Annotated[
        Optional[Path],
        typer.Option(
            "--out",
            help="Output directory (default: intervene/<run name>-MODE, never inside the run directory).",
            show_default=False,
        ),
    ] = None,
    device: Annotated[str, typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    pope: Annotated[
        Optional[list[Path]],
        typer.Option(
            "--pope",
            help="The run's question file(s) at another path (checked by sha256); repeatable.",
            show_default=False,
        ),
    ] = None,
    images: Annotated[
        Optional[Path],
        typer.Option(
            "--images",
            help="The run's images folder at another path (each image, or each clip's frame, checked by sha256).",
            show_default=False,
        ),
    ] = None,
    annotations: Annotated[
        Optional[Path],
        typer.Option(
            "--annotations",
            help="The run's COCO instances file at another path (checked by sha256).",
            show_default=False,
        ),
    ] = None,
    model: Annotated[
        Optional[str],
        typer.Option(
            "--model", help="The run's model folder at another path (weights checked by sha256).", show_default=False
        ),
    ] = None,
    stage: Annotated[
        str, typer.Option("--stage", help=f"{STAGE_HELP} Eligibility and swaps use its kept set.")
    ] = "first",
    json_output: Annotated[bool, typer.Option("--json", help="Print intervention.json instead of a table.")] = False,
    threads: ThreadsOption = None,
    quiet: QuietOption = False,
) -> None:
    """Causal test of pruned evidence: swap kept tokens, re-run the model, compare with a control.

    restore: on questions whose object lost every token, up to --max-cells random
    kept tokens are replaced by the object's cells with the most object area; the
    control replaces the same kept tokens by random cells that are neither kept nor
    object. remove: on questions whose object kept 1..32 cells, those cells are
    replaced by random non-kept non-object cells; the control replaces as many kept
    non-object cells by the same cells. The budget stays fixed; in-LLM stage sets
    stay nested. On a run of video clips the object is its pixels in the
    question's window (the whole clip without one): restore takes the questions
    lost in the window, remove those with window pixels kept; each clip is read
    from its frame folder as run reads it; --stage first only.

    Writes records.parquet (both conditions, run-record columns plus condition,
    cells_changed, object_area_changed) and intervention.json: accuracy and mean
    confidence per condition, intervention minus control with a 95% paired
    image-bootstrap interval, and the object area restored or removed.

    The inputs are read where the run's manifest names them; on a run copied
    elsewhere, --pope, --images, --annotations and --model name them anew and
    are accepted only with the content the manifest pins.
    """
    from prune_audit.cli.progress import progress_reporter
    from prune_audit.records.stages import parse_stage
    from prune_audit.runner.intervene import InterveneRequest
    from prune_audit.runner.intervene import intervene as run_intervention
    from prune_audit.runner.intervene.inputs import RunInputs
    from prune_audit.threads import configure_threads

    chosen_threads = configure_threads(threads)
    request = InterveneRequest(
        run_dir=run_dir,
        mode=mode,
        max_cells=max_cells,
        controls=controls,
        bootstrap=bootstrap,
        seed=seed,
        out=out,
        device=device,
        stage=parse_stage(stage),
        threads=chosen_threads,
        inputs=RunInputs(tuple(pope or ()), images, annotations, model),
    )
    with progress_reporter(quiet=quiet) as progress:
        result = run_intervention(request, progress.update)
    if json_output:
        from prune_audit.analysis.outputs import to_json

        print(to_json(result.report), end="")
    else:
        print_intervention_table(result.report, result.out)


def _cell(estimate: dict) -> str:
    low, high = estimate["ci95"]
    interval = "" if low is None else f" [{low:.3f}, {high:.3f}]"
    return "-" if estimate["value"] is None else f"{estimate['value']:.4f}{interval}"


def print_intervention_table(report: dict, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    from prune_audit.analysis.outputs import json_ready

    report = json_ready(report)
    counts = report["questions"]
    table = Table(
        title=f"{report['label']} | intervene --mode {report['mode']} | stage {report['stage']} | "
        f"{counts['intervened']} questions, {counts['images']} images (95% image-bootstrap intervals)"
    )
    for column in ("metric", "recorded", "intervention", "control", "intervention - control"):
        table.add_column(column)
    conditions = ("intervention", "control")
    for name, key in (("accuracy", "accuracy"), ("mean confidence", "mean_confidence")):
        table.add_row(name, *(_cell(report[part][key]) for part in ("recorded", *conditions, "difference")))
    retention = (f"{report[part]['mean_retention']:.4f}" for part in ("recorded", *conditions))
    table.add_row("mean retention", *retention, "")
    if "mean_window_retention" in report["recorded"]:  # a clip run: the asked window's object, which the swaps move
        window = (f"{report[part]['mean_window_retention']:.4f}" for part in ("recorded", *conditions))
        table.add_row("mean window retention", *window, "")
    table.add_row("cells swapped", "", *(f"{report[part]['mean_cells_changed']:.2f}" for part in conditions), "")
    area_changed = (f"{report[part]['mean_object_area_changed']:+.1f}" for part in conditions)
    table.add_row("object pixels changed", "", *area_changed, "")
    console = Console()
    console.print(table)
    if counts["skipped"]:
        reasons = "; ".join(f"{reason}: {count}" for reason, count in counts["skipped"].items())
        skipped = sum(counts["skipped"].values())
        console.print(f"skipped {skipped} of {counts['eligible']} eligible questions ({reasons})")
    console.print(f"wrote records.parquet and intervention.json to {out}")
