"""``prune-audit study``: reference + selectors x budgets, calibrated and cascaded, in one command."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from prune_audit.cli.common import (
    STAGE_HELP,
    ClipTextOption,
    ConfidenceOption,
    DeviceOption,
    DtypeOption,
    LimitOption,
    MaxNewTokensOption,
    ModelOption,
    PopeOption,
    PromptTemplateOption,
    QuestionsOption,
    QuietOption,
    SplitOption,
    TaskOption,
    ThreadsOption,
    command_line,
    handle_errors,
    parse_epsilons,
)
from prune_audit.runner.study.defaults import DEFAULT_BUDGETS, DEFAULT_SELECTORS, DEFAULT_SUBSET_BASELINE


@handle_errors
def study(
    selectors: Annotated[
        str, typer.Option(help="Selectors, comma-separated; a composed one as run spells it (visionzip+fastv).")
    ] = ",".join(DEFAULT_SELECTORS),
    budgets: Annotated[
        str,
        typer.Option(
            help="Budgets (visual tokens, a share such as 11%, or all), comma-separated, each once; a composed "
            "selector's budget joins its parts with / (96/48). Each selector runs at the budgets of its part count."
        ),
    ] = ",".join(DEFAULT_BUDGETS),
    model: ModelOption = None,
    task: TaskOption = "pope",
    tasks: Annotated[
        Optional[str],
        typer.Option(
            help="Several tasks, comma-separated (pope,gqa,scienceqa,caption): "
            "one grid per task under OUT/runs/<task>-<run>, one summary with a task "
            "column and a report section per task. Name each input's task: "
            "--questions TASK=FILE, --images TASK=DIR, --annotations TASK=FILE."
        ),
    ] = None,
    option: Annotated[
        Optional[list[str]],
        typer.Option(
            help="A selector's option, SELECTOR:KEY=VALUE (a composed selector's SELECTOR:PART.KEY=VALUE), at each "
            "of its budgets, as run's --option (e.g. fastvid:merge=false); repeatable."
        ),
    ] = None,
    pope: PopeOption = None,
    questions: QuestionsOption = None,
    max_new_tokens: MaxNewTokensOption = None,
    confidence: ConfidenceOption = None,
    split: SplitOption = None,
    images: Annotated[
        Optional[list[Path]],
        typer.Option(help="Folder with the questions' images (with --tasks: TASK=DIR, repeatable)."),
    ] = None,
    annotations: Annotated[
        Optional[list[Path]],
        typer.Option(
            help="Evidence annotations: COCO instances (POPE, "
            "captions), GQA scene graphs (with --tasks: TASK=FILE, "
            "repeatable)."
        ),
    ] = None,
    out: Annotated[Path, typer.Option(help="Study folder: runs/, summary, reports.")] = Path("study"),
    limit: LimitOption = None,
    batch_size: Annotated[int, typer.Option(help="Questions per forward pass.")] = 16,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    seed: Annotated[int, typer.Option(help="Seed of random selectors, image splits and the bootstrap.")] = 0,
    prompt_template: PromptTemplateOption = None,
    clip_text: ClipTextOption = None,
    epsilons: Annotated[str, typer.Option(help="Cascade disagreement targets.")] = "0.01,0.02,0.05,0.1",
    bootstrap: Annotated[int, typer.Option(help="Image-clustered bootstrap resamples.")] = 1000,
    bins: Annotated[int, typer.Option(help="Confidence bins, 1 to 1000.")] = 15,
    splits: Annotated[int, typer.Option(help="Random image splits of the cascade's validity check.")] = 200,
    stage: Annotated[
        str,
        typer.Option(
            "--stage",
            help=STAGE_HELP + " The study reads its unpruned reference at the same stage, so an index can only be 0.",
        ),
    ] = "first",
    plan: Annotated[
        bool,
        typer.Option(
            "--plan",
            help="Print the grid's run commands instead of running them (after "
            "the same checks as the study, on the loaded model).",
        ),
    ] = False,
    plan_format: Annotated[str, typer.Option(help="With --plan: lines, shell or slurm (array script).")] = "lines",
    plan_file: Annotated[
        Optional[Path], typer.Option(help="With --plan: write the script here instead of printing.")
    ] = None,
    shard: Annotated[Optional[str], typer.Option(help="With --plan: only commands I, I+N, ...")] = None,
    report: Annotated[bool, typer.Option("--report", help="Only build summary and report from OUT/runs.")] = False,
    force: Annotated[
        bool, typer.Option("--force", help="Compare runs even when model, question files or prompt differ.")
    ] = False,
    subset: Annotated[
        Optional[str],
        typer.Option(
            help="Also tabulate every run on a hard subset: difficult = the questions the --subset-baseline "
            "run of the same budget answers wrongly (VTC-Bench); the report shows both tables."
        ),
    ] = None,
    subset_baseline: Annotated[
        Optional[str],
        typer.Option(
            help=f"With --subset: the selector whose wrong answers make the subset (default {DEFAULT_SUBSET_BASELINE}"
            "); it must be in --selectors."
        ),
    ] = None,
    threads: ThreadsOption = None,
    quiet: QuietOption = False,
) -> None:
    """Run the unpruned reference and every selector x budget, calibrate each against the reference,
    run the cascade over an epsilon sweep, and write OUT/summary.csv, summary.parquet, report.md and
    report.html.

    Resumable: a finished run under OUT/runs is reused, an interrupted one continues. With no
    options it studies the bundled demo: fastv and divprune at 32 and 64 of its 144
    visual tokens. --plan prints the `prune-audit run` commands (or a shell / SLURM array
    script) for a scheduler; --report then builds the summary from their run folders. Loyalty: the share of
    answers equal to the dense run's. With --subset difficult, a second table holds every budget's runs on
    the questions that the baseline run of that budget answers wrongly (summary_difficult.csv).
    """
    command = command_line("study", study, dict(locals()))
    from prune_audit.analysis.calibration import CalibrationSettings
    from prune_audit.analysis.study import StudySettings
    from prune_audit.analysis.subsets import check_baseline_in_grid, parse_subset
    from prune_audit.errors import PruneAuditError
    from prune_audit.records.stages import parse_stage
    from prune_audit.runner.request import RunRequest
    from prune_audit.runner.sharding import parse_shard
    from prune_audit.runner.study.grid import (
        StudyGrid,
        check_grid,
        check_stage,
        check_subset_budgets,
        inputs_by_task,
        parse_budgets,
        parse_list,
        parse_selector_options,
        parse_tasks,
        task_option,
    )

    names = parse_tasks(task, tasks, max_new_tokens, confidence)  # unknown tasks or misplaced options, first
    if pope and questions:
        raise PruneAuditError("pass the question files once: --pope (POPE) or --questions (any task), not both")
    if pope and names != ["pope"]:
        raise PruneAuditError(
            f"--pope names POPE question files; pass the {', '.join(names)} question files with --questions"
        )
    targets = parse_epsilons(epsilons, "--epsilons")
    if splits < 1:
        raise PruneAuditError(f"--splits must be at least 1, got {splits}")
    if (plan_file or shard or plan_format != "lines") and not plan:
        raise PruneAuditError("--plan-format, --plan-file and --shard only apply with --plan")
    if plan and report:
        raise PruneAuditError("--plan and --report exclude each other: plan first, report after the runs")
    settings = StudySettings(
        CalibrationSettings(bins, "width", bootstrap, 0.5, seed),
        tuple(targets),
        splits,
        parse_stage(stage),
        parse_subset(subset, subset_baseline, DEFAULT_SUBSET_BASELINE),
    )
    check_stage(settings.stage)
    if report:
        _report(out, settings, force, command, names)
        return
    if model is None and len(names) > 1:
        from prune_audit.demo import default_demo

        model = default_demo(names)  # one demo answers every task's grid (the task demo once any task is not POPE)
    studied = parse_list(selectors, "--selectors")
    selector_options = parse_selector_options(list(option or []), studied)
    question_files = inputs_by_task(list(pope or questions or []), names, "--questions")
    folders = inputs_by_task(list(images or []), names, "--images", single=True)
    evidence = inputs_by_task(list(annotations or []), names, "--annotations", single=True)
    grids = [
        StudyGrid(
            studied,
            parse_budgets(budgets),
            out,
            RunRequest(
                model=model,
                question_files=question_files[name],
                task=name,
                max_new_tokens=task_option(name, "max_new_tokens", max_new_tokens),
                confidence=task_option(name, "confidence", confidence),
                split=split,
                images=next(iter(folders[name]), None),
                annotations=next(iter(evidence[name]), None),
                limit=limit,
                batch_size=batch_size,
                device=device,
                dtype=dtype,
                seed=seed,
                prompt_template=prompt_template,
                clip_text=clip_text,
                threads=threads,
            ),
            named_by_task=len(names) > 1,
            options=selector_options,
        )
        for name in names
    ]
    check_grid(grids[0].selectors, grids[0].budgets)
    check_baseline_in_grid(settings.subset, grids[0].selectors)  # before any run: the subset needs the baseline's
    check_subset_budgets(settings.subset, grids[0].budgets)  # and at every budget
    if plan:
        _plan(grids, plan_format, plan_file, parse_shard(shard) if shard else None)
        return
    _run_grid(grids, quiet, settings, force, command)


def _plan(grids, plan_format: str, plan_file: Path | None, shard) -> None:
    from prune_audit.errors import PruneAuditError
    from prune_audit.runner.study.grid import shard_commands
    from prune_audit.runner.study.script import render_plan

    if plan_file is not None and plan_file.exists():
        raise PruneAuditError(f"--plan-file {plan_file} exists; pass a new file name")
    commands = shard_commands([grid.command(cell) for grid in grids for cell in grid.cells], shard)
    text = render_plan(commands, plan_format, grids[0].out)
    _plan_grids(grids)  # the checks the study makes before running (budgets against the model's tokens, run folders)
    if plan_file is None:
        print(text, end="")
        return
    from prune_audit.safety.atomic import write_text_atomic

    write_text_atomic(text, plan_file)  # one hidden temporary beside it, renamed: nothing else in a user's folder
    plan_file.chmod(0o755)
    print(f"wrote {len(commands)} run commands to {plan_file}")


def _plan_grids(grids) -> list:
    """Every task's grid planned on one loaded model, (grid, plans) per task."""
    from prune_audit.runner.study.execute import plan_grid

    planned = []
    for grid in grids:
        planned.append((grid, plan_grid(grid, planned[0][1][0].vlm if planned else None)))
    return planned


