"""The study's summary: one row per run, every number taken from the ``calibrate`` and ``cascade`` reports.

``study_reports`` calls ``calibration_report`` and ``cascade_report`` (the functions behind
``prune-audit calibrate`` and ``prune-audit cascade``) on the study's runs; ``summary_rows``
only reads their results, so each cell of ``summary.csv`` equals the number those commands
print for the same runs and settings. Columns are described in ``SUMMARY_COLUMNS``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prune_audit.analysis.calibration import CalibrationSettings, metrics_against_reference
from prune_audit.analysis.cascade import minimum_epsilon
from prune_audit.analysis.cost import COST_MEANS, cost_summary
from prune_audit.analysis.metric_table import METRICS
from prune_audit.analysis.reports import calibration_report, cascade_report
from prune_audit.analysis.runs import Run, check_comparable, load_run
from prune_audit.analysis.subsets import Subset, budget_subsets
from prune_audit.analysis.temperature import split_images
from prune_audit.errors import PruneAuditError
from prune_audit.records.manifest import MANIFEST_FILE
from prune_audit.records.stages import FIRST, StageChoice
from prune_audit.records.store import RecordStore

DEFAULT_EPSILONS = (0.01, 0.02, 0.05, 0.1)

ESTIMATED = {
    **{metric.name: ("metrics", "all", metric.name) for metric in METRICS if metric.in_study},
    "ece_test_before": ("temperature", "test_before", "ece"),
    "ece_test_after": ("temperature", "test_after", "ece"),
    "ece_mass_test_before": ("temperature", "test_before", "ece_mass"),
    "ece_mass_test_after": ("temperature", "test_after", "ece_mass"),
    "lost_accuracy": ("survival", "lost", "accuracy"),
    "lost_confidence": ("survival", "lost", "confidence"),
    "lost_reference_accuracy": ("survival", "lost", "reference_accuracy"),
    "lost_reference_confidence": ("survival", "lost", "reference_confidence"),
    "accuracy_minus_reference": ("difference_vs_reference", "metrics", "all", "accuracy"),
    "ece_minus_reference": ("difference_vs_reference", "metrics", "all", "ece"),
    "auroc_minus_reference": ("difference_vs_reference", "metrics", "all", "auroc"),
    "brier_minus_reference": ("difference_vs_reference", "metrics", "all", "brier"),
}
"""Column -> path in a run's calibrate entry; each also gets ``<column>_low`` / ``_high`` (95 % interval). The
metrics of ``metric_table`` marked ``in_study`` come first, in its order."""

SUMMARY_COLUMNS = {
    "run": "run label (selector@budget, dense for the reference)",
    "task": "the runs' task (prune_audit.tasks; a study of several tasks has one reference per task)",
    "selector": "selector name (dense: unpruned reference)",
    "budget": "requested budget: visual tokens, or a share of each image's tokens (11%); empty for the reference",
    "visual_tokens": "realised visual tokens per question, mean (in-LLM selectors: layer average)",
    "questions": "questions answered",
    "stage": "the stage whose kept set decides retention and lost (--stage), with its decoder layer",
    "mean_confidence": "mean top-label confidence",
    **{name: f"calibrate: {'/'.join(path)}" for name, path in ESTIMATED.items()},
    "temperature": "calibrate: fitted temperature T (calibration images)",
    "lost_share": "share of the questions with evidence masks (POPE: yes-questions) whose evidence lost every token at "
    "the stage read",
    "savings_share": "cascade: share of the possible savings between an uninformative and a perfect gate, "
    "at the first epsilon",
    "latency_ms": "mean latency per question (ms), from the records",
    **{f"mean_{name}": f"mean {name} per question, from the records (docs/compute.md)" for name in COST_MEANS},
    "flops_relative": "mean flops / mean flops_dense: prefill FLOPs relative to the same questions unpruned",
}
"""Every fixed summary column and its meaning; ``cascade_cost_eps<e>`` and ``savings_share_eps<e>`` follow, then a
task's own comparison with the dense run (``Task.reference_comparison``: captions' ``omitted_lost``,
``omitted_lost_reference``, ...; RefCOCO's ``box_loyalty``, ``mean_iou``, ``mean_iou_reference``; empty in other
tasks' rows)."""


