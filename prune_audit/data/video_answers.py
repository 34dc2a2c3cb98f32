"""Released answers to multiple-choice video questions (MVBench, Video-MME) scored as lmms-eval scores them.

Reference: EvolvingLMMs-Lab/lmms-eval 75571cfe (the commit whose prompts ``tasks.video_mc`` follows), re-implemented
from its rules:

- MVBench (``tasks/mvbench/utils.py``: ``mcq_acc``, ``mvbench_aggregate_results``): the answer text and the
  reference letter are each brought to a normal form, and a question is correct when the two are equal. The normal
  form of a text: its letter when it reads ``"X. ..."`` (X in A-E, either case); else the text with newlines and
  tabs as spaces, stripped, its punctuation ``; / [ ] " { } ( ) = + \\ _ - > < @ ` , ? !`` deleted where the text
  holds it beside a space (or holds a digit-comma-digit) and made a space elsewhere, then periods not before a digit
  deleted (the first 32: lmms-eval passes ``re.UNICODE``, 32, as ``re.sub``'s count), stripped of ``'``, ``"``,
  ``)``, ``(`` and spaces, lower-cased; then its first stand-alone letter A-E (either case, upper-cased), else the
  text itself. So an answer "a dog" reads as letter A, as upstream. Accuracy counts the answered questions only (an
  empty answer text is left out), as lmms-eval's aggregate does.
- Video-MME (``tasks/videomme/utils.py`` ``extract_characters_regex``, i.e. ``tasks/_task_utils/mcq_extract.py``
  ``extract_mcq_answer`` over the letters A-D): the answer's letter is the best-ranked of its candidates, higher
  rank first, then the later position: the text starting with a stand-alone letter (rank 10), ending with one (9),
  a letter after an answer phrase ("the answer is", ... : rank 7), "(X)" (6), "X." (5), "X:" (4), "X)" (3),
  "X " (2), each at its last occurrence in the text stripped of ``, . ! ? ; : ' "`` at its ends and padded with a
  space; without any, the last occurrence of any letter (0); without one, no letter (wrong). Correct: the letter
  equals the answer letter; accuracy over every question.

Answers files are LLaVA's JSON Lines (``question_id`` and ``text``), matched by id, never by order: an MVBench
question's id is its entry's index in its file (the records' ``question_id``), a Video-MME question's its
``question_id`` as the file writes it ("001-1") or the records' integer id (``export --answers``). MVBench files
number their entries alike, so with several files each answer line names its file's stem (the sub-task, the
records' ``split``) in a ``split`` field.

Agreement: both rules were run beside lmms-eval's own functions at 75571cfe (``extract_mcq_answer`` with choices
A-D; ``mcq_acc`` against each letter A-E) on 20,000 seeded random answer texts (letters, punctuation, answer
phrases, digits): no disagreement. lmms-eval is no dependency, so tests/tasks/test_video_answers.py checks hand-worked
cases of each rule instead.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prune_audit.data.answers import ANSWERS_FILE, ANSWERS_FIX, answer_id
from prune_audit.data.files import file_sha256, read_json_lines
from prune_audit.data.video_questions import MVBENCH, VideoChoiceQuestion
from prune_audit.errors import PruneAuditError
from prune_audit.integers import is_digits

MVBENCH_PUNCTUATION = tuple(';/[]"{}()=+\\_-><@`,?!')
"""The marks ``mcq_acc`` deletes or spaces out, in its order."""
_DIGIT_COMMA = re.compile(r"(\d)(,)(\d)")
_PERIOD = re.compile(r"(?!<=\d)(\.)(?!\d)")  # upstream's pattern: its "look-behind" is a look-ahead, never matching
_OPTION = re.compile(r"^([A-E])\.\s*(.+)$", re.IGNORECASE)
_LONE_LETTER = re.compile(r"\b([A-E])\b", re.IGNORECASE)

VIDEOMME_LETTERS = ("A", "B", "C", "D")
ANSWER_PHRASES = (
    "the answer is", "answer is", "the correct answer is", "correct answer is", "the best answer is",
    "best answer is", "the correct option is", "correct option is", "the best option is", "best option is",
    "the choice is", "choice is", "the correct choice is", "correct choice is", "i choose", "i select", "i pick",
    "my answer is", "my choice is", "옵션", "정답은", "답은", "답:", "答案是", "答案为", "选", "答えは",
)  # fmt: skip
"""lmms-eval's answer phrases (``mcq_extract._ANSWER_PHRASES``), matched in the lower-cased text."""
RANKS = {"(X)": 6, "X.": 5, "X:": 4, "X)": 3, "X ": 2}
"""The ranks of a letter's written forms; a phrase's letter ranks 7, a starting letter 10, an ending one 9."""