def _run_grid(grids, quiet: bool, settings, force: bool, command: str) -> None:
    """Run every cell of every task's grid, then write the report, holding OUT throughout."""
    from prune_audit.safety.ownership import hold_output_dir

    planned = _plan_grids(grids)  # every input of every task checked before OUT (hold_output_dir checks it)
    with hold_output_dir(grids[0].out, "study"):
        for grid, plans in planned:
            _answer_grid(grid, plans, quiet)
        _write_report(grids[0].out, settings, force, command, [grid.base.task for grid in grids])


def _answer_grid(grid, plans, quiet: bool) -> None:
    import sys

    from prune_audit.cli.progress import progress_reporter
    from prune_audit.runner.study.execute import run_grid
    from prune_audit.runner.study.grid import RUNS_FOLDER
    from prune_audit.safety.progress import report_saved

    total = sum(len(plan.questions) for plan in plans)

    def on_cell(index: int, cell) -> None:
        if not quiet:
            print(f"run {index + 1}/{len(plans)}: {cell.name}", file=sys.stderr, flush=True)

    with progress_reporter("study questions", quiet=quiet) as progress:
        progress.start(0, total)
        outcomes = run_grid(grid, plans, progress.advance, on_cell)
    report_saved(grid.out / RUNS_FOLDER, total, total)  # a failure while reporting names the report, not the last run
    reused = sum(outcome.answered == 0 for outcome in outcomes)
    counts = [
        f"{len(outcomes) - reused} answered now" if reused < len(outcomes) else "",
        f"{reused} finished before, reused" if reused else "",
    ]
    print(f"{len(outcomes)} runs under {grid.out / 'runs'} ({', '.join(filter(None, counts))})")


