"""ScienceQA-IMG multiple choice: the first token over the offered option letters.

Question files (``--questions``): LLaVA's ``llava_test_CQM-A.json`` layout (``data.scienceqa``),
the IMG subset (questions with an image). The prompt is LLaVA's (``model_vqa_science.py
--single-pred-prompt``): context, question, one ``X. choice`` line per option, then "Answer with
the option's letter from the given choices directly." The answer is the offered letter whose
single-token spellings (case and word-start variants summed, as POPE's yes/no) have the highest
first-token probability; confidence is that letter's probability renormalised over the offered
letters. (Released free-text answers are parsed by LLaVA's ``eval_science_qa.py`` rule,
``data.scienceqa.parse_letter``; a first-token answer needs no parsing.) A run answers the IMG
subset only, so its answers (``prune-audit export RUN --answers FILE.jsonl``) are scored with
``prune-audit score --task scienceqa FILE.jsonl --questions llava_test_CQM-A.json --subset img``.

Every question has its own image, so each question is its own exchangeable unit: its
``image_id`` is its question id (bootstrap resamples and conformal splits draw questions).
ScienceQA names no image regions, so the task has no evidence (no ``--annotations``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import pyarrow as pa

from prune_audit.answer_modes import OptionLetters
from prune_audit.data.scienceqa import ScienceQaQuestion, load_scienceqa_files
from prune_audit.errors import PruneAuditError
from prune_audit.record_columns import column
from prune_audit.tasks.base import CONFIDENCE_METRICS, Scored, Task
from prune_audit.tasks.prompts import OPTION_LETTER
from prune_audit.tasks.registry import register_task

if TYPE_CHECKING:
    from prune_audit.answer_modes import LetterChoice
    from prune_audit.data.lmms_parquet import ParquetQuestions

SPLIT = "scienceqa"
"""The records' ``split`` of every ScienceQA question: its problem ids are unique."""


@dataclass(frozen=True)
class ScienceQaTaskQuestion:
    """A ScienceQA-IMG question keyed as a record: (``split`` = "scienceqa", integer ``question_id``)."""

    sqa: ScienceQaQuestion
    question_id: int

    @property
    def split(self) -> str:
        return SPLIT

    @property
    def image(self) -> str:
        return str(self.sqa.image)

    @property
    def text(self) -> str:
        return self.sqa.text


def _record_id(question: ScienceQaQuestion) -> int:
    """ScienceQA's problem id as the records' int64 key."""
    key = question.question_id
    if not (key.isascii() and key.isdigit()) or str(int(key)) != key or int(key) >= 2**63:
        raise PruneAuditError(
            f"ScienceQA id {key!r} is not a plain number below 2**63; records key questions by an int64 id: fix the "
            f"question file"
        )
    return int(key)


@register_task
class ScienceQaTask(Task):
    name = "scienceqa"
    summary = "ScienceQA-IMG multiple choice (LLaVA's prompt), answered by its option letter"
    answer_mode_text = "the first token over the offered option letters"
    confidence_definition = "the chosen letter's first-token probability renormalised over the offered letters"
    correct_definition = "the chosen letter equals the answer letter"
    instruction = OPTION_LETTER  # model_vqa_science.py --single-pred-prompt; lmms-eval's scienceqa_img post_prompt
    evidence_definition = "none: ScienceQA names no image regions (no retention or lost objects)"
    evidence_noun = "the evidence regions (none for scienceqa)"
    names_evidence = False
    report_metrics = (
        "accuracy",
        "loyalty",
        *CONFIDENCE_METRICS,
    )
    answer_subsets = {"img": "the questions with an image (LLaVA's IMG-Accuracy; the questions `run` answers)"}

    def read_questions(self, paths: Sequence[Path]) -> list[ScienceQaTaskQuestion]:
        return [
            ScienceQaTaskQuestion(question, _record_id(question))
            for question in load_scienceqa_files(paths, images_only=True)
        ]

    parquet_layout = "lmms-lab/ScienceQA (ScienceQA-IMG rows: those with an image)"
    record_columns = (
        column(
            "letter_probs",
            pa.list_(pa.float64()),
            "first-token probability of each offered option letter over "
            "the full vocabulary, spellings summed, in letter order",
        ),
        column("options_offered", pa.int64(), "number of options the question offers (2 to 5)"),
    )

    def read_parquet(self, paths: Sequence[Path]) -> ParquetQuestions[ScienceQaTaskQuestion]:
        """Question ids are row numbers over the files in the order given (the layout has no problem id)."""
        from prune_audit.data.lmms_parquet import ParquetQuestions, read_scienceqa_parquet

        loaded = read_scienceqa_parquet(paths, images_only=True)
        return ParquetQuestions([ScienceQaTaskQuestion(q, _record_id(q)) for q in loaded.questions], loaded.images)

    def check_questions(self, questions: Sequence[ScienceQaTaskQuestion]) -> None:
        unanswered = [q for q in questions if q.sqa.answer is None]
        if unanswered:
            raise PruneAuditError(
                f"{len(unanswered)} ScienceQA questions have no answer turn (first: id {unanswered[0].sqa.question_id}); "
                f"pass a question file with the answers (LLaVA's llava_test_CQM-A.json)"
            )

    def answer_mode(self, question: ScienceQaTaskQuestion) -> OptionLetters:
        return OptionLetters(question.sqa.letters)

    def score(self, question: ScienceQaTaskQuestion, choice: LetterChoice) -> Scored:
        reference = str(question.sqa.answer)
        columns: dict[str, Any] = {
            "letter_probs": list(choice.letter_probs),
            "options_offered": len(question.sqa.options),
        }
        return Scored(choice.answer, (reference,), choice.answer == reference, choice.confidence, columns)

    def score_answers(self, answers: Path, question_files: Sequence[Path], subset: str | None = None) -> dict[str, Any]:
        """LLaVA's eval_science_qa.py over every question of the files (its accuracy) and the IMG subset (``img``),
        free-text answers parsed by its letter rule (``data.scienceqa.score_scienceqa_answers``); ``subset`` "img"
        scores the questions with an image alone (the ones ``run`` answers)."""
        from prune_audit.data.scienceqa import score_scienceqa_answers

        if self.parquet_inputs(question_files):
            # matching by row order would score every answer against the wrong question once a file is filtered
            # or reordered, and LLaVA's answers carry problem ids, which lmms-lab/ScienceQA's rows lack
            raise PruneAuditError(
                "lmms-lab/ScienceQA Parquet rows have no problem id to match the answers' "
                "question_id; pass LLaVA's llava_test_CQM-A.json with --questions"
            )
        images_only = subset == "img"
        report = score_scienceqa_answers(answers, load_scienceqa_files(question_files, images_only=images_only))
        return report if subset is None else {"subset": subset, **report}

    def image_id(self, question: ScienceQaTaskQuestion) -> int:
        return question.question_id

    def load_evidence(self, path: Path, questions: Sequence[ScienceQaTaskQuestion]) -> NoReturn:
        raise PruneAuditError(
            "ScienceQA names no image regions, so scienceqa runs have no evidence: drop --annotations"
        )


__all__ = ["ScienceQaTask", "ScienceQaTaskQuestion"]
