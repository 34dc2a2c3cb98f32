"""Video question files: MVBench and Video-MME multiple choice, and temporal presence questions.

- MVBench (OpenGVLab/MVBench ``json/<task>.json``, lmms-eval ``mvbench_*``): a JSON list of
  ``{"video": "x.mp4", "question", "candidates": [...], "answer": <a candidate's text>}``; the split is the file's
  stem (MVBench's sub-task), the question id the entry's index in its file.
- Video-MME (lmms-eval ``videomme``, ``lmms-eval/Video-MME`` Parquet or a JSON list of its rows): ``videoID`` (or
  ``video_id``), ``question_id``, ``question``, ``options`` (``["A. ...", ...]``), ``answer`` (a letter); the split
  is the row's ``duration`` (short / medium / long) when given, else ``videomme``; ``question_id`` ("001-1") keys
  the record through ``data.files.stable_image_id``.
- Temporal presence (``video_presence``): a JSON list of ``{"question_id", "video", "question", "answer": "yes" |
  "no", "category", "window": [first, last] | null}``, the window in the clip's frames as stored, inclusive.

Every entry may give the clip's stored frame rate as ``"fps"`` (frames per second of its frame folder); without it
the reader leaves it None and the run reads the folder at :data:`DEFAULT_FRAME_RATE`.
"""

from __future__ import annotations

import math
import string
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prune_audit.data.coco import read_json
from prune_audit.data.files import stable_image_id
from prune_audit.data.pope import LABELS
from prune_audit.data.question_ids import QuestionPlace, QuestionPlaces, note_question
from prune_audit.errors import PruneAuditError

DEFAULT_FRAME_RATE = 2.0
"""Frames per second of a frame folder whose question gives no ``fps``: qwen-vl-utils' own sampling rate, so every
stored frame is a sampled one (up to its frame limits) and a window's frames are sampled frames."""

MVBENCH = "mvbench"
VIDEOMME = "videomme"
VIDEOMME_SPLITS = ("short", "medium", "long")


@dataclass(frozen=True)
class VideoChoiceQuestion:
    """One multiple-choice video question.

    Attributes:
        options: the options as the prompt lists them (MVBench: the candidates' texts; Video-MME: "A. ..." as given).
        answer: the answer letter.
        layout: ``mvbench`` or ``videomme`` (its prompt, ``tasks.video_mc``).
        fps: the clip's stored frame rate from the entry, None when it gives none.
        key: the id the file gives the question (Video-MME's ``question_id``, "001-1"), which released answers
            name; None for MVBench, whose id is the entry's index in its file.
    """

    question_id: int
    split: str
    video: str
    question: str
    options: tuple[str, ...]
    answer: str
    layout: str
    fps: float | None = None
    key: str | None = None

    @property
    def image(self) -> str:
        """The clip's frame folder under ``--images``: the video's name without its suffix."""
        return video_folder(self.video)

    @property
    def text(self) -> str:
        """The question as the file gives it (``tasks.video_mc`` writes the prompt around it)."""
        return self.question

    @property
    def letters(self) -> tuple[str, ...]:
        return tuple(string.ascii_uppercase[: len(self.options)])


@dataclass(frozen=True)
class PresenceQuestion:
    """One temporal presence question ("Is there a {category} at the beginning of the video?")."""

    question_id: int
    video: str
    text: str
    label: str
    category: str
    window: tuple[int, int] | None
    fps: float | None = None
    split: str = ""  # the task's name (``tasks.video_presence``): its files have no splits

    @property
    def image(self) -> str:
        return video_folder(self.video)


def video_folder(video: str) -> str:
    """The frame folder of a question's video: its name without a suffix (``x.mp4`` -> ``x``, ``a/x.mp4`` -> ``a/x``)."""
    return str(Path(video).with_suffix("")) if Path(video).suffix else video


def _text(entry: dict[str, Any], key: str, where: str) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not value.strip():
        raise PruneAuditError(f"{where}: {key!r} must be a non-empty string, got {value!r}; fix the question file")
    return value


def _fps(entry: dict[str, Any], where: str) -> float | None:
    value = entry.get("fps")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise PruneAuditError(f"{where}: 'fps' must be a positive number, got {value!r}; fix the question file")
    return float(value)


def _entries(path: Path, layout: str) -> list[tuple[QuestionPlace, dict[str, Any]]]:
    """(place, entry) of a JSON list file, or of a Parquet file's rows (Video-MME)."""
    if path.suffix == ".parquet":
        from prune_audit.data.lmms_parquet import read_rows

        rows = read_rows(path, ("question", "options", "answer"), layout)
        return [(QuestionPlace(path, "row", index, "it"), row) for index, row in enumerate(rows)]
    data = read_json(path, "question file", f"pass the {layout} question file")
    if not isinstance(data, list) or not all(isinstance(entry, dict) for entry in data):
        raise PruneAuditError(f"{path}: expected a JSON list of question objects ({layout} layout)")
    return [(QuestionPlace(path, "entry", index, "it"), entry) for index, entry in enumerate(data)]


