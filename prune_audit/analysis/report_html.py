"""The study report: report.md (figures as files beside it) and a self-contained report.html.

The HTML embeds every figure as a base64 PNG and loads nothing from the network. The
findings are sentences written from the summary rows (which run, which number, whether the
interval excludes zero), never fixed text.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prune_audit.analysis.metric_table import METRIC_NAMES, metric

TABLE_COLUMNS = (
    ("run", "run"),
    ("visual tokens", "visual_tokens"),
    ("accuracy", "accuracy"),
    ("loyalty", "loyalty"),
    ("loyalty (token F1)", "loyalty_overlap"),
    ("F1", "f1"),
    ("ECE", "ece"),
    ("ECE after T (test)", "ece_test_after"),
    ("AUROC", "auroc"),
    ("lost share", "lost_share"),
    ("acc. lost (pruned / dense)", "lost_pair"),
    ("FLOPs / dense", "flops_relative"),
    ("KV KiB", "mean_kv_bytes"),
    ("latency ms", "latency_ms"),
)

FIGURES = (
    ("accuracy_vs_budget", "Accuracy against realised visual tokens"),
    ("calibration_vs_budget", "ECE and AUROC against realised visual tokens"),
    ("quality_vs_flops", "Accuracy and AUROC against prefill FLOPs relative to dense (matched compute)"),
    ("lost_objects", "Questions whose object was lost: accuracy against confidence, pruned and dense"),
    ("reliability_grid", "Reliability diagrams, every run"),
    ("cascade_cost_vs_epsilon", "Cascade prefill cost against the disagreement target epsilon"),
    ("cascade_validity", "Cascade validity: held-out disagreement against epsilon over random image splits"),
)


def _number(value: float, digits: int = 3) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _with_interval(row: dict, name: str) -> str:
    value, low, high = row[name], row.get(f"{name}_low", math.nan), row.get(f"{name}_high", math.nan)
    if not math.isfinite(low):
        return _number(value)
    return f"{_number(value)} [{_number(low)}, {_number(high)}]"


SUBSET_TABLE_COLUMNS = (
    ("budget", "budget"),
    ("run", "run"),
    ("questions", "questions"),
    ("accuracy", "accuracy"),
    ("loyalty", "loyalty"),
    ("loyalty (token F1)", "loyalty_overlap"),
    ("F1", "f1"),
    ("ECE", "ece"),
    ("AUROC", "auroc"),
    ("accuracy minus dense", "accuracy_minus_reference"),
)
"""The columns of the subset table (``study --subset``), the same questions in every row of a budget."""
SUBSET_HEADING = "Difficult questions"

ESTIMATED_CELLS = ("accuracy", "loyalty", "loyalty_overlap", "ece", "auroc", "accuracy_minus_reference")
"""Columns shown with their 95% interval."""

EVIDENCE_COLUMNS = ("lost_share", "lost_pair")
"""The columns about lost evidence: a task whose questions name no image regions (ScienceQA) has none to show."""
EVIDENCE_FIGURES = ("lost_objects",)


def table_columns(
    report_metrics: Sequence[str], names_evidence: bool = True, columns: Sequence[tuple[str, str]] = TABLE_COLUMNS
) -> tuple[tuple[str, str], ...]:
    """The ``columns`` (``TABLE_COLUMNS``, ``SUBSET_TABLE_COLUMNS``) a task's table shows: the lost-evidence columns
    only if its questions name evidence (``Task.names_evidence``), a metric's column only if the task reports it
    (``Task.report_metrics``; GQA has no F1)."""
    return tuple(
        column
        for column in columns
        if (column[1] not in METRIC_NAMES or column[1] in report_metrics)
        and (names_evidence or column[1] not in EVIDENCE_COLUMNS)
    )


def section_figures(names_evidence: bool) -> tuple[tuple[str, str], ...]:
    """The report figures of a task: the lost-objects figure only if its questions name evidence."""
    return tuple(figure for figure in FIGURES if names_evidence or figure[0] not in EVIDENCE_FIGURES)


@dataclass(frozen=True)
class TaskSection:
    """One task's part of a study report.

    Attributes:
        task: the task's name; rows: its summary rows (reference first); epsilons: its cascade targets;
        note: its settings line (``study.settings_note``); questions: its question set (``question_set``);
        report_metrics: ``Task.report_metrics``; figure_prefix: prefix of its figure files (several tasks);
        names_evidence: ``Task.names_evidence`` (without evidence: no lost-evidence columns, finding or figure).
        subset_rows, subset_note: the rows of ``study --subset`` (``study.SubsetTable``) and the note under them;
            no note: no subset table.
    """

    task: str
    rows: Sequence[dict]
    epsilons: Sequence[float]
    note: str
    questions: str
    report_metrics: Sequence[str]
    figure_prefix: str = ""
    names_evidence: bool = True
    subset_rows: Sequence[dict] = ()
    subset_note: str = ""


def table_cells(row: dict, columns: Sequence[tuple[str, str]] = TABLE_COLUMNS) -> list[str]:
    """The report table's cells of one summary row, for ``columns`` (``table_columns``)."""
    cells = []
    for _, name in columns:
        if name in ("run", "budget"):
            cells.append(str(row[name]))
        elif name == "questions":
            cells.append(str(int(row[name])))
        elif name == "lost_pair":
            cells.append(f"{_number(row['lost_accuracy'])} / {_number(row['lost_reference_accuracy'])}")
        elif name in ("visual_tokens", "latency_ms"):
            cells.append(_number(row[name], 1))
        elif name == "mean_kv_bytes":
            cells.append(_number(row[name] / 1024, 0))
        elif name == "lost_share":
            cells.append("-" if not math.isfinite(row[name]) else f"{row[name]:.1%}")
        elif name in ESTIMATED_CELLS:
            cells.append(_with_interval(row, name))
        else:
            cells.append(_number(row[name]))
    return cells