@dataclass(frozen=True)
class StudySettings:
    """Settings of the calibrate and cascade analyses of a study."""

    calibration: CalibrationSettings
    epsilons: tuple[float, ...] = DEFAULT_EPSILONS
    splits: int = 200
    stage: StageChoice = FIRST
    subset: Subset | None = None
    """``--subset``: also tabulate every run on a hard subset of the questions (``analysis.subsets``)."""


SUBSET_COLUMNS = {
    "subset": "the hard subset (study --subset): difficult = the questions the baseline run of the budget answers "
    "wrongly (VTC-Bench's filter)",
    "baseline": "the run whose wrong answers make the subset",
    "run": "run label (dense: the reference on the same questions)",
    "task": SUMMARY_COLUMNS["task"],
    "selector": SUMMARY_COLUMNS["selector"],
    "budget": "the budget whose baseline run picks the questions (for every row of that budget, dense included)",
    "questions": "questions in the subset",
    **{
        name: f"calibrate on the subset: {'/'.join(path)}"
        for name, path in ESTIMATED.items()
        if path[0] == "metrics" or path[:2] == ("difference_vs_reference", "metrics")
    },
}
"""Every column of summary_difficult.csv (``study --subset difficult``); each estimate has ``_low`` / ``_high``."""


def subset_columns() -> list[str]:
    """The columns of summary_difficult.csv in order: ``SUBSET_COLUMNS``, each estimate followed by its interval."""
    return [
        column
        for name in SUBSET_COLUMNS
        for column in ([name, f"{name}_low", f"{name}_high"] if name in ESTIMATED else [name])
    ]


@dataclass(frozen=True)
class SubsetTable:
    """A study's rows on a hard subset: per budget the dense row, then the runs of that budget
    (``SUBSET_COLUMNS``); ``empty``: the budgets whose baseline answers every question right."""

    subset: Subset
    rows: list[dict]
    empty: list[str]


@dataclass(frozen=True)
class StudyReports:
    """The reference, the pruned runs and the two reports computed on them (and the subset table, with --subset)."""

    reference: Run
    runs: list[Run]
    calibration: dict
    cascade: dict
    stage: str = FIRST.name
    difficult: SubsetTable | None = None


def study_tasks(
    runs_dir: Path, stage: StageChoice = FIRST, order: Sequence[str] = ()
) -> dict[str, tuple[Run, list[Run]]]:
    """Per task (``Run.task``), the reference and the pruned runs among the run folders under ``runs_dir``
    (``study_runs``); tasks in ``order`` first, then the others sorted by name."""
    folders = sorted(path for path in Path(runs_dir).iterdir() if (path / MANIFEST_FILE).is_file())
    by_task: dict[str, list[Run]] = {}
    for run in (load_run(folder, stage) for folder in folders):
        by_task.setdefault(run.task.name, []).append(run)
    if not by_task:
        raise PruneAuditError(
            f"{runs_dir} holds no run; a study needs one unpruned reference run (--selector none) "
            f"and pruned runs of each task: run the study's commands first"
        )
    missing = [name for name in order if name not in by_task]
    if missing:
        raise PruneAuditError(f"{runs_dir} holds no run of task {missing[0]}; run the study's commands first")
    names = [*order, *sorted(set(by_task) - set(order))]
    return {name: _reference_and_pruned(runs_dir, by_task[name], name) for name in names}


def study_runs(runs_dir: Path, stage: StageChoice = FIRST) -> tuple[Run, list[Run]]:
    """The reference (no selector) and the pruned runs among the run folders under ``runs_dir``, retention
    and lost read at ``stage``; an unfinished run is refused, and so are runs of several tasks (``study_tasks``)."""
    tasks = study_tasks(runs_dir, stage)
    if len(tasks) > 1:
        raise PruneAuditError(f"{runs_dir} holds runs of the tasks {', '.join(tasks)}; study them with --tasks")
    return next(iter(tasks.values()))


