"""The seed calibration study's published figures, where a reproduction measures each, and the comparison.

``prune-audit reproduce`` runs the seed's LLaVA-1.5-7B POPE grid as a ``study`` (``STUDY_FOLDER``) plus a
batch-32 timing study (``TIMING_FOLDER``), then compares every figure of ``SEED_FIGURES`` with the number the
study wrote (``summary.csv`` / ``cascade.json``, the same numbers ``calibrate`` and ``cascade`` print). Its
``--dry-run`` prints the same list. Each figure names its metric column, its run and its questions.

Pooled questions: the study's metrics are computed over all 9,000 questions of the three official POPE splits
(adversarial, popular, random) together, as the seed's study did, not as the mean of per-split numbers.

Tolerances (absolute, in the figure's unit, unless marked relative), and why:

- accuracy +-1.0 point: 9,000 questions on 500 images give an image-clustered standard error near 0.4
  points; bfloat16 kernels, attention implementations and library versions flip answers whose yes/no
  probabilities sit near 0.5, which moves accuracy by a few tenths. One point is beyond both and still
  far below the gaps the seed reports between selectors (7 to 17 points).
- mean confidence +-0.02 and AUROC +-0.02: the same sources; AUROC's bootstrap interval on this set is
  about +-0.015 wide.
- lost-object accuracy +-5 points and confidence +-0.03: these are computed on the few hundred questions
  whose object lost every token, so their sampling error is several times larger than the pooled one.
- cascade prefill cost +-0.05 (5 % of dense prefill tokens): the conformal threshold is set on the
  calibration half of the images, and a one-step change of it escalates a batch of questions at once.
- latency and throughput +-20 % relative: they depend on the GPU, driver, CUDA and library versions and
  on the machine's load; the seed's come from one H200.
- the LLaVA-1.5-13B golden F1 +-0.0001: scoring a fixed released answers file is deterministic; the
  tolerance only covers the published figure's rounding to four digits.

Assumptions this module makes where the seed's text leaves a choice open (each also in its figure's
``claim``): the lost-object figures are FastV@64's (the selector whose lost objects the seed discusses);
the cascade's uninformative cost is the one of FastV@64's cascade (the gate its FastV figure is compared
with); the batch-32 throughput is dense against ``TIMING_SELECTOR``@64, an input-level selector, so
every decoder layer sees 64 instead of 576 visual tokens.
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from prune_audit.errors import PruneAuditError
from prune_audit.safety.ownership import REPRODUCE_STUDY_FOLDERS

STUDY_FOLDER, TIMING_FOLDER = REPRODUCE_STUDY_FOLDERS  # ownership recognises a reproduction by them

MODEL_ID = "llava-hf/llava-1.5-7b-hf"
GOLDEN_MODEL = "LLaVA-1.5-13B"
GRID_SELECTORS = ("fastv", "cls_attn", "coverage", "cdpruner", "divprune")
GRID_BUDGETS = ("64", "128")
POPE_SPLITS = ("adversarial", "popular", "random")
QUESTIONS_PER_SPLIT = 3000
GRID_BATCH = 1  # the seed timed its questions at batch 1: the grid's dense run gives that latency
CASCADE_EPSILON = 0.02
TIMING_SELECTOR = "cls_attn"
TIMING_BUDGET = "64"
TIMING_BATCH = 32
TIMING_QUESTIONS = 640  # 20 batches of 32: enough for a stable mean, a minute of GPU time
TABLE_FILES = ("reproduce.md", "reproduce.csv")
STUDY_PRESETS: dict[str, dict[str, str | int]] = {
    STUDY_FOLDER: {"selectors": ",".join(GRID_SELECTORS), "budgets": ",".join(GRID_BUDGETS), "batch_size": GRID_BATCH},
    # the timing pair only reads latency: its analyses at the smallest settings valid on its 640 questions
    TIMING_FOLDER: {
        "selectors": TIMING_SELECTOR,
        "budgets": TIMING_BUDGET,
        "batch_size": TIMING_BATCH,
        "limit": TIMING_QUESTIONS,
        "epsilons": "0.1",
        "bootstrap": 100,
        "splits": 20,
    },
}
"""The ``study`` options of each study folder under --out (the grid keeps study's analysis settings: its
epsilon sweep holds ``CASCADE_EPSILON``); inputs, device and threads are the reproduction's."""
POOLED = "all 9,000 questions of the three POPE splits, pooled"


