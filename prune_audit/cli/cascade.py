"""``prune-audit cascade``: confidence-gated cascade with conformal risk control."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from prune_audit.cli.common import STAGE_HELP, handle_errors, parse_epsilons


@handle_errors
def cascade(
    pruned_runs: Annotated[
        list[Path], typer.Argument(help="Pruned run directories (the stages when --multi-stage).", show_default=False)
    ],
    reference: Annotated[
        Path | None,
        # checked in the command, so that a missing --reference is one line, not click's usage box
        typer.Option(
            "--reference",
            help="Required. Run answering the escalated questions, over the same "
            "questions: usually the dense run; a larger-budget pruned run makes a two-tier cascade.",
            show_default=False,
        ),
    ] = None,
    epsilon: Annotated[float, typer.Option("--epsilon", help="Target mean disagreement with the dense model.")] = 0.02,
    splits: Annotated[int, typer.Option("--splits", help="Random image splits for the validity check.")] = 200,
    calibration_fraction: Annotated[
        float, typer.Option("--calibration-fraction", help="Share of images used to choose the threshold.")
    ] = 0.5,
    seed: Annotated[int, typer.Option("--seed", help="Seed of the image splits.")] = 0,
    sweep: Annotated[
        str | None,
        typer.Option(
            "--sweep",
            help="Targets of the curve, comma-separated (default: 0.005,0.01,0.02,0.03,0.05,0.075,0.1, "
            "skipping those too small for the number of calibration images).",
        ),
    ] = None,
    multi_stage: Annotated[
        bool,
        typer.Option("--multi-stage", help="Chain the pruned runs as stages, cheapest first (64 -> 128 -> dense)."),
    ] = False,
    out: Annotated[Path, typer.Option("--out", help="Directory for cascade.json and the plots.")] = Path("cascade"),
    json_output: Annotated[bool, typer.Option("--json", help="Print cascade.json instead of a table.")] = False,
    cost: Annotated[
        str,
        typer.Option(
            "--cost",
            help="Cost unit: tokens (layer-averaged prefill tokens), flops (analytic prefill "
            "FLOPs) or latency (measured prefill time); docs/compute.md.",
        ),
    ] = "tokens",
    # the cascade reads no retention: --stage is only accepted (hidden) so that older scripts still run
    stage: Annotated[str, typer.Option("--stage", hidden=True, help=STAGE_HELP)] = "first",
    force: Annotated[
        bool, typer.Option("--force", help="Run even when model, question files or prompt differ.")
    ] = False,
) -> None:
    """Confidence-gated cascade: the pruned model answers when confident, else the reference (usually dense).

    The first pruned stage whose confidence exceeds t answers; otherwise the
    dense model does. Loss of an image: share of its questions answered by a
    pruned model with an answer that differs from the dense model's.

    t comes from conformal risk control on calibration images: the smallest t
    with (n/(n+1)) mean loss + 1/(n+1) <= epsilon, images being the
    exchangeable unit, so the expected disagreement on new images is at most
    epsilon. Epsilon below 1/(n+1) is refused.

    Cost (--cost): prefill tokens, FLOPs or latency relative to the dense model
    on every question; an escalated question pays every stage it visits. Without --multi-stage each
    pruned run forms its own two-stage cascade.
    """
    from prune_audit.analysis.outputs import to_json, write_files
    from prune_audit.analysis.reports import cascade_files, cascade_report
    from prune_audit.analysis.runs import check_comparable, completeness, load_run, unique_labels
    from prune_audit.errors import PruneAuditError
    from prune_audit.records.stages import parse_stage
    from prune_audit.safety.ownership import check_output_dir, hold_output_dir

    if reference is None:
        raise PruneAuditError("--reference RUN is required: the cascade escalates to it (usually the dense run)")
    from prune_audit.analysis.cascade import COST_UNITS, DEFAULT_SWEEP

    if cost not in COST_UNITS:
        raise PruneAuditError(f"--cost must be one of {', '.join(COST_UNITS)}, got {cost!r}")

    targets = list(parse_epsilons(sweep, "--sweep")) if sweep is not None else []  # "" is refused, not the default
    choice = parse_stage(stage)
    outputs = {
        "runs": [str(p.resolve()) for p in pruned_runs],
        "reference": str(reference.resolve()),
        "epsilon": epsilon,
        "sweep": targets,
        "splits": splits,
        "calibration_fraction": calibration_fraction,
        "seed": seed,
        "multi_stage": multi_stage,
        "stage": choice.name,
        "cost": cost,
    }
    stages = [load_run(path, choice) for path in pruned_runs]
    reference_run = load_run(reference, choice)
    differences = check_comparable([*stages, reference_run], force)
    check_output_dir(out, "cascade", outputs)  # after the inputs: a mistyped run is named as such
    *labels, reference_label = unique_labels([*stages, reference_run])  # "dense" only for an unpruned reference
    cascades = (
        [(" -> ".join([*labels, reference_label]), stages)]
        if multi_stage
        else [(label, [stage]) for label, stage in zip(labels, stages)]
    )
    report = cascade_report(
        cascades,
        reference_run,
        epsilon,
        targets,
        splits,
        calibration_fraction,
        seed,
        differences,
        optional_sweep=() if sweep is not None else DEFAULT_SWEEP,
        cost=cost,
    )
    report["completeness"] = completeness([*stages, reference_run], [*labels, reference_label])
    with hold_output_dir(out, "cascade", outputs):
        write_files(out, cascade_files(report, reference_run.model_name))
    if json_output:
        print(to_json(report), end="")
    else:
        print_cascade_table(report, out)


def sweep_table(report: dict):
    """Cost (relative to dense) and held-out mean disagreement of every cascade at every target."""
    from rich.table import Table

    table = Table(title="Epsilon sweep: cost / held-out mean disagreement")
    table.add_column("epsilon")
    for entry in report["cascades"]:
        table.add_column(entry["label"])
    for index, result in enumerate(report["cascades"][0]["results"]):
        cells = (
            f"{entry['results'][index]['relative_cost']:.3f} / {entry['results'][index]['validity']['mean_disagreement']:.4f}"
            for entry in report["cascades"]
        )
        table.add_row(f"{result['epsilon']:.3g}", *cells)
    skipped = report["settings"].get("sweep_skipped_infeasible")
    if skipped:
        table.caption = f"skipped (below 1/(n+1) for the calibration images): {', '.join(f'{e:.3g}' for e in skipped)}"
    return table


def print_cascade_table(report: dict, out: Path) -> None:
    from rich.console import Console
    from rich.table import Table

    from prune_audit.analysis.cascade import COST_LABELS
    from prune_audit.analysis.outputs import json_ready

    report = json_ready(report)
    table = Table(title=f"Confidence-gated cascade (conformal risk control, epsilon = {report['settings']['epsilon']})")
    table.add_column("cascade", no_wrap=True)
    for column in ("t", "escalated", "cost", "savings", "test risk", "held-out mean ± s.e. / worst"):
        table.add_column(column)
    for entry in report["cascades"]:
        checks = entry["validity"]
        share = entry.get("savings_share")
        table.add_row(
            entry["label"],
            f"{entry['threshold']:.4f}",
            f"{entry['escalation_rate']:.1%}",
            f"{entry['relative_cost']:.3f}",
            "-" if share is None else f"{share:.2f}",
            f"{entry['disagreement']:.4f}",
            f"{checks['mean_disagreement']:.4f} ± {checks['sem_disagreement']:.4f} / {checks['worst_disagreement']:.4f}",
        )
    console = Console()
    console.print(table)
    console.print(sweep_table(report))
    reference = report["reference"]["label"]
    console.print(
        f"t: confidence threshold; cost: {COST_LABELS[report['settings']['cost']]} relative to the reference "
        f"{reference}; savings: share of the "
        f"possible savings (uninformative -> perfect gating); test risk: mean disagreement with {reference} on the "
        f"test images; held-out: over {report['settings']['splits']} random image splits (each question is its own "
        f"image for ScienceQA), mean ± its standard error, against epsilon"
    )
    console.print(f"wrote cascade.json and plots to {out}")
