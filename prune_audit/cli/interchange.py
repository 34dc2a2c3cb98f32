"""``prune-audit export`` and ``prune-audit import``: kept sets in the interchange format (docs/interchange.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from prune_audit.cli.common import (
    AnnotationsOption,
    DeviceOption,
    DtypeOption,
    ImagesOption,
    PopeOption,
    PromptTemplateOption,
    QuestionsOption,
    QuietOption,
    ThreadsOption,
    command_line,
    fail,
    handle_errors,
)


@handle_errors
def export(
    run_dir: Annotated[Path, typer.Argument(help="Run directory written by `prune-audit run` (or import).")],
    out: Annotated[Optional[Path], typer.Option(help="Kept-set file to write: FILE.jsonl or FILE.parquet.")] = None,
    answers: Annotated[
        Optional[Path],
        typer.Option(
            "--answers",
            help="Answers file to write (FILE.jsonl, LLaVA's question_id + text lines) for `prune-audit score`.",
        ),
    ] = None,
) -> None:
    """Write a run's kept sets per stage and its answers in the interchange format (docs/interchange.md), with
    --answers its answers as LLaVA's answers file (`prune-audit score` reads it)."""
    from prune_audit.runner.export import check_answers_path, export_answers, export_run

    if out is None and answers is None:
        raise fail("pass --out FILE (kept sets), --answers FILE.jsonl (answers for `prune-audit score`), or both")
    if answers is not None:
        check_answers_path(answers)  # before --out is written: a refused --answers leaves no kept-set file behind
    if out is not None:
        print(f"exported {export_run(run_dir, out)} questions to {out}")
    if answers is not None:
        print(f"exported {export_answers(run_dir, answers)} answers to {answers}")


@handle_errors
def import_(
    kept_sets: Annotated[
        Path, typer.Argument(metavar="FILE", help="Kept-set file (.jsonl or .parquet, docs/interchange.md).")
    ],
    out: Annotated[Path, typer.Option(help="Run directory to write (a new or empty folder, or this import's own).")],
    pope: PopeOption = None,
    questions: QuestionsOption = None,
    images: ImagesOption = None,
    annotations: AnnotationsOption = None,
    geometry: Annotated[
        Optional[str],
        typer.Option(
            help="Model or processor folder (image processor, tokenizer, "
            "config.json; weights not needed), hub id or demo name whose "
            "prompt, token grid and depth the kept sets index (default: the "
            "bundled demo); never run."
        ),
    ] = None,
    model: Annotated[
        Optional[str],
        typer.Option(
            help="Re-answer every question with this model under the "
            "imported kept sets forced (its grid is the geometry)."
        ),
    ] = None,
    batch_size: Annotated[int, typer.Option(help="Questions per forward pass with --model.")] = 16,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    prompt_template: PromptTemplateOption = None,
    threads: ThreadsOption = None,
    quiet: QuietOption = False,
) -> None:
    """Audit kept sets a pruner made elsewhere: build a run directory (records and manifest, as `run` writes them)
    from a kept-set file, so calibrate, cascade, visualize --run and study read it.

    Without --pope/--questions it reads the bundled demo questions, images and annotations, as `run` does.
    """
    command = command_line("import", import_, dict(locals()))
    from prune_audit.records.interchange import read_kept_sets
    from prune_audit.runner.execute import execute
    from prune_audit.runner.plan import plan_run
    from prune_audit.runner.request import RunRequest

    if model is not None and geometry is not None:
        raise fail("--model answers and is the geometry; pass --geometry only without --model")
    if pope and questions:
        raise fail("pass the question files once: --pope (POPE) or --questions (any task), not both")
    file = read_kept_sets(kept_sets)
    request = RunRequest(
        model=model or geometry,
        task=file.task,
        max_new_tokens=file.header.get("max_new_tokens"),
        confidence=file.header.get("confidence"),
        question_files=list(pope or questions or []),
        images=images,
        annotations=annotations,
        out=out,
        batch_size=batch_size,
        device=device,
        dtype=dtype,
        prompt_template=prompt_template,
        threads=threads,
        command=command,
        kept_sets=file,
        reanswer=model is not None,
    )
    plan = plan_run(request)
    from prune_audit.cli.progress import progress_reporter
    from prune_audit.cli.run import print_summary

    with progress_reporter(quiet=quiet) as progress:
        result = execute(plan, on_start=progress.start, on_progress=progress.advance)
    print_summary(result, plan)
