"""RefCOCO / RefCOCO+ / RefCOCOg grounding: a box generated for a referring expression, scored by IoU (Acc@0.5).

Question files (``--questions``): the ``refer`` layout (``data.refcoco``): the dataset's refs file
(``refs(unc).p``; RefCOCOg ``refs(umd).p`` or ``refs(google).p``; or a JSON copy of its list), read without
running code, and the dataset's ``instances.json`` (the referred objects' boxes, the images' names and sizes). One
question per expression (``sent_id``); ``--split`` picks the refs' split (``val``, ``testA``, ``testB``,
``test``, ``train``). Images: COCO ``train2014`` (``--images``). Evidence (``--annotations``, the same
``instances.json`` or COCO's ``instances_train2014.json``): the referred object's own mask (its ``ann_id``'s
segmentation), so retention, lost and diluted say whether pruning kept the tokens of the object the model must find.

The prompt and the box are the answering family's (``data.boxes``; the family adapter declares its convention,
``grounding``): LLaVA-1.5 asks "Please provide the bounding box coordinate of the region this sentence describes:
<expression>." and answers ``[x1, y1, x2, y2]`` in 0-1 of the image padded to a square; Qwen2.5-VL asks "Locate
<expression>, output its bbox coordinates using JSON format." and answers ``bbox_2d`` in pixels of its resized
input; InternVL asks for ``<ref><expression></ref>`` and answers ``[[x1, y1, x2, y2]]`` on a 0-1000 grid. A
family without a convention is refused before anything runs. LLaVA's frame is the padded square whatever the
checkpoint's processor does (a llava-hf ``hf_crop`` processor included): it is the frame LLaVA-1.5 learned to answer
in. The box is mapped back to the pixels of the image at its annotated size (``instances.json``; ``--annotations``
checks every image file against it) through the model's token geometry of that size, and compared with the
referred object's box: ``correct`` is IoU >= 0.5
(Acc@0.5, lmms-eval's ``refcoco_ACC@0.5`` and InternVL's "Precision @ 1"); an answer without a box is wrong
(IoU 0, ``predicted_box`` null), never an error. Greedy decoding up to ``max_new_tokens`` (default 100: InternVL's
``evaluate_grounding.py``) reusing the pruned KV cache; confidence is the probability of the generated answer,
the product of its tokens' probabilities (``sequence_prob``, as GQA's), the box's tokens being the answer.
``score --task refcoco`` is refused: a released answer's box is in its model's frame, which an answers file does
not name. The Qwen-VL / InternVL ``refcoco_*.jsonl`` files are not read. Against a reference run (a study's dense
run, ``calibrate --reference``) the task adds its own comparison: ``box_loyalty``, the share of expressions whose box
has IoU >= 0.5 with the reference's box (exact-text ``loyalty`` counts a box that moved by 0.01 as disloyal), and the
two runs' mean IoU on the same expressions (``mean_iou``, ``mean_iou_reference``).

lmms-lab's Parquet files (``lmms-lab/RefCOCO``, ``RefCOCOplus``, ``RefCOCOg``: ``<split>-NNNNN-of-NNNNN.parquet``,
images embedded; ``data.lmms_parquet``) read too: one row per referred object, exploded into one question per
referring expression (``answer``) as lmms-eval's ``refcoco_bbox_rec`` explodes it, each numbered within its split
(the split is the file name's prefix). The target is the row's ``bbox`` (COCO ``[x, y, w, h]`` in pixels of the
embedded image, whose own size is the image size), ``ann_id`` the row's ``question_id``, and the evidence the row's
``segmentation`` (the referred object's polygon), so such a run needs no ``--annotations``; the rows name no
category, so the object is called "referred object". ``visualize --run`` of such a run draws the boxes, not the
mask outline, and ``intervene`` refuses it (it reads the masks from the run's ``--annotations``): give such a run the
dataset's ``instances.json`` with ``--annotations`` (its annotation ids are the rows' ``question_id``) to have both.

``visualize --run`` draws the referred object's mask outline (with ``--annotations``) and its target box in cyan
(labelled with its category; the legend says "referred object"), and the predicted box dashed in green, labelled with
its IoU; an answer without a box reads "no box parsed" in the title.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa

from prune_audit.data.boxes import Box, BoxConvention, box_convention, box_iou, format_box
from prune_audit.data.coco import CocoInstances
from prune_audit.data.refcoco import SPLITS, RefQuestion, annotations_by_id, load_refcoco, polygon_mask, target_box
from prune_audit.errors import PruneAuditError
from prune_audit.record_columns import column
from prune_audit.tasks.base import (
    CONFIDENCE_METRICS,
    GENERATED_CONFIDENCES,
    AnsweringModel,
    Evidence,
    FigureBoxes,
    GeneratingTask,
    Scored,
)
from prune_audit.tasks.prompts import compose_prompt
from prune_audit.tasks.registry import register_task

if TYPE_CHECKING:
    from prune_audit.answer_modes import Generation
    from prune_audit.data.geometry import TokenGeometry
    from prune_audit.data.lmms_parquet import ParquetQuestions
    from prune_audit.data.retention import ObjectArea
    from prune_audit.tasks.base import TaskQuestion

ANNOTATIONS_FIX = "pass the dataset's instances.json (or COCO's instances_train2014.json) with --annotations"
ACCURACY_IOU = 0.5
"""The IoU from which a box counts as correct (Acc@0.5)."""


def boxes_agree(box: Sequence[float] | None, reference: Sequence[float] | None) -> bool:
    """Two answers' boxes ([x1, y1, x2, y2] in image pixels, None: no box) agree when their IoU is >= 0.5, the
    accuracy threshold, or when neither holds a box."""
    if box is None or reference is None:
        return box is None and reference is None
    return box_iou(Box(*box), Box(*reference)) >= ACCURACY_IOU


def _boxes_by_question(records: pa.Table) -> dict[tuple[str, int], tuple[list[float] | None, float]]:
    """(split, question_id) -> (predicted_box, iou) of each record."""
    rows = records.select(["split", "question_id", "predicted_box", "iou"]).to_pylist()
    return {(row["split"], row["question_id"]): (row["predicted_box"], row["iou"]) for row in rows}


class ReferredObjectEvidence:
    """A COCO instances file as evidence regions: each question's referred object, its annotation's own mask."""

    def __init__(self, coco: CocoInstances) -> None:
        self.coco = coco
        self._anns = annotations_by_id(coco)
        self._areas: dict[tuple[int, Any], ObjectArea] = {}

    def annotation(self, ann_id: int) -> dict[str, Any]:
        if ann_id not in self._anns:
            raise PruneAuditError(f"annotation {ann_id} is not in {self.coco.source}; {ANNOTATIONS_FIX}")
        return self._anns[ann_id]

    def image_id(self, image: str) -> int:
        return self.coco.image_id(image)

    def check_image_size(self, image: str, size: tuple[int, int], path: Path) -> None:
        self.coco.check_image_size(self.image_id(image), size, path)

    def area(self, question: RefQuestion, image_id: int, geometry: TokenGeometry) -> ObjectArea:
        from prune_audit.data.retention import object_area

        key = (question.ann_id, geometry)
        if key not in self._areas:
            self._areas[key] = object_area(self.coco.annotation_mask(self.annotation(question.ann_id)), geometry)
        return self._areas[key]

    def objects(self, question: RefQuestion, image_id: int, geometry: TokenGeometry) -> list[tuple[str, ObjectArea]]:
        return [(question.category, self.area(question, image_id, geometry))]

    def record_mask(self, record: dict[str, Any]) -> np.ndarray:
        """(height, width) bool: the mask of the record's referred annotation (``ann_id``)."""
        return self.coco.annotation_mask(self.annotation(record["ann_id"]))


