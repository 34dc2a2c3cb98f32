"""Captions: a detailed description generated under pruning, its object mentions scored by CHAIR.

Question files (``--questions``): a COCO instances file, one question per image (``data.captions``),
and optionally a COCO captions file whose reference captions' objects also count as present
(CHAIR's rule). Evidence (``--annotations``, the same instances file, or one that annotates the questions'
images alike: same ids, file names, sizes, objects and masks): every annotated object's mask;
the region is their union, and each object is also measured on its own (``evidence_objects_lost``),
so an omitted object can be told lost (no token of it survived the first stage) or kept.

The prompt is "Describe this image in detail." (LLaVA's detailed-description instruction); greedy
decoding up to ``max_new_tokens`` (default 1024: LLaVA's ``llava/eval/model_vqa.py``, haotian-liu/LLaVA
commit 064abb3) reusing the pruned KV cache. Mentions are extracted with CHAIR's COCO synonym list
(``data.chair``: plurals, multi-word names, an object named twice counted once), plus the instances
file's category names the list lacks (``data.chair.with_categories``: the demo's shapes; a name no caption word
can match sensibly, such as ``a`` or ``Red Circle``, is refused). ``correct`` is
CHAIR-s's complement: the caption mentions no absent object. Confidence is the length-normalised
probability of the caption (geometric mean of its tokens' probabilities, ``mean_token_prob``): the
product over hundreds of tokens underflows towards 0 for every caption; the product is recorded too.
The run summary adds CHAIR-s, object recall and the omission rate among the objects the first stage lost
against those it kept (``omission_by_fate``). Against the dense run on the same images (``calibrate
--reference DENSE``, and the study, which pairs its dense run with each pruned one), the omission rates
of the lost and of the kept objects stand beside the dense model's omission rates of the same objects
(``paired_omission_by_fate``; calibration.json ``reference_comparison``, the summary's ``omitted_lost``,
``omitted_lost_reference``, ``omitted_kept``, ``omitted_kept_reference`` and a finding of the report): an
object the pruned model omits because its tokens were lost shows as a gap the dense model does not have.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from prune_audit.data.captions import (
    CaptionQuestion,
    caption_questions,
    check_evidence_file,
    read_coco_captions,
)
from prune_audit.data.chair import (
    ChairVocabulary,
    default_vocabulary,
    score_caption,
    with_categories,
)
from prune_audit.data.coco import CocoInstances, read_json
from prune_audit.errors import PruneAuditError
from prune_audit.record_columns import column
from prune_audit.tasks.base import CONFIDENCE_METRICS, GENERATED_CONFIDENCES, GeneratingTask, Scored
from prune_audit.tasks.evidence import CocoEvidence
from prune_audit.tasks.prompts import DETAILED_DESCRIPTION
from prune_audit.tasks.registry import register_task

if TYPE_CHECKING:
    from prune_audit.answer_modes import Generation
    from prune_audit.data.geometry import TokenGeometry
    from prune_audit.data.retention import ObjectArea

SPLIT = "caption"
"""The records' ``split`` of every caption question (its id is the COCO image id)."""


@dataclass(frozen=True)
class CaptionTaskQuestion:
    """An image to describe, keyed as a record: (``split`` = "caption", ``question_id`` = COCO image id)."""

    caption: CaptionQuestion

    @property
    def question_id(self) -> int:
        return self.caption.question_id

    @property
    def split(self) -> str:
        return SPLIT

    @property
    def image(self) -> str:
        return self.caption.image

    @property
    def text(self) -> str:
        """Nothing: the caption task's instruction is the whole question (``CaptionTask.prompt_text``)."""
        return ""


class CaptionEvidence(CocoEvidence):
    """Every annotated object of the image: the union of their masks, and each category's mask on its own."""

    def area(self, question: CaptionTaskQuestion, image_id: int, geometry: TokenGeometry) -> ObjectArea | None:
        from prune_audit.data.retention import object_area

        if not question.caption.objects:
            return None
        union = np.logical_or.reduce([self.coco.category_mask(image_id, name) for name in question.caption.objects])
        return object_area(union, geometry)

    def objects(
        self, question: CaptionTaskQuestion, image_id: int, geometry: TokenGeometry
    ) -> list[tuple[str, ObjectArea]]:
        return [(name, self.category_area(image_id, name, geometry)) for name in question.caption.objects]


