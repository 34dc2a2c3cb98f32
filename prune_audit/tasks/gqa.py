"""GQA short answers: greedy generation under pruning, scored by GQA's exact match.

Question files (``--questions``): GQA's question JSON (``*_questions.json``: answers and the
``annotations`` naming the scene-graph objects of question and answer), optionally with
LLaVA's ``llava_gqa_testdev_balanced.jsonl`` (its questions, order and prompt). Evidence
(``--annotations``): GQA's scene graphs; a question's evidence region is the union of the boxes
of the objects its annotations name (``data.gqa.evidence_mask``). Reading and scoring are
``data.gqa``'s (LLaVA's rule: ``text.strip().rstrip('.').lower() == answer``).

The answer is LLaVA-1.5's: the prompt ends with "Answer the question using a single word or
phrase.", greedy decoding up to ``max_new_tokens`` (default 128: ``--max_new_tokens`` of LLaVA's
``llava/eval/model_vqa_loader.py``, haotian-liu/LLaVA commit 10462fe) that reuses the pruned KV cache. Confidence is the probability of the whole generated answer, the
product of its tokens' probabilities (``sequence_prob``); the length-normalised form, the
geometric mean of the token probabilities, is recorded beside it (``mean_token_prob``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from prune_audit.data.files import stable_image_id
from prune_audit.data.gqa import (
    GqaQuestion,
    SceneGraph,
    box_mask,
    check_image_size,
    evidence_mask,
    evidence_objects,
    exact_match,
    normalize_answer,
)
from prune_audit.errors import PruneAuditError
from prune_audit.record_columns import column
from prune_audit.tasks.base import CONFIDENCE_METRICS, GENERATED_CONFIDENCES, GeneratingTask, Scored
from prune_audit.tasks.prompts import SHORT_ANSWER
from prune_audit.tasks.registry import register_task

if TYPE_CHECKING:
    from prune_audit.answer_modes import Generation
    from prune_audit.data.geometry import TokenGeometry
    from prune_audit.data.lmms_parquet import ParquetQuestions
    from prune_audit.data.retention import ObjectArea

SPLIT = "gqa"
"""The records' ``split`` of every GQA question: GQA's question ids are unique within a release."""


@dataclass(frozen=True)
class GqaTaskQuestion:
    """A GQA question keyed as a record: (``split`` = "gqa", integer ``question_id``)."""

    gqa: GqaQuestion
    question_id: int

    @property
    def split(self) -> str:
        return SPLIT

    @property
    def image(self) -> str:
        return self.gqa.image

    @property
    def text(self) -> str:
        return self.gqa.text


def _record_id(question: GqaQuestion) -> int:
    """GQA's digit-string id as the records' int64; a leading zero would not survive the round trip."""
    value = int(question.question_id)
    if str(value) != question.question_id or value >= 2**63:
        raise PruneAuditError(
            f"GQA question id {question.question_id!r} is not a plain number below 2**63 (a leading zero?); "
            f"records key questions by an int64 id: fix the question file"
        )
    return value


class SceneGraphEvidence:
    """GQA scene graphs as evidence regions: the union of the annotated objects' boxes."""

    def __init__(self, graphs: dict[str, SceneGraph]) -> None:
        self.graphs = graphs

    def image_id(self, image: str) -> int:
        return stable_image_id(Path(image).stem)

    def check_image_size(self, image: str, size: tuple[int, int], path: Path) -> None:
        check_image_size(self.graphs[Path(image).stem], size, path)

    def area(self, question: GqaTaskQuestion, image_id: int, geometry: TokenGeometry) -> ObjectArea | None:
        if not question.gqa.evidence_object_ids:
            return None
        from prune_audit.data.retention import object_area

        return object_area(evidence_mask(question.gqa, self.graphs[question.gqa.image_id]), geometry)

    def record_mask(self, record: dict[str, Any]) -> np.ndarray | None:
        """(height, width) bool: the union of the boxes of the record's ``evidence_object_ids`` in its image's scene
        graph; None when the annotations named no object."""
        graph = self.graphs.get(Path(record["image"]).stem)
        unknown = [i for i in record["evidence_object_ids"] if graph is None or i not in graph.objects]
        if unknown:
            raise PruneAuditError(
                f"object {unknown[0]} of question {record['question_id']} is not in the scene graphs "
                f"of {record['image']}; restore the run's --annotations file"
            )
        if not record["evidence_object_ids"]:
            return None
        return np.logical_or.reduce([box_mask(graph.objects[i], graph) for i in record["evidence_object_ids"]])  # type: ignore[union-attr, arg-type]  # no graph: refused above

    def objects(
        self, question: GqaTaskQuestion, image_id: int, geometry: TokenGeometry
    ) -> list[tuple[str, ObjectArea]]:
        """Each annotated object's box on its own, named by its scene-graph name."""
        from prune_audit.data.retention import object_area

        graph = self.graphs[question.gqa.image_id]
        return [
            (obj.name, object_area(box_mask(obj, graph), geometry)) for _, obj in evidence_objects(question.gqa, graph)
        ]