@dataclass(frozen=True)
class Source:
    """Where a reproduction measures a figure: a ``kind`` of number in ``folder`` (under --out) for ``run``.

    kinds: ``summary`` (``column`` of the run's ``summary.csv`` row), ``uninformative`` (the run's
    cascade ``uninformative_cost`` at ``CASCADE_EPSILON`` in ``cascade.json``), ``speedup`` (the dense
    row's ``column`` over the run's), ``golden`` (the average F1 of ``score`` on --golden-answers).
    ``questions`` says which questions the number is computed on.
    """

    kind: str
    run: str
    column: str
    folder: str = STUDY_FOLDER
    questions: str = POOLED

    def describe(self) -> str:
        """Where the number comes from, in words a reader can follow to the file."""
        if self.kind == "golden":
            return "prune-audit score --task pope on --golden-answers: splits.average.f1 (mean over the 3 splits)"
        if self.kind == "uninformative":
            return f"{self.folder}/cascade.json: {self.run} results at epsilon {CASCADE_EPSILON:g}, uninformative_cost"
        if self.kind == "speedup":
            return f"{self.folder}/summary.csv: {self.column} of dense / {self.column} of {self.run}"
        return f"{self.folder}/summary.csv: row {self.run}, column {self.column}"


@dataclass(frozen=True)
class SeedFigure:
    """One published number: ``expected`` in ``unit`` (the study's value times ``scale``), within ``tolerance``
    (absolute in ``unit``, or a share of ``expected`` when ``relative``)."""

    key: str
    claim: str
    expected: float
    tolerance: float
    unit: str
    source: Source
    scale: float = 1.0
    relative: bool = False

    def tolerance_text(self) -> str:
        if self.relative:
            return f"+-{self.tolerance:.0%}"
        return f"+-{self.tolerance:.1f} points" if self.unit == "points" else f"+-{self.tolerance:g}"

    def allowed(self) -> float:
        """The largest difference that passes, in ``unit``."""
        return self.tolerance * abs(self.expected) if self.relative else self.tolerance

    def format(self, value: float) -> str:
        return "" if math.isnan(value) else f"{value:.{_digits(self.unit)}f}{_unit_suffix(self.unit)}"


def _unit_suffix(unit: str) -> str:
    return {"points": " %", "ms": " ms", "x": "x"}.get(unit, "")


def _digits(unit: str) -> int:
    return {"points": 1, "ms": 1, "x": 2, "f1": 4}.get(unit, 3)


def _percent(
    key: str,
    run: str,
    expected: float,
    claim: str,
    column: str = "accuracy",
    tolerance: float = 1.0,
    questions: str = POOLED,
) -> SeedFigure:
    """A share in the study's summary (0 to 1) the seed states in percent, tolerance in points."""
    return SeedFigure(
        key, claim, expected, tolerance, "points", Source("summary", run, column, questions=questions), scale=100.0
    )


def _share(
    key: str,
    run: str,
    expected: float,
    claim: str,
    column: str = "mean_confidence",
    tolerance: float = 0.02,
    questions: str = POOLED,
) -> SeedFigure:
    """A number in the study's summary the seed states as it is (confidence, AUROC)."""
    return SeedFigure(key, claim, expected, tolerance, "share", Source("summary", run, column, questions=questions))


_LOST = (
    "FastV@64's lost-object questions among the 9,000: yes-questions whose object lost every token at the first stage"
)
_CASCADE = f"cascade at epsilon {CASCADE_EPSILON:.0%}, first stage 64 tokens, then dense"
_CASCADE_QUESTIONS = "the test half of the 500 images (the cascade's image split, seed 0), pooled over the splits"
_TIMING = f"first {TIMING_QUESTIONS} questions, batch {TIMING_BATCH}"

