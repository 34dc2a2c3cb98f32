"""``prune-audit run`` and ``prune-audit merge``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from prune_audit.cli.common import (
    AnnotationsOption,
    ClipTextOption,
    ConfidenceOption,
    DeviceOption,
    DtypeOption,
    ImagesOption,
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
    fail,
    handle_errors,
)


@handle_errors
def run(
    model: ModelOption = None,
    selector: Annotated[
        str,
        typer.Option(
            help="Registered selector (see `prune-audit selectors`), INPUT+LLM to compose an input-level and an "
            "in-LLM one, or none for the unpruned reference."
        ),
    ] = "none",
    budget: Annotated[
        Optional[str],
        typer.Option(
            help="Visual tokens to keep (in-LLM selectors: layer average), a share of each image's tokens (11%), or all; "
            "a composed selector one per part, each below the one before (128,64)."
        ),
    ] = None,
    option: Annotated[
        Optional[list[str]],
        typer.Option(help="Selector option KEY=VALUE (a composed selector's: PART.KEY=VALUE); repeatable."),
    ] = None,
    task: TaskOption = "pope",
    pope: PopeOption = None,
    questions: QuestionsOption = None,
    split: SplitOption = None,
    max_new_tokens: MaxNewTokensOption = None,
    confidence: ConfidenceOption = None,
    images: ImagesOption = None,
    annotations: AnnotationsOption = None,
    out: Annotated[
        Optional[Path],
        typer.Option(
            help="Run directory (default: runs/<model>-<selector>-<budget>, then each --option value that differs from its default, then limitN with --limit N, e.g. runs/demo-fastv-64-paper-limit200)."
        ),
    ] = None,
    limit: LimitOption = None,
    batch_size: Annotated[
        int,
        typer.Option(
            help="Questions per forward pass (answers do not depend on it; probabilities move by float32 rounding only: at --threads 1, batch 1 against 16 moved p_yes by at most 4.8e-7 on 1,500 demo questions)."
        ),
    ] = 16,
    device: DeviceOption = "auto",
    dtype: DtypeOption = "auto",
    seed: Annotated[int, typer.Option(help="Seed for random selectors (per question, independent of batching).")] = 0,
    shard: Annotated[
        Optional[str],
        typer.Option(help="Run shard I/N of the questions (split by image); merge with `prune-audit merge`."),
    ] = None,
    prompt_template: PromptTemplateOption = None,
    clip_text: ClipTextOption = None,
    threads: ThreadsOption = None,
    quiet: QuietOption = False,
) -> None:
    """Run a model under a selector and budget over a task's questions (POPE by default); one record per question.

    Writes RUN_DIR/records.parquet and RUN_DIR/manifest.json. Re-running the same
    command resumes: finished questions are skipped. With no --model and no --pope
    it audits the bundled demo model on the demo question set.
    """
    command = command_line("run", run, dict(locals()))
    from prune_audit.compute.budget import parse_budget
    from prune_audit.runner.execute import execute
    from prune_audit.runner.plan import plan_run
    from prune_audit.runner.request import RunRequest
    from prune_audit.runner.sharding import parse_shard
    from prune_audit.tasks import get_task

    get_task(task, max_new_tokens, confidence)  # an unknown task or a misplaced option before the question options
    if pope and questions:
        raise fail("pass the question files once: --pope (POPE) or --questions (any task), not both")
    if pope and task != "pope":
        raise fail(f"--pope names POPE question files; pass the {task} question files with --questions")
    request = RunRequest(
        model=model,
        selector=selector,
        budget=parse_budget(budget),
        options=list(option or []),
        question_files=list(pope or questions or []),
        task=task,
        max_new_tokens=max_new_tokens,
        confidence=confidence,
        split=split,
        images=images,
        annotations=annotations,
        out=out,
        limit=limit,
        batch_size=batch_size,
        device=device,
        dtype=dtype,
        seed=seed,
        shard=parse_shard(shard) if shard else None,
        prompt_template=prompt_template,
        clip_text=clip_text,
        threads=threads,
        command=command,
    )
    plan = plan_run(request)
    from prune_audit.cli.progress import progress_reporter

    with progress_reporter(quiet=quiet) as progress:
        result = execute(plan, on_start=progress.start, on_progress=progress.advance)
    print_summary(result, plan)


def print_summary(result, plan) -> None:
    """The summary table under a one-line title naming the model, then where the records and manifest are."""
    from rich.console import Console
    from rich.table import Table

    from prune_audit.records.manifest import MANIFEST_FILE
    from prune_audit.records.stages import budget_words, stage_place

    summary = result.summary
    averaged = plan.selector is None or plan.selector.averages_budget  # an imported kept set names no selector
    budget = (
        "all visual tokens"
        if plan.manifest["budget"] is None
        else budget_words(plan.manifest["budget"], summary.get("stage_layers", [0]), averaged)
    )
    task = "" if plan.task.name == "pope" else f"task {plan.task.name} | "  # POPE's title predates tasks
    print(
        f"{task}{model_label(plan.manifest['model']['id'])} | selector {plan.manifest['selector']['name']} | {budget}"
    )
    table = Table(show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    rows = [
        (
            "questions",
            f"{summary.get('questions', 0)}" + ("" if result.complete else f" of {len(plan.questions)} (shard)"),
        ),
        ("accuracy", f"{summary.get('accuracy', float('nan')):.4f}"),
        ("mean confidence", f"{summary.get('mean_confidence', float('nan')):.4f}"),
        ("avg visual tokens (layer average)", f"{summary.get('visual_tokens_avg', float('nan')):.2f}"),
    ]
    if plan.manifest["budget"] is not None and summary.get("stage_tokens"):  # a budget may be a layer average
        rows += [
            (f"visual tokens {stage_place(layer)} (mean)", f"{tokens:g}")
            for layer, tokens in zip(summary["stage_layers"], summary["stage_tokens"])
        ]
    if summary.get("questions_with_mask"):  # questions with evidence regions (Task.names_evidence; annotations given)
        rows += evidence_rows(summary, plan.task.evidence_noun)
    rows += plan.task.summary_rows(result.records) if summary.get("questions") else []
    rows += cost_rows(summary)
    for name, value in rows:
        table.add_row(name, value)
    Console().print(table)
    # plain prints: a long path stays whole on its line
    print(f"prompt template: {plan.manifest['prompt']['template']} (first prompt in the manifest)")
    print(f"records: {result.run_dir / ('records.parquet' if result.complete else 'parts')}")
    print(f"manifest: {result.run_dir / MANIFEST_FILE}")


def evidence_rows(summary: dict, evidence_noun: str) -> list[tuple[str, str]]:
    """The summary's rows of the evidence regions: retention, lost (first and last stage) and diluted objects."""
    first, with_mask = summary["first_stage"], summary["questions_with_mask"]
    rows = [
        (f"mean retention of {evidence_noun}, stage {first}", f"{summary['mean_retention']:.4f}"),
        (f"lost objects, stage {first}", f"{summary['lost_objects']} of {with_mask}"),
    ]
    if not summary["last_is_first"]:  # a stage after the first: what it lost too
        last = summary["lost_objects_last_stage"]
        rows.append((f"lost objects, stage {summary['last_stage']}", f"{last} of {with_mask}"))
    if summary["diluted_objects"]:  # only merging selectors dilute: the row appears for them
        rows.append((f"diluted objects, stage {first}", f"{summary['diluted_objects']} of {with_mask}"))
    return rows