def mvbench_normal_form(text: str) -> str:
    """The form ``mcq_acc`` compares (module docstring): a letter A-E, or the normalised text."""
    option = _OPTION.match(text.strip())
    if option:
        return option.group(1).upper()
    spaced = text.replace("\n", " ").replace("\t", " ").strip()
    cleaned = spaced
    for mark in MVBENCH_PUNCTUATION:
        beside_space = mark + " " in spaced or " " + mark in spaced or _DIGIT_COMMA.search(spaced) is not None
        cleaned = cleaned.replace(mark, "" if beside_space else " ")
    cleaned = _PERIOD.sub("", cleaned, count=int(re.UNICODE))
    cleaned = cleaned.strip("'").strip('"').strip(")").strip("(").strip().lower()
    letter = _LONE_LETTER.search(cleaned)
    return letter.group(1).upper() if letter else cleaned


def videomme_letter(text: str, letters: Sequence[str] = VIDEOMME_LETTERS) -> str:
    """The letter ``extract_mcq_answer`` reads in ``text`` (module docstring); "" when none."""
    body = text.strip()
    if not body:
        return ""
    for mark in ",.!?;:'\"":
        body = body.strip(mark)
    padded, core = f" {body} ", body.strip()
    found: list[tuple[int, int, str]] = []  # (rank, position, letter)
    for letter in letters:
        for form, rank in RANKS.items():
            written = form.replace("X", letter)
            if written in padded:
                found.append((rank, padded.rfind(written), letter))
        if core.startswith(letter) and (len(core) == 1 or not core[1].isalpha()):
            found.append((10, 0, letter))
        if core.endswith(letter) and (len(core) == 1 or not core[-2].isalpha()):
            found.append((9, len(padded) - 1, letter))
    lowered = padded.lower()
    for phrase in ANSWER_PHRASES:
        start = lowered.find(phrase)
        if start != -1:
            after = start + len(phrase)
            found += [(7, padded.find(letter, after), letter) for letter in letters if letter in padded[after:]]
    if not found:
        found = [(0, padded.rfind(letter), letter) for letter in letters if letter in padded]
    return max(found, key=lambda candidate: candidate[:2])[2] if found else ""


def scored_choice(question: VideoChoiceQuestion, text: str) -> tuple[str, bool, bool]:
    """(the letter or normal form read, correct, counted in the accuracy) of one answer, by the question's layout."""
    if question.layout == MVBENCH:
        parsed = mvbench_normal_form(text)
        return parsed, parsed == mvbench_normal_form(question.answer), text != ""
    parsed = videomme_letter(text)
    return parsed, parsed.lower() == question.answer.lower(), True


@dataclass(frozen=True)
class ChoiceAnswer:
    """One answers-file line: the question id as written, the split it names (None: none), the text, its line."""

    question_id: str
    split: str | None
    text: str
    line: int


def load_choice_answers(path: Path) -> list[ChoiceAnswer]:
    """Every line of a LLaVA answers file, with its optional ``split``; malformed lines name file and line."""
    answers = []
    for number, row in read_json_lines(path, ANSWERS_FILE, ANSWERS_FIX):
        where = f"{path}:{number}"
        if "question_id" not in row:
            raise PruneAuditError(f"{where}: missing question_id; LLaVA answers files name each line's question")
        text, split = row.get("text"), row.get("split")
        if not isinstance(text, str):
            raise PruneAuditError(f"{where}: an answer line needs a string 'text', got {text!r}")
        if split is not None and not isinstance(split, str):
            raise PruneAuditError(f"{where}: 'split' must name the question file's stem, got {split!r}")
        answers.append(ChoiceAnswer(answer_id(row["question_id"], where), split, text, number))
    if not answers:
        raise PruneAuditError(f"{path}: no answers")
    if len({answer.split is None for answer in answers}) > 1:
        raise PruneAuditError(f"{path}: some answer lines name a split and some do not; name it on every line or none")
    return answers