def _report(out: Path, settings, force: bool, command: str, tasks: list[str]) -> None:
    """``--report``: the summary and report of the runs already in OUT/runs."""
    from prune_audit.runner.study.execute import check_study_folder
    from prune_audit.safety.ownership import check_output_dir, hold_output_dir

    check_output_dir(out, "study")
    check_study_folder(out)
    with hold_output_dir(out, "study"):
        _write_report(out, settings, force, command, tasks)


def _write_report(out: Path, settings, force: bool, command: str, tasks: list[str]) -> None:
    """The summary and report of the ``tasks`` runs under OUT/runs (a study of one task reads every run there)."""
    from prune_audit.analysis.outputs import write_files
    from prune_audit.analysis.report_html import SUBSET_HEADING
    from prune_audit.analysis.study import study_files, study_reports, study_runs, study_tasks
    from prune_audit.runner.study.grid import RUNS_FOLDER

    runs_dir = out / RUNS_FOLDER
    by_task = (
        study_tasks(runs_dir, settings.stage, tasks)
        if len(tasks) > 1
        else {tasks[0]: study_runs(runs_dir, settings.stage)}
    )
    reports = {name: study_reports(reference, runs, settings, force) for name, (reference, runs) in by_task.items()}
    for name, task_reports in reports.items():
        feasible = {r["epsilon"] for r in task_reports.cascade["cascades"][0]["results"]}
        dropped = sorted(set(settings.epsilons) - feasible)
        if dropped:
            print(f"note: epsilon {', '.join(f'{e:g}' for e in dropped)} below 1/(n+1) for the {name} images; left out")
    write_files(out, study_files(reports, command))  # no settings recorded: the report is rebuilt with those given
    report = (out / "report.md").read_text(encoding="utf-8")
    print(report.split("\n## Findings")[0])
    heading = f"\n## {SUBSET_HEADING}"
    if heading in report:  # a study of one task with --subset: its subset table too
        print(SUBSET_HEADING + report.split(heading)[1].split("\n## ")[0])
    subset = f", summary_{settings.subset.name}.csv, .parquet" if settings.subset else ""
    print(f"wrote summary.csv, summary.parquet{subset}, report.md and report.html to {out}")
