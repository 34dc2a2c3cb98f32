"""ScienceQA questions in LLaVA's format, LLaVA's answer-letter rule and scoring.

``llava_test_CQM-A.json`` (haotian-liu/LLaVA, ``playground/data/eval/scienceqa``) is one JSON list
of ``{id, image?, conversations: [{from: human, value}, {from: gpt, value: letter}]}``; the human
value is ``<image>\\n`` (with an image), ``Context: <hint>\\n`` (when ScienceQA has a hint), the
question, then one ``X. choice`` line per option (A, B, ...), as lmms-eval's ``sqa_doc_to_text``
also builds it. Entries with ``image`` are the IMG subset (2,017 of the 4,241 test questions).
The question text is the human value without ``<image>``, stripped (``model_vqa_science.py``); the
scienceqa task adds :data:`INSTRUCTION` on its own line (its ``--single-pred-prompt``; ``tasks.prompts``).

Answer parsing re-implements LLaVA's ``llava/eval/eval_science_qa.py`` (commit c121f04) exactly:
the text is a letter of A-E; or starts with ``X. `` (X in A-E); or contains exactly one match of
``The answer is ([A-Z]).`` (any capital, any following character); otherwise ``FAILED``. A parsed
letter the question does not offer, and ``FAILED``, score as wrong (``get_pred_idx`` -> -1).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prune_audit.data.answers import answer_id, load_llava_answers, match_answers
from prune_audit.data.coco import read_json
from prune_audit.data.files import file_sha256
from prune_audit.data.question_ids import QuestionPlace, QuestionPlaces, note_question
from prune_audit.errors import PruneAuditError
from prune_audit.safety.inputs import check_image_name

INSTRUCTION = "Answer with the option's letter from the given choices directly."
LETTERS = ("A", "B", "C", "D", "E")
"""``eval_science_qa.py``'s ``--options``: ScienceQA offers 2 to 5 choices."""
FAILED = "FAILED"
IMAGE_TAG = "<image>"
CONTEXT_PREFIX = "Context: "
_OPTION_LINE = re.compile(r"^(?P<letter>[A-Z])\. (?P<choice>.*)$")
_THE_ANSWER_IS = re.compile(r"The answer is ([A-Z]).")


@dataclass(frozen=True)
class ScienceQaQuestion:
    """One ScienceQA question.

    Attributes:
        question_id: ScienceQA's problem id (``id``, e.g. "5").
        image: image path relative to the images folder (``5/image.png``), None without one.
        text: the prompt without the instruction: the human value, ``<image>`` removed, stripped.
        question: the question (with a context, the line before the options; else all of the
            text before them).
        context: the hint after ``Context: ``, None without one.
        options: the choices in letter order (2 to 5).
        answer: the reference letter, None when the file has none.
    """

    question_id: str
    image: str | None
    text: str
    question: str
    context: str | None
    options: tuple[str, ...]
    answer: str | None

    @property
    def letters(self) -> tuple[str, ...]:
        """The offered letters, ``("A", "B", ...)``."""
        return LETTERS[: len(self.options)]


def parse_prompt(value: str, where: str) -> tuple[str, str, str | None, tuple[str, ...]]:
    """(text, question, context, options) of a human value.

    The options are the block from the last line starting ``A. `` to the end, each ``X. `` line
    starting the next letter in order; other lines continue the option above (a choice may span
    lines: "A. See you soon,\\nJanet").
    """
    text = value.replace(IMAGE_TAG, "").strip()
    lines = text.split("\n")
    starts = [index for index, line in enumerate(lines) if _OPTION_LINE.match(line)]
    first_a = max((index for index in starts if lines[index].startswith("A. ")), default=None)
    block = [] if first_a is None else [index for index in starts if index >= first_a]
    letters = [lines[index][0] for index in block]
    if letters != list(LETTERS[: len(letters)]) or len(letters) < 2:
        found = ", ".join(letters) or "none"
        raise PruneAuditError(
            f"{where}: options must be 2 to 5 lines 'A. ...', 'B. ...' in order at the end of the question, "
            f"found letters {found}; fix the entry"
        )
    body = lines[: block[0]]
    if not "\n".join(body).strip():
        raise PruneAuditError(f"{where}: no question before the options; fix the entry")
    ends = [*block[1:], len(lines)]
    options = tuple("\n".join(lines[start:end])[3:] for start, end in zip(block, ends))
    if body[0].startswith(CONTEXT_PREFIX) and len(body) > 1:
        context = "\n".join(body[:-1])[len(CONTEXT_PREFIX) :]
        return text, body[-1], context, options
    return text, "\n".join(body), None, options