SEED_FIGURES: tuple[SeedFigure, ...] = (
    _percent("dense.accuracy", "dense", 87.0, "dense accuracy"),
    _share("dense.confidence", "dense", 0.91, "dense mean confidence"),
    _percent("fastv64.accuracy", "fastv@64", 71.1, "FastV@64 accuracy"),
    _share("fastv64.confidence", "fastv@64", 0.92, "FastV@64 mean confidence"),
    _percent("cls_attn64.accuracy", "cls_attn@64", 80.5, "CLS attention@64 accuracy"),
    _share("cls_attn64.confidence", "cls_attn@64", 0.89, "CLS attention@64 mean confidence"),
    _percent("coverage64.accuracy", "coverage@64", 85.1, "coverage@64 accuracy"),
    _percent("cdpruner64.accuracy", "cdpruner@64", 88.0, "CDPruner@64 accuracy"),
    _share("dense.auroc", "dense", 0.801, "dense AUROC (confidence ranks correct above wrong answers)", column="auroc"),
    _share("fastv64.auroc", "fastv@64", 0.674, "FastV@64 AUROC (from dense 0.801)", column="auroc"),
    _percent(
        "fastv64.lost_accuracy",
        "fastv@64",
        17.0,
        "FastV@64 accuracy on its lost-object questions",
        column="lost_accuracy",
        tolerance=5.0,
        questions=_LOST,
    ),
    _percent(
        "fastv64.lost_reference_accuracy",
        "fastv@64",
        59.0,
        "dense accuracy on FastV@64's lost-object questions",
        column="lost_reference_accuracy",
        tolerance=5.0,
        questions=_LOST,
    ),
    _share(
        "fastv64.lost_confidence",
        "fastv@64",
        0.82,
        "FastV@64 mean confidence on its lost-object questions",
        column="lost_confidence",
        tolerance=0.03,
        questions=_LOST,
    ),
    _share(
        "fastv64.lost_reference_confidence",
        "fastv@64",
        0.80,
        "dense mean confidence on FastV@64's lost-object questions",
        column="lost_reference_confidence",
        tolerance=0.03,
        questions=_LOST,
    ),
    _percent(
        "coverage64.cascade_cost",
        "coverage@64",
        36.0,
        f"coverage {_CASCADE}: prefill tokens, % of dense",
        column=f"cascade_cost_eps{CASCADE_EPSILON:g}",
        tolerance=5.0,
        questions=_CASCADE_QUESTIONS,
    ),
    _percent(
        "fastv64.cascade_cost",
        "fastv@64",
        105.0,
        f"FastV {_CASCADE}: prefill tokens, % of dense",
        column=f"cascade_cost_eps{CASCADE_EPSILON:g}",
        tolerance=5.0,
        questions=_CASCADE_QUESTIONS,
    ),
    SeedFigure(
        "fastv64.uninformative_cost",
        f"uninformative gate (random escalation), FastV {_CASCADE}: prefill tokens, % of dense",
        97.0,
        5.0,
        "points",
        Source("uninformative", "fastv@64", "uninformative_cost", questions=_CASCADE_QUESTIONS),
        scale=100.0,
    ),
    SeedFigure(
        "dense.ms_b1",
        "H200 dense latency per question, batch 1",
        52.7,
        0.2,
        "ms",
        Source("summary", "dense", "latency_ms", questions=f"{POOLED}, batch {GRID_BATCH}"),
        relative=True,
    ),
    SeedFigure(
        "timing.throughput_b32",
        f"H200 throughput at batch {TIMING_BATCH}, {TIMING_BUDGET} vs 576 visual tokens "
        f"({TIMING_SELECTOR}@{TIMING_BUDGET} against dense)",
        5.0,
        0.2,
        "x",
        Source("speedup", f"{TIMING_SELECTOR}@{TIMING_BUDGET}", "latency_ms", TIMING_FOLDER, _TIMING),
        relative=True,
    ),
    SeedFigure(
        "golden13b.f1",
        f"{GOLDEN_MODEL} golden POPE F1 of its released answers, through score",
        0.8595,
        0.0001,
        "f1",
        Source("golden", GOLDEN_MODEL, "f1", "", "the three POPE splits, F1 averaged"),
    ),
)
"""Every figure of the seed study that ``reproduce`` checks, in the order of its table."""

TABLE_COLUMNS = (
    "figure",
    "claim",
    "run",
    "measured from",
    "questions",
    "seed",
    "tolerance",
    "measured",
    "difference",
    "status",
)


@dataclass(frozen=True)
class StudyOutputs:
    """The files a reproduction compares: per folder, ``summary.csv`` rows by run label and ``cascade.json``
    results by run label and epsilon; ``golden_f1`` from ``score`` (None when no answers were given)."""

    summaries: Mapping[str, Mapping[str, Mapping[str, str]]]
    cascades: Mapping[str, Mapping[str, Mapping[float, Mapping]]]
    golden_f1: float | None = None


def read_outputs(out: Path, golden_f1: float | None = None) -> StudyOutputs:
    """The summaries and cascade reports of the study folders under ``out``; a missing one is refused."""
    summaries, cascades = {}, {}
    for folder in (STUDY_FOLDER, TIMING_FOLDER):
        summary = out / folder / "summary.csv"
        if not summary.is_file():
            raise PruneAuditError(f"{summary} not found; run prune-audit reproduce without --report first")
        with summary.open(encoding="utf-8", newline="") as handle:
            summaries[folder] = {row["run"]: row for row in csv.DictReader(handle)}
        cascade = out / folder / "cascade.json"
        entries = json.loads(cascade.read_text(encoding="utf-8"))["cascades"] if cascade.is_file() else []
        cascades[folder] = {
            entry["label"]: {result["epsilon"]: result for result in entry["results"]} for entry in entries
        }
    return StudyOutputs(summaries, cascades, golden_f1)


