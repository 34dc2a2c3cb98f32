"""Run directories (``records.parquet`` + ``manifest.json``, docs/records.md) as analysis tables."""

from __future__ import annotations

import errno
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from prune_audit.analysis.questions import QuestionTable
from prune_audit.compute.budget import budget_text
from prune_audit.errors import PruneAuditError
from prune_audit.records.manifest import UNPRUNED, differing_fields
from prune_audit.records.stages import FIRST, StageChoice, StageValues, stage_values
from prune_audit.records.store import read_run
from prune_audit.tasks import DEFAULT_TASK, Task, get_task, manifest_task

REQUIRED_COLUMNS = ("question_id", "split", "image_id", "confidence", "correct", "cost_tokens", "flops", "latency_ms")
"""Core columns the analyses read that must hold a value in every row (``lost`` may be null); each task adds
its own (``Task.required_columns``)."""

COMPARED_FIELDS = ("task", "model", "question_files", "prompt")
"""Manifest fields that must agree for runs to be compared: task, model id, question-file hashes, prompt."""


@dataclass(frozen=True)
class Run:
    """One run directory: its manifest and its questions, retention and lost read at ``stage``.

    ``stage`` says which stage was read, e.g. ``first (decoder layer 0)``.
    """

    path: Path
    manifest: dict[str, Any]
    questions: QuestionTable
    stage: str = FIRST.name

    @property
    def selector(self) -> str:
        """The selector's name; ``dense`` for the unpruned reference (selector ``none``)."""
        name = self.manifest["selector"]["name"]
        return "dense" if name == UNPRUNED else name

    @property
    def task(self) -> Task:
        """The run's task (manifest ``task``)."""
        return manifest_task(self.manifest)

    @property
    def budget(self) -> int | str | None:
        """The requested budget (manifest ``budget``): a count, a share (``11%``), ``all`` or None (unpruned); a
        composed run's list of part budgets as ``--budget`` spells it (``96,48``), one label and one set member."""
        budget = self.manifest.get("budget")
        return budget_text(budget) if isinstance(budget, list) else budget

    @property
    def model(self) -> str:
        return self.manifest["model"]["id"]

    @property
    def model_name(self) -> str:
        """The model for titles: a hub id as is, a local folder by its name (no local paths in figures)."""
        return display_model(self.model)

    @property
    def label(self) -> str:
        """Short name: selector and budget, e.g. ``divprune@64`` (``dense`` without a selector)."""
        return self.selector if self.budget is None else f"{self.selector}@{self.budget}"

    @property
    def title(self) -> str:
        """Model, selector and budget, for figure titles."""
        budget = "all tokens" if self.budget is None else f"{self.budget} tokens"
        return f"{self.model_name} | {self.selector} | {budget}"


def display_model(model_id: str) -> str:
    """``llava-hf/llava-1.5-7b-hf`` stays; ``/models/llava-1.5-7b-hf`` becomes ``llava-1.5-7b-hf``."""
    return Path(model_id.rstrip("/")).name if Path(model_id).is_absolute() else model_id


def load_run(path: Path | str, stage: StageChoice = FIRST) -> Run:
    """Read a run directory, retention and lost at ``stage``; raises FileNotFoundError or
    PruneAuditError naming the problem (an older run's schema included)."""
    path = Path(path)
    if not path.is_dir():
        raise FileNotFoundError(errno.ENOENT, "run directory not found", str(path))
    manifest, records = read_run(path)
    if records.num_rows == 0:
        raise PruneAuditError(f"{path} holds no records; finish the run with prune-audit run first")
    at_stage = stage_values(records, stage, str(path))
    questions = _question_table(manifest_task(manifest), records, str(path), at_stage)
    return Run(path=path, manifest=manifest, questions=questions, stage=stage.describe(at_stage.layer))


def question_table(
    records: pa.Table, source: str, stage: StageChoice = FIRST, task: Task | None = None
) -> QuestionTable:
    """The analysis columns of a records table (docs/records.md) of ``task`` (default POPE), retention and lost
    at ``stage``."""
    return _question_table(task or get_task(DEFAULT_TASK), records, source, stage_values(records, stage, source))


def _question_table(task: Task, records: pa.Table, source: str, at_stage: StageValues) -> QuestionTable:
    for name in (*REQUIRED_COLUMNS, *task.required_columns):
        if name not in records.column_names or records[name].null_count:
            raise PruneAuditError(f"records of {source} lack column {name!r} in some rows; re-run to rewrite them")
    binary = task.binary_view(records, source)
    return QuestionTable(
        split=records["split"].to_numpy(zero_copy_only=False).astype(str),
        question_id=records["question_id"].to_numpy().astype(np.int64),
        image_id=records["image_id"].to_numpy().astype(np.int64),
        label_yes=binary["label_yes"],
        answer_yes=binary["answer_yes"],
        correct=records["correct"].to_numpy(zero_copy_only=False).astype(bool),
        confidence=records["confidence"].to_numpy().astype(np.float64),
        p_yes=binary["p_yes"],
        logit_diff=binary["logit_diff"],
        retention=at_stage.retention,
        lost=at_stage.lost,
        diluted=at_stage.diluted,
        cost_tokens=records["cost_tokens"].to_numpy().astype(np.float64),
        flops=records["flops"].to_numpy().astype(np.float64),
        latency_ms=records["latency_ms"].to_numpy().astype(np.float64),
        answer=binary["answer"],
        top_label=bool(binary["top_label"]),
        generated=task.generates(),
    )


