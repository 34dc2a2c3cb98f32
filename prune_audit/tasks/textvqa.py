"""TextVQA short answers: greedy generation under pruning, scored by the official VQA accuracy.

Question files (``--questions``): TextVQA's question JSON (``TextVQA_0.5.1_val.json``: ids, the 10 human answers,
image sizes), optionally with LLaVA-1.5's ``llava_textvqa_val_v051_ocr.jsonl`` (its questions, order and prompt).
The prompt depends on the files given. With LLaVA's file (the default recipe, the one behind LLaVA-1.5's published
TextVQA numbers) each question is asked as that file writes it: the question, a line ``Reference OCR token: ...``
listing the image's Rosetta OCR tokens, then "Answer the question using a single word or phrase." With the JSON
alone it is asked as lmms-eval's ``textvqa_val`` asks it by default (``ocr: false``): the question capitalised, then
the same instruction, no OCR line. lmms-eval's ``ocr: true`` form (the JSON's ``ocr_tokens`` line between the two)
is the class attribute ``TextVqaTask.ocr_reference`` (``run`` has no per-task option: a plug-in subclass sets it).
Reading and scoring are ``data.textvqa``'s. lmms-lab/textvqa's Parquet files (``validation-*.parquet``, images
embedded; ``data.lmms_parquet``) read as the JSON does: a row carries the JSON entry's fields, and is asked as
lmms-eval's ``textvqa_val`` asks it (with ``ocr_reference``, its ``ocr_tokens`` line too).

``vqa_accuracy`` is the official score: the answer and the 10 human answers normalised as the EvalAI/VQA evaluation
does (punctuation, number words to digits, articles, contractions), then ``min(#annotators who gave it / 3, 1)``
averaged over the 10 subsets of 9 annotators; the run summary's "VQA accuracy" is its mean, the published number.
``correct`` is its binary form, at least 3 of the 10 annotators gave the answer (the VQA criterion of a fully
correct answer, ``vqa_accuracy`` >= 0.9), which calibration and the cascade read; ``annotator_matches`` records the
count. Greedy decoding up to ``max_new_tokens`` (default 128, LLaVA's ``model_vqa_loader.py``) reuses the pruned KV
cache; confidence is the product of the answer tokens' probabilities (``--confidence mean-token``: their geometric
mean), both recorded.

Evidence (``--annotations``): TextVQA's Rosetta OCR file (``TextVQA_Rosetta_OCR_v0.2_val.json``). A question's
evidence region is the union of the boxes of the OCR tokens that spell one of its human answers (a run of
consecutive tokens whose normalised words equal a normalised answer, ``data.textvqa.answer_boxes``), each such token
also measured on its own (``evidence_objects``, ``evidence_objects_lost``). ``retention``, ``lost`` and ``diluted``
(per stage) then say how much of the answer's text the pruner kept. A question whose answer no OCR token spells has
no evidence (NaN retention), unless ``TextVqaTask.evidence_fallback`` is set: then every OCR box of its image is its
evidence. lmms-lab/textvqa's rows carry the OCR tokens' words but not their boxes, so a run from its Parquet files
takes the same Rosetta OCR file for evidence. ``visualize --run`` frames each of those tokens' boxes in cyan,
labelled with its OCR word, over the kept tokens; the legend names the outline "answer's OCR text". A run without
``--annotations`` draws no boxes.

``prune-audit score --task textvqa answers.jsonl --questions TextVQA_0.5.1_val.json`` scores an answers file keyed by
TextVQA's ``question_id`` (what ``export --answers`` writes): the mean VQA accuracy (``accuracy``) and the share with
3 matching annotators or more (``exact``). LLaVA's own answer files key each line by the image id, which two
questions share, so they are not read.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import pyarrow as pa

from prune_audit.data.boxes import Box
from prune_audit.data.files import stable_image_id
from prune_audit.data.textvqa import (
    OcrBox,
    TextVqaQuestion,
    annotator_matches,
    answer_boxes,
    box_mask,
    normalize_answer,
    vqa_accuracy,
)
from prune_audit.errors import PruneAuditError
from prune_audit.record_columns import column
from prune_audit.tasks.base import (
    CONFIDENCE_METRICS,
    GENERATED_CONFIDENCES,
    Evidence,
    FigureBoxes,
    GeneratingTask,
    Scored,
)
from prune_audit.tasks.prompts import SHORT_ANSWER
from prune_audit.tasks.registry import register_task

if TYPE_CHECKING:
    from prune_audit.answer_modes import Generation
    from prune_audit.data.geometry import TokenGeometry
    from prune_audit.data.lmms_parquet import ParquetQuestions
    from prune_audit.data.retention import ObjectArea

SPLIT = "textvqa"
"""The records' ``split`` of every TextVQA question: its question ids are unique within a release."""