def _excludes_zero(row: dict, name: str) -> bool:
    low, high = row[f"{name}_low"], row[f"{name}_high"]
    return math.isfinite(low) and (low > 0 or high < 0)


def _signed(row: dict, name: str) -> str:
    """A paired difference and its interval in words; one that is the same on every resample says so."""
    value, low, high = row[name], row[f"{name}_low"], row[f"{name}_high"]
    if low == high == value:
        return "identical answers on every resample" if value == 0 else f"{value:+.3f} on every bootstrap resample"
    verdict = "excludes 0" if _excludes_zero(row, name) else "includes 0"
    return f"{value:+.3f}, 95% interval [{low:+.3f}, {high:+.3f}] {verdict}"


def findings(rows: Sequence[dict], epsilons: Sequence[float], names_evidence: bool = True) -> list[str]:
    """Sentences stating what the numbers show, each naming its runs and values (the lost-evidence one only where
    the task's questions name evidence)."""
    reference = next(row for row in rows if row["selector"] == "dense")
    pruned = [row for row in rows if row["selector"] != "dense"]
    texts = []
    for budget in sorted({row["budget"] for row in pruned}, key=str):
        group = sorted((row for row in pruned if row["budget"] == budget), key=lambda row: -row["accuracy"])
        best, worst = group[0], group[-1]
        text = (
            f"At budget {budget}, {best['run']} keeps the most accuracy ({best['accuracy']:.3f}; minus dense "
            f"{_signed(best, 'accuracy_minus_reference')})"
        )
        if worst is not best:
            text += (
                f" and {worst['run']} the least ({worst['accuracy']:.3f}; {_signed(worst, 'accuracy_minus_reference')})"
            )
        texts.append(text + f"; the dense model scores {reference['accuracy']:.3f}.")
    texts.extend(_loyalty_finding(pruned))
    texts.append(_change_finding(pruned, reference, "ece", "ECE"))
    texts.append(_change_finding(pruned, reference, "auroc", "AUROC"))
    texts.extend(_lost_finding(pruned) if names_evidence else [])
    texts.extend(_omission_finding(pruned))
    texts.extend(_cascade_findings(pruned, epsilons))
    return texts


def _loyalty_finding(pruned: Sequence[dict]) -> list[str]:
    """The least loyal run (its answers differ most often from the dense run's on the same questions), with the
    token-overlap loyalty where the task generates its answers; none where no run has a loyalty."""
    loyal = [row for row in pruned if math.isfinite(row.get("loyalty", math.nan))]
    if not loyal:
        return []
    row = min(loyal, key=lambda row: row["loyalty"])
    overlap = row.get("loyalty_overlap", math.nan)
    words = (
        "" if not math.isfinite(overlap) else f", and its words overlap the dense answer's with token F1 {overlap:.3f}"
    )
    return [
        f"{row['run']} is the least loyal to the dense model: it gives the dense answer to {row['loyalty']:.1%} of "
        f"the questions (95% interval {_share(row['loyalty_low'])} to {_share(row['loyalty_high'])}){words}."
    ]


