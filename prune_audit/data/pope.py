"""POPE question files, answer parsing and metrics.

Follows the official POPE repository (AoiDragon/POPE, ``evaluate.py`` and the files in
``output/coco/``) and LLaVA's copy (``llava/eval/eval_pope.py``, ``llava_pope_test.jsonl``);
see evaluation spec section A. Question files are JSON Lines with ``question_id``,
``image``, ``text`` and ``label``; LLaVA's merged file has ``category`` instead of
``label`` and appends an instruction line to ``text``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from prune_audit.data.coco import CocoInstances, image_id_from_file_name
from prune_audit.data.files import read_json_lines
from prune_audit.data.question_ids import QuestionPlace, QuestionPlaces, note_question
from prune_audit.errors import PruneAuditError
from prune_audit.integers import is_digits
from prune_audit.safety.fingerprint import file_sha256
from prune_audit.safety.inputs import check_image_name

POPE_SPLITS = ("random", "popular", "adversarial")
LABELS = ("yes", "no")

# The vowel branch of POPE's early builder replaced every "a" of the template with "an",
# which also turned "image" into "imange" (still in LLaVA's pinned copy).
_QUESTION = re.compile(r"^Is there an? (?P<object>.+) in the im(?:a|an)ge\?$")
_SPLIT_IN_NAME = re.compile(r"pope_(?P<split>[A-Za-z0-9]+)$")


@dataclass(frozen=True)
class PopeQuestion:
    """One POPE question.

    Attributes:
        question_id: id from the file (repeats across split files; LLaVA's merged file
            offsets them per category).
        split: random / popular / adversarial (LLaVA's ``category``, or from the file name).
        image: image file name as in the file (``COCO_val2014_%012d.jpg``).
        text: the question text as in the file.
        label: "yes" / "no", or None when the file has no labels (LLaVA's merged file).
        object: queried object parsed from ``text`` (a COCO category name).
        category: LLaVA's ``category`` field when present.
    """

    question_id: int
    split: str
    image: str
    text: str
    label: str | None
    object: str
    category: str | None = None

    @property
    def image_id(self) -> int | None:
        """COCO image id from the file name."""
        return image_id_from_file_name(self.image)


def parse_object(text: str) -> str:
    """The object of ``Is there a/an <object> in the image?`` (also the "imange" typo).

    Only the first line counts, so LLaVA's appended instruction line is ignored.
    """
    first_line = text.strip().splitlines()[0].strip() if text.strip() else ""
    match = _QUESTION.match(first_line)
    if not match:
        raise PruneAuditError(f"not a POPE question: {first_line!r}")
    return match.group("object")


def split_from_file_name(path: str | Path) -> str:
    """``coco_pope_random.json`` -> ``random``; a name without ``pope_<split>`` gives its stem."""
    stem = Path(path).stem
    match = _SPLIT_IN_NAME.search(stem)
    return match.group("split") if match else stem


QUESTION_ID_LIMIT = 2**63
"""Question ids are stored as int64 (records' ``question_id``): 0 <= id < 2**63."""


def _question_id(value: Any, where: str) -> int:
    digits = isinstance(value, str) and is_digits(value)  # ASCII digits only: int() also takes "²", "+3", "1_0"
    if isinstance(value, bool) or not (isinstance(value, int) or digits) or not 0 <= int(value) < QUESTION_ID_LIMIT:
        raise PruneAuditError(
            f"{where}: question_id must be an integer from 0 to 2**63-1, got {value!r}; fix the question file"
        )
    return int(value)


def load_pope(path: str | Path, split: str | None = None, seen: QuestionPlaces | None = None) -> list[PopeQuestion]:
    """Load a POPE question file (official splits, any version, or LLaVA's merged file).

    Args:
        path: JSON Lines file.
        split: split name for rows without ``category``; default from the file name.
        seen: the questions of the files read before it, when they are read together (``note_question``);
            filled with this file's (``data.question_ids``).

    Raises:
        PruneAuditError: a malformed line, a missing key, a label other than yes/no, an
            unparseable question, an image outside the images folder (absolute or ``..``)
            or a repeated (split, question_id), naming file and line.
    """
    default_split = split or split_from_file_name(path)
    questions = []
    seen = {} if seen is None else seen
    for number, row in read_json_lines(path):
        where = f"{path}:{number}"
        missing = [key for key in ("question_id", "image", "text") if key not in row]
        if missing:
            raise PruneAuditError(f"{where}: missing {', '.join(missing)}")
        label = row.get("label")
        if label is not None and label not in LABELS:
            raise PruneAuditError(f"{where}: label must be 'yes' or 'no', got {label!r}")
        try:
            obj = parse_object(str(row["text"]))
        except PruneAuditError as error:
            raise PruneAuditError(f"{where}: {error}") from None
        category = row.get("category")
        question = PopeQuestion(
            question_id=_question_id(row["question_id"], where),
            split=str(category) if category is not None else default_split,
            image=check_image_name(row["image"], where),
            text=str(row["text"]),
            label=label,
            object=obj,
            category=None if category is None else str(category),
        )
        key = (question.split, question.question_id)
        note_question(key, QuestionPlace(Path(path), "line", number, f"question_id {key[1]} of split {key[0]}"), seen)
        questions.append(question)
    if not questions:
        raise PruneAuditError(f"{path}: no questions")
    return questions


def attach_labels(questions: Sequence[PopeQuestion], labelled: Sequence[PopeQuestion]) -> list[PopeQuestion]:
    """Labels for an unlabelled question set (LLaVA's merged file) from per-split label files.

    As LLaVA's ``eval_pope.py``: within each split the questions and the label file's rows
    are paired in order. Each pair must name the same image and object, so a different
    file version (e.g. 3000 instead of 2910 random questions) is an error, never a shift.
    """
    by_split: dict[str, list[PopeQuestion]] = {}
    for question in labelled:
        by_split.setdefault(question.split, []).append(question)
    wanted: dict[str, list[PopeQuestion]] = {}
    for question in questions:
        wanted.setdefault(question.split, []).append(question)
    unused = sorted(set(by_split) - set(wanted))
    if unused:
        raise PruneAuditError(f"label files for split(s) {', '.join(unused)} match no unlabelled question")
    labels: dict[tuple[str, int], str] = {}
    for split, split_questions in wanted.items():
        rows = by_split.get(split)
        if rows is None:
            raise PruneAuditError(f"no label file for split {split!r} (pass its coco_pope_{split}.json)")
        if len(rows) != len(split_questions):
            raise PruneAuditError(
                f"split {split!r}: {len(split_questions)} questions but {len(rows)} labels (different POPE file version?)"
            )
        for question, row in zip(split_questions, rows):
            if (question.image, question.object) != (row.image, row.object):
                raise PruneAuditError(
                    f"split {split!r}: question {question.question_id} ({question.image}, {question.object}) does not "
                    f"match label row {row.question_id} ({row.image}, {row.object}) (different POPE file version?)"
                )
            labels[(split, question.question_id)] = row.label  # type: ignore[assignment]
    return [replace(q, label=labels[(q.split, q.question_id)]) for q in questions]


def parse_answer(text: str) -> str:
    """ "yes" or "no" exactly as POPE's ``evaluate.py`` (and LLaVA's ``eval_pope.py``).

    Keep the text before the first period, delete commas, split on single spaces; any word
    equal to "No", "not" or "no" means no, anything else (also empty text) means yes.
    """
    first_sentence = text.split(".")[0]
    words = first_sentence.replace(",", "").split(" ")
    return "no" if any(word in ("No", "not", "no") for word in words) else "yes"


def _as_yes(values: Sequence[Any] | np.ndarray, name: str) -> np.ndarray:
    """(n,) bool: True for "yes"/True/1, False for "no"/False/0."""
    array = np.asarray(values)
    if array.dtype.kind in "biu":
        if array.size and not np.isin(array, (0, 1)).all():
            raise PruneAuditError(f"{name} must be 0/1, booleans or 'yes'/'no'")
        return array.astype(bool)
    if array.size and not np.isin(array, LABELS).all():
        bad = array[~np.isin(array, LABELS)][0]
        raise PruneAuditError(f"{name} must be 'yes' or 'no', got {bad!r}")
    return array == "yes"


def _ratio(numerator: Any, denominator: Any) -> Any:
    """numerator / denominator elementwise, NaN where the denominator is 0 (scalars or arrays)."""
    numerator, denominator = np.asarray(numerator, dtype=np.float64), np.asarray(denominator, dtype=np.float64)
    out = np.divide(
        numerator,
        denominator,
        out=np.full(np.broadcast(numerator, denominator).shape, math.nan),
        where=denominator != 0,
    )
    return float(out) if out.ndim == 0 else out


def pope_ratios(tp: Any, fp: Any, tn: Any, fn: Any) -> dict[str, Any]:
    """Accuracy, precision, recall, F1 and yes-ratio of predictions from confusion counts.

    Counts may be ints or (B,) arrays of (weighted) counts, e.g. one per bootstrap
    resample; a ratio with a zero denominator is NaN (POPE's script would divide by zero).
    """
    precision, recall = _ratio(tp, np.add(tp, fp)), _ratio(tp, np.add(tp, fn))
    total = np.add(np.add(tp, fp), np.add(tn, fn))
    return {
        "accuracy": _ratio(np.add(tp, tn), total),
        "precision": precision,
        "recall": recall,
        "f1": _ratio(np.multiply(np.multiply(2, precision), recall), np.add(precision, recall)),
        "yes_ratio": _ratio(np.add(tp, fp), total),
    }


def pope_metrics(labels: Sequence[Any] | np.ndarray, predictions: Sequence[Any] | np.ndarray) -> dict[str, Any]:
    """POPE metrics with "yes" as the positive class.

    Args:
        labels: (n,) ground truth, "yes"/"no" strings or booleans (True = yes).
        predictions: (n,) parsed answers in the same form.

    Returns:
        n, tp, fp, tn, fn (ints) and accuracy, precision, recall, f1, yes_ratio (floats;
        yes_ratio is the share of *predictions* that are yes, as POPE reports it). A
        ratio with a zero denominator is NaN (POPE's script would divide by zero).
    """
    truth, predicted = _as_yes(labels, "labels"), _as_yes(predictions, "predictions")
    if truth.shape != predicted.shape or truth.ndim != 1:
        raise PruneAuditError(f"labels {truth.shape} and predictions {predicted.shape} must be equal-length vectors")
    tp = int(np.count_nonzero(truth & predicted))
    fp = int(np.count_nonzero(~truth & predicted))
    tn = int(np.count_nonzero(~truth & ~predicted))
    fn = int(np.count_nonzero(truth & ~predicted))
    return {"n": int(truth.size), "tp": tp, "fp": fp, "tn": tn, "fn": fn, **pope_ratios(tp, fp, tn, fn)}


def summarize_questions(
    questions: Sequence[PopeQuestion], coco: CocoInstances | None = None
) -> dict[str, dict[str, Any]]:
    """Per split: question, image, yes/no and unlabelled counts; with ``coco`` also object checks.

    With an instances file: ``unknown_objects`` (sorted names that are not COCO categories),
    ``images_not_in_annotations`` (questions whose image the file lacks) and
    ``yes_without_mask`` ("yes" questions whose image has no instance of the object; such
    questions must be flagged, never scored as zero object area).
    """
    summaries: dict[str, dict[str, Any]] = {}
    for split in dict.fromkeys(question.split for question in questions):
        subset = [question for question in questions if question.split == split]
        labels = [question.label for question in subset]
        summary: dict[str, Any] = {
            "questions": len(subset),
            "images": len({question.image for question in subset}),
            "yes": labels.count("yes"),
            "no": labels.count("no"),
            "unlabelled": labels.count(None),
        }
        if coco is not None:
            summary.update(_object_checks(subset, coco))
        summaries[split] = summary
    return summaries


def describe_question_files(files: Sequence[str | Path], coco: CocoInstances | None = None) -> list[dict[str, Any]]:
    """Per file: its ``path``, ``sha256`` and per-split ``splits`` summary (:func:`summarize_questions`)."""
    return [
        {"path": str(path), "sha256": file_sha256(path), "splits": summarize_questions(load_pope(path), coco)}
        for path in files
    ]


def _object_checks(questions: Sequence[PopeQuestion], coco: CocoInstances) -> dict[str, Any]:
    unknown = sorted({q.object for q in questions if q.object not in coco.category_ids})
    missing_images: set[str] = set()
    without_mask = 0
    for question in questions:
        try:
            image_id = coco.image_id(question.image)
        except PruneAuditError:
            missing_images.add(question.image)
            continue
        known = question.object in coco.category_ids
        if question.label == "yes" and (not known or not coco.has_instances(image_id, question.object)):
            without_mask += 1
    return {
        "unknown_objects": unknown,
        "images_not_in_annotations": len(missing_images),
        "yes_without_mask": without_mask,
    }
