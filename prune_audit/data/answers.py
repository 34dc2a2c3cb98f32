"""LLaVA answers files: one JSON object a line with ``question_id`` and the model's ``text``.

LLaVA's evaluation scripts (``model_vqa_loader.py``, ``model_vqa_science.py``) write this format
for GQA, ScienceQA and captions alike; ids are the question file's, as a string or an integer.
Answers are matched to questions by id, never by order: an unknown, repeated or missing id is an
error naming the file and line, so a published answers file is never silently misaligned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from prune_audit.data.files import read_json_lines
from prune_audit.errors import PruneAuditError
from prune_audit.integers import is_digits

ANSWERS_FILE = "answers file"
ANSWERS_FIX = "pass the answers file (JSON Lines, one answer a line)"
"""How a refused answers path is named and what to do instead (``safety.inputs``)."""


@dataclass(frozen=True)
class LlavaAnswer:
    """One answers-file line: the question id (as a string), the answer text and its line number."""

    question_id: str
    text: str
    line: int


def answer_id(value: object, where: str) -> str:
    """A question id from an answers or question file as a string: a string, or a non-negative integer."""
    if isinstance(value, bool) or not isinstance(value, (str, int)) or (isinstance(value, int) and value < 0):
        raise PruneAuditError(f"{where}: question_id must be a string or a non-negative integer, got {value!r}")
    text = str(value)
    if not text.strip():
        raise PruneAuditError(f"{where}: question_id is empty; give every line its question's id")
    return text


def load_llava_answers(path: str | Path) -> dict[str, LlavaAnswer]:
    """Answers by question id; a line without a string ``text``, or a repeated id, names file and line."""
    answers: dict[str, LlavaAnswer] = {}
    for number, row in read_json_lines(path, ANSWERS_FILE, ANSWERS_FIX):
        where = f"{path}:{number}"
        if "question_id" not in row:
            raise PruneAuditError(f"{where}: missing question_id; LLaVA answers files name each line's question")
        text = row.get("text")
        if not isinstance(text, str):
            raise PruneAuditError(f"{where}: an answer line needs a string 'text', got {text!r}")
        key = answer_id(row["question_id"], where)
        if key in answers:
            raise PruneAuditError(f"{where}: question_id {key} repeats line {answers[key].line}; keep one answer each")
        answers[key] = LlavaAnswer(question_id=key, text=text, line=number)
    if not answers:
        raise PruneAuditError(f"{path}: no answers")
    return answers


def match_answers(question_ids: Sequence[str], answers: dict[str, LlavaAnswer], path: str | Path) -> list[str]:
    """The answer text of every question, in question order; ids match as written or as whole numbers.

    Raises:
        PruneAuditError: an answer for an id the questions lack (naming its line), or questions
            without an answer (their count and the first id).
    """
    by_number = {int(key): key for key in answers if is_digits(key)}
    texts, used = [], set()
    missing = []
    for question_id in question_ids:
        key = (
            question_id
            if question_id in answers
            else by_number.get(int(question_id))
            if is_digits(question_id)
            else None
        )
        if key is None:
            missing.append(question_id)
            continue
        used.add(key)
        texts.append(answers[key].text)
    unknown = [answer for key, answer in answers.items() if key not in used]
    if unknown:
        first = min(unknown, key=lambda answer: answer.line)
        raise PruneAuditError(
            f"{path}:{first.line}: answer for question {first.question_id}, which is not among the questions "
            f"({len(unknown)} such answers); pass the question file the answers were made from"
        )
    if missing:
        raise PruneAuditError(
            f"{path}: {len(missing)} questions have no answer (first: {missing[0]}); "
            f"answer every question or pass only the questions answered"
        )
    return texts