def _change_finding(pruned: Sequence[dict], reference: dict, name: str, title: str) -> str:
    """The run whose ``name`` moved most in the bad direction (``metric_table``'s ``higher_is_better``), and
    whether its paired interval excludes 0."""
    worst = min if metric(name).higher_is_better else max
    row = worst(pruned, key=lambda row: row[f"{name}_minus_reference"])
    difference = f"{name}_minus_reference"
    lead = (
        f"{title} moves most for {row['run']}"
        if _excludes_zero(row, difference)
        else f"No pruned run's {title} differs from dense beyond its interval; "
        f"the least favourable change is {row['run']}'s"
    )
    text = f"{lead}: {row[name]:.3f} against dense {reference[name]:.3f} ({_signed(row, difference)})"
    if name == "ece":
        text += (
            f"; temperature scaling (T = {row['temperature']:.2f}) moves its test-image ECE from "
            f"{row['ece_test_before']:.3f} to {row['ece_test_after']:.3f}"
        )
    return text + "."


def _lost_finding(pruned: Sequence[dict]) -> list[str]:
    with_lost = [row for row in pruned if math.isfinite(row["lost_share"]) and math.isfinite(row["lost_accuracy"])]
    if not with_lost:
        return ["No pruned run lost every token of a question's evidence (or the runs have no evidence masks)."]
    row = max(with_lost, key=lambda row: row["lost_share"])
    gap = row["lost_confidence"] - row["lost_accuracy"]
    # POPE's evidence is the queried object of a yes-question; other tasks' is every object a question names
    lost = (
        "the queried object in {:.1%} of the yes-questions"
        if row.get("task", "pope") == "pope"
        else "every token of the evidence of {:.1%} of the questions with evidence masks"
    )
    return [
        f"{row['run']} loses {lost.format(row['lost_share'])}; on those it "
        f"answers with accuracy {row['lost_accuracy']:.3f} at mean confidence {row['lost_confidence']:.3f} "
        f"({'over' if gap > 0 else 'under'}confident by {abs(gap):.3f}), while the dense model on the same "
        f"questions scores {row['lost_reference_accuracy']:.3f} at confidence {row['lost_reference_confidence']:.3f}."
    ]


def _omission_finding(pruned: Sequence[dict]) -> list[str]:
    """Captions (``Task.reference_comparison``): the omission rate of the objects a run lost beside those it kept,
    and the dense model's on the same objects, for the run that loses the most objects."""
    compared = [row for row in pruned if row.get("objects_lost", 0) > 0]
    if not compared:
        return []
    row = max(compared, key=lambda row: row["objects_lost"])
    return [
        f"{row['run']}'s captions omit {row['omitted_lost']:.1%} of the {row['objects_lost']} annotated objects its "
        f"first stage lost and {_share(row['omitted_kept'])} of the {row['objects_kept']} it kept; the dense model's "
        f"captions omit {row['omitted_lost_reference']:.1%} and {_share(row['omitted_kept_reference'])} of the same "
        f"objects."
    ]


def _share(value: float) -> str:
    return "-" if not math.isfinite(value) else f"{value:.1%}"


def _cascade_findings(pruned: Sequence[dict], epsilons: Sequence[float]) -> list[str]:
    """The cheapest cascade per target; targets with the same cheapest run and cost share one sentence."""
    cheapest: dict[tuple[str, str, str], list[str]] = {}
    for epsilon in epsilons:
        column = f"cascade_cost_eps{epsilon:g}"
        costed = [row for row in pruned if math.isfinite(row.get(column, math.nan))]
        if not costed:
            continue
        row = min(costed, key=lambda row: row[column])
        share = row[f"savings_share_eps{epsilon:g}"]
        savings = "" if not math.isfinite(share) else f", {share:.0%} of the savings a perfect gate would reach"
        cheapest.setdefault((row["run"], f"{row[column]:.3f}", savings), []).append(f"{epsilon:g}")
    texts = []
    for (run, cost, savings), targets in cheapest.items():
        where = f"target {targets[0]}" if len(targets) == 1 else f"targets {', '.join(targets)}"
        texts.append(
            f"At disagreement {where}, the cheapest cascade answers with {run} first and costs {cost} of the dense "
            f"prefill{savings}."
        )
    return texts


