"""Caption questions on COCO images and CHAIR scoring of a captions answers file.

One question per image, asked by the caption task's instruction :data:`PROMPT` (LLaVA's detailed-description
instruction, as CHAIR evaluations of LVLMs use it; ``tasks.caption``), the image's annotated COCO categories
from an instances file and, when a COCO captions file is given, the categories its reference captions mention (CHAIR
counts both as present; only the annotated ones count as omissions, since only they have masks).
Answers are LLaVA answers files with the COCO image id as ``question_id`` (as LLaVA's caption
scripts write it, ``image_id = int(question_id)``). Scores: :mod:`prune_audit.data.chair`.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prune_audit.data.answers import load_llava_answers, match_answers
from prune_audit.data.chair import ChairVocabulary, caption_objects, chair_metrics, score_caption
from prune_audit.data.coco import CocoInstances, read_json
from prune_audit.data.files import file_sha256
from prune_audit.errors import PruneAuditError
from prune_audit.safety.inputs import check_image_name

PROMPT = "Describe this image in detail."


@dataclass(frozen=True)
class CaptionQuestion:
    """One image to describe.

    Attributes:
        question_id: the COCO image id.
        image: its file name in the instances file.
        objects: COCO category names of its instances, in order of first annotation.
        annotations_sha256: what the instances file says of the image (``image_annotations_sha256``): the
            evidence file (``--annotations``) must say the same.
        caption_objects: CHAIR categories its reference captions mention (empty without captions).
    """

    question_id: int
    image: str
    objects: tuple[str, ...]
    annotations_sha256: str
    caption_objects: tuple[str, ...] = ()


def read_coco_captions(path: str | Path) -> dict[int, list[str]]:
    """Reference captions by image id from a COCO captions file (``captions_val2014.json``)."""
    data = read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("annotations"), list):
        raise PruneAuditError(f"{path}: expected a COCO captions file, an object with an annotations list")
    captions: dict[int, list[str]] = {}
    for index, entry in enumerate(data["annotations"]):
        where = f"{path}: annotations[{index}]"
        if not isinstance(entry, dict):
            raise PruneAuditError(f"{where} is a JSON {type(entry).__name__}, not an object")
        image_id, caption = entry.get("image_id"), entry.get("caption")
        if isinstance(image_id, bool) or not isinstance(image_id, int) or image_id < 0:
            raise PruneAuditError(f"{where}: image_id must be a non-negative integer, got {image_id!r}")
        if not isinstance(caption, str):
            raise PruneAuditError(f"{where}: caption must be text, got {caption!r}")
        captions.setdefault(image_id, []).append(caption)
    return captions


def caption_questions(
    coco: CocoInstances,
    captions: dict[int, list[str]] | None = None,
    image_ids: Sequence[int] | None = None,
    vocabulary: ChairVocabulary | None = None,
) -> list[CaptionQuestion]:
    """One question per image (default every image of ``coco``, in file order).

    Raises:
        PruneAuditError: an image id not in ``coco`` or repeated in ``image_ids``; with
            ``captions``, an image that has no reference caption.
    """
    ids = list(coco.images) if image_ids is None else list(image_ids)
    repeated = next((image_id for index, image_id in enumerate(ids) if image_id in ids[:index]), None)
    if repeated is not None:
        raise PruneAuditError(f"image {repeated} is listed twice; describe each image once")
    questions = []
    for image_id in ids:
        image = coco.image(image_id)
        mentioned: tuple[str, ...] = ()
        if captions is not None:
            if image_id not in captions:
                raise PruneAuditError(
                    f"image {image_id} has no reference caption; pass the captions file of {coco.source}'s images"
                )
            mentioned = tuple(sorted(caption_objects(captions[image_id], vocabulary)))
        name = check_image_name(image.file_name, f"{coco.source}: image {image_id}")
        questions.append(
            CaptionQuestion(
                question_id=image_id,
                image=name,
                objects=tuple(coco.object_names(image_id)),
                annotations_sha256=image_annotations_sha256(coco, image_id),
                caption_objects=mentioned,
            )
        )
    if not questions:
        raise PruneAuditError(f"{coco.source}: no images to describe")
    return questions


def image_annotations_sha256(coco: CocoInstances, image_id: int) -> str:
    """sha256 of what ``coco`` says of one image: its id, file name and size, and each annotation's category name
    and segmentation in file order (category ids and other fields may differ between exports)."""
    image = coco.image(image_id)
    annotations = [
        [coco.category_names[ann["category_id"]], ann["segmentation"]] for ann in coco.annotations_by_image[image_id]
    ]
    content = [image.id, image.file_name, image.width, image.height, annotations]
    return hashlib.sha256(json.dumps(content, sort_keys=True).encode()).hexdigest()


def check_evidence_file(questions: Sequence[CaptionQuestion], coco: CocoInstances) -> None:
    """Refuse an evidence file (``--annotations``) that lacks an image of the questions or annotates it otherwise
    than the instances file the questions came from: its masks would measure other objects than the captions are
    scored against."""
    for question in questions:
        try:
            image_id: int | None = coco.image_id(question.image)
        except PruneAuditError:  # the image is not in the file
            image_id = None
        if image_id is None or image_annotations_sha256(coco, image_id) != question.annotations_sha256:
            what = (
                "does not hold" if image_id is None else "annotates otherwise (id, file name, size, objects or masks)"
            )
            raise PruneAuditError(
                f"{coco.source} {what} image {question.image} of the caption questions; pass the "
                f"instances file of --questions with --annotations too"
            )


def score_caption_answers(
    answers: str | Path, questions: Sequence[CaptionQuestion], vocabulary: ChairVocabulary | None = None
) -> dict[str, Any]:
    """CHAIR of a LLaVA answers file (``question_id`` = image id, ``text`` = caption).

    Returns ``answers`` (path, sha256), ``metrics`` (:func:`~prune_audit.data.chair.chair_metrics`)
    and ``per_question`` rows: question_id, caption, mentioned, hallucinated, omitted, chair_i,
    chair_s, recall (NaN for an image without annotated objects).
    """
    texts = match_answers([str(q.question_id) for q in questions], load_llava_answers(answers), answers)
    scores = [
        score_caption(text, q.objects, q.caption_objects, vocabulary) for q, text in zip(questions, texts, strict=True)
    ]
    rows = [
        {
            "question_id": q.question_id,
            "caption": text,
            "mentioned": list(score.mentioned),
            "hallucinated": list(score.hallucinated),
            "omitted": list(score.omitted),
            "chair_i": score.chair_i,
            "chair_s": score.chair_s,
            "recall": score.recall,
        }
        for q, text, score in zip(questions, texts, scores)
    ]
    return {
        "answers": {"path": str(answers), "sha256": file_sha256(answers)},
        "metrics": chair_metrics(scores),
        "per_question": rows,
    }