def _reference_and_pruned(runs_dir: Path, runs: list[Run], task: str) -> tuple[Run, list[Run]]:
    """The task's one reference and its pruned runs (selector, then budget order); unfinished runs refused."""
    for run in runs:
        done, total = len(run.questions), int(run.manifest.get("num_questions") or len(run.questions))
        if done < total:
            raise PruneAuditError(
                f"{run.path} holds {done} of {total} questions; finish it with its prune-audit run command "
                f"(study --plan lists them) or merge its shards, then build the report"
            )
    references = [run for run in runs if run.selector == "dense"]
    if len(references) != 1:
        raise PruneAuditError(
            f"{runs_dir} holds {len(references)} unpruned runs of task {task}; a study needs exactly one reference "
            f"per task (--selector none)"
        )
    pruned = sorted(
        (run for run in runs if run.selector != "dense"), key=lambda run: (run.selector, _budget_order(run.budget))
    )
    if not pruned:
        raise PruneAuditError(f"{runs_dir} holds no pruned run of task {task}; run the study's commands first")
    return references[0], pruned


def feasible_epsilons(epsilons: Sequence[float], reference: Run, settings: CalibrationSettings) -> list[float]:
    """The targets conformal risk control can meet with the calibration images (>= 1/(n+1)), sorted."""
    calibration_images, _ = split_images(reference.questions.image_id, settings.calibration_fraction, settings.seed)
    floor = minimum_epsilon(len(calibration_images))
    return sorted(epsilon for epsilon in epsilons if epsilon >= floor)


def _budget_order(budget: object) -> tuple[int, float, str]:
    """Counts in increasing order, then shares (``11%``) in increasing order."""
    text = str(budget)
    if text.endswith("%"):
        return 1, float(text[:-1]), text
    return (0, float(text), text) if text.isdigit() else (2, 0.0, text)


def study_reports(reference: Run, runs: Sequence[Run], settings: StudySettings, force: bool = False) -> StudyReports:
    """Calibrate every run against the reference and cascade each over the feasible epsilons of the sweep (and, with
    ``settings.subset``, measure every run on the subset)."""
    differences = check_comparable([*runs, reference], force)
    difficult = subset_table(reference, runs, settings) if settings.subset else None
    epsilons = feasible_epsilons(settings.epsilons, reference, settings.calibration)
    if not epsilons:
        raise PruneAuditError(
            f"every --epsilons target is below 1/(n+1) for the {len(set(reference.questions.image_id.tolist()))} "
            "images' calibration half; pass larger targets or run more questions"
        )
    calibration = calibration_report(runs, reference, settings.calibration, differences)
    cascades = [(entry["label"], [run]) for entry, run in zip(calibration["runs"], runs)]
    seed, fraction = settings.calibration.seed, settings.calibration.calibration_fraction
    cascade = cascade_report(
        cascades, reference, epsilons[0], epsilons[1:], settings.splits, fraction, seed, differences
    )
    return StudyReports(reference, list(runs), calibration, cascade, settings.stage.name, difficult)


def subset_table(reference: Run, runs: Sequence[Run], settings: StudySettings) -> SubsetTable:
    """Every budget's runs and the reference measured on the questions the budget's baseline run answers wrongly
    (``analysis.subsets``): accuracy, loyalty and the other metrics of ``question_metrics`` with image-clustered
    intervals, and the paired differences to the reference on the same questions."""
    assert settings.subset is not None
    rows, empty = [], []
    for part in budget_subsets(runs, settings.subset):
        group = [run for run in runs if str(run.budget) == part.budget]
        dense = reference.questions.take(part.mask(reference))
        if not len(dense):
            empty.append(part.budget)
            continue
        tables = [run.questions.take(part.mask(run)) for run in group]
        measured = metrics_against_reference(tables, dense, settings.calibration)
        for run, entry in zip([reference, *group], [measured["reference"], *measured["runs"]]):
            row = {
                "subset": settings.subset.name,
                "baseline": part.baseline.label,
                "run": run.label,
                "task": run.task.name,
                "selector": run.selector,
                "budget": part.budget,
                "questions": len(dense),
            }
            for name in SUBSET_COLUMNS:
                if name in ESTIMATED:
                    value, low, high = _estimate(entry, ESTIMATED[name])
                    row.update({name: value, f"{name}_low": low, f"{name}_high": high})
            rows.append(row)
    return SubsetTable(settings.subset, rows, empty)