def measure(figure: SeedFigure, outputs: StudyOutputs) -> float:
    """The reproduction's value of ``figure`` in its unit; NaN where the outputs lack it."""
    source = figure.source
    if source.kind == "golden":
        value = math.nan if outputs.golden_f1 is None else outputs.golden_f1
    elif source.kind == "uninformative":
        result = outputs.cascades.get(source.folder, {}).get(source.run, {}).get(CASCADE_EPSILON, {})
        value = float(result.get(source.column, math.nan))
    else:
        rows = outputs.summaries.get(source.folder, {})
        value = _cell(rows, source.run, source.column)
        if source.kind == "speedup":
            value = _cell(rows, "dense", source.column) / value if value else math.nan
    return value * figure.scale


def _cell(rows: Mapping[str, Mapping[str, str]], run: str, column: str) -> float:
    text = rows.get(run, {}).get(column, "")
    try:
        return float(text)
    except ValueError:
        return math.nan


def comparison_rows(outputs: StudyOutputs, figures: Sequence[SeedFigure] = SEED_FIGURES) -> list[dict[str, str]]:
    """One row per figure (``TABLE_COLUMNS``): the seed's value, the tolerance, the measured value and pass, fail
    or not measured."""
    rows = []
    for figure in figures:
        value = measure(figure, outputs)
        difference = value - figure.expected
        status = "not measured" if math.isnan(value) else "pass" if abs(difference) <= figure.allowed() else "fail"
        shown = "" if math.isnan(value) else f"{difference:+.{_digits(figure.unit)}f}"
        rows.append(_row(figure, figure.format(value), shown, status))
    return rows


def expected_rows(figures: Sequence[SeedFigure] = SEED_FIGURES) -> list[dict[str, str]]:
    """The table without measurements (``--dry-run``)."""
    return [_row(figure, "", "", "planned") for figure in figures]


def _row(figure: SeedFigure, measured: str, difference: str, status: str) -> dict[str, str]:
    values = (
        figure.key,
        figure.claim,
        figure.source.run,
        figure.source.describe(),
        figure.source.questions,
        figure.format(figure.expected),
        figure.tolerance_text(),
        measured,
        difference,
        status,
    )
    return dict(zip(TABLE_COLUMNS, values))


def table_markdown(rows: Sequence[Mapping[str, str]], title: str, note: str = "") -> str:
    """A Markdown table of ``rows``, headed by ``title`` and a count of passes."""
    lines = [f"# {title}", ""]
    if any(row["status"] != "planned" for row in rows):  # a comparison, not the dry run's plan
        passed = sum(row["status"] == "pass" for row in rows)
        lines += [f"{passed} of {len(rows)} figures within tolerance.", ""]
    if note:
        lines += [note, ""]
    lines += ["| " + " | ".join(TABLE_COLUMNS) + " |", "|" + " --- |" * len(TABLE_COLUMNS)]
    lines += ["| " + " | ".join(row[name].replace("|", "/") for name in TABLE_COLUMNS) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def table_csv(rows: Sequence[Mapping[str, str]]) -> str:
    """The same rows as CSV (``TABLE_COLUMNS``), one line per figure."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=TABLE_COLUMNS, lineterminator="\n")
    writer.writeheader()
    writer.writerows(rows)
    return buffer.getvalue()


def grid_runs() -> list[str]:
    """The study's run labels: the reference, then selectors x budgets."""
    return ["dense", *(f"{selector}@{budget}" for selector in GRID_SELECTORS for budget in GRID_BUDGETS)]


def estimated_seconds(questions: int, timing_questions: int) -> float:
    """Answering time on an H200, an estimate: every run's questions at the seed's dense time per question at
    batch 1 (pruned runs are faster, so it bounds the grid from above; model loading and the analyses are not
    counted), plus the two timing runs at the same rate."""
    per_question = seed_figure("dense.ms_b1").expected / 1000
    return per_question * (len(grid_runs()) * questions + 2 * timing_questions)


def seed_figure(key: str) -> SeedFigure:
    """The figure of ``SEED_FIGURES`` named ``key``."""
    return next(figure for figure in SEED_FIGURES if figure.key == key)


def preset_options(folder: str, limit: int | None) -> dict[str, str | int]:
    """``STUDY_PRESETS[folder]``, each run cut to the first ``limit`` questions when given (testing)."""
    options = dict(STUDY_PRESETS[folder])
    if limit is not None:
        options["limit"] = min(limit, int(options.get("limit", limit)))
    return options


def preset_command(folder: str, out: Path, limit: int | None = None) -> str:
    """The ``prune-audit study`` command line of ``folder``'s preset, inputs as placeholders."""
    options = [f"--{name.replace('_', '-')} {value}" for name, value in preset_options(folder, limit).items()]
    inputs = [
        "--model MODEL --clip-text CLIP",
        *(f"--pope coco_pope_{split}.json" for split in POPE_SPLITS),
        "--images VAL2014 --annotations instances_val2014.json",
    ]
    return " ".join(["prune-audit study", *options, *inputs, f"--out {out / folder}"])
