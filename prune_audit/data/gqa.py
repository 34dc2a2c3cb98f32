"""GQA questions, scene-graph evidence and exact-match scoring.

Formats (see docs/tasks in the issue): LLaVA-1.5's ``llava_gqa_testdev_balanced.jsonl``
(``question_id`` digit string, ``image``, ``text`` = question + "\\n" + :data:`INSTRUCTION`,
``category``); GQA's own question JSON (``{id: {imageId, question, answer, fullAnswer,
annotations: {question, answer, fullAnswer: {"word span": object id}}, ...}}``); GQA's scene graphs
(``{imageId: {width, height, objects: {id: {name, x, y, w, h, ...}}}}``). GQA publishes scene
graphs for train and val only, so testdev questions have answers but no evidence boxes.

Scoring follows the pipeline behind LLaVA's GQA numbers: ``scripts/convert_gqa_for_eval.py``
(haotian-liu/LLaVA) turns each answer into ``text.rstrip('.').lower()`` and GQA's official
``eval.py`` then counts ``predicted == gold`` with no further normalisation (no article,
punctuation or number-word rules: those are VQAv2's, not GQA's). lmms-eval's ``gqa`` task
instead uses ``exact_match`` with ``ignore_case`` and ``ignore_punctuation`` (every
``string.punctuation`` character removed from both sides): rule ``"lmms-eval"``.
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from prune_audit.data.answers import answer_id, load_llava_answers, match_answers
from prune_audit.data.coco import read_json
from prune_audit.data.files import file_sha256, read_json_lines
from prune_audit.data.question_ids import QuestionPlace, QuestionPlaces, note_question
from prune_audit.errors import PruneAuditError
from prune_audit.integers import is_digits
from prune_audit.safety.inputs import check_image_name

INSTRUCTION = "Answer the question using a single word or phrase."
"""LLaVA-1.5's short-answer instruction, appended on its own line (lmms-eval's default ``post_prompt``)."""
RULES = ("llava", "lmms-eval")
ANNOTATION_FIELDS = ("question", "answer", "fullAnswer")


@dataclass(frozen=True)
class GqaQuestion:
    """One GQA question.

    Attributes:
        question_id: GQA's id (a digit string in the released files).
        image: image file name (LLaVA's ``image``, or ``<imageId>.jpg``).
        text: the question as the file gives it (LLaVA's: question, newline, :data:`INSTRUCTION`; GQA's JSON: the
            question alone); the GQA task adds the instruction where it is missing (``tasks.prompts``).
        question: the question alone (``text``'s first line, or GQA's ``question``).
        answer: the reference short answer, None when no GQA question JSON gave it.
        full_answer: GQA's ``fullAnswer`` sentence, when given.
        evidence_object_ids: scene-graph ids of the objects the ``annotations`` of question,
            answer and full answer name, each once, in that order.
        category: LLaVA's ``category`` field when present.
    """

    question_id: str
    image: str
    text: str
    question: str
    answer: str | None = None
    full_answer: str | None = None
    evidence_object_ids: tuple[str, ...] = ()
    category: str | None = None

    @property
    def image_id(self) -> str:
        """GQA's ``imageId``: the image file name without its extension."""
        return Path(self.image).stem


@dataclass(frozen=True)
class SceneObject:
    """One scene-graph object: its name and box (pixels; x, y top-left, w, h size)."""

    name: str
    x: int
    y: int
    w: int
    h: int


@dataclass(frozen=True)
class SceneGraph:
    """One image's scene graph: size and objects by id."""

    image_id: str
    width: int
    height: int
    objects: dict[str, SceneObject]


def _text(value: Any, where: str, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise PruneAuditError(f"{where}: {key} must be non-empty text, got {value!r}; fix the entry")
    return value


def reference_text(value: Any, where: str, key: str) -> str | None:
    """A reference of a question (``answer``, ``fullAnswer``): None when absent, else non-blank text. Both GQA
    readers (the question JSON and lmms-lab/GQA's Parquet) apply this rule: a blank reference would mark every
    answer to its question wrong without a word."""
    if value is None:
        return None
    if not isinstance(value, str) or not value.strip():
        raise PruneAuditError(
            f"{where}: {key} must be text and not blank (or be left out), got {value!r}: a blank "
            f"reference marks every answer wrong; give the reference {key} or leave the field out"
        )
    return value


def question_id_digits(value: Any, where: str) -> str:
    """A GQA question id (a digit string or a non-negative integer) as a digit string; else one line naming ``where``."""
    key = answer_id(value, where)
    if not is_digits(key):
        raise PruneAuditError(f"{where}: question_id must be digits (GQA's ids), got {value!r}; fix the question file")
    return key


def load_llava_gqa(path: str | Path) -> list[GqaQuestion]:
    """LLaVA's GQA question file (JSON Lines), without answers; a bad or repeated id names file and line."""
    questions: list[GqaQuestion] = []
    seen: QuestionPlaces = {}
    for number, row in read_json_lines(path):
        where = f"{path}:{number}"
        missing = [key for key in ("question_id", "image", "text") if key not in row]
        if missing:
            raise PruneAuditError(
                f"{where}: missing {', '.join(missing)}; LLaVA's GQA lines have question_id, image, text"
            )
        question_id = question_id_digits(row["question_id"], where)
        note_question(question_id, QuestionPlace(Path(path), "line", number, f"question_id {question_id}"), seen)
        text = _text(row["text"], where, "text")
        category = row.get("category")
        questions.append(
            GqaQuestion(
                question_id=question_id,
                image=check_image_name(row["image"], where),
                text=text,
                question=text.strip().splitlines()[0].strip(),
                category=None if category is None else str(category),
            )
        )
    if not questions:
        raise PruneAuditError(f"{path}: no questions")
    return questions


def _annotation_ids(entry: dict[str, Any], where: str) -> tuple[str, ...]:
    """Object ids the annotations name: question, answer, then full answer, each once."""
    annotations = entry.get("annotations", {})
    if not isinstance(annotations, dict):
        raise PruneAuditError(f"{where}: annotations must be an object of question/answer/fullAnswer maps")
    ids: dict[str, None] = {}
    for field in ANNOTATION_FIELDS:
        spans = annotations.get(field, {})
        if not isinstance(spans, dict) or not all(isinstance(v, str) and v for v in spans.values()):
            raise PruneAuditError(f"{where}: annotations.{field} must map word spans to object ids (text)")
        ids.update(dict.fromkeys(spans.values()))
    return tuple(ids)


def read_gqa_questions(path: str | Path) -> dict[str, dict[str, Any]]:
    """GQA's question JSON (``{id: {...}}``), each entry's types checked; naming file and question id."""
    data = read_json(path)
    if not isinstance(data, dict) or not data:
        raise PruneAuditError(f"{path}: expected GQA's question JSON, an object of questions by id")
    for key, entry in data.items():
        where = f"{path}: question {key}"
        question_id_digits(key, where)
        if not isinstance(entry, dict):
            raise PruneAuditError(f"{where} is a JSON {type(entry).__name__}, not an object")
        _text(entry.get("imageId"), where, "imageId")
        _text(entry.get("question"), where, "question")
        for reference in ("answer", "fullAnswer"):
            reference_text(entry.get(reference), where, reference)
        _annotation_ids(entry, where)
    return data


def _from_gqa_entry(question_id: str, entry: dict[str, Any], where: str) -> GqaQuestion:
    return GqaQuestion(
        question_id=question_id,
        image=f"{entry['imageId']}.jpg",
        text=entry["question"],
        question=entry["question"],
        answer=entry.get("answer"),
        full_answer=entry.get("fullAnswer"),
        evidence_object_ids=_annotation_ids(entry, where),
    )


def load_gqa(
    questions_json: str | Path, llava_file: str | Path | None = None, scene_graphs: dict[str, SceneGraph] | None = None
) -> list[GqaQuestion]:
    """GQA questions with reference answers and evidence object ids.

    Args:
        questions_json: GQA's question JSON (answers and annotations).
        llava_file: LLaVA's question file; its questions, order and prompt text are used and each
            must be in ``questions_json`` with the same image. Without it every question of
            ``questions_json`` is used, prompted as LLaVA does (question, newline, instruction).
        scene_graphs: from :func:`load_scene_graphs`; when given, every question's image must
            have a graph and every annotated object must be in it.
    """
    entries = read_gqa_questions(questions_json)
    if llava_file is None:
        questions = [_from_gqa_entry(key, entry, f"{questions_json}: question {key}") for key, entry in entries.items()]
    else:
        questions = []
        for question in load_llava_gqa(llava_file):
            entry = entries.get(question.question_id)
            where = f"{llava_file}: question {question.question_id}"
            if entry is None:
                raise PruneAuditError(f"{where} is not in {questions_json}; pass GQA's question JSON of the same split")
            if entry["imageId"] != question.image_id:
                raise PruneAuditError(
                    f"{where} names image {question.image} but {questions_json} gives imageId {entry['imageId']}; "
                    f"pass the files of the same GQA release"
                )
            full = _from_gqa_entry(question.question_id, entry, where)
            questions.append(
                GqaQuestion(
                    question_id=question.question_id,
                    image=question.image,
                    text=question.text,
                    question=question.question,
                    answer=full.answer,
                    full_answer=full.full_answer,
                    evidence_object_ids=full.evidence_object_ids,
                    category=question.category,
                )
            )
    if scene_graphs is not None:
        for question in questions:
            _check_evidence(question, scene_graphs)
    return questions


def _check_evidence(question: GqaQuestion, graphs: dict[str, SceneGraph]) -> None:
    graph = graphs.get(question.image_id)
    if graph is None:
        raise PruneAuditError(
            f"question {question.question_id}: image {question.image_id} has no scene graph; GQA publishes scene "
            f"graphs for train and val only, so pass none for testdev questions"
        )
    unknown = [object_id for object_id in question.evidence_object_ids if object_id not in graph.objects]
    if unknown:
        raise PruneAuditError(
            f"question {question.question_id}: annotated object {unknown[0]} is not in image {graph.image_id}'s scene "
            f"graph; pass the scene graphs of the questions' split"
        )


def _pixels(value: Any, where: str, minimum: int) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value != int(value)
    ):
        raise PruneAuditError(f"{where} must be a whole number of pixels, got {value!r}; fix the scene graph")
    if value < minimum:
        raise PruneAuditError(f"{where} must be at least {minimum}, got {value!r}; fix the scene graph")
    return int(value)


def load_scene_graphs(path: str | Path) -> dict[str, SceneGraph]:
    """GQA scene graphs by image id, sizes and object boxes checked (naming file, image and object)."""
    data = read_json(path, "scene-graph file", "pass GQA's scene graphs (sceneGraphs.json) with --annotations")
    if not isinstance(data, dict) or not data:
        raise PruneAuditError(f"{path}: expected GQA scene graphs, an object of graphs by image id")
    graphs = {}
    for image_id, entry in data.items():
        where = f"{path}: image {image_id}"
        if not isinstance(entry, dict) or not isinstance(entry.get("objects"), dict):
            raise PruneAuditError(f"{where} needs width, height and an objects map")
        width, height = (
            _pixels(entry.get("width"), f"{where} width", 1),
            _pixels(entry.get("height"), f"{where} height", 1),
        )
        objects = {}
        for object_id, obj in entry["objects"].items():
            at = f"{where} object {object_id}"
            if not isinstance(obj, dict):
                raise PruneAuditError(f"{at} is a JSON {type(obj).__name__}, not an object")
            objects[object_id] = SceneObject(
                name=_text(obj.get("name"), at, "name"),
                x=_pixels(obj.get("x"), f"{at} x", 0),
                y=_pixels(obj.get("y"), f"{at} y", 0),
                w=_pixels(obj.get("w"), f"{at} w", 0),
                h=_pixels(obj.get("h"), f"{at} h", 0),
            )
        graphs[image_id] = SceneGraph(image_id=image_id, width=width, height=height, objects=objects)
    return graphs


def check_image_size(graph: SceneGraph, size: tuple[int, int], path: str | Path) -> None:
    """Refuse the image at ``path`` when its (width, height) ``size`` is not its scene graph's (boxes would not line up)."""
    if tuple(size) != (graph.width, graph.height):
        raise PruneAuditError(
            f"image {path} is {size[0]}x{size[1]} pixels but its scene graph says {graph.width}x{graph.height} "
            f"(width x height), so its evidence boxes would not line up; pass the GQA images of these scene graphs"
        )


def evidence_objects(question: GqaQuestion, graph: SceneGraph) -> list[tuple[str, SceneObject]]:
    """(id, object) of each object the question's annotations name, in :attr:`GqaQuestion.evidence_object_ids` order."""
    _check_evidence(question, {graph.image_id: graph})
    return [(object_id, graph.objects[object_id]) for object_id in question.evidence_object_ids]


def box_mask(obj: SceneObject, graph: SceneGraph) -> np.ndarray:
    """(height, width) bool: one object's box, clipped to the image.

    A box covers columns ``x .. x+w-1`` and rows ``y .. y+h-1`` (GQA's ``eval.py`` region is
    ``[x, x+w] x [y, y+h]``).
    """
    mask = np.zeros((graph.height, graph.width), dtype=bool)
    mask[obj.y : min(obj.y + obj.h, graph.height), obj.x : min(obj.x + obj.w, graph.width)] = True
    return mask


def evidence_mask(question: GqaQuestion, graph: SceneGraph) -> np.ndarray:
    """(height, width) bool: the union of the evidence objects' boxes (:func:`box_mask`); all False when the
    annotations name no object."""
    mask = np.zeros((graph.height, graph.width), dtype=bool)
    for _, obj in evidence_objects(question, graph):
        mask |= box_mask(obj, graph)
    return mask


_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str, rule: str = "llava") -> str:
    """An answer as the scoring rule compares it.

    ``"llava"``: surrounding whitespace stripped (``model_vqa_loader.py`` strips the output),
    trailing periods removed, lowercased (``convert_gqa_for_eval.py``). ``"lmms-eval"``:
    lowercased and every ASCII punctuation character removed (``exact_match`` with
    ``ignore_case`` and ``ignore_punctuation``).
    """
    if rule == "llava":
        return text.strip().rstrip(".").lower()
    if rule == "lmms-eval":
        return text.lower().translate(_PUNCTUATION)
    raise PruneAuditError(f"unknown GQA scoring rule {rule!r}; use one of {', '.join(RULES)}")