def cost_rows(summary: dict) -> list[tuple[str, str]]:
    """The summary's compute rows: prefill FLOPs against dense, KV cache, equivalent tokens, latency parts."""
    if "mean_flops" not in summary:
        return []
    return [
        ("prefill FLOPs (of dense)", f"{summary['mean_flops'] / 1e6:,.1f} M ({summary['flops_relative']:.1%})"),
        ("KV cache after prefill", f"{summary['mean_kv_bytes'] / 1024:,.0f} KiB"),
        (
            "equivalent tokens: layer-averaged / FLOP-equivalent",
            f"{summary['mean_cost_tokens']:.1f} / {summary['mean_flop_equivalent_tokens']:.1f}",
        ),
        (
            "latency ms: vision / selection / prefill",
            f"{summary['mean_latency_vision_ms']:.2f} / {summary['mean_latency_selection_ms']:.2f} / "
            f"{summary['mean_latency_prefill_ms']:.2f}",
        ),
    ]


def model_label(model_id: str) -> str:
    """A model as the summary names it: a local folder by its name (``demo``), a hub id as given, also
    when it was read from the hub cache (``.../models--org--name/snapshots/HASH``: ``org/name``)."""
    path = Path(model_id)
    if not path.is_dir():
        return model_id
    if path.parent.name == "snapshots" and path.parent.parent.name.startswith("models--"):
        return path.parent.parent.name.removeprefix("models--").replace("--", "/")
    return path.name


@handle_errors
def merge(
    run_dirs: Annotated[
        list[Path], typer.Argument(help="Run directories written by sharded runs of one configuration.")
    ],
    out: Annotated[Optional[Path], typer.Option(help="Merged run directory (default: the first RUN_DIR).")] = None,
) -> None:
    """Merge sharded runs (same configuration) into one records.parquet and manifest."""
    from prune_audit.runner.merge import merge_runs

    merged = merge_runs(run_dirs, out)
    print(f"merged {merged.num_rows} records into {(out or run_dirs[0]) / 'records.parquet'}")