@dataclass(frozen=True)
class TextVqaTaskQuestion:
    """A TextVQA question keyed as a record: (``split`` = "textvqa", TextVQA's integer ``question_id``)."""

    tvqa: TextVqaQuestion

    @property
    def question_id(self) -> int:
        return self.tvqa.question_id

    @property
    def split(self) -> str:
        return SPLIT

    @property
    def image(self) -> str:
        return self.tvqa.image

    @property
    def text(self) -> str:
        return self.tvqa.text


class OcrEvidence:
    """Rosetta OCR boxes as evidence regions: the boxes of the OCR tokens that spell a human answer.

    Args:
        ocr: each image's OCR tokens by TextVQA image id (``data.textvqa.load_rosetta_ocr``).
        sizes: (width, height) by image file name, from the question JSON (empty: not checked).
        fallback: a question whose answers no token spells takes every OCR box of its image.
    """

    def __init__(
        self, ocr: dict[str, tuple[OcrBox, ...]], sizes: dict[str, tuple[int, int]], fallback: bool = False
    ) -> None:
        self.ocr = ocr
        self.sizes = sizes
        self.fallback = fallback

    def image_id(self, image: str) -> int:
        return stable_image_id(Path(image).stem)

    def check_image_size(self, image: str, size: tuple[int, int], path: Path) -> None:
        expected = self.sizes.get(image)
        if expected is not None and tuple(size) != expected:
            raise PruneAuditError(
                f"image {path} is {size[0]}x{size[1]} pixels but the question JSON says {expected[0]}x{expected[1]} "
                f"(width x height), so its OCR boxes would not line up; pass the TextVQA images of these questions"
            )

    def boxes(self, image: str, answers: Sequence[str]) -> list[tuple[str, OcrBox]]:
        """(word, box) of the evidence tokens of a question on ``image`` with human ``answers``."""
        tokens = self.ocr.get(Path(image).stem, ())
        chosen = answer_boxes(answers, tokens)
        if not chosen and self.fallback:
            chosen = list(range(len(tokens)))
        return [(tokens[index].word, tokens[index]) for index in chosen]

    def _masks(self, question: TextVqaTaskQuestion, geometry: TokenGeometry) -> list[tuple[str, np.ndarray]]:
        width, height = geometry.image_size
        found = self.boxes(question.image, question.tvqa.answers or ())
        return [(word, box_mask(box, width, height)) for word, box in found]

    def area(self, question: TextVqaTaskQuestion, image_id: int, geometry: TokenGeometry) -> ObjectArea | None:
        from prune_audit.data.retention import object_area

        masks = self._masks(question, geometry)
        if not masks:
            return None
        return object_area(np.logical_or.reduce([mask for _, mask in masks]), geometry)

    def objects(
        self, question: TextVqaTaskQuestion, image_id: int, geometry: TokenGeometry
    ) -> list[tuple[str, ObjectArea]]:
        """Each evidence token's box on its own, named by its OCR word."""
        from prune_audit.data.retention import object_area

        return [(word, object_area(mask, geometry)) for word, mask in self._masks(question, geometry)]

    def record_mask(self, record: dict[str, Any]) -> np.ndarray | None:
        """(height, width) bool: the union of the evidence boxes of the record's image and ``references`` (the human
        answers), at the image size its ``geometry`` recorded; None when no OCR token spells an answer."""
        width, height = _record_size(record)
        found = self.boxes(record["image"], record["references"])
        if not found:
            return None
        return np.logical_or.reduce([box_mask(box, width, height) for _, box in found])

    def record_boxes(self, record: dict[str, Any]) -> list[tuple[str, Box]]:
        """(word, box in image pixels) of each evidence token of a recorded question (its image and ``references``),
        at the image size its ``geometry`` recorded; ``visualize --run`` frames and labels them."""
        width, height = _record_size(record)
        return [
            (word, Box(box.x * width, box.y * height, (box.x + box.width) * width, (box.y + box.height) * height))
            for word, box in self.boxes(record["image"], record["references"])
        ]


