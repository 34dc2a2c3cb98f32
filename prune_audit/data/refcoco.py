"""RefCOCO, RefCOCO+ and RefCOCOg referring expressions, read from the files of the ``refer`` API.

The layout (lichengunc/refer, the layout every RefCOCO release ships and lmms-eval's and InternVL's converted files
derive from): a dataset folder (``refcoco``, ``refcoco+``, ``refcocog``) holding

- ``refs(unc).p`` (RefCOCOg: ``refs(umd).p`` or ``refs(google).p``): a pickled list of refs, each
  ``{ref_id, ann_id, image_id, category_id, split, sentences: [{sent_id, sent, ...}], ...}``; a ref names one
  COCO object (``ann_id``) by one or more expressions. A JSON file holding the same list (``refs.json``) reads
  alike. The pickle is read without running code: only lists, dicts, strings and numbers are unpickled, and a
  pickle that asks for any other object is refused.
- ``instances.json``: the COCO instances of the refs' ``train2014`` images (``images``: file names and sizes;
  ``annotations``: each object's ``bbox`` and ``segmentation``; ``categories``).

One question per expression (``sent_id``, unique within a dataset; lmms-eval likewise explodes its rows into one
per sentence): its text is the expression, its target the referred annotation's box (COCO ``[x, y, w, h]`` as
``[x1, y1, x2, y2]`` pixels), its split the ref's (``train``, ``val``, ``testA``, ``testB``, ``test``).
"""

from __future__ import annotations

import io
import math
import pickle
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from prune_audit.data.boxes import Box
from prune_audit.data.coco import CocoInstances, decode_rle, read_json
from prune_audit.data.question_ids import QuestionPlace, QuestionPlaces, note_question
from prune_audit.errors import PruneAuditError
from prune_audit.safety.inputs import check_image_name, read_input

SPLITS = ("val", "testA", "testB", "test", "train")
"""The refs' splits (RefCOCO and RefCOCO+: train, val, testA, testB; RefCOCOg umd: train, val, test)."""

REFS_FIX = "pass the dataset's refs file (refs(unc).p, refs(umd).p, refs(google).p or a JSON copy of its list)"
INSTANCES_FIX = "pass the dataset's instances.json (or COCO's instances_train2014.json) with --questions"


@dataclass(frozen=True)
class RefQuestion:
    """One referring expression to ground.

    Attributes:
        question_id: the expression's ``sent_id``.
        split: its ref's split.
        image: the image's file name (``instances.json``), under ``--images``.
        text: the expression.
        ref_id, ann_id: the ref and the referred COCO annotation.
        image_id: the COCO image id.
        category: the referred object's category name.
        box: the referred object's box in image pixels.
        image_size: the annotated (width, height).
        segmentation: the referred object's polygon, flat ``x, y`` pixel pairs, when the question file carries it
            (lmms-lab's Parquet rows: the evidence then needs no ``--annotations``); None otherwise.
    """

    question_id: int
    split: str
    image: str
    text: str
    ref_id: int
    ann_id: int
    image_id: int
    category: str
    box: Box
    image_size: tuple[int, int]
    segmentation: tuple[float, ...] | None = None


class _PlainUnpickler(pickle.Unpickler):
    """Unpickles lists, dicts, tuples, strings and numbers only: any class or function is refused, so loading runs
    no code the file names."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"it asks for {module}.{name}, and a refs file holds plain lists and dicts")


def read_refs(path: Path) -> Any:
    """The unpickled content of a ``refs(*).p`` file (the refs list, checked by ``load_refcoco``)."""
    data = read_input(path, "refs file", REFS_FIX)
    try:
        return _PlainUnpickler(io.BytesIO(data), encoding="utf-8").load()
    except (pickle.UnpicklingError, EOFError, ValueError, UnicodeDecodeError, TypeError, IndexError) as error:
        raise PruneAuditError(f"{path} is not a plain refs pickle ({error}); {REFS_FIX}") from None


def _whole(value: Any, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value >= 2**63:
        raise PruneAuditError(f"{where} must be a whole number below 2**63, got {value!r}; fix the refs file")
    return value


def target_box(ann: dict[str, Any], where: str, fix: str = INSTANCES_FIX) -> Box:
    """The annotation's ``bbox`` as a box; refused unless four finite numbers of non-negative width and height."""
    bbox = ann.get("bbox")
    if (
        not isinstance(bbox, list)
        or len(bbox) != 4
        or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in bbox)
        or min(bbox[2], bbox[3]) < 0
    ):
        raise PruneAuditError(f"{where}: bbox must be [x, y, width, height], got {bbox!r}; {fix}")
    return Box.from_coco(bbox)