def _mvbench(entry: dict[str, Any], where: str, path: Path, index: int) -> VideoChoiceQuestion:
    candidates = entry.get("candidates")
    if (
        not isinstance(candidates, list)
        or not 2 <= len(candidates) <= 26
        or not all(isinstance(c, str) for c in candidates)
    ):
        raise PruneAuditError(f"{where}: 'candidates' must be a list of 2 to 26 strings; fix the question file")
    answer = entry.get("answer")
    if answer not in candidates:
        raise PruneAuditError(f"{where}: the answer {answer!r} is none of the candidates; fix the question file")
    letter = string.ascii_uppercase[candidates.index(answer)]  # lmms-eval: the first candidate equal to it
    video, question = _text(entry, "video", where), _text(entry, "question", where)
    return VideoChoiceQuestion(
        index, path.stem, video, question, tuple(candidates), letter, MVBENCH, _fps(entry, where)
    )


def _videomme(entry: dict[str, Any], where: str) -> VideoChoiceQuestion:
    video = entry.get("videoID", entry.get("video_id"))
    if not isinstance(video, str) or not video.strip():
        raise PruneAuditError(f"{where}: 'videoID' (or 'video_id') must name the video; fix the question file")
    options = entry.get("options")
    if not isinstance(options, list) or not 2 <= len(options) <= 26:
        raise PruneAuditError(f"{where}: 'options' must be a list of 2 to 26 options; fix the question file")
    letters = string.ascii_uppercase[: len(options)]
    if not all(isinstance(o, str) and o.startswith(f"{letter}.") for o, letter in zip(options, letters)):
        raise PruneAuditError(f"{where}: options must read 'A. ...', 'B. ...' in order; fix the question file")
    answer = entry.get("answer")
    if answer not in letters:
        raise PruneAuditError(f"{where}: the answer {answer!r} is not one of the letters {', '.join(letters)}")
    key = entry.get("question_id")
    if not isinstance(key, (str, int)) or isinstance(key, bool):
        raise PruneAuditError(f"{where}: 'question_id' must be a string or integer; fix the question file")
    split = entry.get("duration") if entry.get("duration") in VIDEOMME_SPLITS else VIDEOMME
    question = _text(entry, "question", where)
    return VideoChoiceQuestion(
        stable_image_id(str(key)),
        str(split),
        video,
        question,
        tuple(options),
        str(answer),
        VIDEOMME,
        _fps(entry, where),
        str(key),
    )


def load_video_choice(paths: Sequence[Path]) -> list[VideoChoiceQuestion]:
    """Every question of MVBench or Video-MME files (each file's layout told by its keys: ``candidates`` is
    MVBench's, ``options`` Video-MME's); a question id may appear once per split over all the files."""
    seen: QuestionPlaces = {}
    questions = []
    for path in paths:
        for place, entry in _entries(Path(path), "MVBench or Video-MME"):
            where = str(place)
            if "candidates" in entry:
                question = _mvbench(entry, where, Path(path), place.number)
            elif "options" in entry:
                question = _videomme(entry, where)
            else:
                raise PruneAuditError(
                    f"{where}: neither MVBench's 'candidates' nor Video-MME's 'options'; pass MVBench or Video-MME files"
                )
            note_question((question.split, question.question_id), place, seen)
            questions.append(question)
    return questions


def _window(entry: dict[str, Any], where: str) -> tuple[int, int] | None:
    window = entry.get("window")
    if window is None:
        return None
    if (
        not isinstance(window, list)
        or len(window) != 2
        or any(isinstance(v, bool) or not isinstance(v, int) for v in window)
        or not 0 <= window[0] <= window[1]
    ):
        raise PruneAuditError(
            f"{where}: 'window' must be [first, last] frame indices (0 <= first <= last) or null, got {window!r}"
        )
    return (window[0], window[1])


def _presence(entry: dict[str, Any], where: str) -> PresenceQuestion:
    key = entry.get("question_id")
    if isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < 2**63:
        raise PruneAuditError(f"{where}: 'question_id' must be a non-negative integer, got {key!r}")
    label = entry.get("answer")
    if label not in LABELS:
        raise PruneAuditError(f"{where}: 'answer' must be yes or no, got {label!r}; fix the question file")
    return PresenceQuestion(
        key,
        _text(entry, "video", where),
        _text(entry, "question", where),
        str(label),
        _text(entry, "category", where),
        _window(entry, where),
        _fps(entry, where),
    )


def load_presence(paths: Sequence[Path]) -> list[PresenceQuestion]:
    """Every temporal presence question of ``paths`` (JSON lists), each question id once over all the files."""
    seen: QuestionPlaces = {}
    questions = []
    for path in paths:
        for place, entry in _entries(Path(path), "temporal presence"):
            question = _presence(entry, str(place))
            note_question(question.question_id, place, seen)
            questions.append(question)
    return questions


__all__ = [
    "DEFAULT_FRAME_RATE",
    "PresenceQuestion",
    "VideoChoiceQuestion",
    "load_presence",
    "load_video_choice",
    "video_folder",
]
