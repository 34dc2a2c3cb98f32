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

TABLE_COLUMNS = (
    ("run", "run"),
    ("visual tokens", "visual_tokens"),
    ("accuracy", "accuracy"),
    ("F1", "f1"),
    ("ECE", "ece"),
    ("ECE after T (test)", "ece_test_after"),
    ("AUROC", "auroc"),
    ("lost share", "lost_share"),
    ("acc. lost (pruned / dense)", "lost_pair"),
    ("latency ms", "latency_ms"),
)

FIGURES = (
    ("accuracy_vs_budget", "Accuracy against realised visual tokens"),
    ("calibration_vs_budget", "ECE and AUROC against realised visual tokens"),
    ("lost_objects", "Questions whose object was lost: accuracy against confidence, pruned and dense"),
    ("reliability_grid", "Reliability diagrams, every run"),
    ("cascade_cost_vs_epsilon", "Cascade prefill cost against the disagreement target epsilon"),
)


def _number(value: float, digits: int = 3) -> str:
    return "-" if value is None or not math.isfinite(value) else f"{value:.{digits}f}"


def _with_interval(row: dict, name: str) -> str:
    value, low, high = row[name], row.get(f"{name}_low", math.nan), row.get(f"{name}_high", math.nan)
    if not math.isfinite(low):
        return _number(value)
    return f"{_number(value)} [{_number(low)}, {_number(high)}]"


def table_cells(row: dict) -> list[str]:
    """The report table's cells of one summary row."""
    cells = []
    for _, name in TABLE_COLUMNS:
        if name == "run":
            cells.append(str(row["run"]))
        elif name == "lost_pair":
            cells.append(f"{_number(row['lost_accuracy'])} / {_number(row['lost_reference_accuracy'])}")
        elif name in ("visual_tokens", "latency_ms"):
            cells.append(_number(row[name], 1))
        elif name == "lost_share":
            cells.append("-" if not math.isfinite(row[name]) else f"{row[name]:.1%}")
        elif name in ("accuracy", "ece", "auroc"):
            cells.append(_with_interval(row, name))
        else:
            cells.append(_number(row[name]))
    return cells


def _excludes_zero(row: dict, name: str) -> bool:
    low, high = row[f"{name}_low"], row[f"{name}_high"]
    return math.isfinite(low) and (low > 0 or high < 0)


def _signed(row: dict, name: str) -> str:
    verdict = "interval excludes 0" if _excludes_zero(row, name) else "interval includes 0"
    return f"{row[name]:+.3f} [{row[f'{name}_low']:+.3f}, {row[f'{name}_high']:+.3f}], {verdict}"


def findings(rows: Sequence[dict], epsilons: Sequence[float]) -> list[str]:
    """Sentences stating what the numbers show, each naming its runs and values."""
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
            text += f" and {worst['run']} the least ({worst['accuracy']:.3f}; {_signed(worst, 'accuracy_minus_reference')})"
        texts.append(text + f"; the dense model scores {reference['accuracy']:.3f}.")
    texts.append(_change_finding(pruned, reference, "ece", "ECE", worst=max))
    texts.append(_change_finding(pruned, reference, "auroc", "AUROC", worst=min))
    texts.extend(_lost_finding(pruned))
    texts.extend(_cascade_findings(pruned, epsilons))
    return texts


def _change_finding(pruned: Sequence[dict], reference: dict, name: str, title: str, worst) -> str:
    """The run whose ``name`` moved most in the bad direction, and whether its paired interval excludes 0."""
    row = worst(pruned, key=lambda row: row[f"{name}_minus_reference"])
    difference = f"{name}_minus_reference"
    lead = (
        f"{title} moves most for {row['run']}" if _excludes_zero(row, difference)
        else f"No pruned run's {title} differs from dense beyond its interval; "
        f"the least favourable change is {row['run']}'s"
    )
    text = f"{lead}: {row[name]:.3f} against dense {reference[name]:.3f} ({_signed(row, difference)})"
    if name == "ece":
        text += (f"; temperature scaling (T = {row['temperature']:.2f}) moves its test-image ECE from "
                 f"{row['ece_test_before']:.3f} to {row['ece_test_after']:.3f}")
    return text + "."


def _lost_finding(pruned: Sequence[dict]) -> list[str]:
    with_lost = [row for row in pruned if math.isfinite(row["lost_share"]) and math.isfinite(row["lost_accuracy"])]
    if not with_lost:
        return ["No pruned run lost a queried object (or the runs have no object masks)."]
    row = max(with_lost, key=lambda row: row["lost_share"])
    gap = row["lost_confidence"] - row["lost_accuracy"]
    return [
        f"{row['run']} loses the queried object in {row['lost_share']:.1%} of the yes-questions; on those it "
        f"answers with accuracy {row['lost_accuracy']:.3f} at mean confidence {row['lost_confidence']:.3f} "
        f"({'over' if gap > 0 else 'under'}confident by {abs(gap):.3f}), while the dense model on the same "
        f"questions scores {row['lost_reference_accuracy']:.3f} at confidence {row['lost_reference_confidence']:.3f}."
    ]


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


def report_markdown(rows: Sequence[dict], epsilons: Sequence[float], title: str, note: str) -> str:
    """report.md: table, findings and the figures (PNG files beside it)."""
    header = [name for name, _ in TABLE_COLUMNS]
    lines = [f"# Study: {title}", "", "| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    lines += ["| " + " | ".join(table_cells(row)) + " |" for row in rows]
    lines += ["", note, "", "## Findings", ""]
    lines += [f"- {text}" for text in findings(rows, epsilons)]
    for stem, caption in FIGURES:
        lines += ["", f"## {caption}", "", f"![{caption}]({stem}.png)"]
    return "\n".join(lines) + "\n"


STYLE = (
    "body{font-family:sans-serif;max-width:1100px;margin:2em auto;padding:0 1em}"
    "table{border-collapse:collapse;font-size:0.9em}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
    "td:first-child,th:first-child{text-align:left}img{max-width:100%}"
)


def report_html(
    rows: Sequence[dict], epsilons: Sequence[float], title: str, note: str, pictures: dict[str, bytes]
) -> str:
    """report.html: the same content with every figure embedded as a base64 PNG; no external resource."""
    escape = html.escape
    head = "".join(f"<th>{escape(name)}</th>" for name, _ in TABLE_COLUMNS)
    body = "".join(
        "<tr>" + "".join(f"<td>{escape(cell)}</td>" for cell in table_cells(row)) + "</tr>" for row in rows
    )
    parts = [
        "<!DOCTYPE html>",
        f'<html lang="en"><head><meta charset="utf-8"><title>{escape(title)}</title><style>{STYLE}</style></head><body>',
        f"<h1>Study: {escape(title)}</h1>",
        f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>",
        f"<p>{escape(note)}</p>",
        "<h2>Findings</h2><ul>" + "".join(f"<li>{escape(text)}</li>" for text in findings(rows, epsilons)) + "</ul>",
    ]
    for stem, caption in FIGURES:
        data = base64.b64encode(pictures[f"{stem}.png"]).decode("ascii")
        parts.append(
            f'<h2>{escape(caption)}</h2><img alt="{escape(caption)}" src="data:image/png;base64,{data}">'
        )
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