class RowPolygonEvidence:
    """The questions' own polygons as evidence regions (lmms-lab's Parquet rows): each referred object's mask,
    rasterised at the size of the image the row embeds."""

    def __init__(self, questions: Sequence[RefQuestion]) -> None:
        self._questions = {(question.split, question.question_id): question for question in questions}
        self._images = {question.image: question for question in questions}

    def image_id(self, image: str) -> int:
        return self._images[image].image_id

    def check_image_size(self, image: str, size: tuple[int, int], path: Path) -> None:
        expected = self._images[image].image_size
        if tuple(size) != expected:
            raise PruneAuditError(
                f"image {path} is {size[0]}x{size[1]} pixels but its question rows describe {expected[0]}x"
                f"{expected[1]} (width x height); pass the images the question files embed"
            )

    def _mask(self, question: RefQuestion) -> np.ndarray | None:
        if question.segmentation is None:
            return None
        return polygon_mask(question.segmentation, question.image_size)

    def area(self, question: RefQuestion, image_id: int, geometry: TokenGeometry) -> ObjectArea | None:
        from prune_audit.data.retention import object_area

        mask = self._mask(question)
        return None if mask is None else object_area(mask, geometry)

    def objects(self, question: RefQuestion, image_id: int, geometry: TokenGeometry) -> list[tuple[str, ObjectArea]]:
        area = self.area(question, image_id, geometry)
        return [] if area is None else [(question.category, area)]

    def record_mask(self, record: dict[str, Any]) -> np.ndarray | None:
        """(height, width) bool: the polygon of the recorded question (by ``split`` and ``question_id``)."""
        question = self._questions.get((record["split"], record["question_id"]))
        return None if question is None else self._mask(question)