@dataclass(frozen=True)
class ReportHeader:
    """What a reader of a report needs before any number: how it was made, with what, on what, and when."""

    command: str
    version: str
    model: str
    questions: str
    date: str
    device: str

    def items(self) -> list[tuple[str, str]]:
        return [
            ("command", self.command or "-"),
            ("prune-audit", self.version),
            ("model", self.model),
            ("questions", self.questions),
            ("device", self.device),
            ("report date", self.date),
        ]


def question_set(manifest: dict[str, Any], questions: int) -> str:
    """The question files (names), split and counts of a run, e.g. ``coco_pope_random.json (split all, 60 questions
    on 10 images)``."""
    files = ", ".join(Path(entry["path"]).name for entry in manifest.get("question_files") or []) or "unknown files"
    images = (manifest.get("images") or {}).get("count")
    on_images = f" on {images} images" if images else ""
    return f"{files} (split {manifest.get('split') or 'all'}, {questions} questions{on_images})"


def report_header(manifest: dict[str, Any], model: str, questions: int, command: str) -> ReportHeader:
    """The header of a study report from its reference run's manifest; the date is now, in UTC."""
    from datetime import datetime, timezone

    from prune_audit import __version__

    recorded = manifest.get("version")
    version = __version__ + (f" (runs recorded with {recorded})" if recorded and recorded != __version__ else "")
    revision = manifest.get("git_revision")
    version += f", git {revision[:12]}" if revision else ""
    return ReportHeader(
        command=command,
        version=version,
        model=model,
        questions=question_set(manifest, questions),
        date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        device=str(manifest.get("device") or "unknown"),
    )


def latency_caveat(header: ReportHeader) -> str:
    """How to read the latency column: wall-clock on the machine of the runs, load included."""
    text = (
        "latency ms: mean wall-clock time per question in the runs, selector scoring included, as measured on "
        f"{header.device}"
    )
    if header.device == "cpu":
        text += (
            "; on a CPU, and especially a shared one, it moves with the machine's load and the selector's own "
            "work, so a pruned run can read slower than dense: compare prefill speed with "
            "benchmarks/ on an idle accelerator, not with this column"
        )
    return text + "."