@register_task
class GqaTask(GeneratingTask):
    name = "gqa"
    summary = "GQA short answers (LLaVA's prompt), scored by GQA's exact match"
    answer_mode_text = "greedy decoding under pruning, reusing the pruned KV cache"
    instruction = SHORT_ANSWER  # LLaVA's question file carries it already; GQA's JSON and lmms-lab/GQA do not
    confidence_definition = (
        f"the probability of the whole generated answer, {GENERATED_CONFIDENCES['sequence']}; "
        f"`--confidence mean-token` takes {GENERATED_CONFIDENCES['mean-token']}; both are "
        f"recorded"
    )
    correct_definition = (
        "GQA's exact match: the answer under LLaVA's normalisation (stripped, a final '.' "
        "dropped, lower case) equals the reference answer"
    )
    evidence_definition = "the union of the scene-graph boxes of the objects the question's annotations name"
    evidence_noun = "the annotated objects"
    evidence_label = "queried objects"
    evidence_fate = "questions by the fate of the objects their annotations name (together)"
    evidence_questions = "questions with evidence masks"
    report_metrics = (
        "accuracy",
        "loyalty",
        "loyalty_overlap",
        *CONFIDENCE_METRICS,
    )
    default_max_new_tokens = 128
    confidences = ("sequence", "mean-token")
    record_columns = (
        column(
            "evidence_object_ids",
            pa.list_(pa.string()),
            "scene-graph ids of the objects the question's annotations name (its evidence region's boxes)",
        ),
    )

    def read_questions(self, paths: Sequence[Path]) -> list[GqaTaskQuestion]:
        from prune_audit.data.gqa import load_gqa, load_llava_gqa

        by_kind: dict[str, list[Path]] = {".json": [], ".jsonl": []}
        for path in paths:
            if path.suffix not in by_kind:
                raise PruneAuditError(
                    f"{path}: GQA questions are GQA's question JSON (.json) and optionally LLaVA's "
                    f"question file (.jsonl); pass those with --questions"
                )
            by_kind[path.suffix].append(path)
        if len(by_kind[".json"]) > 1 or len(by_kind[".jsonl"]) > 1:
            raise PruneAuditError("pass one GQA question JSON and at most one LLaVA question file with --questions")
        if by_kind[".json"]:
            loaded = load_gqa(by_kind[".json"][0], by_kind[".jsonl"][0] if by_kind[".jsonl"] else None)
        else:
            loaded = load_llava_gqa(by_kind[".jsonl"][0])
        return [GqaTaskQuestion(question, _record_id(question)) for question in loaded]

    parquet_layout = "lmms-lab/GQA (*_instructions and *_images files together)"

    def read_parquet(self, paths: Sequence[Path]) -> ParquetQuestions[GqaTaskQuestion]:
        from prune_audit.data.lmms_parquet import ParquetQuestions, read_gqa_parquet_files

        loaded = read_gqa_parquet_files(paths)
        return ParquetQuestions([GqaTaskQuestion(q, _record_id(q)) for q in loaded.questions], loaded.images)

    def check_questions(self, questions: Sequence[GqaTaskQuestion]) -> None:
        unanswered = [q for q in questions if q.gqa.answer is None]
        if unanswered:
            raise PruneAuditError(
                f"{len(unanswered)} GQA questions have no reference answer (first: {unanswered[0].gqa.question_id}); "
                f"pass GQA's question JSON (testdev or val) with --questions too"
            )

    def score(self, question: GqaTaskQuestion, generation: Generation) -> Scored:
        reference = str(question.gqa.answer)
        columns: dict[str, Any] = {
            "sequence_prob": generation.confidence,
            "mean_token_prob": generation.mean_token_prob,
            "answer_tokens": generation.answer_tokens,
            "stopped": generation.stopped,
            "evidence_object_ids": list(question.gqa.evidence_object_ids),
        }
        confidence = columns["sequence_prob" if self.confidence == "sequence" else "mean_token_prob"]
        return Scored(generation.answer, (reference,), exact_match(generation.answer, reference), confidence, columns)

    def score_answers(self, answers: Path, question_files: Sequence[Path], subset: str | None = None) -> dict[str, Any]:
        """GQA's exact match after LLaVA's normalisation (``data.gqa.score_gqa_answers``); of lmms-lab/GQA's Parquet
        files only the ``*_instructions`` ones are read."""
        from prune_audit.data.gqa import score_gqa_answers

        if self.parquet_inputs(question_files):
            from prune_audit.data.lmms_parquet import read_gqa_parquet_questions

            return score_gqa_answers(answers, read_gqa_parquet_questions(question_files))
        return score_gqa_answers(answers, [question.gqa for question in self.read_questions(question_files)])

    def comparable_answers(self, records: pa.Table) -> np.ndarray:
        """Answers as GQA's evaluation compares them (LLaVA's normalisation: stripped, trailing periods, lower case)."""
        texts = records["answer_text"].to_numpy(zero_copy_only=False).astype(str)
        return np.array([normalize_answer(text) for text in texts], dtype=str)

    def image_id(self, question: GqaTaskQuestion) -> int:
        return stable_image_id(question.gqa.image_id)

    def load_evidence(self, path: Path, questions: Sequence[GqaTaskQuestion]) -> SceneGraphEvidence:
        from prune_audit.data.gqa import load_scene_graphs

        graphs = load_scene_graphs(path)
        for question in questions:
            graph = graphs.get(question.gqa.image_id)
            if graph is None:
                raise PruneAuditError(
                    f"question {question.gqa.question_id}: image {question.gqa.image_id} has no scene graph in {path}; "
                    f"pass the scene graphs of the questions' split (GQA has none for testdev: drop --annotations)"
                )
            evidence_objects(question.gqa, graph)  # every annotated object is in the graph
        return SceneGraphEvidence(graphs)


__all__ = ["GqaTask", "GqaTaskQuestion", "SceneGraphEvidence"]