def _objects_by_fate(rows: Sequence[dict[str, Any]]) -> Iterator[tuple[dict[str, Any], str, str]]:
    """(row, object name, "lost" or "kept") for each annotated object of each record whose first-stage fate is
    known (records' ``evidence_objects`` and ``evidence_objects_lost``; objects without pixels left out)."""
    for row in rows:
        for name, lost in zip(row["evidence_objects"], row["evidence_objects_lost"]):
            if lost is not None:
                yield row, name, "lost" if lost else "kept"


def omission_by_fate(rows: Sequence[dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """(objects, omitted) among the annotated objects the first stage ``lost`` and those it ``kept``
    (records' ``evidence_objects``, ``evidence_objects_lost`` and ``omitted``; objects without pixels left out)."""
    counts = {"lost": [0, 0], "kept": [0, 0]}
    for row, name, fate in _objects_by_fate(rows):
        counts[fate][0] += 1
        counts[fate][1] += name in row["omitted"]
    return {fate: (objects, omitted) for fate, (objects, omitted) in counts.items()}


def paired_omission_by_fate(
    rows: Sequence[dict[str, Any]], reference_rows: Sequence[dict[str, Any]]
) -> dict[str, tuple[int, int, int]]:
    """(objects, omitted by the run, omitted by the reference) among the annotated objects the run's first stage
    ``lost`` and those it ``kept``, over the images both runs captioned (records keyed by ``split`` and
    ``question_id``): the same objects in the same images, pruned against the reference's captions."""
    reference_omitted = {(row["split"], row["question_id"]): set(row["omitted"]) for row in reference_rows}
    counts = {"lost": [0, 0, 0], "kept": [0, 0, 0]}
    for row, name, fate in _objects_by_fate(rows):
        omitted_there = reference_omitted.get((row["split"], row["question_id"]))
        if omitted_there is None:
            continue
        tally = counts[fate]
        tally[0] += 1
        tally[1] += name in row["omitted"]
        tally[2] += name in omitted_there
    return {fate: (objects, run, reference) for fate, (objects, run, reference) in counts.items()}


def _is_instances(data: Any) -> bool:
    return isinstance(data, dict) and "categories" in data


@register_task
class CaptionTask(GeneratingTask):
    name = "caption"
    summary = "Detailed captions of COCO images, object mentions scored by CHAIR (hallucinated and omitted objects)"
    answer_mode_text = "greedy decoding under pruning, reusing the pruned KV cache"
    confidence_definition = (
        f"the caption's probability, {GENERATED_CONFIDENCES['mean-token']}; "
        f"`--confidence sequence` takes {GENERATED_CONFIDENCES['sequence']}; both are recorded"
    )
    correct_definition = "CHAIR-s's complement: the caption mentions no object absent from the image"
    evidence_definition = "every annotated object's COCO mask: their union, and each object on its own"
    evidence_noun = "the annotated objects"
    evidence_label = "annotated objects"
    evidence_fate = "captions by the fate of their image's annotated objects (together)"
    evidence_questions = "captions with annotated objects"
    instruction = DETAILED_DESCRIPTION
    report_metrics = (
        "accuracy",
        "loyalty",
        "loyalty_overlap",
        *CONFIDENCE_METRICS,
    )
    default_max_new_tokens = 1024
    confidences = ("mean-token", "sequence")
    record_columns = (
        column(
            "mentioned",
            pa.list_(pa.string()),
            "COCO categories the caption mentions (CHAIR's synonym list), each once, in order of first mention",
        ),
        column(
            "hallucinated",
            pa.list_(pa.string()),
            "mentioned categories absent from the image (neither annotated nor in its reference captions)",
        ),
        column(
            "omitted",
            pa.list_(pa.string()),
            "annotated categories the caption never mentions, in evidence_objects "
            "order (evidence_objects_lost says which the first stage lost)",
        ),
        column("chair_i", pa.float64(), "hallucinated mentions / mentions (0 without mentions)"),
        column("recall", pa.float64(), "share of annotated categories mentioned (NaN when none is annotated)"),
    )
    vocabulary: ChairVocabulary | None = None
    """CHAIR's list plus the question file's categories it lacks (``read_questions`` sets it; None: CHAIR's)."""

    def read_questions(self, paths: Sequence[Path]) -> list[CaptionTaskQuestion]:
        instances: list[tuple[Path, Any]] = []
        captions: list[tuple[Path, Any]] = []
        for path in paths:
            data = read_json(path)
            (instances if _is_instances(data) else captions).append((path, data))
        if len(instances) != 1 or len(captions) > 1:
            raise PruneAuditError(
                "caption questions come from one COCO instances file (the images to describe), "
                "optionally with one COCO captions file: pass them with --questions"
            )
        path, data = instances[0]
        coco = CocoInstances(data, source=str(path))
        references = read_coco_captions(captions[0][0]) if captions else None
        self.vocabulary = with_categories(default_vocabulary(), list(coco.category_names.values()), str(path))
        return [
            CaptionTaskQuestion(question)
            for question in caption_questions(coco, references, vocabulary=self.vocabulary)
        ]

    def score(self, question: CaptionTaskQuestion, generation: Generation) -> Scored:
        caption = question.caption
        scored = score_caption(generation.answer, caption.objects, caption.caption_objects, self.vocabulary)
        columns: dict[str, Any] = {
            "sequence_prob": generation.confidence,
            "mean_token_prob": generation.mean_token_prob,
            "answer_tokens": generation.answer_tokens,
            "stopped": generation.stopped,
            "mentioned": list(scored.mentioned),
            "hallucinated": list(scored.hallucinated),
            "omitted": list(scored.omitted),
            "chair_i": scored.chair_i,
            "recall": scored.recall,
        }
        present = tuple(dict.fromkeys((*scored.annotated, *caption.caption_objects)))
        confidence = columns["sequence_prob" if self.confidence == "sequence" else "mean_token_prob"]
        return Scored(generation.answer, present, not scored.chair_s, confidence, columns)

    def score_answers(self, answers: Path, question_files: Sequence[Path], subset: str | None = None) -> dict[str, Any]:
        """CHAIR-s, CHAIR-i, recall and omissions of the captions (``data.captions.score_caption_answers``); the
        answers' ``question_id`` is the COCO image id."""
        from prune_audit.data.captions import score_caption_answers

        self.parquet_inputs(question_files)  # refuses Parquet files in one line: captions have no Parquet layout
        questions = [question.caption for question in self.read_questions(question_files)]
        return score_caption_answers(answers, questions, self.vocabulary)

    def summary_rows(self, records: pa.Table) -> list[tuple[str, str]]:
        """CHAIR-s, object recall, and the omission rate of the objects the first stage lost against those it kept
        (the same failure as a lost POPE object, outside yes/no)."""
        rows = records.select(["correct", "evidence_objects", "evidence_objects_lost", "omitted"]).to_pylist()
        fates = omission_by_fate(rows)
        annotated = sum(len(row["evidence_objects"]) for row in rows)
        omitted = sum(len(row["omitted"]) for row in rows)
        lines = [
            ("CHAIR-s (captions naming an absent object)", f"{1 - sum(r['correct'] for r in rows) / len(rows):.4f}"),
            ("object recall", f"{1 - omitted / annotated:.4f}" if annotated else "-"),
        ]
        for fate, (count, missed) in fates.items():
            lines.append(
                (
                    f"omitted among objects {fate} at the first stage",
                    f"{missed / count:.4f} of {count}" if count else "- of 0",
                )
            )
        return lines

    reference_comparison_meanings = {
        "objects_lost": "annotated objects the run's first stage lost (no token kept), on images both runs captioned",
        "omitted_lost": "share of those objects the run's captions omit",
        "omitted_lost_reference": "share of the same objects (same images) the reference's captions omit",
        "objects_kept": "annotated objects the run's first stage kept (a token or more), on the same images",
        "omitted_kept": "share of those objects the run's captions omit",
        "omitted_kept_reference": "share of the same objects the reference's captions omit",
    }

    def reference_comparison(self, records: pa.Table, reference: pa.Table) -> dict[str, float | int]:
        """The omission rate of lost and of kept objects, the run's captions beside the reference's on the same
        objects (``paired_omission_by_fate``): does pruning omit what it lost, beyond what the dense model omits?"""
        columns = ["split", "question_id", "evidence_objects", "evidence_objects_lost", "omitted"]
        counts = paired_omission_by_fate(
            records.select(columns).to_pylist(), reference.select(["split", "question_id", "omitted"]).to_pylist()
        )
        comparison: dict[str, float | int] = {}
        for fate, (objects, run, dense) in counts.items():
            comparison[f"objects_{fate}"] = objects
            comparison[f"omitted_{fate}"] = run / objects if objects else math.nan
            comparison[f"omitted_{fate}_reference"] = dense / objects if objects else math.nan
        return comparison

    def image_id(self, question: CaptionTaskQuestion) -> int:
        return question.question_id

    def load_evidence(self, path: Path, questions: Sequence[CaptionTaskQuestion]) -> CaptionEvidence:
        coco = CocoInstances.load(path)
        check_evidence_file([question.caption for question in questions], coco)
        return CaptionEvidence(coco)


__all__ = ["CaptionEvidence", "CaptionTask", "CaptionTaskQuestion", "omission_by_fate", "paired_omission_by_fate"]