def summary_rows(reports: StudyReports) -> list[dict]:
    """One row per run, the reference first; columns ``SUMMARY_COLUMNS`` plus one cost per epsilon."""
    entries = [reports.calibration["reference"], *reports.calibration["runs"]]
    cascades = {entry["label"]: entry for entry in reports.cascade["cascades"]}
    epsilons = [result["epsilon"] for result in reports.cascade["cascades"][0]["results"]]
    rows = []
    for run, entry in zip([reports.reference, *reports.runs], entries):
        row = _identity(run, entry)
        for name, path in ESTIMATED.items():
            value, low, high = _estimate(entry, path)
            row.update({name: value, f"{name}_low": low, f"{name}_high": high})
        row["temperature"] = entry["temperature"]["temperature"]
        lost, survived = (_estimate(entry, ("survival", group, "count"))[0] for group in ("lost", "survived"))
        row["lost_share"] = lost / (lost + survived) if lost + survived > 0 else math.nan
        row.update(_cascade_columns(cascades.get(entry["label"]), epsilons))
        row.update(entry.get("reference_comparison", {}))  # the task's own comparison with the reference
        records = RecordStore(run.path, run.manifest).read()
        row["latency_ms"] = float(np.mean(records["latency_ms"].to_numpy()))
        row.update(cost_summary(records))
        rows.append(row)
    return rows


def _identity(run: Run, entry: dict) -> dict:
    realised = run.manifest.get("realised_visual_tokens_avg")
    return {
        "run": entry["label"],
        "task": run.task.name,
        "selector": run.selector,
        "budget": None if run.budget is None else str(run.budget),
        "visual_tokens": math.nan if realised is None else float(realised),
        "questions": len(run.questions),
        "stage": run.stage,
        "mean_confidence": float(np.mean(run.questions.confidence)),
    }


def _estimate(entry: dict, path: Sequence[str]) -> tuple[float, float, float]:
    """(value, low, high) at ``path``; NaN where the report has no such number (e.g. the reference's differences)."""
    node: object = entry
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return math.nan, math.nan, math.nan
        node = node[key]
    assert isinstance(node, dict)
    low, high = node["ci95"]
    return tuple(math.nan if v is None else float(v) for v in (node["value"], low, high))  # type: ignore[return-value]


def _cascade_columns(cascade: dict | None, epsilons: Sequence[float]) -> dict[str, float]:
    """Relative prefill cost and savings share at every epsilon (NaN for the reference)."""
    results = {result["epsilon"]: result for result in cascade["results"]} if cascade else {}
    columns: dict[str, float] = {}
    for epsilon in epsilons:
        result = results.get(epsilon, {})
        columns[f"cascade_cost_eps{epsilon:g}"] = result.get("relative_cost", math.nan)
        columns[f"savings_share_eps{epsilon:g}"] = result.get("savings_share", math.nan)
    columns["savings_share"] = columns[f"savings_share_eps{epsilons[0]:g}"]
    return columns


def summary_files(rows: Sequence[dict], stem: str = "summary", columns: Sequence[str] = ()) -> dict[str, bytes | str]:
    """``<stem>``.csv and .parquet of the rows (same columns, same order); ``columns`` come first, so that a table
    without rows still has its header."""
    import io

    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    names = dict.fromkeys([*columns, *(name for row in rows for name in row)])  # a task's own: NaN in other rows
    table = pa.table({name: [row.get(name, math.nan) for row in rows] for name in names})
    csv_buffer, parquet_buffer = io.BytesIO(), io.BytesIO()
    pacsv.write_csv(table, csv_buffer)
    pq.write_table(table, parquet_buffer)
    return {f"{stem}.csv": csv_buffer.getvalue(), f"{stem}.parquet": parquet_buffer.getvalue()}