def _ref_entry(ref: Any, where: str) -> dict[str, Any]:
    """One ref, its ids, split and sentences checked."""
    if not isinstance(ref, dict):
        raise PruneAuditError(f"{where} is a {type(ref).__name__}, not a ref object; {REFS_FIX}")
    missing = [key for key in ("ref_id", "ann_id", "image_id", "split", "sentences") if key not in ref]
    if missing:
        raise PruneAuditError(f"{where} lacks {', '.join(missing)}; {REFS_FIX}")
    if ref["split"] not in SPLITS:
        raise PruneAuditError(f"{where}: split {ref['split']!r} is not one of {', '.join(SPLITS)}; {REFS_FIX}")
    if not isinstance(ref["sentences"], list) or not ref["sentences"]:
        raise PruneAuditError(f"{where}: sentences must be a non-empty list; {REFS_FIX}")
    for key in ("ref_id", "ann_id", "image_id"):
        _whole(ref[key], f"{where}.{key}")
    return ref


def _sentence(sentence: Any, where: str) -> tuple[int, str]:
    """(sent_id, sent) of one sentence entry."""
    if not isinstance(sentence, dict) or "sent_id" not in sentence or "sent" not in sentence:
        raise PruneAuditError(f"{where} must be an object with sent_id and sent; {REFS_FIX}")
    text = sentence["sent"]
    if not isinstance(text, str) or not text.strip():
        raise PruneAuditError(f"{where}.sent must be a non-empty expression, got {text!r}; {REFS_FIX}")
    return _whole(sentence["sent_id"], f"{where}.sent_id"), text.strip()


def polygon_mask(polygon: Sequence[float], size: tuple[int, int]) -> np.ndarray:
    """(height, width) bool: the pixels of one polygon (flat ``x, y`` pixel pairs) on an image of ``size`` = (width,
    height), rasterised by pycocotools as ``COCO.annToMask`` rasterises a polygon segmentation."""
    from pycocotools import mask as mask_utils

    width, height = size
    return decode_rle(mask_utils.merge(mask_utils.frPyObjects([list(polygon)], height, width)))


def annotations_by_id(coco: CocoInstances) -> dict[int, dict[str, Any]]:
    """Every annotation of ``coco`` that has an integer ``id``, by that id."""
    return {
        int(ann["id"]): ann
        for anns in coco.annotations_by_image.values()
        for ann in anns
        if isinstance(ann.get("id"), int) and not isinstance(ann.get("id"), bool)
    }


def ref_questions(refs_path: Path, refs: list[Any], coco: CocoInstances) -> list[RefQuestion]:
    """One question per expression of ``refs``, its target and image read from ``coco``; every entry checked."""
    anns = annotations_by_id(coco)
    seen: QuestionPlaces = {}
    questions = []
    for index, raw in enumerate(refs):
        where = f"{refs_path}: refs[{index}]"
        ref = _ref_entry(raw, where)
        ann = anns.get(ref["ann_id"])
        if ann is None or ann["image_id"] != ref["image_id"]:
            raise PruneAuditError(
                f"{where}: annotation {ref['ann_id']} of image {ref['image_id']} is not in {coco.source}; "
                f"{INSTANCES_FIX} (the one beside the refs file)"
            )
        image = coco.image(ref["image_id"])
        box = target_box(ann, f"{coco.source}: annotation {ref['ann_id']}")
        name = check_image_name(image.file_name, f"{coco.source}: image {image.id}")
        category = coco.category_names[ann["category_id"]]
        for number, sentence in enumerate(ref["sentences"]):
            sent_id, text = _sentence(sentence, f"{where}.sentences[{number}]")
            note_question(sent_id, QuestionPlace(refs_path, "ref", index, f"sent_id {sent_id}"), seen)
            questions.append(
                RefQuestion(
                    sent_id, ref["split"], name, text, ref["ref_id"], ref["ann_id"], image.id, category, box, image.size
                )
            )
    return questions


def load_refcoco(paths: Sequence[Path]) -> list[RefQuestion]:
    """The expressions of a refs file (``refs(unc).p`` or a JSON copy of its list) with the dataset's
    ``instances.json``, given in either order: a JSON object is the instances file, a list the refs."""
    refs: list[tuple[Path, list[Any]]] = []
    instances: list[tuple[Path, Any]] = []
    for path in paths:
        if path.suffix != ".json":
            refs.append((path, read_refs(path)))
            continue
        data = read_json(path, "question file", REFS_FIX)
        (instances if isinstance(data, dict) else refs).append((path, data))
    if len(refs) != 1 or len(instances) != 1:
        raise PruneAuditError(
            "grounding questions come from one refs file (refs(unc).p, refs(umd).p, refs(google).p or a JSON copy "
            "of its list) and the dataset's instances.json: pass both with --questions"
        )
    (refs_path, ref_list), (instances_path, data) = refs[0], instances[0]
    if not isinstance(ref_list, list):
        raise PruneAuditError(f"{refs_path} holds a {type(ref_list).__name__}, not the list of refs; {REFS_FIX}")
    return ref_questions(refs_path, ref_list, CocoInstances(data, source=str(instances_path)))


__all__ = [
    "SPLITS",
    "RefQuestion",
    "annotations_by_id",
    "load_refcoco",
    "polygon_mask",
    "read_refs",
    "ref_questions",
    "target_box",
]