def _record_size(record: dict[str, Any]) -> tuple[int, int]:
    """(width, height) of a recorded question's image, from the token geometry the record holds."""
    from prune_audit.data.multigrid import geometry_from_dict

    width, height = geometry_from_dict(json.loads(record["geometry"])).image_size
    return int(width), int(height)


@register_task
class TextVqaTask(GeneratingTask):
    name = "textvqa"
    summary = "TextVQA short answers (LLaVA-1.5's OCR-token prompt), scored by the official VQA accuracy"
    answer_mode_text = "greedy decoding under pruning, reusing the pruned KV cache"
    instruction = SHORT_ANSWER  # LLaVA's question file carries it; lmms-eval's post_prompt adds it to the JSON's
    confidence_definition = (
        f"the probability of the whole generated answer, {GENERATED_CONFIDENCES['sequence']}; "
        f"`--confidence mean-token` takes {GENERATED_CONFIDENCES['mean-token']}; both are recorded"
    )
    correct_definition = (
        "at least 3 of the 10 annotators gave the answer, both normalised as the official VQA evaluation does "
        "(vqa_accuracy >= 0.9); the official soft score is vqa_accuracy"
    )
    evidence_definition = (
        "the Rosetta OCR boxes of the tokens that spell a human answer: their union, and each on its own"
    )
    evidence_noun = "the answers' OCR tokens"
    evidence_label = "answer's OCR text"
    evidence_fate = "questions by the fate of the OCR tokens that spell their answer (together)"
    evidence_questions = "questions with answer tokens"
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
            "vqa_accuracy",
            pa.float64(),
            "official VQA accuracy: min(#annotators who gave the answer / 3, 1) averaged over the 10 subsets of 9 "
            "annotators, answers normalised as the EvalAI evaluation does",
        ),
        column("annotator_matches", pa.int64(), "how many of the 10 human answers equal the answer, both normalised"),
        column("answer_normalized", pa.string(), "the answer as the official evaluation normalises it"),
    )
    ocr_reference: ClassVar[bool] = False
    """Ask the question JSON's ``ocr_tokens`` line when no LLaVA question file is given (lmms-eval's ``ocr: true``)."""
    evidence_fallback: ClassVar[bool] = False
    """Take every OCR box of the image as the evidence of a question whose answers no OCR token spells."""

    def read_questions(self, paths: Sequence[Path]) -> list[TextVqaTaskQuestion]:
        from prune_audit.data.textvqa import load_textvqa

        by_kind: dict[str, list[Path]] = {".json": [], ".jsonl": []}
        for path in paths:
            if path.suffix not in by_kind:
                raise PruneAuditError(
                    f"{path}: TextVQA questions are TextVQA's question JSON (.json) and optionally LLaVA's "
                    f"question file (.jsonl); pass those with --questions"
                )
            by_kind[path.suffix].append(path)
        if len(by_kind[".json"]) != 1 or len(by_kind[".jsonl"]) > 1:
            raise PruneAuditError(
                "pass one TextVQA question JSON (TextVQA_0.5.1_val.json: the answers) and at most one LLaVA question "
                "file (llava_textvqa_val_v051_ocr.jsonl) with --questions"
            )
        llava = by_kind[".jsonl"][0] if by_kind[".jsonl"] else None
        loaded = load_textvqa(by_kind[".json"][0], llava, self.ocr_reference)
        return [TextVqaTaskQuestion(question) for question in loaded]

    parquet_layout = "lmms-lab/textvqa"

    def read_parquet(self, paths: Sequence[Path]) -> ParquetQuestions[TextVqaTaskQuestion]:
        from prune_audit.data.lmms_parquet import ParquetQuestions, read_textvqa_parquet

        loaded = read_textvqa_parquet(paths, self.ocr_reference)
        return ParquetQuestions([TextVqaTaskQuestion(question) for question in loaded.questions], loaded.images)

    def check_questions(self, questions: Sequence[TextVqaTaskQuestion]) -> None:
        unanswered = [q for q in questions if q.tvqa.answers is None]
        if unanswered:
            raise PruneAuditError(
                f"{len(unanswered)} TextVQA questions have no human answers (first: {unanswered[0].question_id}); "
                f"pass TextVQA's question JSON of the train or val split (the test split has none)"
            )

    def score(self, question: TextVqaTaskQuestion, generation: Generation) -> Scored:
        answers = question.tvqa.answers or ()
        matches = annotator_matches(generation.answer, answers)
        columns: dict[str, Any] = {
            "sequence_prob": generation.confidence,
            "mean_token_prob": generation.mean_token_prob,
            "answer_tokens": generation.answer_tokens,
            "stopped": generation.stopped,
            "vqa_accuracy": vqa_accuracy(generation.answer, answers),
            "annotator_matches": matches,
            "answer_normalized": normalize_answer(generation.answer),
        }
        confidence = columns["sequence_prob" if self.confidence == "sequence" else "mean_token_prob"]
        return Scored(generation.answer, answers, matches >= 3, confidence, columns)

    def score_answers(self, answers: Path, question_files: Sequence[Path], subset: str | None = None) -> dict[str, Any]:
        """The official VQA accuracy of an answers file whose ``question_id`` is TextVQA's (``export --answers``
        writes it so; ``data.textvqa.score_textvqa_answers``); of lmms-lab/textvqa's Parquet files only the
        questions are read, not the images."""
        from prune_audit.data.textvqa import score_textvqa_answers

        if self.parquet_inputs(question_files):
            from prune_audit.data.lmms_parquet import read_textvqa_parquet

            return score_textvqa_answers(answers, read_textvqa_parquet(question_files, images=False).questions)
        return score_textvqa_answers(answers, [question.tvqa for question in self.read_questions(question_files)])

    def summary_rows(self, records: pa.Table) -> list[tuple[str, str]]:
        """The official number: the mean VQA accuracy (``accuracy`` above it counts ``correct``, 3 annotators or
        more)."""
        scores = records["vqa_accuracy"].to_numpy(zero_copy_only=False).astype(np.float64)
        return [("VQA accuracy (official, mean over 10 choose 9 annotators)", f"{scores.mean():.4f}")]

    def comparable_answers(self, records: pa.Table) -> np.ndarray:
        """Answers as the official evaluation compares them (``answer_normalized``)."""
        return records["answer_normalized"].to_numpy(zero_copy_only=False).astype(str)

    required_columns = ("answer_normalized",)

    def figure_boxes(self, record: dict[str, Any], evidence: Evidence | None) -> FigureBoxes:
        """Each OCR token that spells a human answer, framed and labelled with its word (needs the run's OCR file,
        ``--annotations``)."""
        if not isinstance(evidence, OcrEvidence):
            return FigureBoxes()
        return FigureBoxes(evidence=tuple(evidence.record_boxes(record)))

    def image_id(self, question: TextVqaTaskQuestion) -> int:
        return stable_image_id(question.tvqa.image_id)

    def load_evidence(self, path: Path, questions: Sequence[TextVqaTaskQuestion]) -> OcrEvidence:
        """The Rosetta OCR file; every question's image must be in it (an image without text lists no tokens)."""
        from prune_audit.data.textvqa import load_rosetta_ocr

        ocr = load_rosetta_ocr(path)
        for question in questions:
            if question.tvqa.image_id not in ocr:
                raise PruneAuditError(
                    f"question {question.question_id}: image {question.tvqa.image_id} is not in the OCR file {path}; "
                    f"pass the Rosetta OCR file of the questions' split (TextVQA_Rosetta_OCR_v0.2_val.json)"
                )
        sizes = {q.image: q.tvqa.image_size for q in questions if q.tvqa.image_size is not None}
        return OcrEvidence(ocr, sizes, self.evidence_fallback)


__all__ = ["OcrEvidence", "TextVqaTask", "TextVqaTaskQuestion"]
