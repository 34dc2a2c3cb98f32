"""``prune-audit visualize``: kept tokens over the image, per selector and stage."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from prune_audit.cli.common import STAGE_CHOICES, ThreadsOption, fail, handle_errors


@handle_errors
def visualize(
    image: Annotated[Optional[Path], typer.Argument(help="Image to run the model on (omit with --run).")] = None,
    model: Annotated[
        Optional[str], typer.Option(help="Model folder or hub id (default: the bundled demo model).")
    ] = None,
    selector: Annotated[
        Optional[list[str]],
        typer.Option(
            help="Selector to draw; repeatable; all: every selector (default: none plus fastv, sparsevlm, visionzip, divprune, cdpruner, random)."
        ),
    ] = None,
    budget: Annotated[
        Optional[str],
        typer.Option(
            help="Visual tokens to keep, a share of the image's tokens (11%), or all (default: a quarter of the grid)."
        ),
    ] = None,
    option: Annotated[
        Optional[list[str]],
        typer.Option(help="Option KEY=VALUE of the one --selector drawn besides none (e.g. recycle=true); repeatable."),
    ] = None,
    object_name: Annotated[
        Optional[str],
        typer.Option(
            "--object", help="Ask the POPE question about this object (default: the annotated one the model sees most)."
        ),
    ] = None,
    question: Annotated[
        Optional[str], typer.Option(help="Full question text instead of --object (text-conditioned selectors use it).")
    ] = None,
    annotations: Annotated[
        Optional[Path], typer.Option(help="COCO instances file: outline the queried object, show retention.")
    ] = None,
    clip_text: Annotated[Optional[Path], typer.Option(help="CLIP text tower folder (lets CDPruner run).")] = None,
    out: Annotated[
        Optional[Path], typer.Option(help="Output folder (default: figures/<image stem>/), or a .png/.svg file.")
    ] = None,
    run: Annotated[
        Optional[Path],
        typer.Option(
            "--run", help="Redraw a recorded question from this run directory (no model; a clip's as a frame strip)."
        ),
    ] = None,
    question_id: Annotated[Optional[int], typer.Option(help="With --run: the question id.")] = None,
    split: Annotated[
        Optional[str], typer.Option(help="With --run: the split, when the id repeats across splits.")
    ] = None,
    stage: Annotated[
        str,
        typer.Option(
            help=f"With --run: the stage whose retention the panel states (a clip: whose kept cells each frame shows): {STAGE_CHOICES}"
        ),
    ] = "first",
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    seed: Annotated[int, typer.Option(help="Seed for random selectors.")] = 0,
    threads: ThreadsOption = None,
) -> None:
    """Draw the kept tokens over the original image with the model's exact geometry.

    A grid of panels (at most 4 per row): one per selector, one per stage for
    progressive selectors, each titled with the selector, budget and kept count.
    Pruned areas are dimmed and kept cells outlined; pixels the model's preprocessing crops
    away are grey; cells carried only by merged tokens (VisionZip's contextual tokens,
    SparseVLM with --option recycle=true) are half-dimmed and hatched; with --annotations the
    queried object's mask is outlined and its retention shown; the answer and confidence are
    under each panel. Without --selector the unpruned model and six selectors of different
    kinds are drawn (--selector all: every selector); those the model cannot run are listed
    with the reason. Without --object or --question the question is about the annotated
    object the model sees most (needs --annotations; the demo model reads its own scene
    annotations). A warning says when the object is partly cropped away or the demo model
    is shown an image that is not one of its scenes.
    """
    from prune_audit.runner.visualize import VisualizeRequest, visualize_live
    from prune_audit.runner.visualize_record import visualize_record

    if out is not None and out.suffix and out.suffix.lower() not in {".png", ".svg"}:
        raise fail(f"--out must be a folder or end in .png or .svg, got {out.name}")
    live_only = {
        "IMAGE": image,
        "--model": model,
        "--selector": selector,
        "--budget": budget,
        "--option": option,
        "--object": object_name,
        "--question": question,
        "--annotations": annotations,
        "--clip-text": clip_text,
        "--device": device != "auto",
        "--seed": seed != 0,
        "--threads": threads,
    }
    record_only = {"--question-id": question_id, "--split": split, "--stage": stage != "first"}
    if run is not None and (given := _first_given(live_only)):
        raise fail(
            f"{given} does not apply with --run, which redraws the recorded question as it ran; drop {given} or --run"
        )
    if run is None and (given := _first_given(record_only)):
        raise fail(f"{given} applies only with --run RUN_DIR; drop it or add --run")
    if run is not None:
        if question_id is None:
            raise fail("--run needs --question-id ID")
        from prune_audit.records.stages import parse_stage

        figure = visualize_record(run, question_id, split, out, parse_stage(stage))
    elif image is None:
        raise fail("pass an IMAGE, or --run RUN_DIR --question-id ID")
    else:
        from prune_audit.compute.budget import parse_budget
        from prune_audit.threads import configure_threads

        configure_threads(threads)
        request = VisualizeRequest(
            image=image,
            model=model,
            selectors=selector or [],
            options=option or [],
            budget=parse_budget(budget),
            question=question,
            object_name=object_name,
            annotations=annotations,
            out=out,
            clip_text=clip_text,
            device=device,
            seed=seed,
        )
        figure = visualize_live(request)
        for warning in figure.warnings:
            print(f"warning: {warning}", file=sys.stderr)
    _print_figure(figure)


def _print_figure(figure) -> None:
    """The question, each panel's answer, the selectors not drawn, then the figure's path."""
    from prune_audit.cli.terminal import Page

    page = Page()
    page.paragraph(f"question: {figure.question}", hang=2)
    for answer in figure.answers:
        page.paragraph(f"{answer.panel}: answer {answer.answer} (confidence {answer.confidence:.3f})", indent=2, hang=4)
    for note in figure.notes:
        page.paragraph(note, hang=2)
    page.show()
    print(f"wrote {figure.path}")  # whole on its line, however long


def _first_given(options: dict[str, object]) -> str | None:
    """The first option name whose value was given (not None, False or an empty list; 0 counts as given)."""
    return next(
        (name for name, value in options.items() if value is not None and value is not False and value != []), None
    )