def study_files(by_task: Mapping[str, StudyReports], command: str = "") -> dict[str, bytes | str]:
    """Everything ``study`` writes beside the runs (headed by ``command``, the study command line): one summary
    (a row per run, its task column telling the tasks apart), calibrate/cascade JSON and figures per task, and a
    report with a section per task, showing the metrics that task reports. A study of one task writes its JSON
    and figures under their plain names; several tasks prefix them with ``<task>_``."""
    from dataclasses import replace

    from prune_audit.analysis.outputs import to_json
    from prune_audit.analysis.report_html import report_header, report_html, report_markdown
    from prune_audit.analysis.study_figures import study_figures

    first = next(iter(by_task.values())).reference
    title = Path(first.model).name or first.model
    files: dict[str, bytes | str] = {}
    pictures: dict[str, bytes] = {}
    sections, every_row, difficult_rows = [], [], []
    for name, reports in by_task.items():
        prefix = f"{name}_" if len(by_task) > 1 else ""
        rows = summary_rows(reports)
        epsilons = [result["epsilon"] for result in reports.cascade["cascades"][0]["results"]]
        figure_title = f"{title}, {name}" if prefix else title
        figures = {
            f"{prefix}{stem}": data
            for stem, data in study_figures(
                rows, reports.calibration, reports.cascade, figure_title, reports.reference.task
            ).items()
        }
        pictures.update(figures)
        files.update(
            {
                f"{prefix}calibration.json": to_json(reports.calibration),
                f"{prefix}cascade.json": to_json(reports.cascade),
                **figures,
            }
        )
        sections.append(_task_section(name, reports, rows, epsilons, prefix))
        every_row += rows
        difficult_rows += reports.difficult.rows if reports.difficult else []
    header = report_header(first.manifest, first.model_name, len(first.questions), command)
    if len(by_task) > 1:
        header = replace(header, questions=f"tasks {', '.join(by_task)} (each task's section names its questions)")
    subset = next(iter(by_task.values())).difficult
    return {
        **summary_files(every_row),
        **(summary_files(difficult_rows, f"summary_{subset.subset.name}", subset_columns()) if subset else {}),
        **files,
        "report.md": report_markdown(sections, title, header),
        "report.html": report_html(sections, title, pictures, header),
    }


def settings_note(reports: StudyReports) -> str:
    """One line under the table: intervals, analysis settings, questions and the column reference."""
    calibration, cascade = reports.calibration["settings"], reports.cascade["settings"]
    return (
        f"{len(reports.reference.questions)} questions per run. Intervals: 95% image-bootstrap "
        f"({calibration['bootstrap']} resamples, seed {calibration['seed']}); temperature fitted on "
        f"{calibration['calibration_fraction']:.0%} of the images; cascade over {cascade['splits']} image splits. "
        f"Lost object: none of its tokens kept at stage {reports.stage} (--stage; its decoder layer per run in "
        "summary.csv). Every column: summary.csv."
    )


def _task_section(name: str, reports: StudyReports, rows: list[dict], epsilons: list[float], prefix: str):
    """A task's part of the report (``report_html.TaskSection``): its rows, notes and, with --subset, its subset
    table."""
    from prune_audit.analysis.report_html import TaskSection, question_set

    reference = reports.reference
    return TaskSection(
        name,
        rows,
        epsilons,
        settings_note(reports),
        question_set(reference.manifest, len(reference.questions)),
        reference.task.report_metrics,
        prefix,
        reference.task.names_evidence,
        *((reports.difficult.rows, subset_note(reports.difficult)) if reports.difficult else ()),
    )


def subset_note(table: SubsetTable) -> str:
    """The lines under a subset table: which questions, from which baseline, and the budgets without any."""
    subset = table.subset
    text = (
        f"Questions that {subset.baseline} answers wrongly at each budget (study --subset {subset.name} "
        f"--subset-baseline {subset.baseline}; VTC-Bench's filter): each budget's runs and the dense model on that "
        f"budget's questions, intervals as above, differences paired. Every column: summary_{subset.name}.csv."
    )
    if table.empty:
        text += f" No such question at budget {', '.join(table.empty)}: {subset.baseline} answers every one right."
    return text