def _plain(key: str) -> str:
    """An id as matched: a whole number without its leading zeros, anything else as written."""
    return str(int(key)) if is_digits(key) else key


def _question_keys(questions: Sequence[VideoChoiceQuestion], by_split: bool) -> dict[tuple[str | None, str], int]:
    """Each question's position by (split or None, id): its record id and, for Video-MME, its file's id too."""
    keys: dict[tuple[str | None, str], int] = {}
    for index, question in enumerate(questions):
        for name in {str(question.question_id), *([question.key] if question.key is not None else [])}:
            key = (question.split if by_split else None, _plain(name))
            if keys.setdefault(key, index) != index:
                raise PruneAuditError(
                    f"question id {name} names several questions of the question files (MVBench numbers each file "
                    "from 0); give every answer line a 'split' (its file's stem) or score one file at a time"
                )
    return keys


def match_choice_answers(questions: Sequence[VideoChoiceQuestion], path: Path) -> list[str]:
    """The answer text of every question, in question order; an unknown, repeated or missing answer refused."""
    answers = load_choice_answers(path)
    by_split = answers[0].split is not None
    keys = _question_keys(questions, by_split)
    texts: dict[int, ChoiceAnswer] = {}
    for answer in answers:
        index = keys.get((answer.split, _plain(answer.question_id)))
        if index is None:
            named = f"{answer.split}/{answer.question_id}" if by_split else answer.question_id
            raise PruneAuditError(
                f"{path}:{answer.line}: answer for question {named}, which is not among the questions; pass the "
                "question files the answers were made from"
            )
        if index in texts:
            raise PruneAuditError(f"{path}:{answer.line}: a second answer to the question of line {texts[index].line}")
        texts[index] = answer
    missing = [question for index, question in enumerate(questions) if index not in texts]
    if missing:
        first = missing[0]
        raise PruneAuditError(
            f"{path}: {len(missing)} questions have no answer (first: {first.split}/{first.key or first.question_id}); "
            "answer every question or pass only the question files answered"
        )
    return [texts[index].text for index in range(len(questions))]


def _accuracy(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    counted = [row for row in rows if row["counted"]]
    correct = sum(row["correct"] for row in counted)
    return {"n": len(rows), "answered": len(counted), "correct": correct,
            "accuracy": correct / len(counted) if counted else math.nan}  # fmt: skip


def score_video_choice_answers(
    answers: Path, question_files: Sequence[Path], questions: Sequence[VideoChoiceQuestion]
) -> dict[str, Any]:
    """Score a LLaVA answers file against MVBench / Video-MME questions as lmms-eval does (module docstring).

    Returns ``answers`` and ``question_files`` (path and sha256), ``n``, ``answered`` (the questions counted:
    MVBench leaves out empty answers), ``correct``, ``accuracy``, ``splits`` (the same per split: MVBench's
    sub-task, Video-MME's duration) and ``per_question`` (split, question_id, prediction, parsed, reference,
    correct) in question order.
    """
    rows = []
    for question, text in zip(questions, match_choice_answers(questions, answers), strict=True):
        parsed, correct, counted = scored_choice(question, text)
        rows.append(
            {"split": question.split, "question_id": question.key or question.question_id, "prediction": text,
             "parsed": parsed, "reference": question.answer, "correct": correct, "counted": counted}
        )  # fmt: skip
    splits = {split: _accuracy([row for row in rows if row["split"] == split]) for split in dict.fromkeys(
        row["split"] for row in rows)}  # fmt: skip
    return {
        "answers": {"path": str(answers), "sha256": file_sha256(answers)},
        "question_files": [{"path": str(path), "sha256": file_sha256(path)} for path in question_files],
        "matched_by": "id",
        **_accuracy(rows),
        "splits": splits,
        "per_question": rows,
    }


__all__ = ["mvbench_normal_form", "score_video_choice_answers", "videomme_letter"]
