"""POPE: "Is there a <object> in the image?" answered by the first token's yes/no probabilities.

Question files as ``data.pope.load_pope`` reads them (the official splits, LLaVA's merged file
with label files); scoring, confidence and evidence exactly as prune-audit reported them before
tasks were a seam (evaluation spec A and E), so POPE numbers do not depend on the seam.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from prune_audit.answer_modes import YES_NO
from prune_audit.data.pope import LABELS, POPE_SPLITS, PopeQuestion, load_pope
from prune_audit.data.question_ids import QuestionPlaces
from prune_audit.errors import PruneAuditError
from prune_audit.record_columns import column
from prune_audit.tasks.base import CONFIDENCE_METRICS, Scored, Task
from prune_audit.tasks.evidence import CocoEvidence
from prune_audit.tasks.prompts import SHORT_ANSWER
from prune_audit.tasks.registry import register_task

if TYPE_CHECKING:
    from prune_audit.answer_modes import AnswerMode, YesNo
    from prune_audit.data.geometry import TokenGeometry
    from prune_audit.data.lmms_parquet import ParquetQuestions
    from prune_audit.data.retention import ObjectArea


class PopeEvidence(CocoEvidence):
    """The queried object's COCO mask, for "yes" questions only (a "no" object is absent)."""

    def area(self, question: PopeQuestion, image_id: int, geometry: TokenGeometry) -> ObjectArea | None:
        if question.label != "yes":
            return None
        return self.category_area(image_id, question.object, geometry)

    def objects(self, question: PopeQuestion, image_id: int, geometry: TokenGeometry) -> list[tuple[str, ObjectArea]]:
        area = self.area(question, image_id, geometry)
        return [] if area is None else [(question.object, area)]


def yes_no_scored(asked: str, label: str, reduced: YesNo) -> Scored:
    """A yes/no answer scored as POPE scores it: correct when it equals ``label``; its columns the asked object, the
    label and the yes/no probabilities (``YesNo``)."""
    columns: dict[str, Any] = {
        "object": asked,
        "label": label,
        "answer": reduced.answer,
        "p_yes": reduced.p_yes,
        "p_no": reduced.p_no,
        "p_yes_2way": reduced.p_yes_2way,
        "logit_diff": reduced.logit_diff,
    }
    return Scored(reduced.answer, (label,), reduced.answer == label, reduced.confidence, columns)


@register_task
class PopeTask(Task):
    name = "pope"
    summary = "POPE yes/no object questions (Is there a <object> in the image?)"
    answer_mode_text = "the first token: yes/no probabilities, every single-token spelling summed"
    confidence_definition = (
        "max(p_yes_2way, 1 - p_yes_2way), p_yes_2way = sigmoid(logit_diff): the two-way probability of the answer given"
    )
    correct_definition = "the answer (yes/no) equals the label"
    evidence_definition = "the queried object's COCO instance mask (yes questions; none for no questions)"
    evidence_noun = "the yes questions' objects"
    evidence_label = "queried object"
    evidence_fate = "'yes' questions by the fate of the queried object"
    evidence_questions = "yes-questions"
    # as LLaVA's llava_pope_test.jsonl and lmms-eval's pope post_prompt ask; the official POPE files carry none
    instruction = SHORT_ANSWER
    splits = POPE_SPLITS
    report_metrics = (
        "accuracy",
        "loyalty",
        "precision",
        "recall",
        "f1",
        "yes_ratio",
        *CONFIDENCE_METRICS,
    )

    def read_questions(self, paths: Sequence[Path]) -> list[PopeQuestion]:
        seen: QuestionPlaces = {}  # a question id may appear once over all the files
        return [question for path in paths for question in load_pope(path, seen=seen)]

    parquet_layout = "lmms-lab/POPE"
    record_columns = (
        column("object", pa.string(), "queried object parsed from the question"),
        column("label", pa.string(), 'ground truth "yes" / "no"'),
        column("answer", pa.string(), 'model\'s prediction "yes" / "no" (argmax of the two-way probabilities)'),
        column(
            "p_yes", pa.float64(), "first-token probability of yes over the full vocabulary, case/space variants summed"
        ),
        column("p_no", pa.float64(), "first-token probability of no, likewise"),
        column("p_yes_2way", pa.float64(), "p_yes / (p_yes + p_no)"),
        column("logit_diff", pa.float64(), "log p_yes - log p_no (the two-way logit d; p_yes_2way = sigmoid(d))"),
    )

    def read_parquet(self, paths: Sequence[Path]) -> ParquetQuestions[PopeQuestion]:
        from prune_audit.data.lmms_parquet import read_pope_parquet

        return read_pope_parquet(paths)

    def check_questions(self, questions: Sequence[PopeQuestion]) -> None:
        unlabelled = [q for q in questions if q.label is None]
        if unlabelled:
            raise PruneAuditError(f"{len(unlabelled)} questions have no label; pass the POPE label files with --pope")

    def answer_mode(self, question: PopeQuestion) -> AnswerMode:
        return YES_NO

    def score(self, question: PopeQuestion, reduced: YesNo) -> Scored:
        return yes_no_scored(question.object, str(question.label), reduced)

    def score_answers(self, answers: Path, question_files: Sequence[Path], subset: str | None = None) -> dict[str, Any]:
        """POPE's evaluate.py per split and averaged (``prune-audit pope score``'s report); lmms-lab/POPE Parquet
        files are read without their images."""
        from prune_audit.data.pope_score import score_files

        if self.parquet_inputs(question_files):
            from prune_audit.data.lmms_parquet import read_pope_parquet

            questions = read_pope_parquet(question_files, images=False).questions
            return score_files(answers, list(question_files), questions)
        return score_files(answers, list(question_files))

    def image_id(self, question: PopeQuestion) -> int | None:
        return question.image_id

    def load_evidence(self, path: Path, questions: Sequence[PopeQuestion]) -> PopeEvidence:
        from prune_audit.data.coco import CocoInstances

        coco = CocoInstances.load(path)
        for question in questions:
            try:
                coco.category_id(question.object)
            except (KeyError, PruneAuditError):
                raise PruneAuditError(
                    f"question {question.split}/{question.question_id} asks about {question.object!r}, "
                    f"which is no category of {path}; pass the matching --annotations file"
                ) from None
        return PopeEvidence(coco)

    required_columns = ("label", "answer", "p_yes_2way", "logit_diff")

    def binary_view(self, records: pa.Table, source: str) -> dict[str, Any]:
        """The yes/no event itself: label and answer "yes", two-way p(yes) and its logit; answers compared as
        yes/no."""
        label, answer = (records[name].to_numpy(zero_copy_only=False).astype(str) for name in ("label", "answer"))
        for name, values in (("label", label), ("answer", answer)):
            unexpected = sorted(set(values.tolist()) - set(LABELS))
            if unexpected:
                raise PruneAuditError(
                    f"records of {source}: column {name!r} holds {unexpected[0]!r}, expected yes or no"
                )
        return {
            "label_yes": label == "yes",
            "answer_yes": answer == "yes",
            "p_yes": records["p_yes_2way"].to_numpy().astype(np.float64),
            "logit_diff": records["logit_diff"].to_numpy().astype(np.float64),
            "answer": answer,
            "top_label": False,
        }


__all__ = ["PopeEvidence", "PopeTask"]
