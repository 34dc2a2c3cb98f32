"""``prune-audit reproduce``: the seed study's LLaVA-1.5-7B POPE grid as a ``study`` preset, compared with the
seed's published figures (``prune_audit.analysis.reproduce``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Optional

import typer

from prune_audit.cli.common import DeviceOption, DtypeOption, PopeOption, QuietOption, ThreadsOption, handle_errors
from prune_audit.errors import PruneAuditError

CLIP_ID = "openai/clip-vit-large-patch14-336"  # LLaVA-1.5's vision tower: CDPruner's text side needs its text tower


@handle_errors
def reproduce(
    model: Annotated[
        Optional[str],
        typer.Option(help="LLaVA-1.5-7B weights: a local folder or a hub id already downloaded (never fetched here)."),
    ] = None,
    clip_text: Annotated[
        Optional[str],
        typer.Option(
            help=f"CLIP text tower of {CLIP_ID} (CDPruner's relevance): a local folder or a downloaded hub id."
        ),
    ] = None,
    pope: PopeOption = None,
    images: Annotated[Optional[Path], typer.Option(help="COCO val2014 images of the POPE questions.")] = None,
    annotations: Annotated[Optional[Path], typer.Option(help="COCO instances_val2014.json (lost objects).")] = None,
    golden_answers: Annotated[
        Optional[Path],
        typer.Option(
            help="LLaVA-1.5-13B's released POPE answers (LLaVA's answers format), scored with --pope by `score`."
        ),
    ] = None,
    golden_questions: Annotated[
        Optional[Path],
        typer.Option(
            help="LLaVA's llava_pope_test.jsonl, which the golden "
            "answers' question ids refer to (scored with the --pope "
            "labels)."
        ),
    ] = None,
    out: Annotated[Path, typer.Option(help="Reproduction folder: study/, timing-b32/, reproduce.md/.csv.")] = Path(
        "reproduce"
    ),
    dry_run: Annotated[
        bool,
        typer.Option(
            "--dry-run",
            help="Print the plan, the seed's figures with their "
            "tolerances and the estimated time; run and write nothing.",
        ),
    ] = False,
    report: Annotated[
        bool,
        typer.Option(
            "--report",
            help="Only compare: read OUT/study and OUT/timing-b32 (e.g. "
            "after their study --plan commands ran) and write the table.",
        ),
    ] = False,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    threads: ThreadsOption = None,
    quiet: QuietOption = False,
    limit: Annotated[
        Optional[int],
        typer.Option(
            min=1, hidden=True, help="Testing: only the first N questions per run (not the seed's question set)."
        ),
    ] = None,
) -> None:
    """Run the seed calibration study's LLaVA-1.5-7B POPE grid (dense; fastv, cls_attn, coverage, cdpruner and
    divprune at 64 and 128 tokens; adversarial, popular and random, 9,000 questions) through `study`, plus a
    batch-32 timing study, and write OUT/reproduce.md and reproduce.csv: every figure of the seed next to the
    measured one, with its tolerance and pass or fail (docs/reproduce.md). Needs a GPU and the weights;
    --dry-run prints the plan and an estimated time and writes nothing."""
    from prune_audit.analysis.reproduce import MODEL_ID
    from prune_audit.safety.ownership import check_output_dir, hold_output_dir

    if dry_run:
        if report:
            raise PruneAuditError("--dry-run and --report exclude each other; plan first, report after the runs")
        _print_plan(out, limit)
        return
    if report:  # everything read before the folder is held: a refusal writes nothing
        check_output_dir(out, "reproduce")
        pope_files = _pope_files(pope, required=golden_answers is not None)
        rows = _comparison(out, _golden(golden_answers, golden_questions, pope_files))
        with hold_output_dir(out, "reproduce"):
            _write_table(out, rows, limit)
        return
    grid = dict(
        model=_local(model, "--model", MODEL_ID),
        clip_text=Path(_local(clip_text, "--clip-text", CLIP_ID)),
        pope=_pope_files(pope, required=True),
        images=[_images_folder(images)],
        annotations=[_annotations(annotations)],
        device=device,
        dtype=dtype,
        threads=threads,
        quiet=quiet,
    )
    golden = _golden(golden_answers, golden_questions, grid["pope"])
    with hold_output_dir(out, "reproduce"):
        _studies(out, grid, limit)
        _write_table(out, _comparison(out, golden), limit)


def _golden(answers: Path | None, questions: Path | None, pope_files: list[Path]) -> tuple[Path, list[Path]] | None:
    """The golden answers and the question files `score` reads them with; None without answers."""
    if answers is None:
        if questions is not None:
            raise PruneAuditError("--golden-questions only applies with --golden-answers; drop it or pass the answers")
        return None
    for option, path, name in (
        ("--golden-answers", answers, "answers/llava-v1.5-13b.jsonl"),
        ("--golden-questions", questions, "llava_pope_test.jsonl"),
    ):
        if path is not None and not path.is_file():
            raise PruneAuditError(
                f"{option} {path} not found; pass LLaVA's {name} of its POPE evaluation "
                f"(playground/data/eval/pope) or drop the option"
            )
    return answers, [*([questions] if questions else []), *pope_files]


def _local(source: str | None, option: str, hub_id: str) -> str:
    """``source`` as given (a hub id stays one, so the runs' manifests name it) once its weights are found on
    this machine; else a one-line refusal saying how to get them."""
    from prune_audit.models.hub import local_weights

    how = f"download them with `huggingface-cli download {hub_id}` and pass {option} PATH (or {option} {hub_id})"
    if not source:
        raise PruneAuditError(f"reproduce needs the {hub_id} weights; {how}")
    if local_weights(source) is None:
        raise PruneAuditError(f"{option} {source}: no config.json and weights found locally; {how}")
    return source


def _pope_files(pope: list[Path] | None, required: bool) -> list[Path]:
    """The three official POPE split files, each found and named by its split."""
    from prune_audit.analysis.reproduce import POPE_SPLITS

    files = list(pope or [])
    how = (
        "pass the official POPE files with --pope coco_pope_adversarial.json --pope coco_pope_popular.json "
        "--pope coco_pope_random.json (AoiDragon/POPE, output/coco/)"
    )
    if not files and required:
        raise PruneAuditError(f"reproduce needs the POPE questions; {how}")
    for path in files:
        if not path.is_file():
            raise PruneAuditError(f"--pope {path} not found; {how}")
    missing = [split for split in POPE_SPLITS if files and not any(split in path.name for path in files)]
    if missing:
        raise PruneAuditError(f"--pope names no file of the {', '.join(missing)} split; {how}")
    if len(files) not in (0, len(POPE_SPLITS)):
        raise PruneAuditError(f"--pope names {len(files)} files; {how}, each once")
    return files


def _images_folder(images: Path | None) -> Path:
    if images is None or not images.is_dir():
        raise PruneAuditError(
            f"reproduce needs the COCO val2014 images{f' ({images} is no folder)' if images else ''}"
            f"; pass their folder with --images (cocodataset.org: val2014.zip)"
        )
    return images


def _annotations(annotations: Path | None) -> Path:
    if annotations is None or not annotations.is_file():
        raise PruneAuditError(
            f"reproduce needs COCO's instances_val2014.json"
            f"{f' ({annotations} not found)' if annotations else ''}; pass it with --annotations "
            f"(cocodataset.org: annotations_trainval2014.zip)"
        )
    return annotations


def _studies(out: Path, grid: dict, limit: int | None) -> None:
    """The seed's grid, then the batch-32 timing pair, each an ordinary study folder under OUT."""
    from prune_audit.analysis.reproduce import STUDY_PRESETS, preset_options
    from prune_audit.cli.study import study

    for folder in STUDY_PRESETS:
        study(out=out / folder, **preset_options(folder, limit), **grid)


def _comparison(out: Path, golden: tuple[Path, list[Path]] | None) -> list[dict[str, str]]:
    """The table's rows from the study folders under OUT and, when given, the golden answers' F1 by `score`."""
    from prune_audit.analysis.reproduce import comparison_rows, read_outputs

    f1 = None
    if golden is not None:
        from prune_audit.tasks import get_task

        f1 = get_task("pope").score_answers(*golden)["splits"]["average"]["f1"]
    return comparison_rows(read_outputs(out, f1))


def _write_table(out: Path, rows: list[dict[str, str]], limit: int | None) -> None:
    from prune_audit.analysis.reproduce import TABLE_FILES, table_csv, table_markdown
    from prune_audit.safety.atomic import write_files

    note = f"Limited to the first {limit} questions per run: not the seed's question set." if limit else ""
    markdown = table_markdown(rows, "Reproduction of the seed calibration study", note)
    write_files(out, dict(zip(TABLE_FILES, (markdown, table_csv(rows)))))
    print(markdown, end="")
    print(f"wrote {', '.join(TABLE_FILES)} to {out}")


def _print_plan(out: Path, limit: int | None) -> None:
    """The runs, questions and budgets, the seed's figures with their tolerances and the estimated time."""
    from prune_audit.analysis.reproduce import (
        MODEL_ID,
        POPE_SPLITS,
        QUESTIONS_PER_SPLIT,
        STUDY_FOLDER,
        STUDY_PRESETS,
        TIMING_FOLDER,
        estimated_seconds,
        expected_rows,
        grid_runs,
        preset_command,
        preset_options,
        seed_figure,
        table_markdown,
    )

    questions = min(limit or math.inf, QUESTIONS_PER_SPLIT * len(POPE_SPLITS))
    grid, timing = preset_options(STUDY_FOLDER, limit), preset_options(TIMING_FOLDER, limit)
    runs = grid_runs()
    print(f"reproduce plan (dry run: nothing is loaded, run or written); model {MODEL_ID}")
    print(
        f"study: {len(runs)} runs into {out / STUDY_FOLDER}, {questions:,} questions each "
        f"({', '.join(POPE_SPLITS)}), batch {grid['batch_size']}, budgets {grid['budgets']} of 576 visual tokens:"
    )
    print(f"  {', '.join(runs)}")
    print(
        f"timing: dense and {timing['selectors']}@{timing['budgets']}, first {timing['limit']:,} questions, batch "
        f"{timing['batch_size']}, into {out / TIMING_FOLDER}"
    )
    print("golden: LLaVA-1.5-13B POPE F1 by `score` on --golden-answers (not measured without it)")
    print("the same as these study commands, then `prune-audit reproduce --report`:")
    for folder in STUDY_PRESETS:
        print(f"  {preset_command(folder, out, limit)}")
    print(table_markdown(expected_rows(), "Seed figures and tolerances"), end="")
    seconds = estimated_seconds(int(questions), int(timing["limit"]))
    print(
        f"estimated time: about {seconds / 3600:.1f} h on one H200 (an estimate: every question at the seed's "
        f"dense {seed_figure('dense.ms_b1').expected:g} ms at batch 1, model loading and analyses not counted)"
    )