def exact_match(prediction: str, reference: str, rule: str = "llava") -> bool:
    """GQA correctness: the normalised prediction equals the reference (GQA's ``eval.py``: ``predicted == gold``).

    Under ``"llava"`` only the prediction is normalised (gold answers are used as released); under
    ``"lmms-eval"`` both sides are.
    """
    gold = reference if rule == "llava" else normalize_answer(reference, rule)
    return normalize_answer(prediction, rule) == gold


def score_gqa_answers(answers: str | Path, questions: Sequence[GqaQuestion], rule: str = "llava") -> dict[str, Any]:
    """Score a LLaVA answers file (``question_id``, ``text``) against GQA questions with answers.

    Returns ``answers`` (path, sha256), ``rule``, ``n``, ``correct``, ``accuracy`` and
    ``per_question`` (question_id, prediction, reference, correct) in question order.
    """
    normalize_answer("", rule)  # refuses an unknown rule before reading anything
    unanswerable = [question.question_id for question in questions if question.answer is None]
    if unanswerable:
        raise PruneAuditError(
            f"{len(unanswerable)} questions have no reference answer (first: {unanswerable[0]}); "
            f"pass GQA's question JSON with answers (testdev/val, not test)"
        )
    texts = match_answers([q.question_id for q in questions], load_llava_answers(answers), answers)
    rows = [
        {
            "question_id": q.question_id,
            "prediction": text,
            "reference": q.answer,
            "correct": exact_match(text, q.answer, rule),
        }  # type: ignore[arg-type]
        for q, text in zip(questions, texts, strict=True)
    ]
    correct = sum(row["correct"] for row in rows)
    return {
        "answers": {"path": str(answers), "sha256": file_sha256(answers)},
        "rule": rule,
        "n": len(rows),
        "correct": correct,
        "accuracy": correct / len(rows) if rows else math.nan,
        "per_question": rows,
    }