def comparison_view(manifest: dict[str, Any]) -> dict[str, Any]:
    """The manifest fields that decide comparability, question files reduced to their sorted sha256.

    The model counts by the sha256 of its weights where both runs record it, else by its id.
    """
    return {
        "task": manifest_task(manifest).name,
        "model": {key: (manifest.get("model") or {}).get(key) for key in ("id", "weights_sha256")},
        "question_files": {"sha256": sorted(str(item.get("sha256")) for item in manifest.get("question_files") or [])},
        "prompt": manifest.get("prompt"),
    }


def check_comparable(runs: Sequence[Run], force: bool) -> list[str]:
    """Refuse runs whose model id, question files (sha256) or prompt differ from the first run's, and runs
    of the same question files that hold other questions than the first run (whatever ``force`` says).

    Returns the differences found (as "RUN: field, field"), which ``force`` lets through. A run given
    twice (the same directory, also through a link) is refused even with ``force``: it would be compared
    with itself.
    """
    _refuse_same_run(runs)
    base = comparison_view(runs[0].manifest)
    differences = []
    for run in runs[1:]:
        fields = differing_fields(base, comparison_view(run.manifest), COMPARED_FIELDS)
        if fields:
            differences.append(f"{run.path}: {', '.join(fields)}")
    if differences and not force:
        raise PruneAuditError(
            f"runs differ from {runs[0].path} in {'; '.join(differences)}; "
            "refusing to compare them side by side (pass --force to compare anyway)"
        )
    for run in runs[1:]:
        if comparison_view(run.manifest)["question_files"] == base["question_files"]:
            _refuse_other_questions(runs[0], run)
    return differences


def _refuse_other_questions(first: Run, other: Run) -> None:
    """Two runs of the same question files must hold the same questions (a --limit, --split, shard or
    stopped run holds fewer): no --force, since no analysis can pair them and their metrics would
    describe different questions."""
    if set(first.questions.keys()) == set(other.questions.keys()):
        return
    smaller, larger = sorted((first, other), key=lambda run: len(run.questions))
    raise PruneAuditError(
        f"{first.path} holds {_question_set(first)} and {other.path} holds {_question_set(other)}: they do not hold "
        f"the same questions, so they cannot be compared; {_same_questions_fix(smaller, larger)}"
    )


def _question_set(run: Run) -> str:
    """E.g. ``1500 questions (--limit 1500)``, ``9000 questions (no --limit)``, ``18 of its 36 questions (...)``."""
    if _incomplete(run):
        return f"{len(run.questions)} of its {run.manifest['num_questions']} questions (a shard or a stopped run)"
    options = _question_options(run)
    return f"{len(run.questions)} questions ({options or 'no --limit'})"


def _incomplete(run: Run) -> bool:
    return len(run.questions) < run.manifest.get("num_questions", len(run.questions))


def _question_options(run: Run) -> str:
    """The run options that chose its questions among its files: ``--split random --limit 900``, or ''."""
    split, limit = run.manifest.get("split"), run.manifest.get("limit")
    return " ".join(
        [
            *([f"--split {split}"] if split not in (None, "all") else []),
            *([f"--limit {limit}"] if limit is not None else []),
        ]
    )


def _same_questions_fix(smaller: Run, larger: Run) -> str:
    for run in (smaller, larger):
        if _incomplete(run):
            return (
                f"finish {run.path} with the same prune-audit run command (or merge its shards), "
                "then compare runs of the same questions"
            )
    options = _question_options(smaller)
    if options and options != _question_options(larger):
        return f"re-run {larger.path} with {options}, so that both hold the same questions"
    return "compare runs of the same questions (the same --pope files, --split and --limit)"


def _refuse_same_run(runs: Sequence[Run]) -> None:
    seen: dict[Path, Path] = {}
    for run in runs:
        where = run.path.resolve()
        if where in seen:
            given = (
                f"{run.path} is given twice" if run.path == seen[where] else f"{run.path} and {seen[where]} are one run"
            )
            raise PruneAuditError(f"{given}: a run compared with itself shows no difference; pass two different runs")
        seen[where] = run.path


def completeness(runs: Sequence[Run], labels: Sequence[str]) -> list[dict[str, Any]]:
    """Questions done / in the run, per run; an incomplete run (a shard, a run stopped midway)
    gets a warning on stderr, since its numbers cover only the questions it holds."""
    import sys

    entries = []
    for run, label in zip(runs, labels):
        done = int(run.questions.split.size)
        total = run.manifest["num_questions"]
        entries.append({"label": label, "run": str(run.path), "done": done, "total": total, "complete": done >= total})
        if done < total:
            print(
                f"warning: {run.path} is incomplete ({done} of {total} questions: a shard or a run stopped "
                f"midway); its results cover only those questions. Finish it with the same prune-audit run "
                f"command, or merge its shards",
                file=sys.stderr,
            )
    return entries


def unique_labels(runs: Sequence[Run]) -> list[str]:
    """Each run's label, with the directory name added where two runs share a label."""
    labels = [run.label for run in runs]
    return [f"{label} ({run.path.name})" if labels.count(label) > 1 else label for label, run in zip(labels, runs)]