def _section_markdown(section: TaskSection, level: str, caveat: str | None) -> list[str]:
    """A task's table, notes, findings and figures; ``level``: the heading marks of its parts (``##``, ``###``);
    ``caveat``: the latency caveat, after the note (a study of one task)."""
    columns = table_columns(section.report_metrics, section.names_evidence)
    lines = ["| " + " | ".join(name for name, _ in columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(table_cells(row, columns)) + " |" for row in section.rows]
    lines += ["", section.note, "", *([caveat, ""] if caveat else []), f"{level} Findings", ""]
    lines += [f"- {text}" for text in findings(section.rows, section.epsilons, section.names_evidence)]
    if section.subset_note:
        subset = table_columns(section.report_metrics, columns=SUBSET_TABLE_COLUMNS)
        lines += ["", f"{level} {SUBSET_HEADING}", ""]
        lines += ["| " + " | ".join(name for name, _ in subset) + " |", "|" + " --- |" * len(subset)]
        lines += ["| " + " | ".join(table_cells(row, subset)) + " |" for row in section.subset_rows]
        lines += ["", section.subset_note]
    for stem, caption in section_figures(section.names_evidence):
        lines += ["", f"{level} {caption}", "", f"![{caption}]({section.figure_prefix}{stem}.png)"]
    return lines


def report_markdown(sections: Sequence[TaskSection], title: str, header: ReportHeader) -> str:
    """report.md: header, then each task's table, findings and figures (PNG files beside it); a study of one
    task has no task headings."""
    lines = [f"# Study: {title}", ""]
    lines += [f"- {name}: `{value}`" if name == "command" else f"- {name}: {value}" for name, value in header.items()]
    lines.append("")
    if len(sections) == 1:
        return "\n".join([*lines, *_section_markdown(sections[0], "##", latency_caveat(header))]) + "\n"
    lines += [latency_caveat(header), ""]
    for section in sections:
        lines += [
            f"## Task {section.task}",
            "",
            f"questions: {section.questions}",
            "",
            *_section_markdown(section, "###", None),
            "",
        ]
    return "\n".join(lines).rstrip("\n") + "\n"


STYLE = (
    "body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
    "table{border-collapse:collapse;font-size:0.9em}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
    "td:first-child,th:first-child{text-align:left}img{max-width:100%}"
    # an interval goes under its value (table_html) and headers wrap, so the table fits the page's 1100 px; each
    # line of a cell stays whole, and a table wider still (a long run name) scrolls
    "td{white-space:nowrap}th{vertical-align:bottom}.ci{font-size:0.85em;color:#555}"
    ".scroll{overflow-x:auto}dl{display:grid;grid-template-columns:max-content auto;gap:2px 1em}"
    "dt{font-weight:bold}dd{margin:0}code{word-break:break-all}"
)


def table_html(rows: Sequence[dict], columns: Sequence[tuple[str, str]]) -> str:
    """The report table in HTML: each value with its 95% interval on a second, smaller line (``table_cells``' text
    split at " ["), so that the table is as narrow as its values rather than as value and interval together."""
    escape = html.escape

    def cell(text: str) -> str:
        value, bracket, interval = text.partition(" [")
        return escape(value) + (f'<br><span class="ci">[{escape(interval)}</span>' if bracket else "")

    head = "".join(f"<th>{escape(name)}</th>" for name, _ in columns)
    body = "".join(
        "<tr>" + "".join(f"<td>{cell(text)}</td>" for text in table_cells(row, columns)) + "</tr>" for row in rows
    )
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'


def _section_html(section: TaskSection, pictures: dict[str, bytes], level: int, caveat: str | None) -> list[str]:
    """A task's table, notes, findings and embedded figures; ``level``: the heading level of its parts;
    ``caveat``: the latency caveat, after the note (a study of one task)."""
    escape = html.escape
    parts = [
        table_html(section.rows, table_columns(section.report_metrics, section.names_evidence)),
        f"<p>{escape(section.note)}</p>",
        *([f"<p>{escape(caveat)}</p>"] if caveat else []),
        f"<h{level}>Findings</h{level}><ul>"
        + "".join(
            f"<li>{escape(text)}</li>" for text in findings(section.rows, section.epsilons, section.names_evidence)
        )
        + "</ul>",
    ]
    if section.subset_note:
        parts += [
            f"<h{level}>{escape(SUBSET_HEADING)}</h{level}>",
            table_html(section.subset_rows, table_columns(section.report_metrics, columns=SUBSET_TABLE_COLUMNS)),
            f"<p>{escape(section.subset_note)}</p>",
        ]
    for stem, caption in section_figures(section.names_evidence):
        data = base64.b64encode(pictures[f"{section.figure_prefix}{stem}.png"]).decode("ascii")
        parts.append(
            f'<h{level}>{escape(caption)}</h{level}><img alt="{escape(caption)}" src="data:image/png;base64,{data}">'
        )
    return parts


def report_html(sections: Sequence[TaskSection], title: str, pictures: dict[str, bytes], header: ReportHeader) -> str:
    """report.html: the same content with every figure embedded as a base64 PNG; no external resource."""
    escape = html.escape
    described = "".join(
        f"<dt>{escape(name)}</dt><dd>{f'<code>{escape(value)}</code>' if name == 'command' else escape(value)}</dd>"
        for name, value in header.items()
    )
    parts = [
        "<!DOCTYPE html>",
        f'<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title><style>{STYLE}</style></head><body>',
        f"<h1>Study: {escape(title)}</h1>",
        f"<dl>{described}</dl>",
    ]
    if len(sections) == 1:
        parts += _section_html(sections[0], pictures, 2, latency_caveat(header))
    else:
        parts.append(f"<p>{escape(latency_caveat(header))}</p>")
        for section in sections:
            parts += [
                f"<h2>Task {escape(section.task)}</h2>",
                f"<p>questions: {escape(section.questions)}</p>",
                *_section_html(section, pictures, 3, None),
            ]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