@register_task
class RefcocoTask(GeneratingTask):
    name = "refcoco"
    summary = "RefCOCO / RefCOCO+ / RefCOCOg grounding: a box for a referring expression, scored by IoU (Acc@0.5)"
    answer_mode_text = (
        "greedy decoding under pruning, reusing the pruned KV cache; the prompt and the box are the family's own "
        "(LLaVA-1.5: 0-1 of the padded square; Qwen2.5-VL: bbox_2d pixels of the resized input; InternVL: 0-1000)"
    )
    confidence_definition = (
        f"the probability of the generated box, {GENERATED_CONFIDENCES['sequence']}; `--confidence mean-token` "
        f"takes {GENERATED_CONFIDENCES['mean-token']}; both are recorded"
    )
    correct_definition = (
        "Acc@0.5: the box, mapped back to the image's pixels, has IoU >= 0.5 with the referred object's box "
        "(an answer without a box is wrong)"
    )
    evidence_definition = "the referred object's COCO mask (its annotation's segmentation)"
    evidence_noun = "the referred objects"
    evidence_label = "referred object"
    evidence_fate = "expressions by the fate of the object they refer to"
    evidence_questions = "expressions"
    splits = SPLITS
    report_metrics = (
        "accuracy",
        "loyalty",
        *CONFIDENCE_METRICS,
    )
    default_max_new_tokens = 100
    confidences = ("sequence", "mean-token")
    record_columns = (
        column("ref_id", pa.int64(), "the refer API's ref the expression belongs to"),
        column("ann_id", pa.int64(), "the referred object's COCO annotation id (its mask is the evidence region)"),
        column("target_box", pa.list_(pa.float64()), "the referred object's box, [x1, y1, x2, y2] in image pixels"),
        column(
            "predicted_box",
            pa.list_(pa.float64()),
            "the answer's box mapped to image pixels, [x1, y1, x2, y2] (null: the answer holds no box)",
        ),
        column("iou", pa.float64(), "IoU of predicted_box with target_box (0 without a box or for a box of no area)"),
        column("box_convention", pa.string(), "the answering family's box convention (data.boxes) that read the box"),
    )
    convention: BoxConvention | None = None
    """The answering family's box convention (``use_model`` sets it)."""
    _geometry: Callable[[tuple[int, int]], Any]
    """The answering model's token geometry of an image size (``use_model`` sets it): the frame of its boxes."""

    def use_model(self, model: AnsweringModel) -> None:
        self.convention = box_convention(model.grounding, model.display_name)
        self._geometry = model.token_geometry

    def _bound(self) -> BoxConvention:
        if self.convention is None:
            raise RuntimeError("the grounding task was not given its model (Task.use_model) before prompting")
        return self.convention

    def prompt_text(self, question: TaskQuestion, declared: Mapping[str, str] | None = None) -> str:
        """The family's grounding question (``data.boxes``); a checkpoint that declares its own instruction for
        this task (``task_instructions.json``) is asked the expression and that instruction instead."""
        if declared and self.name in declared:
            return compose_prompt(
                question.text, declared[self.name], f"question {question.split}/{question.question_id}"
            )
        return self._bound().prompt(question.text)

    def read_questions(self, paths: Sequence[Path]) -> list[RefQuestion]:
        return load_refcoco(paths)

    parquet_layout = "lmms-lab/RefCOCO, RefCOCOplus or RefCOCOg (<split>-*.parquet; evidence: each row's polygon)"

    def read_parquet(self, paths: Sequence[Path]) -> ParquetQuestions[RefQuestion]:
        from prune_audit.data.lmms_parquet import read_refcoco_parquet

        return read_refcoco_parquet(paths)

    def question_evidence(self, questions: Sequence[RefQuestion]) -> RowPolygonEvidence | None:
        """The rows' polygons when the questions carry them (lmms-lab's Parquet files); None otherwise."""
        return RowPolygonEvidence(questions) if any(q.segmentation is not None for q in questions) else None

    def score(self, question: RefQuestion, generation: Generation) -> Scored:
        convention = self._bound()
        numbers = convention.parse(generation.answer)
        predicted = None if numbers is None else convention.to_image(numbers, self._geometry(question.image_size))
        iou = 0.0 if predicted is None else box_iou(predicted, question.box)
        columns: dict[str, Any] = {
            "sequence_prob": generation.confidence,
            "mean_token_prob": generation.mean_token_prob,
            "answer_tokens": generation.answer_tokens,
            "stopped": generation.stopped,
            "ref_id": question.ref_id,
            "ann_id": question.ann_id,
            "target_box": question.box.as_list(),
            "predicted_box": None if predicted is None else predicted.as_list(),
            "iou": iou,
            "box_convention": convention.name,
        }
        confidence = columns["sequence_prob" if self.confidence == "sequence" else "mean_token_prob"]
        return Scored(generation.answer, (format_box(question.box),), iou >= ACCURACY_IOU, confidence, columns)

    def score_answers(self, answers: Path, question_files: Sequence[Path], subset: str | None = None) -> dict[str, Any]:
        raise PruneAuditError(
            f"score --task {self.name} is not offered: a released answer's box is in its model's frame, which an "
            f"answers file does not name; run the model with prune-audit run --task {self.name}"
        )

    def summary_rows(self, records: pa.Table) -> list[tuple[str, str]]:
        """Mean IoU and the answers without a box."""
        iou = records["iou"].to_numpy(zero_copy_only=False).astype(np.float64)
        unparsed = records["predicted_box"].null_count
        return [
            ("mean IoU", f"{float(iou.mean()):.4f}" if len(iou) else "-"),
            ("answers without a box", f"{unparsed} of {len(iou)}"),
        ]

    reference_comparison_meanings = {
        "box_loyalty": "share of expressions whose box has IoU >= 0.5 with the reference run's box for the same "
        "expression (two answers without a box agree, one without disagrees): loyalty for boxes, which exact-text "
        "loyalty misses whenever a number moves by 0.01",
        "mean_iou": "mean IoU of the run's boxes with the referred objects' boxes (0 for an answer without a box)",
        "mean_iou_reference": "mean IoU of the reference run's boxes on the same expressions",
    }

    def reference_comparison(self, records: pa.Table, reference: pa.Table) -> dict[str, float | int]:
        """Box loyalty and mean IoU against the reference run (a study's dense run) on the expressions both hold."""
        mine, theirs = _boxes_by_question(records), _boxes_by_question(reference)
        shared = [key for key in mine if key in theirs]
        if not shared:
            return {name: math.nan for name in self.reference_comparison_meanings}
        return {
            "box_loyalty": float(np.mean([boxes_agree(mine[key][0], theirs[key][0]) for key in shared])),
            "mean_iou": float(np.mean([mine[key][1] for key in shared])),
            "mean_iou_reference": float(np.mean([theirs[key][1] for key in shared])),
        }

    def image_id(self, question: RefQuestion) -> int:
        return question.image_id

    def figure_boxes(self, record: dict[str, Any], evidence: Evidence | None) -> FigureBoxes:
        """The target box (labelled with the object's category) and the predicted box (labelled with its IoU), both
        from the record; an answer without a box says "no box parsed" in the title."""
        target = (", ".join(record["evidence_objects"] or ()), Box(*record["target_box"]))
        if record["predicted_box"] is None:
            return FigureBoxes(evidence=(target,), note="no box parsed")
        return FigureBoxes(evidence=(target,), answer=(f"IoU {record['iou']:.2f}", Box(*record["predicted_box"])))

    def load_evidence(self, path: Path, questions: Sequence[RefQuestion]) -> ReferredObjectEvidence:
        evidence = ReferredObjectEvidence(CocoInstances.load(path))
        for question in questions:
            ann = evidence.annotation(question.ann_id)
            box = target_box(ann, f"{path}: annotation {question.ann_id}", ANNOTATIONS_FIX)
            same_box = np.allclose(box.as_list(), question.box.as_list(), rtol=1e-6, atol=1e-3)  # float32 rows
            if ann["image_id"] != question.image_id or not same_box:
                raise PruneAuditError(
                    f"annotation {question.ann_id} in {path} is not the one the questions refer to (another image or "
                    f"box); {ANNOTATIONS_FIX}"
                )
        return evidence


__all__ = ["ReferredObjectEvidence", "RefcocoTask", "RowPolygonEvidence", "boxes_agree"]