def _entry(entry: Any, where: str) -> ScienceQaQuestion:
    if not isinstance(entry, dict):
        raise PruneAuditError(f"{where} is a JSON {type(entry).__name__}, not an object")
    if "id" not in entry:
        raise PruneAuditError(f"{where}: missing id")
    question_id = answer_id(entry["id"], where)
    where = f"{where} (id {question_id})"
    turns = entry.get("conversations")
    if not isinstance(turns, list) or not turns or not all(isinstance(t, dict) for t in turns):
        raise PruneAuditError(f"{where}: conversations must be a list of {{from, value}} turns")
    human, gpt = turns[0], turns[1] if len(turns) > 1 else None
    if human.get("from") != "human" or not isinstance(human.get("value"), str):
        raise PruneAuditError(f"{where}: the first turn must be from 'human' with a text value")
    text, question, context, options = parse_prompt(human["value"], where)
    answer = None
    if gpt is not None:
        answer = gpt.get("value")
        if gpt.get("from") != "gpt" or answer not in LETTERS[: len(options)]:
            raise PruneAuditError(
                f"{where}: the answer turn must be from 'gpt' with one of the offered letters "
                f"{', '.join(LETTERS[: len(options)])}, got {answer!r}"
            )
    image = entry.get("image")
    if image is not None:
        image = check_image_name(image, where)
    if (image is None) != (IMAGE_TAG not in human["value"]):
        raise PruneAuditError(
            f"{where}: an entry has an image exactly when its question has {IMAGE_TAG}; fix the entry"
        )
    return ScienceQaQuestion(question_id, image, text, question, context, options, answer)


def load_scienceqa(path: str | Path, images_only: bool = True) -> list[ScienceQaQuestion]:
    """LLaVA's ScienceQA question file; ``images_only`` keeps the IMG subset (entries with ``image``).

    Raises:
        PruneAuditError: not a JSON list, an entry without id or conversations, options that are
            not A, B, ... lines, an answer letter not offered, an image outside the images folder,
            ``<image>`` without ``image`` (or the reverse), a repeated id; naming file, entry and id.
    """
    return load_scienceqa_files([path], images_only)


def load_scienceqa_files(paths: Sequence[str | Path], images_only: bool = True) -> list[ScienceQaQuestion]:
    """The questions of several ScienceQA files in the order given, each read as :func:`load_scienceqa` does; an
    id may appear once over all of them (the same file passed twice would score each answer twice)."""
    questions: list[ScienceQaQuestion] = []
    seen: QuestionPlaces = {}
    for path in map(Path, paths):
        data = read_json(path)
        if not isinstance(data, list):
            raise PruneAuditError(f"{path}: expected LLaVA's ScienceQA file, a JSON list of questions")
        found = []
        for index, entry in enumerate(data):
            question = _entry(entry, f"{path}: entry {index}")
            note_question(question.question_id, QuestionPlace(path, "entry", index, f"id {question.question_id}"), seen)
            if question.image is not None or not images_only:
                found.append(question)
        if not found:
            raise PruneAuditError(f"{path}: no questions{' with an image' if images_only else ''}")
        questions += found
    return questions


def parse_letter(text: str) -> str:
    """The answer letter in a model's text by LLaVA's ``eval_science_qa.py`` rule, or ``FAILED``."""
    if text in LETTERS:
        return text
    if len(text) >= 3 and text[0] in LETTERS and text[1:3] == ". ":
        return text[0]
    found = _THE_ANSWER_IS.findall(text)
    return found[0] if len(found) == 1 else FAILED


def is_correct(text: str, question: ScienceQaQuestion) -> bool:
    """The parsed letter is offered by the question and is its answer."""
    letter = parse_letter(text)
    return letter in question.letters and letter == question.answer


def score_scienceqa_answers(answers: str | Path, questions: Sequence[ScienceQaQuestion]) -> dict[str, Any]:
    """Score a LLaVA answers file against ScienceQA questions, as ``eval_science_qa.py`` does.

    Returns ``answers`` (path, sha256), ``n``, ``correct``, ``accuracy``, ``img`` (n, correct,
    accuracy over the questions with an image: LLaVA's "IMG-Accuracy") and ``per_question``
    (question_id, prediction, parsed, reference, correct) in question order.
    """
    unanswerable = [question.question_id for question in questions if question.answer is None]
    if unanswerable:
        raise PruneAuditError(
            f"{len(unanswerable)} questions have no reference answer (first: {unanswerable[0]}); "
            f"pass a question file with the answer turns"
        )
    texts = match_answers([q.question_id for q in questions], load_llava_answers(answers), answers)
    rows = [
        {
            "question_id": q.question_id,
            "prediction": text,
            "parsed": parse_letter(text),
            "reference": q.answer,
            "correct": is_correct(text, q),
        }
        for q, text in zip(questions, texts, strict=True)
    ]
    with_image = [row for row, q in zip(rows, questions) if q.image is not None]
    return {
        "answers": {"path": str(answers), "sha256": file_sha256(answers)},
        **_accuracy(rows),
        "img": _accuracy(with_image),
        "per_question": rows,
    }


def _accuracy(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    correct = sum(row["correct"] for row in rows)
    return {"n": len(rows), "correct": correct, "accuracy": correct / len(rows) if rows else math.nan}
