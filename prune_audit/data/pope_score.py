"""Scoring POPE answer files: load answers, match them to questions, metrics per split.

Answer files are JSON Lines in POPE's format (``answer``, matched by order as in
``evaluate.py``) or LLaVA's (``question_id``, ``text``, matched by id). A split or
category field on the answers makes ids unambiguous across split files. A count or id
mismatch is an error, never a silent misalignment.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prune_audit.data.answers import ANSWERS_FILE, ANSWERS_FIX
from prune_audit.data.files import file_sha256, read_json_lines
from prune_audit.data.pope import (
    PopeQuestion,
    attach_labels,
    load_pope,
    parse_answer,
    pope_metrics,
)
from prune_audit.data.question_ids import QuestionPlaces, note_question
from prune_audit.errors import PruneAuditError

AVERAGED = ("accuracy", "precision", "recall", "f1", "yes_ratio")
COUNTS = ("n", "tp", "fp", "tn", "fn")


@dataclass(frozen=True)
class PopeAnswer:
    """One model answer: its raw text and, where the file has them, question id and split."""

    text: str
    question_id: int | None = None
    split: str | None = None


def load_answers(path: str | Path) -> list[PopeAnswer]:
    """Read an answers file; each line needs ``answer`` (POPE) or ``text`` (LLaVA)."""
    answers = []
    for number, row in read_json_lines(path, ANSWERS_FILE, ANSWERS_FIX):
        text = row.get("answer", row.get("text"))
        if not isinstance(text, str):
            raise PruneAuditError(f"{path}:{number}: an answer line needs a string 'answer' or 'text'")
        question_id = row.get("question_id")
        if question_id is not None and (isinstance(question_id, bool) or not isinstance(question_id, int)):
            raise PruneAuditError(f"{path}:{number}: question_id must be an integer, got {question_id!r}")
        split = row.get("split", row.get("category"))
        answers.append(PopeAnswer(text=text, question_id=question_id, split=None if split is None else str(split)))
    if not answers:
        raise PruneAuditError(f"{path}: no answers")
    return answers


def match_answers(questions: Sequence[PopeQuestion], answers: Sequence[PopeAnswer]) -> tuple[list[str], str]:
    """Answer text for every question, and how they were matched ("id" or "order")."""
    with_ids = sum(answer.question_id is not None for answer in answers)
    if with_ids == 0:
        if len(answers) != len(questions):
            raise PruneAuditError(f"{len(answers)} answers for {len(questions)} questions (matched by order)")
        return [answer.text for answer in answers], "order"
    if with_ids != len(answers):
        raise PruneAuditError("some answers have a question_id and some do not")
    use_split = all(answer.split is not None for answer in answers)
    keys = [(q.split, q.question_id) if use_split else q.question_id for q in questions]
    if len(set(keys)) != len(keys):
        raise PruneAuditError(
            "question ids repeat across the given question files; give answers a split/category field, "
            "pass LLaVA's merged question file with the label files, or score one split at a time"
        )
    texts: dict[Any, str] = {}
    wanted = set(keys)
    for answer in answers:
        key = (answer.split, answer.question_id) if use_split else answer.question_id
        if key not in wanted:
            raise PruneAuditError(
                f"answer for unknown question {key} (LLaVA answers: add llava_pope_test.jsonl to the question files)"
            )
        if key in texts:
            raise PruneAuditError(f"two answers for question {key}")
        texts[key] = answer.text
    if len(texts) != len(keys):
        missing = next(key for key in keys if key not in texts)
        raise PruneAuditError(f"{len(keys) - len(texts)} questions have no answer (first: {missing})")
    return [texts[key] for key in keys], "id"


def score_by_split(questions: Sequence[PopeQuestion], answer_texts: Sequence[str]) -> dict[str, dict[str, Any]]:
    """POPE metrics per split (in order of first appearance), plus ``average`` over splits when several.

    The average is the unweighted mean of each split's ratios, as papers report it; its
    counts are summed.
    """
    if any(question.label is None for question in questions):
        raise PruneAuditError("questions without labels cannot be scored (pass the label files)")
    splits: dict[str, tuple[list[str], list[str]]] = {}
    for question, text in zip(questions, answer_texts, strict=True):
        labels, predictions = splits.setdefault(question.split, ([], []))
        labels.append(question.label)  # type: ignore[arg-type]
        predictions.append(parse_answer(text))
    results = {split: pope_metrics(labels, predictions) for split, (labels, predictions) in splits.items()}
    if len(results) > 1:
        average: dict[str, Any] = {key: sum(r[key] for r in results.values()) for key in COUNTS}
        for key in AVERAGED:
            values = [r[key] for r in results.values()]
            average[key] = math.nan if any(math.isnan(v) for v in values) else sum(values) / len(values)
        results["average"] = average
    return results


def load_scored_questions(files: Sequence[str | Path]) -> list[PopeQuestion]:
    """Questions with labels: the label files themselves, or LLaVA's merged file labelled from them. A question may
    appear once among the label files and once among the unlabelled ones (``note_question``)."""
    labelled: list[PopeQuestion] = []
    unlabelled: list[PopeQuestion] = []
    places: dict[bool, QuestionPlaces] = {True: {}, False: {}}
    for path in files:
        own: QuestionPlaces = {}
        questions = load_pope(path, seen=own)
        missing = {question.label is None for question in questions}
        if missing == {True, False}:
            raise PruneAuditError(f"{path}: some questions have labels and some do not; label all or none")
        for key, place in own.items():
            note_question(key, place, places[True in missing])
        (unlabelled if True in missing else labelled).extend(questions)
    return attach_labels(unlabelled, labelled) if unlabelled else labelled


def score_files(
    answers: str | Path, question_files: Sequence[str | Path], questions: Sequence[PopeQuestion] | None = None
) -> dict[str, Any]:
    """Score an answers file against POPE question files, as POPE's ``evaluate.py`` does.

    ``questions``: the files' questions when already read (lmms-lab/POPE Parquet files); by default the files
    are POPE's or LLaVA's (``load_scored_questions``). Returns ``answers`` and ``question_files`` (path and
    sha256 of each input), ``matched_by`` ("order" or "id") and ``splits`` (:func:`score_by_split`).
    """
    questions = load_scored_questions(question_files) if questions is None else questions
    texts, matched_by = match_answers(questions, load_answers(answers))
    return {
        "answers": {"path": str(answers), "sha256": file_sha256(answers)},
        "question_files": [{"path": str(path), "sha256": file_sha256(path)} for path in question_files],
        "matched_by": matched_by,
        "splits": score_by_split(questions, texts),
    }
